"""The Celery app that runs counts: ``celery -A workers.app worker`` or ``tracker worker``.

Everything is configured by the settings tree (:class:`tracker.settings.Settings`), read once
when the app is made:

``TRACKER_BROKER_URL``      broker; default ``redis://127.0.0.1:6379/0``. RabbitMQ
                            (``amqp://guest:guest@127.0.0.1:5672//``) works too.
``TRACKER_RESULT_BACKEND``  result backend; default the broker URL when it is Redis,
                            else ``redis://127.0.0.1:6379/0``.
``TRACKER_COUNT_QUEUE``     queue the counts go to / the worker consumes; default ``tracker.count``.
``TRACKER_COUNT_TIMEOUT_S`` default soft time limit of the count task (the policy's
                            ``count_timeout_s``; each call also sends its own limits).
``TRACKER_MODELS_FILE``     extra / overriding model entries of the worker's registry.
``TRACKER_WORKER_METRICS_PORT``  serve the worker's own Prometheus ``/metrics`` on this port
                            (``workers.metrics``: count latency by quality, failures by kind).
``TRACKER_LOG_FORMAT``      ``json``: one JSON object per log line (``tracker.telemetry``).

Traces go where the standard ``OTEL_*`` variables say (none set: no tracing); each count task
is a span in the caller's trace (``tracker.count_task``).

An invalid setting (or models file) stops the worker at start, naming the variable.

The module attribute ``app`` (what ``celery -A workers.app`` looks up) is made on first access
from ``Settings.load()``; importing this module reads nothing. ``tracker worker`` makes its own
app from the settings it already has (:func:`start_worker`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery import Celery, signals

from tracker import telemetry
from tracker.bootstrap import build_registry
from tracker.counting.celery import make_celery_app
from tracker.errors import InvalidInput
from tracker.settings import Settings
from workers import metrics as worker_metrics
from workers.tasks import register_count_task

__all__ = ["app", "make_worker_app", "start_worker", "worker_argv"]


def make_worker_app(settings: Settings) -> Celery:
    """A worker's Celery app: the shared counting configuration plus the count task and its registry.

    The registry is built here, so a bad ``TRACKER_MODELS_FILE`` fails the worker at start, not
    each count; encodings are loaded by ``worker_init``, in the parent before the pool forks.
    """
    timeout_s = settings.policy.count_timeout_s
    registry = build_registry(settings)
    telemetry.configure(
        "tracker-worker", log_format="json" if settings.telemetry.log_format == "json" else None
    )  # text: Celery's own log lines, as before
    port = settings.telemetry.worker_metrics_port
    if port is not None:
        worker_metrics.prepare_multiprocess()
    app = make_celery_app(settings.counting, default_timeout_s=timeout_s)
    register_count_task(app, registry, default_timeout_s=timeout_s)

    def warm(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", app) is not app:  # another app's worker in this process
            return
        from tracker.counting.counters import warm_encodings

        warm_encodings(tuple(sorted(registry.encodings())))
        if port is not None:
            worker_metrics.serve(port)  # in the main process, before the pool forks

    signals.worker_init.connect(warm, weak=False)
    return app


app: Celery  # made on first access, by __getattr__ below (annotation only: no value at import)
_app: Celery | None = None


def __getattr__(name: str) -> Any:
    """``workers.app.app``: the app of ``celery -A workers.app``, made once from ``Settings.load()``."""
    global _app
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _app is None:
        try:
            _app = make_worker_app(Settings.load())
        except InvalidInput as exc:  # InvalidSetting names the variable; a bad models file says so
            raise SystemExit(f"tracker worker: cannot start: {exc}") from None
    return _app


def worker_argv(
    concurrency: int | None = None,
    queues: Sequence[str] | str | None = None,
    loglevel: str = "INFO",
    *,
    hostname: str | None = None,
    pool: str = "prefork",
) -> list[str]:
    """Arguments for ``app.worker_main`` (and after ``celery -A workers.app``).

    Without ``queues`` the worker consumes the app's default queue (``TRACKER_COUNT_QUEUE``).
    """
    if isinstance(queues, str):
        queues = [q for q in queues.split(",") if q]
    argv = ["worker", "--pool", pool, "--loglevel", loglevel, "--without-gossip", "--without-mingle"]
    if concurrency:
        argv += ["--concurrency", str(int(concurrency))]
    if queues:
        argv += ["--queues", ",".join(queues)]
    if hostname:
        argv += ["--hostname", hostname]
    return argv


def start_worker(
    concurrency: int | None = None,
    queues: Sequence[str] | str | None = None,
    loglevel: str = "INFO",
    *,
    settings: Settings | None = None,
    **kw: Any,
) -> None:
    """Run a count worker in this process until it is stopped (``tracker worker``).

    ``settings`` default to ``Settings.load()``; an invalid one raises ``InvalidSetting`` (and a bad
    models file ``InvalidInput``) before anything starts.
    """
    settings = settings if settings is not None else Settings.load()
    app = make_worker_app(settings)
    app.worker_main(worker_argv(concurrency, queues or [settings.counting.count_queue], loglevel, **kw))
