"""The ``count`` task. A thin shell: the work is ``tracker.counting.backends.run_count_task``.

Failures are returned as data (``{"ok": false, "error": {...}}``), never raised, so
the caller rebuilds the same typed exception; only the hard time limit or a dead
process ends a task without an answer, and the caller's wait turns that into
``CountTimeout``. The caller addresses the task by name (``TASK_NAME``), so counting
never imports this package.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tracker import telemetry
from tracker.counting.backends import run_count_task
from tracker.counting.celery import HARD_LIMIT_EXTRA_S, TASK_NAME
from workers.metrics import metrics

if TYPE_CHECKING:  # pragma: no cover
    from celery import Celery, Task

    from tracker.counting.registry import ModelRegistry


def register_count_task(app: Celery, registry: ModelRegistry, *, default_timeout_s: float) -> Task:
    """Add the count task to ``app``: counts with ``registry``, within ``default_timeout_s``
    unless the message brings its own limit (``CeleryCounting`` always sends one)."""

    @app.task(
        name=TASK_NAME,
        bind=True,
        acks_late=False,
        ignore_result=False,
        soft_time_limit=default_timeout_s,
        time_limit=default_timeout_s + HARD_LIMIT_EXTRA_S,
    )
    def count(self: Any, request: dict[str, Any], model: str, timeout_s: float | None = None) -> dict[str, Any]:
        started = time.perf_counter()
        with telemetry.extracted(_trace_headers(self.request)), telemetry.span("tracker.count_task", model=model) as s:
            answer = run_count_task(request, model, timeout_s=timeout_s or default_timeout_s, registry=registry)
            if answer.get("ok"):
                s.set(telemetry.QUALITY, (answer.get("result") or {}).get("quality"))
            else:
                s.set(telemetry.ERROR_CODE, (answer.get("error") or {}).get("code"))
        metrics().observe(answer, time.perf_counter() - started)
        return answer

    return count


def _trace_headers(request: Any) -> dict[str, Any]:
    """The W3C trace context the caller put in the message headers (``CeleryCounting``)."""
    out: dict[str, Any] = {}
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict):
        out.update(headers)
    for key in ("traceparent", "tracestate"):
        value = getattr(request, key, None)
        if isinstance(value, str):
            out[key] = value
    return out
