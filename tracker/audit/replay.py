"""Replay a recorded session: the state after each event, and what-if under another policy.

Everything here streams: events come from ``store.read_stream`` in batches and
each step keeps only the current state, so a 100k-event session replays in
constant memory. The what-if re-runs the *recorded* measurements (tokens,
limits, per-request inputs, times) and the recorded commit / reject / manual
operations through the same ``WhatIf`` runner as ``tracker whatif``. The HTML report is
:mod:`tracker.audit.report`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from tracker.audit.whatif import WhatIf
from tracker.core import Basis, Policy, SessionState, apply, event_from_data
from tracker.core.events import CompactionCommitted, CompactionRejected, CompactionStarted, ContextMeasured
from tracker.queries import Unrecognised, decode
from tracker.store import StoredEvent

#: rejections the core records itself (not an operation a caller made): what-if re-derives them
DERIVED_REJECTIONS = ("lease_expired", "superseded")


@dataclass
class Step:
    event: StoredEvent
    state: SessionState


def replay_states(stored: Iterable[StoredEvent], session_id: str, at: int | None = None) -> Iterator[Step]:
    """The state after each event, up to version ``at`` (``InvalidInput`` at an event the core does not know)."""
    state = SessionState(session_id=session_id)
    for e in stored:
        if at is not None and e.version > at:
            break
        event = decode(e).event
        if isinstance(event, Unrecognised):
            event = event_from_data(e.type, e.data)  # raises the core's InvalidInput naming the field
        state = apply(state, event)
        yield Step(e, state)


def whatif_rows(stored: Iterable[StoredEvent], policy: Policy, session_id: str) -> Iterator[dict[str, Any]]:
    """Re-decide the recorded measurements under ``policy``; one row per recorded operation."""
    runner = WhatIf(policy=policy, session_id=session_id, keep_events=False)
    for e in stored:
        event = decode(e).event
        op: dict[str, Any] | None = None
        match event:
            case ContextMeasured(measurement=m):
                op = {
                    "op": "measure",
                    "basis": Basis.parse(m["basis"]).through,
                    "input_tokens": m["input_tokens"],
                    "input_limit": m["input_limit"],
                    "quality": m["quality"],
                    "at": event.at,
                    **(event.inputs or {}),
                }
            case CompactionCommitted():
                op = {"op": "commit", "tokens_after": event.tokens_after, "at": event.at, "reason": event.reason}
            case CompactionRejected() if event.reject_reason not in DERIVED_REJECTIONS:
                op = {"op": "reject", "reject_reason": event.reject_reason, "at": event.at, "reason": event.reason}
            case CompactionStarted(reason="manual"):
                op = {"op": "manual", "at": event.opened_at}
        if op is None:
            continue
        runner.line_no += 1
        out = runner.step(op)
        row = {"version": e.version, "op": op["op"], "whatif": out}
        if isinstance(event, ContextMeasured):
            row["recorded_action"] = event.action
            row["changed"] = out.get("action") != event.action
        yield row
