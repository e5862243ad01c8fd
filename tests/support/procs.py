"""Processes and ports for the tests: free loopback ports, a port probe, private throwaway servers for
fault tests (so stopping one never disturbs other tests), the PostgreSQL server's log, and the process
helpers the bench shares (``stop_process_group``).
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import socket
import subprocess
import tempfile
import time

from tests.support.bench import free_port, stop_process_group

__all__ = ["PostgresLog", "PrivateRedis", "free_port", "port_open", "racing_context", "stop_process_group"]

#: what every racing process imports before its first line of work: the fork server imports it once
RACER_PRELOAD = [
    "tracker.service",
    "tracker.store",
    "tracker.coordination",
    "tracker.store.postgres",
    "redis",
    "psycopg",
    "tests.support.races",
]


def racing_context() -> mp.context.BaseContext:
    """The ``multiprocessing`` context for processes that race each other: ``forkserver``, whose
    server imported ``RACER_PRELOAD`` once (started on first use, one per test process). Each racer
    is a new process forked from that server (no threads, no connection, no state of the test's),
    so sixteen racers cost one import instead of sixteen, and all of them are ready when the race
    starts. (``spawn`` is the fallback where there is no ``fork``.)"""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RACER_PRELOAD)
    return ctx


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port`` (a broker that may be down)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class PrivateRedis:
    """A redis-server of our own on a free loopback port, which tests may flush, stop and restart."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="ct-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        if shutil.which("redis-server") is None:
            import pytest

            pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run starts it)")
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("private redis did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def flushall(self) -> None:
        import redis

        redis.Redis.from_url(self.url).flushall()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class PostgresLog:
    """The lines the local PostgreSQL server logs for one database, from now on.

    Debian's ``pg_ctlcluster`` writes the server's log to
    ``/var/log/postgresql/postgresql-<major>-main.log`` (prefix ``%m [%p] %q%u@%d``).
    :meth:`find` returns None where that file cannot be read.
    """

    def __init__(self, path: str, database: str) -> None:
        self.path, self.database = path, database
        with open(path, "rb") as f:
            self.offset = f.seek(0, 2)

    @classmethod
    def find(cls, sqlalchemy_url: str) -> PostgresLog | None:
        import glob
        import os

        from sqlalchemy.engine import make_url

        database = make_url(sqlalchemy_url).database or ""
        for path in sorted(glob.glob("/var/log/postgresql/postgresql-*-main.log")):
            if os.access(path, os.R_OK):
                return cls(path, database)
        return None

    def lines(self) -> list[str]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            text = f.read().decode("utf-8", "replace")
        return [line for line in text.splitlines() if f"@{self.database} " in line]

    def errors(self) -> list[str]:
        return [line for line in self.lines() if " ERROR: " in line or " FATAL: " in line]
