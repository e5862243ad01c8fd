"""The ``count`` task. A thin shell: the work is ``tracker.counting.backends.run_count_task``.

Failures are returned as data (``{"ok": false, "error": {...}}``), never raised, so
the caller rebuilds the same typed exception; only the hard time limit or a dead
process ends a task without an answer, and the caller's wait turns that into
``CountTimeout``. The caller addresses the task by name (``TASK_NAME``), so counting
never imports this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tracker.counting.backends import run_count_task
from tracker.counting.celery import HARD_LIMIT_EXTRA_S, TASK_NAME

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
        return run_count_task(request, model, timeout_s=timeout_s or default_timeout_s, registry=registry)

    return count
