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


@dataclass
class Step:
    event: Any  # StoredEvent
    state: SessionState


def replay_states(stored: Iterable[Any], session_id: str, at: int | None = None) -> Iterator[Step]:
    """The state after each event, up to version ``at``."""
    state = SessionState(session_id=session_id)
    for e in stored:
        if at is not None and e.version > at:
            break
        state = apply(state, event_from_data(e.type, e.data))
        yield Step(e, state)


def whatif_rows(stored: Iterable[Any], policy: Policy, session_id: str) -> Iterator[dict[str, Any]]:
    """Re-decide the recorded measurements under ``policy``; one row per recorded operation."""
    runner = WhatIf(policy=policy, session_id=session_id, keep_events=False)
    for e in stored:
        d = e.data
        op: dict[str, Any] | None = None
        if e.type == "ContextMeasured":
            m = d["measurement"]
            op = {
                "op": "measure",
                "basis": Basis.parse(m["basis"]).through,
                "input_tokens": m["input_tokens"],
                "input_limit": m["input_limit"],
                "quality": m["quality"],
                "at": d.get("at", 0.0),
                **(d.get("inputs") or {}),
            }
        elif e.type == "CompactionCommitted":
            op = {"op": "commit", "tokens_after": d["tokens_after"], "at": d.get("at", 0.0), "reason": d["reason"]}
        elif e.type == "CompactionRejected" and d["reject_reason"] not in ("lease_expired", "superseded"):
            op = {"op": "reject", "reject_reason": d["reject_reason"], "at": d.get("at", 0.0), "reason": d["reason"]}
        elif e.type == "CompactionStarted" and d["reason"] == "manual":
            op = {"op": "manual", "at": d["opened_at"]}
        if op is None:
            continue
        runner.line_no += 1
        out = runner.step(op)
        row = {"version": e.version, "op": op["op"], "whatif": out}
        if e.type == "ContextMeasured":
            row["recorded_action"] = d["action"]
            row["changed"] = out.get("action") != d["action"]
        yield row
