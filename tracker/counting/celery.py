"""Counting on Celery workers: the caller's backend and the Celery app both sides configure alike.

* :func:`make_celery_app` — a configured Celery app from :class:`~tracker.settings.CountingSettings`.
  The caller (:class:`CeleryCounting`, built by ``tracker.bootstrap``) and the worker
  (``workers.app``, which adds the count task) use the same configuration.
* :class:`CeleryCounting` — sends the count task ``TASK_NAME`` (whose body is
  :func:`tracker.counting.backends.run_count_task`) and waits for its answer, never past the
  count's deadline.

Counts are short and idempotent, so: ``acks_late`` off, prefetch 1, results kept five
minutes, every message with ``expires`` and soft / hard time limits. This module never
imports ``workers``: the task is addressed by name.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tracker import telemetry
from tracker.counting.backends import DaemonPool, MeasuringBackend, run_before_deadline
from tracker.counting.base import ModelSpec
from tracker.counting.registry import ModelRegistry
from tracker.counting.request import CanonicalRequest
from tracker.errors import CountTimeout, MalformedMeasurement, count_error_from_dict
from tracker.settings import CountingSettings

if TYPE_CHECKING:  # pragma: no cover
    from celery import Celery

TASK_NAME = "workers.tasks.count"
DEFAULT_QUEUE: str = CountingSettings.model_fields["count_queue"].default
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"  # a worker started without TRACKER_BROKER_URL
DEFAULT_RESULT_BACKEND = "redis://127.0.0.1:6379/0"
RESULT_EXPIRES_S = 300
CELERY_SLACK_S = 0.25
HARD_LIMIT_EXTRA_S = 1.0


def broker_url(counting: CountingSettings) -> str:
    """``TRACKER_BROKER_URL``, or Redis on localhost."""
    return counting.broker_url or DEFAULT_BROKER_URL


def result_backend_url(counting: CountingSettings) -> str:
    """``TRACKER_RESULT_BACKEND``, else the broker when it is Redis, else Redis on localhost."""
    if counting.result_backend:
        return counting.result_backend
    broker = broker_url(counting)
    return broker if broker.startswith(("redis://", "rediss://", "unix://")) else DEFAULT_RESULT_BACKEND


def make_celery_app(counting: CountingSettings, *, default_timeout_s: float, include: Sequence[str] = ()) -> Celery:
    """A configured Celery app: broker, result backend and queue from ``counting``.

    ``default_timeout_s`` (the policy's ``count_timeout_s``) is the task's default soft time
    limit; every count also sends its own. ``include`` names task modules a worker imports
    (``workers.app`` passes its own).
    """
    from celery import Celery

    app = Celery("tracker", broker=broker_url(counting), backend=result_backend_url(counting), include=list(include))
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_default_queue=counting.count_queue,
        task_acks_late=False,
        task_reject_on_worker_lost=False,
        task_track_started=False,
        task_soft_time_limit=default_timeout_s,
        task_time_limit=default_timeout_s + HARD_LIMIT_EXTRA_S,
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


class CeleryCounting(MeasuringBackend):
    """Sends the count to a Celery worker; waits at most ``count_timeout_s + slack_s``.

    The task carries ``expires`` and soft / hard time limits (``count_timeout_s`` /
    ``+1 s``). Past the wait the task is revoked and ``CountTimeout`` raised — whether
    the worker is slow, dead, killed mid-task or absent, or the broker / result backend
    is unreachable. A failure inside the worker comes back as data and is raised here as
    the same typed error.

    Sending and waiting run on a small pool of daemon threads (each with its own
    thread-local Celery result backend), so nothing the broker client does — connection
    retries included — can hold the caller past its deadline.
    """

    def __init__(
        self,
        app: Celery,
        registry: ModelRegistry,
        *,
        queue: str | None = None,
        owns_app: bool = False,
        slack_s: float = CELERY_SLACK_S,
        max_inflight: int = 64,
    ) -> None:
        self.app = app
        self.registry = registry
        self.queue = queue or app.conf.task_default_queue or DEFAULT_QUEUE
        self.slack_s = slack_s
        self.max_inflight = max_inflight
        self._pool = DaemonPool(max_inflight)
        self.owns_app = owns_app  # made for this backend (by the composition root): close() closes it

    def close(self) -> None:
        if self.owns_app:
            self.app.close()

    def _count(self, request: CanonicalRequest, spec: ModelSpec, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s + self.slack_s
        headers = telemetry.inject()  # the caller's trace context, taken on the caller's thread
        return run_before_deadline(
            self._pool,
            lambda: self._send_and_wait(request, spec, timeout_s, deadline - 0.03, headers),
            deadline,
            spec,
            timeout_s,
            saturated=f"{self.max_inflight} counts already waiting on Celery",
            late=f"no count from Celery within {timeout_s:g}s (+{self.slack_s:g}s slack)",
        )

    def _send_and_wait(
        self, request: CanonicalRequest, spec: ModelSpec, timeout_s: float, deadline: float, headers: Any = None
    ) -> Any:
        from celery.exceptions import TimeoutError as CeleryTimeout

        try:
            result = self.app.send_task(
                TASK_NAME,
                args=[request.to_dict(), spec.name],
                kwargs={"timeout_s": timeout_s},
                queue=self.queue,
                expires=timeout_s,
                soft_time_limit=timeout_s,
                time_limit=timeout_s + HARD_LIMIT_EXTRA_S,
                retry=False,
                headers=headers or None,
            )
        except Exception as exc:  # noqa: BLE001 - any broker trouble means no count in time
            raise CountTimeout(
                f"{spec.name}: could not send the count: {type(exc).__name__}: {' '.join(str(exc).split())}",
                model=spec.name,
                cause="broker",
            ) from None
        try:
            payload = _wait_for_result(result, max(0.001, deadline - time.monotonic()))
        except CeleryTimeout:
            self._abandon(result)
            raise CountTimeout(
                f"{spec.name}: no count from a worker within {timeout_s:g}s (+{self.slack_s:g}s slack)",
                model=spec.name,
                cause="timeout",
                timeout_s=timeout_s,
                task_id=result.id,
            ) from None
        except Exception as exc:  # noqa: BLE001 - result backend trouble of any kind
            self._abandon(result)
            raise CountTimeout(
                f"{spec.name}: result backend failed: {type(exc).__name__}: {' '.join(str(exc).split())}",
                model=spec.name,
                cause="result_backend",
            ) from None
        if isinstance(payload, BaseException):  # the task itself failed (time limit, worker lost …)
            raise CountTimeout(
                f"{spec.name}: the count task failed: {type(payload).__name__}: {payload}",
                model=spec.name,
                cause="worker_error",
                task_id=result.id,
            )
        if not isinstance(payload, Mapping) or not isinstance(payload.get("ok"), bool):
            raise MalformedMeasurement(f"the worker returned {type(payload).__name__}, not a count", field="result")
        if not payload["ok"]:
            error = payload.get("error")
            if not isinstance(error, Mapping):
                raise MalformedMeasurement("the worker reported a failure without an error", field="error")
            raise count_error_from_dict(dict(error))
        return payload.get("result")

    def _abandon(self, result: Any) -> None:
        """Stop listening for the result and revoke the task (on this pool thread, not the caller's)."""
        try:
            remove = getattr(result.backend, "remove_pending_result", None)
            if remove is not None:
                remove(result)
        except Exception:  # noqa: BLE001  # pragma: no cover - best effort
            pass
        try:
            result.revoke()
        except Exception:  # noqa: BLE001  # pragma: no cover - broker down: the task expires anyway
            pass


WAIT_INTERVAL_S = 0.02


def _wait_for_result(result: Any, timeout: float) -> Any:
    """``AsyncResult.get(timeout, propagate=False)``, but precise to ~20 ms.

    Celery's ``get`` drains the Redis result channel in fixed one-second waits, so a
    timeout can overshoot by up to a second. This subscribes the same way, then drains
    in short waits (no extra Redis commands: it only waits on the subscribed socket).
    """
    from celery.exceptions import TimeoutError as CeleryTimeout

    backend = result.backend
    consumer = getattr(backend, "result_consumer", None)
    drainer = getattr(consumer, "drainer", None)
    if consumer is None or drainer is None or not hasattr(backend, "add_pending_result"):  # polling backends
        return result.get(timeout=timeout, propagate=False, interval=WAIT_INTERVAL_S)
    backend.add_pending_result(result)
    try:
        consumer.on_wait_for_pending(result)  # a result stored before we subscribed
        for _ in drainer.drain_events_until(result.on_ready, timeout=timeout, interval=min(WAIT_INTERVAL_S, timeout)):
            pass
    except TimeoutError:
        raise CeleryTimeout(f"no result within {timeout:.3f}s") from None
    value = result.maybe_throw(propagate=False)
    try:
        backend.remove_pending_result(result)
    except Exception:  # noqa: BLE001  # pragma: no cover - best effort unsubscribe
        pass
    return value
