"""The service layer: observe → decide → record, thin on purpose.

Each call is: validate input → (count, outside any lock) → under the session's
coordination lock: load state, run the pure decision, append its events with
the version the decision was made on → raise the decision's error, if any,
after it is on the record. A ``ConcurrencyConflict`` means another process
appended first: re-load and re-decide (the decision is deterministic in the
state, so the retry sees that process's attempt and does not open another).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from tracker.coordination import Coordinator, coordinator_from_url
from tracker.core import (
    Attempt,
    Basis,
    Decision,
    Measurement,
    Outcome,
    Policy,
    SessionProjector,
    SessionState,
    check_session_id,
    decide_commit,
    decide_count_failed,
    decide_manual,
    decide_measure,
    decide_reject,
    event_from_data,
    expire_leases,
)
from tracker.core.decide import _outcome
from tracker.errors import ConcurrencyConflict, CountError, InvalidInput, ManualAttemptOpen, TrackerError, WaitTimeout
from tracker.bootstrap import build_components
from tracker.settings import Settings

log = logging.getLogger("tracker.service")

CONFLICT_RETRY_S = 30.0


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


class Tracker:
    """The public entry point (SPEC §10). Build one per process with ``Tracker.from_settings()``."""

    def __init__(
        self,
        store: Any,
        *,
        policy: Policy | None = None,
        counting: Any = None,
        coordinator: Coordinator | None = None,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self.store = store
        self.policy = policy or Policy()
        self.counting = counting
        self.coordinator = coordinator or coordinator_from_url(None)
        self.clock = clock
        self.new_id = new_id
        self._states = _StateCache()

    @classmethod
    def from_settings(cls, settings: Settings | None = None, **overrides: Any) -> "Tracker":
        """A Tracker wired by the composition root from ``settings`` (default: ``Settings.load()``).

        ``counting=``, ``coordinator=`` and ``policy=`` replace one part; ``clock=`` and
        ``new_id=`` are passed to the Tracker.
        """
        parts = {k: overrides.pop(k) for k in ("counting", "coordinator", "policy") if k in overrides}
        c = build_components(settings, **parts)
        return cls(c.store, policy=c.policy, counting=c.counting, coordinator=c.coordinator, **overrides)

    def close(self) -> None:
        self.store.close()
        self.coordinator.close()
        close = getattr(self.counting, "close", None)
        if close:
            close()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- state -----------------------------------------------------------------------------
    def _load(self, session_id: str) -> SessionState:
        data, version = self.store.load(session_id)
        if data is None:
            return SessionState(session_id=session_id)
        state = SessionState.from_data(data)
        assert state.version == version, "projection version differs from the stream"
        return state

    def state(self, session_id: str) -> SessionState:
        return self._load(check_session_id(session_id))

    def history(self, session_id: str, from_version: int = 1) -> Iterator[Any]:
        return self.store.read_stream(check_session_id(session_id), from_version)

    def _record(
        self, session_id: str, decide: Callable[[SessionState], Outcome], idempotency_key: str | None = None,
        op: str = "observe",
    ) -> tuple[Outcome, int]:
        """Load → decide → append, under the session lock, retrying on version conflicts.

        Conflicts happen when coordination is degraded (Redis down or flushed) or a lock
        wait timed out; retries back off with full jitter so contenders spread out.
        """
        if idempotency_key is not None:
            # A retried call (commit, reject, manual, observe) gets its original answer, not a new decision.
            replay = self._replay_if_seen(session_id, idempotency_key, op, decide)
            if replay is not None:
                return replay
        deadline = time.monotonic() + CONFLICT_RETRY_S
        attempt = 0
        fresh = False
        while True:
            with self.coordinator.session_lock(session_id):
                # The state this process last recorded is used optimistically: if another process
                # appended since, the append below is refused by its version check and we re-decide
                # on the state read from the database. So a cached state is never trusted alone.
                state = None if fresh else self._states.get(session_id)
                if state is None:
                    state, fresh = self._load(session_id), True
                try:
                    outcome = decide(state)
                except TrackerError:
                    if fresh:
                        raise
                    fresh = True  # refused on a cached state (e.g. a revision it has not seen): ask the record
                    continue
                if not outcome.events:
                    if not fresh:  # nothing to append, so no version check: confirm on the record
                        fresh = True
                        continue
                    return outcome, state.version
                try:
                    result = self.store.append(
                        session_id, state.version, [_new_event(e) for e in outcome.events],
                        idempotency_key=idempotency_key,
                    )
                except ConcurrencyConflict:
                    result = None
                    self._states.pop(session_id)
                except BaseException:
                    self._states.pop(session_id)
                    raise
                if result is not None and not result.replayed:
                    self._states.put(session_id, outcome.state)
            if result is not None:
                if result.replayed:
                    self._states.pop(session_id)
                    return self._replayed(session_id, result, op, decide), result.last_version
                return outcome, result.last_version
            if not fresh:  # a stale cached state: re-decide at once on the record
                fresh = True
                continue
            fresh = True
            attempt += 1
            if time.monotonic() >= deadline:
                raise ConcurrencyConflict(
                    f"session {session_id}: still conflicting after {attempt} tries in {CONFLICT_RETRY_S:.0f}s",
                    session_id=session_id,
                )
            time.sleep(random.uniform(0, min(0.1, 0.002 * 2 ** min(attempt, 10))))

    def _replay_if_seen(
        self, session_id: str, idempotency_key: str, op: str, decide: Callable[[SessionState], Outcome] | None
    ) -> tuple[Outcome, int] | None:
        earlier = self.store.find_idempotent(session_id, idempotency_key)
        if earlier is None:
            return None
        return self._replayed(session_id, earlier, op, decide), earlier.last_version

    def _replayed(self, session_id: str, result: Any, op: str,
                  decide: Callable[[SessionState], Outcome] | None) -> Outcome:
        """An idempotent retry: the original outcome, rebuilt from the events it recorded."""
        from tracker.core import fold

        before = fold((event_from_data(e.type, e.data)
                       for e in self.store.read_stream(session_id, 1, result.first_version - 1)), session_id)
        events = [event_from_data(e.type, e.data)
                  for e in self.store.read_stream(session_id, result.first_version, result.last_version)]
        out = replay_outcome(before, events, op)
        if out.error is None and not _succeeded(op, events) and decide is not None:
            # The original call was refused after recording only side effects (an expired lease):
            # its refusal is a pure function of the state it left, so decide it again, recording nothing.
            try:
                again = decide(out.state)
            except TrackerError as exc:
                again = dataclasses.replace(out, error=exc)
            if again.error is not None:
                out = dataclasses.replace(out, error=again.error)
        return out

    # -- observe ---------------------------------------------------------------------------
    def observe(
        self,
        session_id: str,
        *,
        request: Any = None,
        measurement: Measurement | dict | None = None,
        model: str | None = None,
        basis: Basis | str | None = None,
        compaction_threshold: float | None = None,
        scope: str | None = None,
        scope_confidence: float | None = None,
        overhead_tokens: int | None = None,
        idempotency_key: str | None = None,
    ) -> Result:
        """Count (when given a request), record, decide. Raises ``ContextLimitError`` and count
        failures *after* recording them; bad input raises before anything is written."""
        check_session_id(session_id)
        if (request is None) == (measurement is None):
            raise InvalidInput("request", "give exactly one of request= or measurement=")
        if idempotency_key is not None and (not isinstance(idempotency_key, str) or not 0 < len(idempotency_key) <= 200):
            raise InvalidInput("idempotency_key", "must be a string of 1-200 characters")
        # validate the per-request threshold before counting (bad input writes nothing)
        from tracker.core.thresholds import resolve_threshold

        resolve_threshold(self.policy.compact_at_bp, self.policy.rearm_below_bp, compaction_threshold, scope, scope_confidence)

        if idempotency_key is not None:  # a retry: the original answer, before any (re)counting
            replay = self._replay_if_seen(session_id, idempotency_key, "observe", None)
            if replay is not None:
                outcome, version = replay
                _same_request(outcome, measurement, request)
                if outcome.error is not None:
                    raise outcome.error
                assert outcome.decision is not None
                return Result(session_id=session_id, version=version, decision=outcome.decision)
        # A bare basis ("msg-41") means "at the session's current revision": it is resolved
        # inside the decision, against the state being decided on (validated here first).
        if measurement is not None:
            m = measurement if isinstance(measurement, Measurement) else Measurement.from_data(measurement, 1)
            raw_basis: Any = measurement.basis if isinstance(measurement, Measurement) else measurement["basis"]
        else:
            if model is None:
                raise InvalidInput("model", "is required when counting a request")
            if basis is None:
                raise InvalidInput("basis", "is required when counting a request")
            raw_basis = basis
            b = Basis.parse(basis, 1)
            if self.counting is None:
                raise InvalidInput("request", "this tracker has no counting backend; pass measurement=")
            known = self._states.get(session_id) or self._load(session_id)
            policy = known.policy or self.policy  # the session's policy, fixed when it started
            started = time.monotonic()
            try:
                m = self.counting.measure(request, model=model, basis=b, policy=policy)
            except CountError as exc:
                duration_ms = int((time.monotonic() - started) * 1000)
                self._record(
                    session_id,
                    lambda st, err=exc: decide_count_failed(st, self.policy, err, model=model, duration_ms=duration_ms,
                                                   now=self.clock(), basis=Basis.parse(raw_basis, st.revision)),
                    idempotency_key,
                )
                raise
        attempt_id = self.new_id()
        outcome, version = self._record(
            session_id,
            lambda st: decide_measure(
                st, self.policy, _at_revision(m, raw_basis, st.revision), now=self.clock(), new_attempt_id=attempt_id,
                compaction_threshold=compaction_threshold, scope=scope, scope_confidence=scope_confidence,
                overhead_tokens=overhead_tokens,
            ),
            idempotency_key,
        )
        if outcome.error is not None:
            raise outcome.error
        assert outcome.decision is not None
        return Result(session_id=session_id, version=version, decision=outcome.decision)

    # -- attempts --------------------------------------------------------------------------
    def request_compaction(
        self, session_id: str, *, basis: Basis | str | None = None, overhead_tokens: int | None = None,
        idempotency_key: str | None = None,
    ) -> Attempt:
        """Open a manual attempt (regardless of pressure; at most one manual attempt open)."""
        check_session_id(session_id)
        if basis is not None:
            Basis.parse(basis, 1)  # validate before anything is written
        attempt_id = self.new_id()
        outcome, _ = self._record(
            session_id,
            lambda st: decide_manual(st, self.policy, now=self.clock(), new_attempt_id=attempt_id,
                                     basis=Basis.parse(basis, st.revision) if basis is not None else None,
                                     overhead_tokens=overhead_tokens),
            idempotency_key, op="manual",
        )
        if outcome.error is not None:
            raise outcome.error
        if outcome.attempt is None:  # a replayed refusal whose attempt has closed since
            raise ManualAttemptOpen("a manual attempt was already open when this call was first made")
        return outcome.attempt

    def commit(self, session_id: str, attempt_id: str, fencing_token: int, tokens_after: int,
               idempotency_key: str | None = None) -> SessionState:
        check_session_id(session_id)
        outcome, _ = self._record(
            session_id,
            lambda st: decide_commit(st, attempt_id=attempt_id, fencing_token=fencing_token,
                                     tokens_after=tokens_after, now=self.clock()),
            idempotency_key, op="commit",
        )
        if outcome.error is not None:
            raise outcome.error
        return outcome.state

    def reject(self, session_id: str, attempt_id: str, fencing_token: int, reject_reason: str,
               idempotency_key: str | None = None) -> SessionState:
        check_session_id(session_id)
        outcome, _ = self._record(
            session_id,
            lambda st: decide_reject(st, attempt_id=attempt_id, fencing_token=fencing_token,
                                     reject_reason=reject_reason, now=self.clock()),
            idempotency_key, op="reject",
        )
        if outcome.error is not None:
            raise outcome.error
        return outcome.state

    def expire(self, session_id: str) -> SessionState:
        """Record ``lease_expired`` for attempts past their lease (any decision does this too)."""
        check_session_id(session_id)
        outcome, _ = self._record(session_id, lambda st: _outcome(st, expire_leases(st, self.clock())))
        return outcome.state

    def wait(self, session_id: str, attempt_id: str, timeout: float = 30.0, poll_s: float = 0.05) -> str:
        """Block until the attempt ends; returns 'committed' or 'rejected:<reason>'.

        Raises ``WaitTimeout``. An attempt past its lease is recorded as
        ``lease_expired`` here, so a waiter never waits on a dead holder.
        """
        check_session_id(session_id)
        if not isinstance(timeout, (int, float)) or timeout < 0:
            raise InvalidInput("timeout", f"must be a number >= 0, got {timeout!r}")
        deadline = time.monotonic() + timeout
        while True:
            state = self._load(session_id)
            outcome = state.outcome_of(attempt_id)
            if outcome is None:
                from tracker.errors import UnknownAttempt

                raise UnknownAttempt(f"no attempt {attempt_id} in session {session_id}", attempt_id=attempt_id)
            if outcome != "open":
                return outcome
            attempt = state.find_open(attempt_id)
            if attempt is not None and self.clock() > attempt.lease_expires_at:
                self.expire(session_id)
                continue
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"attempt {attempt_id} still open after {timeout}s", attempt_id=attempt_id)
            time.sleep(poll_s)


class _StateCache:
    """The last state this process recorded per session (bounded LRU, thread-safe)."""

    def __init__(self, size: int = 10_000) -> None:
        from collections import OrderedDict

        self._data: "OrderedDict[str, SessionState]" = OrderedDict()
        self._lock = threading.Lock()
        self._size = size

    def get(self, session_id: str) -> SessionState | None:
        with self._lock:
            state = self._data.get(session_id)
            if state is not None:
                self._data.move_to_end(session_id)
            return state

    def put(self, session_id: str, state: SessionState) -> None:
        with self._lock:
            self._data[session_id] = state
            self._data.move_to_end(session_id)
            while len(self._data) > self._size:
                self._data.popitem(last=False)

    def pop(self, session_id: str) -> None:
        with self._lock:
            self._data.pop(session_id, None)


def _same_request(outcome: Outcome, measurement: Any, request: Any) -> None:
    """A key reused for a different measurement or request is refused, not answered with the old result."""
    from tracker.core.events import ContextMeasured

    recorded = next((e.measurement for e in outcome.events if isinstance(e, ContextMeasured)), None)
    if recorded is None:
        return  # a refused or failed count: nothing to compare with
    if measurement is not None:
        m = measurement if isinstance(measurement, Measurement) else Measurement.from_data(measurement, 1)
        same = (m.input_tokens, m.input_limit, m.fingerprint) == (
            recorded["input_tokens"], recorded["input_limit"], recorded["fingerprint"])
    else:
        from tracker.counting.request import CanonicalRequest

        same = CanonicalRequest.from_dict(request).fingerprint == recorded["fingerprint"]
    if not same:
        raise InvalidInput("idempotency_key", "was already used for a different measurement of this session")


def _at_revision(m: Measurement, raw_basis: Any, revision: int) -> Measurement:
    """Resolve a bare basis at the revision of the state being decided on."""
    b = Basis.parse(raw_basis, revision)
    return m if b == m.basis else dataclasses.replace(m, basis=b)


def _new_event(e: Any) -> Any:
    from tracker.store import NewEvent

    return NewEvent(type=e.TYPE, data=e.to_data())


OP_EVENTS = {  # which recorded events a call of each kind can leave behind
    "observe": {"ContextMeasured", "CountFailed", "MeasurementRefused"},
    "manual": {"CompactionStarted"},
    "commit": {"CompactionCommitted", "CompactionRejected"},
    "reject": {"CompactionRejected"},
}


def _succeeded(op: str, events: list[Any]) -> bool:
    from tracker.core.events import CompactionCommitted, CompactionRejected, CompactionStarted, ContextMeasured

    if op == "observe":
        return any(isinstance(e, ContextMeasured) for e in events)
    if op == "manual":
        return any(isinstance(e, CompactionStarted) and e.reason == "manual" for e in events)
    if op == "commit":
        return any(isinstance(e, CompactionCommitted) for e in events)
    if op == "reject":
        return any(isinstance(e, CompactionRejected) and e.reject_reason not in ("lease_expired", "superseded")
                   for e in events)
    return True


def replay_outcome(before: SessionState, events: list[Any], op: str = "observe") -> Outcome:
    """The outcome a list of recorded events stands for (for idempotent retries), errors included."""
    from tracker.core.events import (
        CompactionRejected,
        CompactionStarted,
        ContextLimitReached,
        ContextMeasured,
        CountFailed,
        MeasurementRefused,
    )
    from tracker.errors import ContextLimitError, StaleBasis, SummaryTooLarge, count_error_from_dict

    kinds = {e.TYPE for e in events} - {"SessionStarted"}
    lease_only = op != "observe" and all(
        isinstance(e, CompactionRejected) and e.reject_reason == "lease_expired" for e in events
        if e.TYPE != "SessionStarted")
    if not lease_only and not (kinds & OP_EVENTS.get(op, kinds)):
        raise InvalidInput("idempotency_key", f"was used for a different kind of call than {op}")
    out = _outcome(before, events)
    decision = None
    attempt = None
    error: Any = None
    for e in events:
        if isinstance(e, CompactionStarted):
            attempt = Attempt.from_started(e)
        elif isinstance(e, ContextMeasured):
            m = e.measurement
            waiting = before.open_automatic if e.action == "wait" else None
            decision = Decision(
                action=e.action, pressure=e.pressure, pressure_before=e.pressure_before, occupancy_bp=e.occupancy_bp,
                threshold_bp=e.threshold_bp, threshold_source=e.threshold_source, compact_level=e.compact_level,
                rearm_level=e.rearm_level, hard_level=e.hard_level, growth_fired=e.growth_fired, trigger=e.trigger,
                basis=m["basis"], revision=int(m["basis"][1:].split(":", 1)[0]), attempt=None, waiting_on=waiting,
            )
        elif isinstance(e, ContextLimitReached):
            error = ContextLimitError(
                f"{e.input_tokens} tokens reach the input limit {e.input_limit} and no automatic compaction is "
                f"eligible for basis {e.basis}", basis=e.basis, input_tokens=e.input_tokens, input_limit=e.input_limit)
        elif isinstance(e, MeasurementRefused):
            error = StaleBasis(f"basis {e.basis} is older than the session's revision r{e.current_revision}",
                               basis=e.basis, current_revision=e.current_revision)
        elif isinstance(e, CountFailed):
            error = count_error_from_dict({"kind": e.kind, "message": e.detail, "model": e.model})
        elif isinstance(e, CompactionRejected) and e.reject_reason == "summary_too_large" and op == "commit":
            error = SummaryTooLarge(f"attempt {e.attempt_id}: tokens_after >= input_limit; recorded as a rejection",
                                    attempt_id=e.attempt_id)
    if decision is not None and decision.action == "compact":
        decision = dataclasses.replace(decision, attempt=attempt)
    return Outcome(events=out.events, state=out.state, decision=decision, attempt=attempt, error=error)
