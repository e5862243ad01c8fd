"""Decisions (behaviour.md "Pressure", "Decisions"): functions of (state, input, now) that return new events.

Nothing here reads a clock, touches I/O or holds globals: ``now`` and new
attempt ids are passed in as data. Every function returns an ``Outcome``
(:mod:`tracker.core.outcome`) whose ``state`` is ``fold(state, events)``
computed with the one ``apply``; the caller records ``events`` and then raises
``error`` if there is one (so a refusal is on the record before the caller
hears about it). This module decides measurements; the attempt lifecycle
(manual attempts, commit, reject, lease expiry) is :mod:`tracker.core.attempts`,
and every decision function is importable from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tracker.core import events as ev
from tracker.core.anchor import RequestShape, anchor_decision
from tracker.core.attempts import begin, decide_commit, decide_manual, decide_reject
from tracker.core.calibration import Calibration, calibrates
from tracker.core.calibration import apply as calibrated
from tracker.core.model import FULL_SCALE_BP, Action, Basis, Measurement, Pressure, Trigger, built
from tracker.core.outcome import Decision, Outcome, context_limit_error, outcome, stale_basis_error
from tracker.core.policy import Policy
from tracker.core.state import Attempt, SessionState, episode_after
from tracker.core.thresholds import (
    Levels,
    check_overhead,
    default_threshold,
    growth_fired,
    history_budget,
    levels_at,
    resolve_threshold,
)
from tracker.errors import CountError, InvalidInput, QualityMismatch, TrackerError

__all__ = [
    "ELIGIBLE",
    "INELIGIBLE",
    "Decision",
    "Eligibility",
    "Ineligible",
    "Outcome",
    "Result",
    "decide_commit",
    "decide_count_failed",
    "decide_manual",
    "decide_measure",
    "decide_reject",
    "eligibility",
    "outcome",
]


@dataclass(frozen=True)
class Result:
    """What ``observe`` returns: the decision, and for ``compact`` the attempt opened for this caller."""

    session_id: str
    version: int
    decision: Decision

    @property
    def action(self) -> str:
        return self.decision.action

    @property
    def attempt(self) -> Attempt | None:
        return self.decision.attempt

    def to_data(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "version": self.version, **self.decision.to_data()}


def _pressure(policy: Policy, before: Pressure, used: int, lv: Levels) -> Pressure:
    """behaviour.md "Pressure", rules in order."""
    if used >= lv.hard:
        return "hard_limit"
    if not policy.automatic:
        return "normal"
    if before in ("compact", "hard_limit") and used >= lv.rearm:
        return "compact"
    if used >= lv.compact:
        return "compact"
    return "normal"


#: Why an automatic attempt is not eligible, in the order :func:`eligibility` checks the conditions.
Ineligible = Literal["observe_only", "not_under_pressure", "basis_exhausted", "attempt_open", "episode_cap"]
INELIGIBLE: tuple[Ineligible, ...] = (
    "observe_only",
    "not_under_pressure",
    "basis_exhausted",
    "attempt_open",
    "episode_cap",
)


@dataclass(frozen=True)
class Eligibility:
    """Whether a measurement may open an automatic attempt; if not, the first condition that failed."""

    eligible: bool
    reason: Ineligible | None = None  # None exactly when eligible


ELIGIBLE = Eligibility(True)
_NOT = {r: Eligibility(False, r) for r in INELIGIBLE}


def eligibility(state: SessionState, policy: Policy, *, basis: str, pressure: Pressure, grew: bool) -> Eligibility:
    """behaviour.md "Decisions": an automatic attempt is eligible when the session is automatic; the
    pressure is ``compact`` or ``hard_limit``, or the growth trigger fired; ``basis`` is not exhausted;
    no automatic attempt is open; and fewer than ``max_automatic_per_episode`` opened in this episode.

    ``state`` is the session as the decision sees it (started, overdue leases expired); ``pressure``
    and ``grew`` are the measurement's. :func:`decide_measure` decides with this function, and the
    session page says why nothing was eligible with it, so the two cannot disagree.
    """
    if not policy.automatic:
        return _NOT["observe_only"]
    if not (grew or pressure == "compact" or pressure == "hard_limit"):
        return _NOT["not_under_pressure"]
    if basis in state.exhausted:
        return _NOT["basis_exhausted"]
    if state.open_automatic is not None:
        return _NOT["attempt_open"]
    if episode_after(pressure, state.episode_automatic) >= policy.max_automatic_per_episode:
        return _NOT["episode_cap"]
    return ELIGIBLE


def decide_measure(
    state: SessionState,
    default_policy: Policy,
    measurement: Measurement,
    *,
    now: float,
    new_attempt_id: str,
    compaction_threshold: Any = None,
    scope: Any = None,
    scope_confidence: Any = None,
    overhead_tokens: Any = None,
    calibration: Calibration | None = None,
    learned_limit: int | None = None,
    shape: RequestShape | None = None,
) -> Outcome:
    """One accepted measurement → exactly one action (behaviour.md "Decisions").

    ``calibration``: the correction of the measurement's model (applied only when its quality is
    an estimate: the count decided on is ``ceil(counted x factor)``); ``learned_limit``: a lower
    input limit learned from a provider rejection (the lower of it and the measurement's is used).
    ``shape``: the counted request's messages and digests (the counting layer's): when the request
    extends the session's anchor (its last billed request, ``tracker.core.anchor``) and its quality
    is an estimate, the count decided on is the anchor's billed count plus the new messages'
    estimate, instead of the calibrated count. All are recorded in the ``ContextMeasured``, so
    replay re-decides with the same numbers."""
    # Bad input first: nothing is recorded for it.
    policy_now = state.policy or default_policy
    if compaction_threshold is None and scope is None and scope_confidence is None:
        threshold = default_threshold(policy_now.compact_at_bp, policy_now.rearm_below_bp)
    else:
        threshold = resolve_threshold(
            policy_now.compact_at_bp, policy_now.rearm_below_bp, compaction_threshold, scope, scope_confidence
        )
    overhead = check_overhead(overhead_tokens)
    basis = measurement.basis
    if basis.revision > state.revision:
        raise InvalidInput("basis.revision", f"r{basis.revision} is ahead of the session's revision r{state.revision}")

    s, events, policy = begin(state, default_policy, now)
    basis_s = str(basis)

    if basis.revision < s.revision:
        events.append(ev.MeasurementRefused(kind="stale_basis", basis=basis_s, current_revision=s.revision, at=now))
        return outcome(state, events, error=stale_basis_error(basis_s, s.revision))
    if not policy.allows_quality(measurement.quality):
        err = QualityMismatch(
            f"quality {measurement.quality} is not allowed by counter_policy {policy.counter_policy}",
            quality=measurement.quality,
            counter_policy=policy.counter_policy,
        )
        events.append(
            ev.CountFailed(
                kind=err.kind, model=measurement.model.name, detail=err.message, duration_ms=0, basis=basis_s, at=now
            )
        )
        return outcome(state, events, error=err)

    counted, L = measurement.input_tokens, measurement.input_limit
    anchor = None
    if calibrates(measurement.quality):
        anchor = anchor_decision(
            s.anchor,
            shape,
            basis_revision=basis.revision,
            model=measurement.model.name,
            quality=measurement.quality,
            counted=counted,
        )
    applied = calibration if anchor is None and calibration is not None and calibrates(measurement.quality) else None
    used = anchor.decided if anchor is not None else calibrated(counted, applied)
    if learned_limit is not None and 0 < learned_limit < L:
        L = learned_limit
    rejected = basis_s in s.rejected
    lv = levels_at(threshold.bp, threshold.rearm_bp, L)
    # = occupancy_bp(used, L): a Measurement's counts are validated integers (used >= 0, L > 0)
    occ = min(FULL_SCALE_BP, used * FULL_SCALE_BP // L)
    before = s.pressure
    # a request the provider refused as too long is at the hard limit, whatever the count says
    pressure = "hard_limit" if rejected else _pressure(policy, before, used, lv)
    prev = (s.last.input_tokens, s.last.input_limit) if s.last and s.last.revision == basis.revision else None
    grew = growth_fired(policy.turn_delta, used, L, prev)

    open_auto = s.open_automatic
    trigger: Trigger | None = None
    action: Action
    if eligibility(s, policy, basis=basis_s, pressure=pressure, grew=grew).eligible:
        action = "compact"
        trigger = "hard_limit" if pressure == "hard_limit" else "threshold" if pressure == "compact" else "growth"
    elif pressure == "hard_limit" and open_auto is not None:
        action = "wait"
    elif pressure == "hard_limit":
        action = "context_limit"
    else:
        action = "proceed"

    measured = built(
        ev.ContextMeasured,
        {
            "measurement": measurement,
            "occupancy_bp": occ,
            "pressure_before": before,
            "pressure": pressure,
            "threshold_bp": threshold.bp,
            "threshold_source": threshold.source,
            "compact_level": lv.compact,
            "rearm_level": lv.rearm,
            "hard_level": lv.hard,
            "growth_fired": grew,
            "action": action,
            "trigger": trigger,
            "at": now,
            "inputs": _inputs(compaction_threshold, scope, scope_confidence, overhead_tokens),
            "input_tokens": used,
            "input_limit": L,
            "calibration": applied,
            "rejected": rejected,
            "shape": shape,
            "anchor": anchor,
        },
    )
    events.append(measured)
    opened: Attempt | None = None
    error: TrackerError | None = None
    if action == "compact":
        started = ev.CompactionStarted(
            attempt_id=new_attempt_id,
            reason="automatic",
            trigger=trigger or "threshold",
            basis=basis_s,
            fencing_token=s.attempts_opened + 1,
            opened_at=now,
            lease_expires_at=now + policy.attempt_lease_s,
            tokens_before=used,
            input_limit=L,
            history_budget=history_budget(L, overhead, threshold.bp, policy.compact_at_bp),
        )
        events.append(started)
        opened = Attempt.from_started(started)
    elif action == "context_limit":
        events.append(ev.ContextLimitReached(basis=basis_s, input_tokens=used, input_limit=L, at=now))
        error = context_limit_error(basis_s, used, L)
    waiting_on = open_auto if action == "wait" else None
    decision = Decision.from_event(measured, waiting_on=waiting_on, attempt=opened, basis=basis)
    return outcome(state, events, decision=decision, error=error)


def decide_count_failed(
    state: SessionState,
    default_policy: Policy,
    error: CountError,
    *,
    model: str,
    duration_ms: int,
    now: float,
    basis: Basis | None = None,
) -> Outcome:
    """A count failure is recorded and never decides anything with a guessed number."""
    s, events, _ = begin(state, default_policy, now)
    events.append(
        ev.CountFailed(
            kind=error.kind,
            model=model,
            detail=error.message,
            duration_ms=max(0, int(duration_ms)),
            basis=str(basis) if basis else None,
            at=now,
        )
    )
    return outcome(state, events, error=error)


def _inputs(
    compaction_threshold: Any, scope: Any, scope_confidence: Any, overhead_tokens: Any
) -> dict[str, Any] | None:
    if compaction_threshold is None and scope is None and scope_confidence is None and overhead_tokens is None:
        return None
    given = {
        "compaction_threshold": compaction_threshold,
        "scope": scope,
        "scope_confidence": scope_confidence,
        "overhead_tokens": overhead_tokens,
    }
    return {k: v for k, v in given.items() if v is not None} or None
