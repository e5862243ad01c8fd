"""The attempt lifecycle (behaviour.md "Decisions"): a manual attempt, commit, reject, and lease expiry.

An attempt is held by its id and fencing token: only the holder may commit or reject it. An
attempt open longer than its lease is rejected as ``lease_expired`` at the start of the next
call on its session (:func:`begin`, which every decision runs first), and a commit supersedes
every other attempt open on the old history. Like the rest of the core these are functions of
(state, input, now) that return an :class:`~tracker.core.outcome.Outcome`: ``now`` and new
attempt ids are passed in as data.
"""

from __future__ import annotations

from typing import Any

from tracker.core import events as ev
from tracker.core.model import Basis, check_text, is_int
from tracker.core.outcome import Outcome, outcome, summary_too_large_error
from tracker.core.policy import Policy
from tracker.core.state import Attempt, SessionState, fold
from tracker.core.thresholds import check_overhead, history_budget
from tracker.errors import (
    AttemptNotOpen,
    InvalidInput,
    ManualAttemptOpen,
    NotAttemptHolder,
    TrackerError,
    UnknownAttempt,
)


def begin(state: SessionState, policy: Policy, now: float) -> tuple[SessionState, list[ev.DomainEvent], Policy]:
    """Start the session if it is new, then expire overdue attempts. Returns the state after those."""
    if state.policy is not None and not state.open_attempts:  # started, nothing to expire: the common case
        return state, [], state.policy
    events: list[ev.DomainEvent] = []
    if not state.started:
        events.append(ev.SessionStarted(policy=policy, at=now))
    s = fold(events, state.session_id, state)
    lease_events = expire_leases(s, now)
    s = fold(lease_events, s.session_id, s)
    policy = s.policy if s.policy is not None else policy  # a started session always has its policy
    return s, events + lease_events, policy


def expire_leases(state: SessionState, now: float) -> list[ev.DomainEvent]:
    """behaviour.md "Decisions" Lease: attempts open past their lease are rejected as ``lease_expired``."""
    return [
        rejected(a, "lease_expired", now)
        for a in state.open_attempts
        if now > a.lease_expires_at  # open *longer than* the lease
    ]


def rejected(a: Attempt, reject_reason: str, now: float) -> ev.CompactionRejected:
    """The rejection of the open attempt ``a`` at ``now``."""
    return ev.CompactionRejected(
        attempt_id=a.attempt_id,
        reason=a.reason,
        basis=a.basis,
        reject_reason=reject_reason,
        duration_ms=ms(now - a.opened_at),
        at=now,
    )


def ms(seconds: float) -> int:
    return max(0, int(round(seconds * 1000)))


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
    overhead = check_overhead(overhead_tokens)
    if basis is not None and basis.revision != state.revision:
        raise InvalidInput("basis.revision", f"must be the session's revision r{state.revision}, got r{basis.revision}")
    s, events, policy = begin(state, default_policy, now)
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
    started = ev.CompactionStarted(
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
        return UnknownAttempt(
            f"no open attempt {attempt_id} in this session", attempt_id=attempt_id, session_id=s.session_id
        )
    if attempt.fencing_token != fencing_token:
        return NotAttemptHolder(
            f"fencing token {fencing_token} does not hold attempt {attempt_id}",
            attempt_id=attempt_id,
        )
    return attempt


def _held(
    state: SessionState, attempt_id: Any, fencing_token: Any, now: float
) -> tuple[SessionState, list[ev.DomainEvent], Attempt | TrackerError]:
    """Expire overdue leases first (recorded either way), then check the caller holds the attempt."""
    if not state.started:
        raise UnknownAttempt("the session has no attempts", attempt_id=attempt_id, session_id=state.session_id)
    events = expire_leases(state, now)
    s = fold(events, state.session_id, state)
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
    if a.input_limit is not None and tokens_after >= a.input_limit:
        events.append(rejected(a, "summary_too_large", now))
        return outcome(
            state, events, attempt=a, error=summary_too_large_error(a.attempt_id, tokens_after, a.input_limit)
        )
    events.append(
        ev.CompactionCommitted(
            attempt_id=a.attempt_id,
            reason=a.reason,
            basis=a.basis,
            new_revision=s.revision + 1,
            tokens_before=a.tokens_before,
            tokens_after=tokens_after,
            duration_ms=ms(now - a.opened_at),
            at=now,
        )
    )
    # Any other attempt open on the old history can no longer apply: it is superseded.
    events.extend(rejected(other, "superseded", now) for other in s.open_attempts if other.attempt_id != a.attempt_id)
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
    events.append(rejected(held, reject_reason, now))
    return outcome(state, events, attempt=held)
