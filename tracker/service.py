"""The service layer: observe → decide → record, thin on purpose.

Each call is: validate input → (count, outside any lock) → load state (this
process's last recorded state when it has one), run the pure decision, append
its events with the version the decision was made on → raise the decision's
error, if any, after it is on the record. A ``ConcurrencyConflict`` means another
process appended first: re-decide (the decision is deterministic in the state, so
the retry sees that process's attempt and does not open another).

Optimistic first: an uncontended session costs no coordination round trip at all
(the store's version check is the guard). After a lost race, and for as long as
others keep writing the session (``CONTENDED_S``), this process decides under the
coordinator's session lock, on the state read under it: contenders queue up
(handed the lock by a wake-up, not by polling) instead of appending on stale
states, and only one automatic attempt per basis is ever started.

Cross-cutting concerns are hooks (``tracker.hooks``): the decision metrics and the spans
subscribe to what is recorded (``Tracker(store, hooks=[...])``; ``Tracker.from_settings`` attaches
the default ones), and none of them can change a decision.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from typing import Any, TypeVar

from tracker._lru import LRU
from tracker.calibrations import CalibrationBook
from tracker.coordination import Coordinator, LocalCoordinator
from tracker.core import (
    Attempt,
    Basis,
    Decision,
    Measurement,
    Outcome,
    Policy,
    SessionState,
    check_session_id,
    check_text,
    decide_commit,
    decide_count_failed,
    decide_manual,
    decide_measure,
    decide_reject,
    expire_leases,
)
from tracker.core.decide import Result
from tracker.core.events import CompactionCommitted, CompactionRejected, ProviderRejected, UsageReported
from tracker.core.outcome import outcome as outcome_of
from tracker.core.reports import Report, decide_rejection, decide_usage, same_report
from tracker.core.thresholds import resolve_threshold
from tracker.errors import (
    ConcurrencyConflict,
    CountError,
    IntegrityError,
    InvalidInput,
    InvalidPolicy,
    ManualAttemptOpen,
    TrackerError,
    UnknownAttempt,
    WaitTimeout,
)
from tracker.hooks import Hooks, TrackerHooks
from tracker.idempotent import answer_from, recorded_answer, same_request
from tracker.store.base import AppendResult, EventStore, NewEvent

log = logging.getLogger("tracker.service")

CONFLICT_RETRY_S = 30.0
STATE_CACHE_SIZE = 10_000  # sessions whose last recorded state this process keeps
CONTENDED_S = 1.0  # after a lost race, decide under the session lock for this long (renewed while contended)
_UNLOCKED = nullcontext(False)  # (reusable: a nullcontext keeps no state between uses)
F = TypeVar("F", bound=Callable[..., Any])


def _command(name: str) -> Callable[[F], F]:
    """A public command ``(self, session_id, [attempt_id, ...])``: its hooks' ``command`` around
    it and ``after_command`` with what it returns (nothing at all when no hook asks)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(self: Tracker, session_id: str, *args: Any, **kwargs: Any) -> Any:
            hooks = self.hooks
            if not hooks.commands:
                return fn(self, session_id, *args, **kwargs)
            attempt_id = args[0] if args and isinstance(args[0], str) else kwargs.get("attempt_id")
            basis = kwargs.get("basis")
            with hooks.command(name, session_id, attempt_id, None if basis is None else str(basis)):
                result = fn(self, session_id, *args, **kwargs)
                hooks.after_command(name, session_id, result)
            return result

        return call  # type: ignore[return-value]

    return wrap


class Tracker:
    """The service: built from its parts (``Tracker(store, policy=..., counting=...)``). The public
    ``tracker.Tracker`` adds ``from_settings``, wired by the composition root (``tracker.bootstrap``)."""

    def __init__(
        self,
        store: EventStore,
        *,
        policy: Policy | None = None,
        counting: Any = None,
        coordinator: Coordinator | None = None,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
        hooks: Iterable[TrackerHooks] = (),
        calibrations: CalibrationBook | None = None,
    ) -> None:
        self.store = store
        #: the provider's numbers this process decides with (``tracker.calibrations``)
        self.calibrations = calibrations if calibrations is not None else CalibrationBook(store)
        self.policy = policy or Policy()
        self.counting = counting
        self.coordinator = coordinator or LocalCoordinator()
        self.clock = clock
        self.new_id = new_id
        self._states: LRU[str, SessionState] = LRU(STATE_CACHE_SIZE)
        #: session -> when this process last saw it contended (see ``_record``)
        self._contended: LRU[str, float] = LRU(STATE_CACHE_SIZE)
        #: subscribers of what this Tracker does (metrics, traces): see ``tracker.hooks``
        self.hooks = Hooks(hooks)
        self._phase = self.hooks.phase

    def close(self) -> None:
        self.store.close()
        self.coordinator.close()
        close = getattr(self.counting, "close", None)
        if close:
            close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- state -----------------------------------------------------------------------------
    def _load(self, session_id: str) -> SessionState:
        data, version = self.store.load(session_id)
        if data is None:
            return SessionState(session_id=session_id)
        state = SessionState.from_data(data)
        if state.version != version:
            raise IntegrityError(
                f"session {session_id}: projection is at version {state.version} but the stream at {version}; "
                "run `tracker verify`",
                session_id=session_id,
            )
        return state

    def state(self, session_id: str) -> SessionState:
        return self._load(check_session_id(session_id))

    def history(self, session_id: str, from_version: int = 1) -> Iterator[Any]:
        return self.store.read_stream(check_session_id(session_id), from_version)

    def _record(
        self,
        session_id: str,
        decide: Callable[[SessionState], Outcome],
        idempotency_key: str | None = None,
        op: str = "observe",
        looked_up: bool = False,
    ) -> tuple[Outcome, int]:
        """Load → decide → append; on a version conflict, decide again on the state that won.

        ``looked_up``: the caller has just looked for a call recorded under ``idempotency_key``
        and found none (observe does, before counting): not looked for again here, since an
        append under a key a racing call took in between is answered by the store as a replay.

        The first try decides on the state this process last recorded, without a lock (the
        store's version check guards it). A refusal or a no-op decided on that cached state is
        confirmed on the record; a lost race (or a session still contended) is decided under the
        coordinator's lock on the state read under it, backing off with full jitter while it
        keeps conflicting (coordination degraded, or a lock wait timed out).
        """
        if idempotency_key is not None:
            check_text("idempotency_key", idempotency_key)  # before it reaches the database
        if idempotency_key is not None and not looked_up:
            # A retried call (commit, reject, manual, observe) gets its original answer, not a new decision.
            replay = recorded_answer(self.store, session_id, idempotency_key, op, decide)
            if replay is not None:
                return replay
        deadline = time.monotonic() + CONFLICT_RETRY_S
        locked = self._is_contended(session_id)
        cached = None if locked else self._states.get(session_id)  # never trusted alone (see above)
        tries = 0
        while True:
            lock = self.coordinator.session_lock(session_id) if locked else _UNLOCKED
            with self._phase("coordination"), lock:
                state = cached if cached is not None else self._load_noting_contention(session_id, locked)
                try:
                    with self._phase("decide"):
                        outcome = decide(state)
                except TrackerError:
                    if cached is None:
                        raise
                    cached = None  # refused on a cached state (a revision it has not seen?): ask the record
                    continue
                if not outcome.events:
                    if cached is None:
                        return outcome, state.version
                    cached = None  # nothing to append, so no version check: confirm on the record
                    continue
                result = self._append(session_id, state, outcome, idempotency_key)
            if result is not None:
                if result.replayed:  # the same key, appended by a racing call: its answer
                    return answer_from(self.store, session_id, result, op, decide), result.last_version
                self.hooks.after_record(op, session_id, outcome)
                if any(isinstance(e, (CompactionCommitted, CompactionRejected)) for e in outcome.events):
                    self.coordinator.attempt_ended(session_id)  # wakes long-polls (a hint; they re-read)
                return outcome, result.last_version
            self._contended.put(session_id, time.monotonic())
            if locked:  # conflicting under the lock: back off
                tries += 1
                if time.monotonic() >= deadline:
                    raise ConcurrencyConflict(
                        f"session {session_id}: still conflicting after {tries} tries in {CONFLICT_RETRY_S:.0f}s",
                        session_id=session_id,
                    )
                time.sleep(random.uniform(0, min(0.1, 0.002 * 2 ** min(tries, 10))))
            locked, cached = True, None  # (a lost optimistic race is re-decided at once, under the lock)

    def _load_noting_contention(self, session_id: str, locked: bool) -> SessionState:
        """The recorded state; under the lock, the session stays contended while others append
        between this process's own appends (the state read is not the one it last recorded)."""
        if not locked:
            return self._load(session_id)
        mine = self._states.get(session_id)
        state = self._load(session_id)
        if mine is not None and mine.version == state.version:
            self._contended.pop(session_id)
        else:
            self._contended.put(session_id, time.monotonic())
        return state

    def _append(
        self, session_id: str, state: SessionState, outcome: Outcome, idempotency_key: str | None
    ) -> AppendResult | None:
        """Append ``outcome``'s events at ``state``'s version; None on a version conflict. The
        state cache follows: the new state when appended, nothing when in doubt."""
        try:
            with self._phase("append"):
                result = self.store.append(
                    session_id,
                    state.version,
                    [_new_event(e) for e in outcome.events],
                    idempotency_key=idempotency_key,
                    projected=outcome.state.to_data(),
                )
        except ConcurrencyConflict:
            self._states.pop(session_id)
            return None
        except BaseException:
            self._states.pop(session_id)
            raise
        if result.replayed:
            self._states.pop(session_id)
        else:
            self._states.put(session_id, outcome.state)
        return result

    def _is_contended(self, session_id: str) -> bool:
        """Whether this process lost a race on the session within the last ``CONTENDED_S`` seconds
        (renewed while it keeps finding that others appended since its own last append)."""
        since = self._contended.get(session_id)
        if since is None:
            return False
        if time.monotonic() - since < CONTENDED_S:
            return True
        self._contended.pop(session_id)
        return False

    def _start_policy(self, policy: Policy | None) -> Policy:
        """The policy a new session starts with: a per-call one (its fleet's, over HTTP), else this Tracker's."""
        if policy is None:
            return self.policy
        if not isinstance(policy, Policy):
            raise InvalidPolicy("policy", f"must be a Policy, got {type(policy).__name__}")
        return policy

    # -- observe ---------------------------------------------------------------------------
    @_command("observe")
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
        policy: Policy | None = None,
    ) -> Result:
        """Count (when given a request), record, decide. Raises ``ContextLimitError`` and count
        failures *after* recording them; bad input raises before anything is written.
        ``policy``: the one a *new* session starts with (default: this Tracker's; a started session keeps its own)."""
        check_session_id(session_id)
        default = self._start_policy(policy)
        if (request is None) == (measurement is None):
            raise InvalidInput("request", "give exactly one of request= or measurement=")
        if idempotency_key is not None:
            check_text("idempotency_key", idempotency_key)
        if model is not None:
            check_text("model", model)
        # validate the per-request threshold before counting (bad input writes nothing)
        if compaction_threshold is not None or scope is not None or scope_confidence is not None:
            resolve_threshold(
                default.compact_at_bp, default.rearm_below_bp, compaction_threshold, scope, scope_confidence
            )

        if idempotency_key is not None:  # a retry: the original answer, before any (re)counting
            replay = recorded_answer(self.store, session_id, idempotency_key, "observe", None)
            if replay is not None:
                outcome, version = replay
                given = dict(threshold=compaction_threshold, scope=scope, confidence=scope_confidence)
                same_request(outcome, measurement, request, basis, overhead=overhead_tokens, **given)
                if outcome.error is not None:
                    raise outcome.error
                return Result(session_id=session_id, version=version, decision=_decision(outcome, session_id))
        # A bare basis ("msg-41") means "at the session's current revision": it is resolved
        # inside the decision, against the state being decided on (validated here first).
        parsed = measurement is not None
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
            started = time.monotonic()
            try:  # the session's policy, fixed when it started
                m = self.counting.measure(request, model=model, basis=b, policy=known.policy or default)
            except CountError as exc:
                duration_ms = int((time.monotonic() - started) * 1000)

                def failed(st: SessionState, err: CountError = exc, model: str = model) -> Outcome:
                    return decide_count_failed(
                        st,
                        default,
                        err,
                        model=model,
                        duration_ms=duration_ms,
                        now=self.clock(),
                        basis=Basis.parse(raw_basis, st.revision),
                    )

                self._record(session_id, failed, idempotency_key)
                raise
        calibration, learned_limit = self.calibrations.for_decision(session_id, m.model.name, m.quality)
        outcome, version = self._record_opening(
            session_id,
            lambda st, **at: decide_measure(
                st,
                default,
                _at_revision(m, raw_basis, st.revision, parsed),
                compaction_threshold=compaction_threshold,
                scope=scope,
                scope_confidence=scope_confidence,
                overhead_tokens=overhead_tokens,
                calibration=calibration,
                learned_limit=learned_limit,
                **at,
            ),
            idempotency_key,
            op="observe",
            looked_up=idempotency_key is not None,  # looked for above, before counting
        )
        return Result(session_id=session_id, version=version, decision=_decision(outcome, session_id))

    # -- the provider's numbers --------------------------------------------------------------
    @_command("usage")
    def report_usage(
        self,
        session_id: str,
        *,
        basis: Basis | str,
        input_tokens: int,
        model: str | None = None,
        output_tokens: int | None = None,
        cache_read_tokens: int | None = None,
        cache_write_tokens: int | None = None,
        idempotency_key: str | None = None,
    ) -> Report:
        """Record what the provider billed for the request of ``basis`` (its response's usage): a
        ``UsageReported`` event, and a calibration sample for the measured model. ``basis`` is one
        this session measured (a bare one: at the current revision); ``model``, when given, must be
        the measured one. Bad input raises ``InvalidInput`` naming the field and writes nothing."""
        given = dict(
            basis=basis,
            input_tokens=input_tokens,
            model=model,
            output_tokens=output_tokens,
            cache_read_tokens=cache_read_tokens,
            cache_write_tokens=cache_write_tokens,
        )
        return self._report(session_id, "usage", decide_usage, given, idempotency_key)

    @_command("rejection")
    def report_rejection(
        self,
        session_id: str,
        *,
        basis: Basis | str,
        message: str | None = None,
        input_tokens: int | None = None,
        input_limit: int | None = None,
        model: str | None = None,
        idempotency_key: str | None = None,
    ) -> Report:
        """Record that the provider refused the request of ``basis`` as too long for the model: a
        ``ProviderRejected`` event. The provider's count and limit are read from ``message``
        (Anthropic, OpenAI and Gemini wordings) unless given. From then on that basis decides at the
        hard limit (compact if an automatic attempt is eligible, else ``ContextLimitError``), the
        numbers are a calibration sample, and a lower limit is learned for the model."""
        given = dict(basis=basis, message=message, input_tokens=input_tokens, input_limit=input_limit, model=model)
        return self._report(session_id, "rejection", decide_rejection, given, idempotency_key)

    def _report(
        self, session_id: str, op: str, decide: Callable[..., Outcome], given: dict[str, Any], key: str | None
    ) -> Report:
        """A usage report or a rejection: ``decide(state, now=..., **given)`` recorded, then noted by calibration."""
        check_session_id(session_id)
        outcome, version = self._record(session_id, lambda st: decide(st, now=self.clock(), **given), key, op=op)
        event: Any = next(e for e in outcome.events if isinstance(e, (UsageReported, ProviderRejected)))
        if key is not None:  # a key reused for another report is refused, not answered with the old one
            same_report(event, given)
        # this process decides with its own report from the next call on (not only once the log's
        # safe horizon has passed it)
        self.calibrations.note(session_id, version, event)
        return Report(session_id=session_id, version=version, event=event)

    def calibration(self, fleet: str | None = None) -> list[Any]:
        """What calibration knows, per (fleet, model, counter): ``ModelSummary`` rows folded from the log."""
        return self.calibrations.summaries(fleet)

    # -- attempts --------------------------------------------------------------------------
    @_command("manual")
    def request_compaction(
        self,
        session_id: str,
        *,
        basis: Basis | str | None = None,
        overhead_tokens: int | None = None,
        idempotency_key: str | None = None,
        policy: Policy | None = None,
    ) -> Attempt:
        """Open a manual attempt (regardless of pressure; at most one manual attempt open).
        ``policy``: the one a *new* session starts with (default: this Tracker's)."""
        check_session_id(session_id)
        start_policy = self._start_policy(policy)
        if basis is not None:
            Basis.parse(basis, 1)  # validate before anything is written
        outcome, _ = self._record_opening(
            session_id,
            lambda st, **at: decide_manual(
                st,
                start_policy,
                basis=Basis.parse(basis, st.revision) if basis is not None else None,
                overhead_tokens=overhead_tokens,
                **at,
            ),
            idempotency_key,
            op="manual",
        )
        if outcome.attempt is None:  # a replayed refusal whose attempt has closed since
            raise ManualAttemptOpen("a manual attempt was already open when this call was first made")
        return outcome.attempt

    @_command("commit")
    def commit(
        self,
        session_id: str,
        attempt_id: str,
        fencing_token: int,
        tokens_after: int,
        idempotency_key: str | None = None,
    ) -> SessionState:
        """Record the attempt's compaction: the session's history is now ``tokens_after`` tokens."""
        end = functools.partial(
            decide_commit, attempt_id=attempt_id, fencing_token=fencing_token, tokens_after=tokens_after
        )
        return self._end_attempt(session_id, "commit", end, idempotency_key)

    @_command("reject")
    def reject(
        self,
        session_id: str,
        attempt_id: str,
        fencing_token: int,
        reject_reason: str,
        idempotency_key: str | None = None,
    ) -> SessionState:
        """Record that the attempt's holder gave up (``reject_reason``): the session's pressure is
        unchanged and a later observe decides again."""
        end = functools.partial(
            decide_reject, attempt_id=attempt_id, fencing_token=fencing_token, reject_reason=reject_reason
        )
        return self._end_attempt(session_id, "reject", end, idempotency_key)

    def _record_opening(
        self,
        session_id: str,
        decide: Callable[..., Outcome],
        idempotency_key: str | None,
        op: str,
        looked_up: bool = False,
    ) -> tuple[Outcome, int]:
        """``_record`` for an observe or a manual request: ``decide(state, now=..., new_attempt_id=...)``
        (the attempt it may open has one new id, the same on every retry), its refusal raised after it."""
        attempt_id = self.new_id()
        outcome, version = self._record(
            session_id,
            lambda st: decide(st, now=self.clock(), new_attempt_id=attempt_id),
            idempotency_key,
            op=op,
            looked_up=looked_up,
        )
        if outcome.error is not None:
            raise outcome.error
        return outcome, version

    def _end_attempt(
        self, session_id: str, op: str, end: Callable[..., Outcome], idempotency_key: str | None
    ) -> SessionState:
        """A commit or a reject: ``end(state, now=...)`` recorded, its refusal raised after it."""
        check_session_id(session_id)
        outcome, _ = self._record(session_id, lambda st: end(st, now=self.clock()), idempotency_key, op=op)
        if outcome.error is not None:
            raise outcome.error
        return outcome.state

    def expire(self, session_id: str) -> SessionState:
        """Record ``lease_expired`` for attempts past their lease (any decision does this too)."""
        check_session_id(session_id)
        outcome, _ = self._record(session_id, lambda st: outcome_of(st, expire_leases(st, self.clock())), op="expire")
        return outcome.state

    @_command("wait")
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
            outcome, _ = self.attempt_status(session_id, attempt_id)
            if outcome != "open":
                return outcome
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"attempt {attempt_id} still open after {timeout}s", attempt_id=attempt_id)
            time.sleep(poll_s)

    def attempt_status(self, session_id: str, attempt_id: str) -> tuple[str, float | None]:
        """One look at an attempt: ``(outcome, lease_expires_at)``; outcome ``open`` (with the time its
        lease ends), ``committed`` or ``rejected:<reason>``. An attempt past its lease is recorded as
        ``lease_expired`` first. Raises ``UnknownAttempt``. (``wait`` polls this; the HTTP API awaits it.)
        """
        check_session_id(session_id)
        while True:
            state = self._load(session_id)
            outcome = state.outcome_of(attempt_id)
            if outcome is None:
                raise UnknownAttempt(f"no attempt {attempt_id} in session {session_id}", attempt_id=attempt_id)
            if outcome != "open":
                return outcome, None
            attempt = state.find_open(attempt_id)
            if attempt is not None and self.clock() > attempt.lease_expires_at:
                self.expire(session_id)
                continue
            return outcome, attempt.lease_expires_at if attempt is not None else None


def _at_revision(m: Measurement, raw_basis: Any, revision: int, parsed: bool = False) -> Measurement:
    """Resolve a bare basis at the revision of the state being decided on. ``parsed``: ``m.basis``
    is ``raw_basis`` parsed (at revision 1, or explicit), so at ``m.basis.revision`` it is ``m``'s."""
    if parsed and revision == m.basis.revision:
        return m
    b = Basis.parse(raw_basis, revision)
    return m if b == m.basis else dataclasses.replace(m, basis=b)


def _new_event(e: Any) -> NewEvent:
    return NewEvent(type=e.TYPE, data=e.to_data())


def _decision(outcome: Outcome, session_id: str) -> Decision:
    if outcome.decision is None:  # an observe that recorded neither a decision nor a refusal
        raise IntegrityError(f"session {session_id}: recorded observe has no decision", session_id=session_id)
    return outcome.decision
