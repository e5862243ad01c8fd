"""Decisions (behaviour.md "Pressure", "Decisions"): functions of (state, input, now) that return new events.

Nothing here reads a clock, touches I/O or holds globals: ``now`` and new
attempt ids are passed in as data. Every function returns an ``Outcome`` whose
``state`` is ``fold(state, events)`` computed with the one ``apply``; the
caller records ``events`` and then raises ``error`` if there is one (so a
refusal is on the record before the caller hears about it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, TypeVar

from tracker.core.events import (
    CompactionCommitted,
    CompactionRejected,
    CompactionStarted,
    ContextLimitReached,
    ContextMeasured,
    CountFailed,
    DomainEvent,
    MeasurementRefused,
    SessionStarted,
)
from tracker.core.model import FULL_SCALE_BP, Action, Basis, Measurement, Pressure, Trigger, check_text, is_int
from tracker.core.policy import Policy
from tracker.core.state import Attempt, SessionState, apply, episode_after
from tracker.core.thresholds import (
    Levels,
    default_threshold,
    growth_fired,
    history_budget,
    levels_at,
    resolve_threshold,
)
from tracker.errors import (
    AttemptNotOpen,
    ContextLimitError,
    CountError,
    InvalidInput,
    ManualAttemptOpen,
    NotAttemptHolder,
    QualityMismatch,
    StaleBasis,
    SummaryTooLarge,
    TrackerError,
    UnknownAttempt,
)

_T = TypeVar("_T")


@dataclass(frozen=True)
class Decision:
    action: Action
    pressure: Pressure
    pressure_before: Pressure
    occupancy_bp: int
    threshold_bp: int
    threshold_source: str
    compact_level: int
    rearm_level: int
    hard_level: int
    growth_fired: bool
    trigger: Trigger | None
    basis: str
    revision: int
    attempt: Attempt | None = None  # the attempt opened for this caller (action == compact)
    waiting_on: Attempt | None = None  # the open automatic attempt (action == wait)

    @classmethod
    def from_event(
        cls, e: ContextMeasured, waiting_on: Attempt | None = None, attempt: Attempt | None = None
    ) -> Decision:
        """The decision a recorded ``ContextMeasured`` stands for."""
        basis = Basis.parse(e.measurement["basis"], 1)
        return cls(
            action=e.action,
            pressure=e.pressure,
            pressure_before=e.pressure_before,
            occupancy_bp=e.occupancy_bp,
            threshold_bp=e.threshold_bp,
            threshold_source=e.threshold_source,
            compact_level=e.compact_level,
            rearm_level=e.rearm_level,
            hard_level=e.hard_level,
            growth_fired=e.growth_fired,
            trigger=e.trigger,
            basis=str(basis),
            revision=basis.revision,
            attempt=attempt,
            waiting_on=waiting_on,
        )

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Decision:
        """The inverse of ``to_data`` (extra keys, e.g. an HTTP answer's ``session_id``, are ignored)."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        for key in ("attempt", "waiting_on"):
            values[key] = Attempt(**values[key]) if values.get(key) else None
        return cls(**values)

    def to_data(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["attempt"] = self.attempt.to_data() if self.attempt else None
        d["waiting_on"] = self.waiting_on.to_data() if self.waiting_on else None
        return d


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


@dataclass(frozen=True)
class Outcome:
    events: tuple[DomainEvent, ...]
    state: SessionState
    decision: Decision | None = None
    attempt: Attempt | None = None  # for manual / commit / reject: the attempt acted on
    error: TrackerError | None = None  # raise after recording the events


def outcome(state: SessionState, events: list[DomainEvent], **kw: Any) -> Outcome:
    """The ``Outcome`` of recording ``events`` on ``state`` (the new state is folded with ``apply``)."""
    s = state
    for e in events:
        s = apply(s, e)
    return Outcome(events=tuple(events), state=s, **kw)


# -- the refusals a decision can record (one constructor each; `recorded.py` rebuilds them too) --


def context_limit_error(basis: str, input_tokens: int, input_limit: int) -> ContextLimitError:
    return ContextLimitError(
        f"{input_tokens} tokens reach the input limit {input_limit} and no automatic compaction is eligible "
        f"for basis {basis}",
        basis=basis,
        input_tokens=input_tokens,
        input_limit=input_limit,
    )


def stale_basis_error(basis: str, current_revision: int) -> StaleBasis:
    return StaleBasis(
        f"basis {basis} is older than the session's revision r{current_revision}",
        basis=basis,
        current_revision=current_revision,
    )


def summary_too_large_error(
    attempt_id: str, tokens_after: int | None = None, input_limit: int | None = None
) -> SummaryTooLarge:
    if tokens_after is None:
        return SummaryTooLarge(
            f"attempt {attempt_id}: tokens_after >= input_limit; recorded as a rejection", attempt_id=attempt_id
        )
    return SummaryTooLarge(
        f"tokens_after {tokens_after} >= input_limit {input_limit}; recorded as a rejection",
        attempt_id=attempt_id,
        tokens_after=tokens_after,
        input_limit=input_limit,
    )


def _begin(state: SessionState, policy: Policy, now: float) -> tuple[SessionState, list[DomainEvent], Policy]:
    """Start the session if it is new, then expire overdue attempts. Returns the state after those."""
    events: list[DomainEvent] = []
    if not state.started:
        events.append(SessionStarted(policy=policy.to_data(), at=now))
    s = state
    for e in events:
        s = apply(s, e)
    lease_events = expire_leases(s, now)
    for e in lease_events:
        s = apply(s, e)
    policy = s.policy if s.policy is not None else policy  # a started session always has its policy
    return s, events + lease_events, policy


def expire_leases(state: SessionState, now: float) -> list[DomainEvent]:
    """behaviour.md "Decisions" Lease: attempts open past their lease are rejected as ``lease_expired``."""
    return [
        CompactionRejected(
            attempt_id=a.attempt_id,
            reason=a.reason,
            basis=a.basis,
            reject_reason="lease_expired",
            duration_ms=_ms(now - a.opened_at),
            at=now,
        )
        for a in state.open_attempts
        if now > a.lease_expires_at  # open *longer than* the lease
    ]


def _ms(seconds: float) -> int:
    return max(0, int(round(seconds * 1000)))


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
) -> Outcome:
    """One accepted measurement → exactly one action (behaviour.md "Decisions")."""
    # Bad input first: nothing is recorded for it.
    policy_now = state.policy or default_policy
    if compaction_threshold is None and scope is None and scope_confidence is None:
        threshold = default_threshold(policy_now.compact_at_bp, policy_now.rearm_below_bp)
    else:
        threshold = resolve_threshold(
            policy_now.compact_at_bp, policy_now.rearm_below_bp, compaction_threshold, scope, scope_confidence
        )
    overhead = _overhead(overhead_tokens)
    basis = measurement.basis
    if basis.revision > state.revision:
        raise InvalidInput("basis.revision", f"r{basis.revision} is ahead of the session's revision r{state.revision}")

    s, events, policy = _begin(state, default_policy, now)
    basis_s = str(basis)

    if basis.revision < s.revision:
        events.append(MeasurementRefused(kind="stale_basis", basis=basis_s, current_revision=s.revision, at=now))
        return outcome(state, events, error=stale_basis_error(basis_s, s.revision))
    if not policy.allows_quality(measurement.quality):
        err = QualityMismatch(
            f"quality {measurement.quality} is not allowed by counter_policy {policy.counter_policy}",
            quality=measurement.quality,
            counter_policy=policy.counter_policy,
        )
        events.append(
            CountFailed(
                kind=err.kind, model=measurement.model.name, detail=err.message, duration_ms=0, basis=basis_s, at=now
            )
        )
        return outcome(state, events, error=err)

    used, L = measurement.input_tokens, measurement.input_limit
    lv = levels_at(threshold.bp, threshold.rearm_bp, L)
    # = occupancy_bp(used, L): a Measurement's counts are validated integers (used >= 0, L > 0)
    occ = min(FULL_SCALE_BP, used * FULL_SCALE_BP // L)
    before = s.pressure
    pressure = _pressure(policy, before, used, lv)
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

    events.append(
        _built(
            ContextMeasured,
            {
                "measurement": measurement.to_data(),
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
            },
        )
    )
    opened: Attempt | None = None
    error: TrackerError | None = None
    if action == "compact":
        started = CompactionStarted(
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
        events.append(ContextLimitReached(basis=basis_s, input_tokens=used, input_limit=L, at=now))
        error = context_limit_error(basis_s, used, L)
    decision = _built(
        Decision,
        {
            "action": action,
            "pressure": pressure,
            "pressure_before": before,
            "occupancy_bp": occ,
            "threshold_bp": threshold.bp,
            "threshold_source": threshold.source,
            "compact_level": lv.compact,
            "rearm_level": lv.rearm,
            "hard_level": lv.hard,
            "growth_fired": grew,
            "trigger": trigger,
            "basis": basis_s,
            "revision": basis.revision,
            "attempt": opened,
            "waiting_on": open_auto if action == "wait" else None,
        },
    )
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
    s, events, _ = _begin(state, default_policy, now)
    events.append(
        CountFailed(
            kind=error.kind,
            model=model,
            detail=error.message,
            duration_ms=max(0, int(duration_ms)),
            basis=str(basis) if basis else None,
            at=now,
        )
    )
    return outcome(state, events, error=error)


def decide_manual(
    state: SessionState,
    default_policy: Policy,
    *,
    now: float,
    new_attempt_id: str,
    basis: Basis | None = None,
    overhead_tokens: Any = None,
) -> Outcome:
    """A manual attempt opens regardless of pressure; at most one manual attempt is open at a time."""
    overhead = _overhead(overhead_tokens)
    if basis is not None and basis.revision != state.revision:
        raise InvalidInput("basis.revision", f"must be the session's revision r{state.revision}, got r{basis.revision}")
    s, events, policy = _begin(state, default_policy, now)
    if s.open_manual is not None:
        return outcome(
            state,
            events,
            error=ManualAttemptOpen(
                f"manual attempt {s.open_manual.attempt_id} is already open",
                attempt_id=s.open_manual.attempt_id,
            ),
        )
    last = s.last if s.last and s.last.revision == s.revision else None
    b = str(basis) if basis else (last.basis if last else f"r{s.revision}:manual")
    L = last.input_limit if last else None
    budget = None
    if L is not None:
        budget = history_budget(L, overhead, policy.compact_at_bp, policy.compact_at_bp)
    started = CompactionStarted(
        attempt_id=new_attempt_id,
        reason="manual",
        trigger="manual",
        basis=b,
        fencing_token=s.attempts_opened + 1,
        opened_at=now,
        lease_expires_at=now + policy.attempt_lease_s,
        tokens_before=last.input_tokens if last else None,
        input_limit=L,
        history_budget=budget,
    )
    events.append(started)
    return outcome(state, events, attempt=Attempt.from_started(started))


def _holder(s: SessionState, attempt_id: Any, fencing_token: Any) -> Attempt | TrackerError:
    if not isinstance(attempt_id, str) or not attempt_id:
        raise InvalidInput("attempt_id", f"must be a non-empty string, got {attempt_id!r}")
    if not is_int(fencing_token):
        raise InvalidInput("fencing_token", f"must be an integer, got {fencing_token!r}")
    attempt = s.find_open(attempt_id)
    if attempt is None:
        outcome = s.outcome_of(attempt_id)
        if outcome is not None:
            return AttemptNotOpen(
                f"attempt {attempt_id} already ended ({outcome})", attempt_id=attempt_id, outcome=outcome
            )
        return UnknownAttempt(f"no open attempt {attempt_id} in session {s.session_id}", attempt_id=attempt_id)
    if attempt.fencing_token != fencing_token:
        return NotAttemptHolder(
            f"fencing token {fencing_token} does not hold attempt {attempt_id}",
            attempt_id=attempt_id,
        )
    return attempt


def _held(
    state: SessionState, attempt_id: Any, fencing_token: Any, now: float
) -> tuple[SessionState, list[DomainEvent], Attempt | TrackerError]:
    """Expire overdue leases first (recorded either way), then check the caller holds the attempt."""
    if not state.started:
        raise UnknownAttempt(f"session {state.session_id} has no attempts", attempt_id=attempt_id)
    events = expire_leases(state, now)
    s = state
    for e in events:
        s = apply(s, e)
    return s, events, _holder(s, attempt_id, fencing_token)


def decide_commit(
    state: SessionState, *, attempt_id: Any, fencing_token: Any, tokens_after: Any, now: float
) -> Outcome:
    """Only the holder may commit. ``tokens_after >= input_limit`` is recorded as ``summary_too_large``."""
    if not is_int(tokens_after) or tokens_after < 0:
        raise InvalidInput("tokens_after", f"must be an integer >= 0, got {tokens_after!r}")
    s, events, held = _held(state, attempt_id, fencing_token, now)
    if isinstance(held, TrackerError):
        return outcome(state, events, error=held)
    a = held
    duration = _ms(now - a.opened_at)
    if a.input_limit is not None and tokens_after >= a.input_limit:
        events.append(
            CompactionRejected(
                attempt_id=a.attempt_id,
                reason=a.reason,
                basis=a.basis,
                reject_reason="summary_too_large",
                duration_ms=duration,
                at=now,
            )
        )
        return outcome(
            state, events, attempt=a, error=summary_too_large_error(a.attempt_id, tokens_after, a.input_limit)
        )
    events.append(
        CompactionCommitted(
            attempt_id=a.attempt_id,
            reason=a.reason,
            basis=a.basis,
            new_revision=s.revision + 1,
            tokens_before=a.tokens_before,
            tokens_after=tokens_after,
            duration_ms=duration,
            at=now,
        )
    )
    # Any other attempt open on the old history can no longer apply: it is superseded.
    for other in s.open_attempts:
        if other.attempt_id != a.attempt_id:
            events.append(
                CompactionRejected(
                    attempt_id=other.attempt_id,
                    reason=other.reason,
                    basis=other.basis,
                    reject_reason="superseded",
                    duration_ms=_ms(now - other.opened_at),
                    at=now,
                )
            )
    return outcome(state, events, attempt=a)


def decide_reject(
    state: SessionState, *, attempt_id: Any, fencing_token: Any, reject_reason: Any, now: float
) -> Outcome:
    if not isinstance(reject_reason, str) or not reject_reason.strip() or len(reject_reason) > 200:
        raise InvalidInput(
            "reject_reason", f"must be a non-empty string of at most 200 characters, got {reject_reason!r}"
        )
    check_text("reject_reason", reject_reason)
    _, events, held = _held(state, attempt_id, fencing_token, now)
    if isinstance(held, TrackerError):
        return outcome(state, events, error=held)
    events.append(
        CompactionRejected(
            attempt_id=held.attempt_id,
            reason=held.reason,
            basis=held.basis,
            reject_reason=reject_reason,
            duration_ms=_ms(now - held.opened_at),
            at=now,
        )
    )
    return outcome(state, events, attempt=held)


def _built(cls: type[_T], values: dict[str, Any]) -> _T:
    """``cls(**values)`` for a frozen dataclass without validation (``Decision``, ``ContextMeasured``),
    given every one of its fields: one dict update instead of a ``object.__setattr__`` per field."""
    new = object.__new__(cls)
    new.__dict__.update(values)
    return new


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


def _overhead(value: Any) -> int:
    if value is None:
        return 0
    if not is_int(value) or value < 0:
        raise InvalidInput("overhead_tokens", f"must be an integer >= 0, got {value!r}")
    return value
