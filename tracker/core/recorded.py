"""Recorded outcomes: what a call's stored events stand for (the inverse of ``decide``).

An idempotent retry (same ``idempotency_key``) is answered from the events the first call
recorded, not by deciding again. ``recorded_outcome`` rebuilds that answer — the decision,
the attempt, and the refusal with the same constructor ``decide`` used — from the state
before the call and the call's events. Pure, like the rest of the core.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tracker.core import events as ev
from tracker.core.outcome import (
    Decision,
    Outcome,
    context_limit_error,
    outcome,
    stale_basis_error,
    summary_too_large_error,
)
from tracker.core.state import Attempt, SessionState
from tracker.errors import InvalidInput, TrackerError, count_error_from_dict

# which recorded events a call of each kind can leave behind
OP_EVENTS: dict[str, frozenset[str]] = {
    "observe": frozenset({"ContextMeasured", "CountFailed", "MeasurementRefused"}),
    "manual": frozenset({"CompactionStarted"}),
    "commit": frozenset({"CompactionCommitted", "CompactionRejected"}),
    "reject": frozenset({"CompactionRejected"}),
    "usage": frozenset({"UsageReported"}),
    "rejection": frozenset({"ProviderRejected"}),
}


def succeeded(op: str, events: Sequence[ev.DomainEvent]) -> bool:
    """Whether the call's own effect is among its events (not only side effects such as an expired lease)."""
    if op == "observe":
        return any(isinstance(e, ev.ContextMeasured) for e in events)
    if op == "manual":
        return any(isinstance(e, ev.CompactionStarted) and e.reason == "manual" for e in events)
    if op == "commit":
        return any(isinstance(e, ev.CompactionCommitted) for e in events)
    if op == "reject":
        return any(
            isinstance(e, ev.CompactionRejected) and e.reject_reason not in ("lease_expired", "superseded")
            for e in events
        )
    return True


def recorded_outcome(before: SessionState, events: Sequence[ev.DomainEvent], op: str = "observe") -> Outcome:
    """The outcome a call of kind ``op`` had, from the state before it and the events it recorded.

    Refuses (``InvalidInput`` on ``idempotency_key``) when the events cannot come from a call of
    that kind: a key reused for another kind of call.
    """
    kinds = {e.TYPE for e in events} - {"SessionStarted"}
    lease_only = op != "observe" and all(
        isinstance(e, ev.CompactionRejected) and e.reject_reason == "lease_expired"
        for e in events
        if e.TYPE != "SessionStarted"
    )
    if not lease_only and not (kinds & OP_EVENTS.get(op, frozenset(kinds))):
        raise InvalidInput("idempotency_key", f"was used for a different kind of call than {op}")
    decision: Decision | None = None
    attempt: Attempt | None = None
    error: TrackerError | None = None
    for e in events:
        if isinstance(e, ev.CompactionStarted):
            attempt = Attempt.from_started(e)
        elif isinstance(e, ev.ContextMeasured):
            decision = Decision.from_event(e, waiting_on=before.open_automatic if e.action == "wait" else None)
        elif isinstance(e, ev.ContextLimitReached):
            error = context_limit_error(e.basis, e.input_tokens, e.input_limit)
        elif isinstance(e, ev.MeasurementRefused):
            error = stale_basis_error(e.basis, e.current_revision)
        elif isinstance(e, ev.CountFailed):
            error = count_error_from_dict({"kind": e.kind, "message": e.detail, "model": e.model})
        elif isinstance(e, ev.CompactionRejected) and e.reject_reason == "summary_too_large" and op == "commit":
            error = summary_too_large_error(e.attempt_id)
    if decision is not None and decision.action == "compact":
        decision = dataclasses.replace(decision, attempt=attempt)
    return outcome(before, list(events), decision=decision, attempt=attempt, error=error)
