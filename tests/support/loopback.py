"""Programs on loopback for the topology tests: :func:`missing` names a program that is not installed
(for a ``pytest.skip`` with the reason), :func:`wait_port` / :func:`wait_for` wait until a server is
usable, :class:`Started` is the ``with X() as x`` shape of every topology, :class:`Proc` one server
process (SIGKILL-able), and the Redis command line and client every Redis topology uses.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from tests.support.bench import free_port

LOOPBACK = "127.0.0.1"


def missing(*programs: str) -> str | None:
    """The first of ``programs`` not on PATH (also looked for in /usr/sbin), else None."""
    for program in programs:
        if shutil.which(program) is None and not Path("/usr/sbin", program).exists():
            return program
    return None


def program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def wait_port(port: int, timeout_s: float = 10.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process on port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection((LOOPBACK, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listens on {LOOPBACK}:{port} after {timeout_s}s")


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception as exc:  # noqa: BLE001 - a server still starting or failing over
            last = exc
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout_s}s waiting for {what} (last error: {last})")


def free_port_pair() -> tuple[int, int]:
    """Two free ports (a cluster node's client port and its bus port)."""
    while True:
        a, b = free_port(), free_port()
        if a != b:
            return a, b


class Started:
    """``with X() as x``: :meth:`start` on entry (what it started is closed again if it fails), :meth:`close` on exit."""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Proc:
    def __init__(self, argv: list[str], port: int, log: Path) -> None:
        self.argv, self.port, self.log = argv, port, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> Proc:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_port(self.port, proc=self.proc)
        return self

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to hand anything over."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def redis_argv(port: int, workdir: Path, *extra: str) -> list[str]:
    return [
        "redis-server",
        "--port",
        str(port),
        "--bind",
        LOOPBACK,
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
        "--repl-diskless-sync-delay",
        "0",  # a replica syncs at once, not after the default 5 s
        *extra,
    ]


def redis_client(port: int, **kw: Any) -> Any:
    import redis

    return redis.Redis(host=LOOPBACK, port=port, socket_timeout=2.0, socket_connect_timeout=1.0, **kw)
