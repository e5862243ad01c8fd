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
from tracker.core import Basis, Policy, SessionState, apply
from tracker.core.events import (
    CompactionCommitted,
    CompactionRejected,
    CompactionStarted,
    ContextMeasured,
    ProviderRejected,
    UsageReported,
)
from tracker.core.ledger import CalibrationLedger
from tracker.core.model import SessionScope
from tracker.queries import decode, event_of
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
        state = apply(state, event_of(e))  # raises the core's InvalidInput naming the field
        yield Step(e, state)


def whatif_rows(
    stored: Iterable[StoredEvent],
    policy: Policy,
    session_id: str,
    *,
    uncalibrated: bool = False,
    reports: Iterable[StoredEvent] | None = None,
) -> Iterator[dict[str, Any]]:
    """Re-decide the recorded measurements under ``policy``; one row per recorded operation.

    Each measurement is re-decided on its raw count with the calibration and the learned limit its
    decision recorded (and the request shape it was counted with), and each usage report and
    provider rejection is replayed (a usage report anchors the decisions after it, as live), so
    under the recorded policy every action and count is the recorded one. ``uncalibrated``: a second run beside it on the raw counts alone
    (no factor; rejections and learned limits still apply, as with ``TRACKER_CALIBRATION=off``),
    in ``row["uncalibrated"]``. ``reports``: the log's provider reports in global order
    (``read_all(types=PROVIDER_REPORTS)``): a third run, in ``row["refolded"]``, decides each
    measurement with the calibration and learned limit *this* code folds from the reports
    recorded before it (an estimator change shows here)."""
    runner = WhatIf(policy=policy, session_id=session_id, keep_events=False)
    raw = WhatIf(policy=policy, session_id=session_id, keep_events=False, calibrated=False) if uncalibrated else None
    refold = _Refold(reports, policy, session_id) if reports is not None else None
    for e in stored:
        event = decode(e).event
        op: dict[str, Any] | None = None
        match event:
            case ContextMeasured(measurement=m):
                op = {
                    "op": "measure",
                    "basis": m.basis.through,
                    "input_tokens": m.input_tokens,
                    "input_limit": m.input_limit,
                    "quality": m.quality,
                    "model": m.model.to_data(),
                    "at": event.at,
                    **(event.inputs or {}),
                }
                if event.calibration is not None:
                    op["calibration"] = event.calibration.to_data()
                if event.decided_limit < m.input_limit:
                    op["learned_limit"] = event.decided_limit
                if event.shape is not None:
                    op["shape"] = event.shape.to_data()
            case UsageReported():
                op = {"op": "usage", "basis": event.basis, "input_tokens": event.billed_tokens, "at": event.at}
            case ProviderRejected():
                op = {"op": "rejection", "basis": Basis.parse(event.basis).through, "at": event.at}
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
        if raw is not None:
            raw.line_no += 1
            row["uncalibrated"] = raw.step(op)
        if refold is not None:
            row["refolded"] = refold.step(e, event, op)
        if isinstance(event, ContextMeasured):
            row["recorded_action"] = event.action
            row["changed"] = out.get("action") != event.action
            if raw is not None:
                row["changed_uncalibrated"] = row["uncalibrated"].get("action") != event.action
            if refold is not None:
                row["changed_refolded"] = row["refolded"].get("action") != event.action
        yield row


class _Refold:
    """The what-if with the calibration folded from the log's reports up to each measurement."""

    def __init__(self, reports: Iterable[StoredEvent], policy: Policy, session_id: str) -> None:
        self.runner = WhatIf(policy=policy, session_id=session_id, keep_events=False)
        self.ledger = CalibrationLedger()
        self.reports = iter(reports)
        self.pending: StoredEvent | None = next(self.reports, None)

    def step(self, e: StoredEvent, event: Any, op: dict[str, Any]) -> dict[str, Any]:
        while self.pending is not None and self.pending.position < e.position:
            r = self.pending
            self.ledger.fold(SessionScope.fleet_of(r.session_id), event_of(r), r.session_id)
            self.pending = next(self.reports, None)
        if isinstance(event, ContextMeasured):
            m = event.measurement
            fleet, name = SessionScope.fleet_of(e.session_id), m.model.name
            content = event.shape.content if event.shape is not None else None
            calibration = self.ledger.calibration(fleet, name, m.quality, content)
            learned = self.ledger.learned_limit(fleet, name)
            op = {k: v for k, v in op.items() if k not in ("calibration", "learned_limit")}
            if calibration is not None:
                op["calibration"] = calibration.to_data()
            if learned is not None and learned < m.input_limit:
                op["learned_limit"] = learned
        self.runner.line_no += 1
        return self.runner.step(op)
