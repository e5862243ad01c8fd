"""Pooler bench: ``Tracker.observe`` through PgBouncer (transaction pooling) next to direct, in one run.

A scratch database on the bench's Postgres, migrated directly; a PgBouncer of the bench's own
(``pool_mode = transaction``, ``auth_type = trust``, a free loopback port, a temporary
directory; as root it runs as ``user = postgres``) in front of it. The same observe loop as the
service bench (measurement given, each process on its own sessions, no Redis: the database
path alone) runs with 1 and 4 processes, direct and through PgBouncer with
``TRACKER_DATABASE_POOLER=transaction``, in the order direct, pooled, pooled, direct (so a load
that drifts during the run weighs on both alike); each side's figures are the mean of its two
windows. ``pgbouncer_vs_direct`` is the throughput ratio.

Needs the ``pgbouncer`` program (Debian package ``pgbouncer``); without it the section fails
with that reason, like any section whose server is missing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tracker.bench.procs import barrier_pool, create_scratch_db, drop_scratch_db, free_port
from tracker.bench.service import observe_for
from tracker.bench.stats import latency_ms, ratio, throughput
from tracker.errors import StoreUnavailable
from tracker.settings import normalize_database_url

PROCESS_COUNTS = (1, 4)


def pgbouncer_program() -> str | None:
    """The ``pgbouncer`` executable (Debian installs it in /usr/sbin), or None."""
    found = shutil.which("pgbouncer")
    if found:
        return found
    return "/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None


@contextmanager
def pgbouncer(pg_host: str, pg_port: int, *, pool_size: int = 8, run_as: str = "postgres") -> Iterator[int]:
    """A PgBouncer in transaction mode in front of ``pg_host:pg_port``, every database name passed
    through; yields its loopback port and stops it afterwards."""
    program = pgbouncer_program()
    if program is None:
        raise StoreUnavailable("pgbouncer is not installed (Debian package pgbouncer)")
    workdir = Path(tempfile.mkdtemp(prefix="ct-bench-pgbouncer-"))
    port = free_port()
    lines = [
        "[databases]",
        f"* = host={pg_host} port={pg_port}",
        "[pgbouncer]",
        "listen_addr = 127.0.0.1",
        f"listen_port = {port}",
        "unix_socket_dir =",
        "auth_type = trust",
        f"auth_file = {workdir / 'userlist.txt'}",
        "pool_mode = transaction",
        f"default_pool_size = {pool_size}",
        "max_client_conn = 500",
        f"logfile = {workdir / 'pgbouncer.log'}",
        "ignore_startup_parameters = extra_float_digits",
    ]
    if os.geteuid() == 0:  # PgBouncer refuses to run as root unless told a user
        lines.append(f"user = {run_as}")
    (workdir / "userlist.txt").write_text(f'"{run_as}" ""\n')
    (workdir / "pgbouncer.ini").write_text("\n".join(lines) + "\n")
    if os.geteuid() == 0:
        import pwd

        pw = pwd.getpwnam(run_as)
        for path in (workdir, *workdir.iterdir()):
            os.chown(path, pw.pw_uid, pw.pw_gid)
    proc = subprocess.Popen(
        [program, str(workdir / "pgbouncer.ini")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                log = workdir / "pgbouncer.log"
                tail = log.read_text(errors="replace")[-300:] if log.exists() else ""
                raise StoreUnavailable(f"pgbouncer exited with {proc.returncode}: {tail}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise StoreUnavailable("pgbouncer did not listen within 10 s") from None
                time.sleep(0.05)
        yield port
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def _observer(args: tuple[str, str, str, float]) -> tuple[int, list[float]]:
    db_url, pooler, prefix, duration = args
    from tracker.settings import Settings

    return observe_for(Settings.of(database_url=db_url, database_pooler=pooler), prefix, duration)


def _window(pool: Any, db_url: str, pooler: str, n: int, duration: float) -> tuple[int, list[float]]:
    args = [(db_url, pooler, f"pool-{pooler}-{n}-{uuid.uuid4().hex[:6]}-{i}", duration) for i in range(n)]
    results = pool.map(_observer, args, chunksize=1)
    return sum(r[0] for r in results), [x for r in results for x in r[1]]


def _figures(windows: list[tuple[int, list[float]]], duration: float) -> dict[str, Any]:
    count = sum(w[0] for w in windows)
    lat = [x for w in windows for x in w[1]]
    return {"observe_per_s": round(throughput(count, duration * len(windows))), **latency_ms(lat)}


def run_pooler_bench(
    pg_url: str, quick: bool = False, process_counts: tuple[int, ...] = PROCESS_COUNTS
) -> dict[str, Any]:
    """observe/s and p50/p99 direct and through PgBouncer (transaction mode), per process count."""
    from sqlalchemy.engine import make_url

    from tracker.store import upgrade

    duration = 0.5 if quick else 1.5
    server = make_url(normalize_database_url(pg_url))
    name, url = create_scratch_db(pg_url, "ct_bench")
    direct = normalize_database_url(url)
    try:
        upgrade(direct)  # migrations go to the server directly (docs/topologies.md)
        with pgbouncer(server.host or "127.0.0.1", server.port or 5432) as port:
            pooled = make_url(direct).set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
            out: dict[str, Any] = {"direct": {}, "pgbouncer_transaction": {}, "pgbouncer_vs_direct": {}}
            for n in process_counts:
                windows: dict[str, list[tuple[int, list[float]]]] = {"none": [], "transaction": []}
                with barrier_pool(n) as pool:  # one pool of processes for the four windows (its barrier is reusable)
                    for pooler in ("none", "transaction", "transaction", "none"):
                        url = direct if pooler == "none" else pooled
                        windows[pooler].append(_window(pool, url, pooler, n, duration))
                out["direct"][str(n)] = _figures(windows["none"], duration)
                out["pgbouncer_transaction"][str(n)] = _figures(windows["transaction"], duration)
                out["pgbouncer_vs_direct"][str(n)] = ratio(
                    out["pgbouncer_transaction"][str(n)]["observe_per_s"], out["direct"][str(n)]["observe_per_s"]
                )
    finally:
        drop_scratch_db(pg_url, name)
    return out
