"""The ``count`` task. A thin shell: the work is ``tracker.counting.service.run_count_task``.

Failures are returned as data (``{"ok": false, "error": {...}}``), never raised, so
the caller rebuilds the same typed exception; only the hard time limit or a dead
process ends a task without an answer, and the caller's wait turns that into
``CountTimeout``.
"""

from __future__ import annotations

from typing import Any

from tracker.counting.service import HARD_LIMIT_EXTRA_S, TASK_NAME, run_count_task
from workers.app import app, default_timeout_s

_DEFAULT_TIMEOUT = default_timeout_s()


@app.task(
    name=TASK_NAME,
    bind=True,
    acks_late=False,
    ignore_result=False,
    soft_time_limit=_DEFAULT_TIMEOUT,
    time_limit=_DEFAULT_TIMEOUT + HARD_LIMIT_EXTRA_S,
)
def count(self: Any, request: dict[str, Any], model: str, timeout_s: float | None = None) -> dict[str, Any]:
    return run_count_task(request, model, timeout_s=timeout_s or _DEFAULT_TIMEOUT)
