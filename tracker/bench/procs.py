"""Process helpers of the bench: scratch Postgres databases, a spawn pool with a common start line,
free loopback ports, ``tracker serve`` subprocesses and Celery count worker subprocesses
(``WorkerProcess``, ``stop_process_group``).

They sit in the bench package (the top of the layer list), so nothing in the product imports
them. The tests reuse them through their own harness (tests/support), which keeps the helpers
only the tests need.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from tracker.errors import StoreUnavailable
from tracker.settings import mask

# -- scratch Postgres databases ----------------------------------------------------------------------


def libpq_url(url: str) -> str:
    """``url`` with the plain ``postgresql://`` scheme psycopg's ``connect`` takes (password kept)."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def create_scratch_db(admin_url: str, prefix: str = "ct") -> tuple[str, str]:
    """Create an empty database ``<prefix>_<random>`` on the server of ``admin_url``.

    Returns ``(name, libpq url of the new database)``; nothing in ``admin_url``'s own database is
    touched. Raises ``StoreUnavailable`` (naming the masked URL) when the server cannot be reached.
    """
    import psycopg
    from sqlalchemy.engine import make_url

    admin = libpq_url(admin_url)
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        raise StoreUnavailable(f"cannot create a scratch database on {mask(admin)}: {exc}".strip()) from exc
    return name, make_url(admin).set(database=name).render_as_string(hide_password=False)


def drop_scratch_db(admin_url: str, name: str) -> None:
    """Drop a database made by :func:`create_scratch_db` (sessions still on it are ended)."""
    import psycopg

    with psycopg.connect(libpq_url(admin_url), autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- a pool of spawned processes with a common start line -------------------------------------------

_start_line: Any = None


def _set_start_line(barrier: Any) -> None:
    global _start_line  # per pool process: the barrier shared by every process of the pool
    _start_line = barrier


def wait_at_start_line(timeout_s: float = 300) -> None:
    """In a :func:`barrier_pool` process: block until every process of the pool has arrived."""
    if _start_line is None:
        raise RuntimeError("wait_at_start_line() called outside a barrier_pool process")
    _start_line.wait(timeout_s)


@contextmanager
def barrier_pool(processes: int) -> Iterator[Any]:
    """A ``spawn`` pool of ``processes`` real processes sharing one start line.

    A task that calls :func:`wait_at_start_line` returns only once every process is running
    one such task, so ``pool.map(task, [...] * processes, chunksize=1)`` puts exactly one task on
    each process and starts their timed parts together. Task functions must be module-level.
    """
    ctx = mp.get_context("spawn")
    with ctx.Pool(processes, initializer=_set_start_line, initargs=(ctx.Barrier(processes),)) as pool:
        yield pool


# -- loopback servers -------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    env: Mapping[str, str],
    port: int,
    *extra: str,
    quiet: bool = True,
    timeout_s: float = 60,
    log_file: Any = None,
    factory: str | None = None,
) -> subprocess.Popen:
    """``tracker serve`` in a subprocess on loopback, returned once /readyz answers 200.

    ``env`` is the child's whole environment (its ``TRACKER_*`` configure the server). With
    ``log_file`` (an open file) the server writes its stdout and stderr there, access log on.
    With ``factory`` (``module:function``) uvicorn serves the app that function returns instead.
    """
    import httpx

    access = [] if log_file is not None else ["--no-access-log"]
    command = ["tracker.cli", "serve"] if factory is None else ["uvicorn", factory, "--factory"]
    proc = subprocess.Popen(
        [sys.executable, "-m", *command, "--port", str(port), *access, *extra],
        env=dict(env),
        stdout=log_file if log_file is not None else subprocess.DEVNULL if quiet else subprocess.PIPE,
        stderr=subprocess.STDOUT if log_file is not None else subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tracker serve exited: {(proc.stderr.read() if proc.stderr else '')[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"tracker serve did not become ready within {timeout_s:g} s")


def stop_server(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGTERM a server from :func:`start_server`, SIGKILL it after ``grace_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


# -- Celery worker subprocesses ---------------------------------------------------------------------

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """Stop a process started with ``start_new_session=True`` and everything in its group:
    SIGTERM, then SIGKILL after ``grace_s``; then sweep up pool children left behind."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
    try:  # pool children of a leader that died first
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def worker_command(
    concurrency: int | None = None, queues: Sequence[str] | str | None = None, loglevel: str = "INFO", **kw: Any
) -> list[str]:
    """The command line of a count worker subprocess (``python -m celery -A workers.app worker …``)."""
    from workers.app import worker_argv

    return [sys.executable, "-m", "celery", "-A", "workers.app", *worker_argv(concurrency, queues, loglevel, **kw)]


class WorkerProcess:
    """A count worker subprocess (``celery -A workers.app worker --pool prefork``) in its own
    process group: start, wait until it answers ping, SIGKILL it with its pool children, stop it.

    The child gets ``env`` on top of this process's environment, the broker, result backend and
    queue as ``TRACKER_*`` variables, and the repository root on ``PYTHONPATH`` (so a models file
    can name a counter class of the tests by import path).
    """

    def __init__(
        self, *, broker: str, backend: str, queue: str, env: Mapping[str, str] | None = None, concurrency: int = 2
    ) -> None:
        self.queue = queue
        self.hostname = f"ct-{uuid.uuid4().hex[:10]}@localhost"
        self.env = {
            **os.environ,
            **(env or {}),
            "TRACKER_BROKER_URL": broker,
            "TRACKER_RESULT_BACKEND": backend,
            "TRACKER_COUNT_QUEUE": queue,
            "PYTHONPATH": _ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        self.cmd = worker_command(concurrency, [queue], "INFO", hostname=self.hostname)
        # open for the worker's whole life (its stdout); removed by stop()
        self.log = tempfile.NamedTemporaryFile(prefix="ct-worker-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, cwd=_ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def _running(self) -> subprocess.Popen[bytes]:
        if self.proc is None:
            raise RuntimeError("the worker has not been started")
        return self.proc

    def wait_ready(self, app: Any, timeout: float = 30.0) -> None:
        """Until the worker answers ``app``'s ping; ``RuntimeError`` with its log if it exits or times out."""
        proc = self._running()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited with {proc.returncode}:\n{self.output()}")
            try:
                if app.control.ping(destination=[self.hostname], timeout=0.3):
                    return
            except Exception:  # noqa: BLE001 - the broker may not answer yet: ask again
                time.sleep(0.1)
        raise RuntimeError(f"worker not ready after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        """The last 4000 characters of the worker's log."""
        try:
            with open(self.log.name, encoding="utf-8", errors="replace") as fh:
                return fh.read()[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_process_group(self.proc, grace_s=10)
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
