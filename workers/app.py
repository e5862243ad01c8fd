"""The Celery app that runs counts (``celery -A workers.app worker``).

Settings (environment):

``TRACKER_BROKER_URL``      broker; default ``redis://127.0.0.1:6379/0``. RabbitMQ
                            (``amqp://guest:guest@127.0.0.1:5672//``) works too.
``TRACKER_RESULT_BACKEND``  result backend; default the broker URL when it is Redis,
                            else ``redis://127.0.0.1:6379/0``.
``TRACKER_COUNT_QUEUE``     queue the counts go to / the worker consumes; default ``tracker.count``.
``TRACKER_COUNT_TIMEOUT_S`` default soft time limit of the count task (the policy's
                            ``count_timeout_s``; each call also sends its own limits).
``TRACKER_MODELS_FILE``     extra / overriding model entries, read by the worker's registry.

Counts are short and idempotent, so: ``acks_late`` off, prefetch 1, results kept
five minutes, every message with ``expires`` and soft / hard time limits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Mapping, Sequence

from celery import Celery, signals

from tracker.counting.service import DEFAULT_QUEUE, HARD_LIMIT_EXTRA_S

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_RESULT_BACKEND = "redis://127.0.0.1:6379/0"
RESULT_EXPIRES_S = 300


def broker_url(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return env.get("TRACKER_BROKER_URL") or DEFAULT_BROKER_URL


def result_backend_url(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    if env.get("TRACKER_RESULT_BACKEND"):
        return env["TRACKER_RESULT_BACKEND"]
    broker = broker_url(env)
    return broker if broker.startswith(("redis://", "rediss://", "unix://")) else DEFAULT_RESULT_BACKEND


def count_queue(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return env.get("TRACKER_COUNT_QUEUE") or DEFAULT_QUEUE


def default_timeout_s(env: Mapping[str, str] | None = None) -> float:
    env = os.environ if env is None else env
    try:
        from tracker.core.policy import Policy

        return float(Policy.from_env(env).count_timeout_s)
    except Exception:
        return 2.0


def make_app(
    env: Mapping[str, str] | None = None,
    *,
    broker: str | None = None,
    backend: str | None = None,
    queue: str | None = None,
) -> Celery:
    """A configured Celery app. Callers (``CeleryCounting``) and the worker use the same config."""
    env = dict(os.environ) if env is None else dict(env)
    broker = broker or broker_url(env)
    backend = backend or result_backend_url({**env, "TRACKER_BROKER_URL": broker})
    queue = queue or count_queue(env)
    timeout = default_timeout_s(env)
    app = Celery("tracker", broker=broker, backend=backend, include=["workers.tasks"])
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_default_queue=queue,
        task_acks_late=False,
        task_reject_on_worker_lost=False,
        task_track_started=False,
        task_soft_time_limit=timeout,
        task_time_limit=timeout + HARD_LIMIT_EXTRA_S,
        task_send_sent_event=False,
        worker_send_task_events=False,
        worker_prefetch_multiplier=1,
        worker_disable_rate_limits=True,
        worker_hijack_root_logger=False,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        result_expires=RESULT_EXPIRES_S,
        result_extended=False,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=2.0,
        broker_pool_limit=16,
        redis_socket_connect_timeout=2.0,
        # a few quick reconnects, not Celery's default ~20 s of them: a count has seconds
        result_backend_transport_options={
            "retry_policy": {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
        },
        redis_backend_health_check_interval=10,
        task_create_missing_queues=True,
        enable_utc=True,
    )
    return app


app = make_app()


@signals.worker_init.connect
def _warm_worker(**_: Any) -> None:
    """In the worker's parent, before the pool forks: load encodings and the registry once."""
    from tracker.counting.counters import warm_encodings
    from tracker.counting.service import worker_registry

    worker_registry()  # a bad TRACKER_MODELS_FILE fails the worker at start, not each count
    warm_encodings()


def worker_argv(
    concurrency: int | None = None,
    queues: Sequence[str] | str | None = None,
    loglevel: str = "INFO",
    *,
    hostname: str | None = None,
    pool: str = "prefork",
) -> list[str]:
    """Arguments for ``app.worker_main`` (and after ``celery -A workers.app``)."""
    if isinstance(queues, str):
        queues = [q for q in queues.split(",") if q]
    argv = ["worker", "--pool", pool, "--loglevel", loglevel, "--without-gossip", "--without-mingle"]
    if concurrency:
        argv += ["--concurrency", str(int(concurrency))]
    argv += ["--queues", ",".join(queues or [count_queue()])]
    if hostname:
        argv += ["--hostname", hostname]
    return argv


def worker_command(
    concurrency: int | None = None,
    queues: Sequence[str] | str | None = None,
    loglevel: str = "INFO",
    **kw: Any,
) -> list[str]:
    """The full command line of a worker subprocess (``python -m celery -A workers.app worker …``)."""
    return [sys.executable, "-m", "celery", "-A", "workers.app", *worker_argv(concurrency, queues, loglevel, **kw)]


def start_worker(
    concurrency: int | None = None,
    queues: Sequence[str] | str | None = None,
    loglevel: str = "INFO",
    **kw: Any,
) -> None:
    """Run a count worker in this process until it is stopped (``tracker worker``)."""
    app.worker_main(worker_argv(concurrency, queues, loglevel, **kw))


# -- worker subprocesses (tests, benches) --------------------------------------------------

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


class WorkerProcess:
    """A worker subprocess (``celery -A workers.app worker --pool prefork``) in its own
    process group, for tests and benches: start, wait until it answers ping, SIGKILL it
    with its pool children, stop it."""

    def __init__(self, *, broker: str, backend: str, queue: str, env: Mapping[str, str] | None = None, concurrency: int = 2) -> None:
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
        self.log = tempfile.NamedTemporaryFile(prefix="ct-worker-", suffix=".log", delete=False)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "WorkerProcess":
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, cwd=_ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def wait_ready(self, app: Any, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if app.control.ping(destination=[self.hostname], timeout=0.3):
                    return
            except Exception:
                time.sleep(0.1)
        raise RuntimeError(f"worker not ready after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        try:
            with open(self.log.name, encoding="utf-8", errors="replace") as fh:
                return fh.read()[-4000:]
        except OSError:
            return ""

    def kill9(self) -> None:
        """SIGKILL the worker and its pool children (its own process group)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_process_group(self.proc, grace_s=10)
        try:
            os.unlink(self.log.name)
        except OSError:
            pass

    def pool_children(self) -> list[int]:
        assert self.proc is not None
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
