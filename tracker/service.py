"""The service layer: observe → decide → record, thin on purpose.

Every public call is a typed command (``tracker.core.commands``: ``Observe``, ``Commit``, ...),
validated once where it is built, and ``Tracker.run(command, scope)`` executes it for a
``SessionScope`` (the library's: ids as stored; a fleet's: ids under its prefix, and the policy its
new sessions start with). ``Tracker.observe(...)`` and the other public methods build one and run it.

Each command is: (count, outside any lock) → load state (this process's last recorded state when
it has one), run the pure decision, append its events with the version the decision was made on →
raise the decision's error, if any, after it is on the record. How a decision is recorded -- the
optimistic first try, the session lock after a lost race, idempotent replay -- is
``tracker.recording``.

Cross-cutting concerns are hooks (``tracker.hooks``): the decision metrics and the spans
subscribe to what is recorded (``Tracker(store, hooks=[...])``; ``Tracker.from_settings`` attaches
the default ones), and none of them can change a decision.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

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
    decide_commit,
    decide_count_failed,
    decide_manual,
    decide_measure,
    decide_reject,
    expire_leases,
)
from tracker.core import commands as cmd
from tracker.core.decide import Result
from tracker.core.events import ProviderRejected, UsageReported
from tracker.core.model import SessionScope
from tracker.core.outcome import outcome as outcome_of
from tracker.core.reports import Report, decide_rejection, decide_usage, same_report
from tracker.errors import CountError, IntegrityError, InvalidInput, ManualAttemptOpen, UnknownAttempt, WaitTimeout
from tracker.hooks import Hooks, TrackerHooks
from tracker.idempotent import recorded_answer, same_request
from tracker.protocol import TrackerProtocol
from tracker.recording import SessionWriter
from tracker.store.base import EventStore, StoredEvent

if TYPE_CHECKING:  # pragma: no cover
    from tracker.counting.backends import RequestHistory

R = TypeVar("R")
#: the library's scope: session ids as they are stored, the Tracker's own policy for new sessions
UNSCOPED = SessionScope()


class Tracker(TrackerProtocol):
    """The public entry point (the README). Build one per process with ``Tracker.from_settings()``.

    The service, built from its parts (``Tracker(store, policy=..., counting=...)``); the public
    ``tracker.Tracker`` adds ``from_settings``, wired by the composition root (``tracker.bootstrap``).
    ``commit``, ``reject`` and ``state`` are ``TrackerProtocol``'s own (they build their command and ``run`` it)."""

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
        #: subscribers of what this Tracker does (metrics, traces): see ``tracker.hooks``
        self.hooks = Hooks(hooks)
        self._writer = SessionWriter(store, self.coordinator, self.hooks)
        self._record = self._writer.record

    def close(self) -> None:
        self.calibrations.close()  # its background refresh reads the store: stopped first
        self.store.close()
        self.coordinator.close()
        close = getattr(self.counting, "close", None)
        if close:
            close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the one way in ------------------------------------------------------------------------
    def run(self, command: cmd.Command[R], scope: SessionScope = UNSCOPED) -> R:
        """Execute ``command`` (already validated) for ``scope``: its session id is mapped into the
        scope here, once, and the hooks' ``command`` / ``after_command`` wrap the writes and ``wait``."""
        if isinstance(command, cmd.Calibration):
            return self.calibrations.summaries(command.fleet if scope.fleet_id is None else scope.fleet_id)  # type: ignore[return-value]
        session_id = scope.internal(command.session_id)
        execute = _EXECUTE[type(command)]
        name, hooks = command.NAME, self.hooks
        if name is None or not hooks.commands:
            return execute(self, command, session_id, scope)
        attempt_id, basis = command.hooked()
        with hooks.command(name, session_id, attempt_id, basis):
            result = execute(self, command, session_id, scope)
            hooks.after_command(name, session_id, result)
        return result

    # -- the public calls (the documented contract: each builds its command and runs it) -------
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
        given = {k: v for k, v in locals().items() if k != "self"}  # the parameters are the command's fields
        return self.run(cmd.Observe(**given))

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
        return self.run(
            cmd.RequestCompaction(session_id, basis, overhead_tokens, policy, idempotency_key=idempotency_key)
        )

    def wait(self, session_id: str, attempt_id: str, timeout: float = 30.0, poll_s: float = 0.05) -> str:
        """Block until the attempt ends; returns 'committed' or 'rejected:<reason>'.

        Raises ``WaitTimeout``. An attempt past its lease is recorded as
        ``lease_expired`` here, so a waiter never waits on a dead holder.
        """
        return self.run(cmd.Wait(session_id, attempt_id, timeout, poll_s))

    def history(self, session_id: str, from_version: int = 1) -> Iterator[StoredEvent]:
        return self.run(cmd.History(session_id, from_version))

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
        given = {k: v for k, v in locals().items() if k != "self"}
        return self.run(cmd.ReportUsage(**given))

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
        given = {k: v for k, v in locals().items() if k != "self"}
        return self.run(cmd.ReportRejection(**given))

    def calibration(self, fleet: str | None = None) -> list[Any]:
        """What calibration knows, per (fleet, model, counter): ``ModelSummary`` rows folded from the log."""
        return self.run(cmd.Calibration(fleet))

    # -- what each command does, on the stored id of its session --------------------------------
    def _start_policy(self, policy: Policy | None, scope: SessionScope) -> Policy:
        """The policy a new session starts with: the call's own, else the scope's (a fleet's), else this Tracker's."""
        if policy is not None:
            return policy
        return scope.start_policy() or self.policy

    def _observe(self, c: cmd.Observe, session_id: str, scope: SessionScope) -> Result:
        default = self._start_policy(c.policy, scope)
        key = c.idempotency_key
        if key is not None:  # a retry: the original answer, before any (re)counting
            replay = recorded_answer(self.store, session_id, key, "observe", None)
            if replay is not None:
                outcome, version = replay
                given = dict(threshold=c.compaction_threshold, scope=c.scope, confidence=c.scope_confidence)
                same_request(outcome, c.measurement, c.request, c.basis, overhead=c.overhead_tokens, **given)
                if outcome.error is not None:
                    raise outcome.error
                return Result(session_id=session_id, version=version, decision=_decision(outcome, session_id))
        # A bare basis ("msg-41") means "at the session's current revision": it is resolved
        # inside the decision, against the state being decided on (validated by the command).
        raw_basis = c.raw_basis
        history: RequestHistory | None = None
        if c.measured is not None:
            m = c.measured
        else:
            m, history = self._count(c, session_id, default)
        if not self.calibrations.enabled:
            history = None  # TRACKER_CALIBRATION=off: raw counts, not anchored either
        content = history.content if history is not None else None
        calibration, learned_limit = self.calibrations.for_decision(session_id, m.model.name, m.quality, content)
        outcome, version = self._record_opening(
            session_id,
            lambda st, **at: decide_measure(
                st,
                default,
                _at_revision(m, raw_basis, st.revision, c.measured is not None),
                **c.per_call(),
                calibration=calibration,
                learned_limit=learned_limit,
                # the request's shape at the anchor's position of the state decided on
                shape=None if history is None else history.shape(st.anchor.messages if st.anchor else None),
                **at,
            ),
            key,
            op="observe",
            looked_up=key is not None,  # looked for above, before counting
        )
        return Result(session_id=session_id, version=version, decision=_decision(outcome, session_id))

    def _count(self, c: cmd.Observe, session_id: str, default: Policy) -> tuple[Measurement, RequestHistory | None]:
        """Count ``c.request`` under the session's policy (fixed when it started), with its history
        digests when the backend gives them (anchoring); a count failure is recorded
        (``CountFailed``), then raised."""
        if self.counting is None:
            raise InvalidInput("request", "this tracker has no counting backend; pass measurement=")
        model = c.model
        assert model is not None  # (the command requires it with a request)
        known = self._writer.known(session_id)
        started = time.monotonic()
        given = dict(model=model, basis=Basis.parse(c.basis, 1), policy=known.policy or default)
        with_history = getattr(self.counting, "measure_history", None)
        try:
            if with_history is not None:
                m, history = with_history(c.request, **given)
                return m, history
            return self.counting.measure(c.request, **given), None
        except CountError as exc:
            duration_ms = int((time.monotonic() - started) * 1000)

            def failed(st: SessionState, err: CountError = exc) -> Outcome:
                basis = Basis.parse(c.basis, st.revision)
                return decide_count_failed(
                    st, default, err, model=model, duration_ms=duration_ms, now=self.clock(), basis=basis
                )

            self._record(session_id, failed, c.idempotency_key)
            raise

    def _report(self, c: cmd.ReportUsage | cmd.ReportRejection, session_id: str, scope: SessionScope) -> Report:
        """A usage report or a rejection: ``decide(state, now=..., **given)`` recorded, then noted by calibration."""
        decide: Callable[..., Outcome]
        op, decide = ("usage", decide_usage) if isinstance(c, cmd.ReportUsage) else ("rejection", decide_rejection)
        given, key = c.given(), c.idempotency_key
        outcome, version = self._record(session_id, lambda st: decide(st, now=self.clock(), **given), key, op=op)
        event: Any = next(e for e in outcome.events if isinstance(e, (UsageReported, ProviderRejected)))
        if key is not None:  # a key reused for another report is refused, not answered with the old one
            same_report(event, given)
        # this process decides with its own report from the next call on (not only once the log's
        # safe horizon has passed it)
        self.calibrations.note(session_id, version, event)
        return Report(session_id=session_id, version=version, event=event)

    def _request_compaction(self, c: cmd.RequestCompaction, session_id: str, scope: SessionScope) -> Attempt:
        start_policy = self._start_policy(c.policy, scope)
        outcome, _ = self._record_opening(
            session_id,
            lambda st, **at: decide_manual(
                st,
                start_policy,
                basis=Basis.parse(c.basis, st.revision) if c.basis is not None else None,
                overhead_tokens=c.overhead_tokens,
                **at,
            ),
            c.idempotency_key,
            op="manual",
        )
        if outcome.attempt is None:  # a replayed refusal whose attempt has closed since
            raise ManualAttemptOpen("a manual attempt was already open when this call was first made")
        return outcome.attempt

    def _end_attempt(self, c: cmd.Commit | cmd.Reject, session_id: str, scope: SessionScope) -> SessionState:
        """A commit or a reject: ``end(state, now=...)`` recorded, its refusal raised after it."""
        if isinstance(c, cmd.Commit):
            op, end = "commit", functools.partial(decide_commit, tokens_after=c.tokens_after)
        else:
            op, end = "reject", functools.partial(decide_reject, reject_reason=c.reject_reason)
        at = dict(attempt_id=c.attempt_id, fencing_token=c.fencing_token)
        outcome, _ = self._record(session_id, lambda st: end(st, now=self.clock(), **at), c.idempotency_key, op=op)
        if outcome.error is not None:
            raise outcome.error
        return outcome.state

    def _record_opening(
        self,
        session_id: str,
        decide: Callable[..., Outcome],
        idempotency_key: str | None,
        op: str,
        looked_up: bool = False,
    ) -> tuple[Outcome, int]:
        """``record`` for an observe or a manual request: ``decide(state, now=..., new_attempt_id=...)``
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

    def _wait(self, c: cmd.Wait, session_id: str, scope: SessionScope) -> str:
        deadline = time.monotonic() + c.timeout
        while True:
            outcome, _ = self.attempt_status(session_id, c.attempt_id)
            if outcome != "open":
                return outcome
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"attempt {c.attempt_id} still open after {c.timeout}s", attempt_id=c.attempt_id)
            time.sleep(c.poll_s)

    def _state(self, c: cmd.State, session_id: str, scope: SessionScope) -> SessionState:
        return self._writer.load(session_id)

    def _history(self, c: cmd.History, session_id: str, scope: SessionScope) -> Iterator[StoredEvent]:
        return self.store.read_stream(session_id, c.from_version)

    # -- attempts, by stored id (``wait`` polls these; the HTTP API's long-poll awaits them) ------
    def expire(self, session_id: str) -> SessionState:
        """Record ``lease_expired`` for attempts past their lease (any decision does this too)."""
        session_id = check_session_id(session_id)
        outcome, _ = self._record(session_id, lambda st: outcome_of(st, expire_leases(st, self.clock())), op="expire")
        return outcome.state

    def attempt_status(self, session_id: str, attempt_id: str) -> tuple[str, float | None]:
        """One look at an attempt: ``(outcome, lease_expires_at)``; outcome ``open`` (with the time its
        lease ends), ``committed`` or ``rejected:<reason>``. An attempt past its lease is recorded as
        ``lease_expired`` first. Raises ``UnknownAttempt``.
        """
        session_id = check_session_id(session_id)
        while True:
            state = self._writer.load(session_id)
            outcome = state.outcome_of(attempt_id)
            if outcome is None:
                raise UnknownAttempt(
                    f"no attempt {attempt_id} in this session", attempt_id=attempt_id, session_id=session_id
                )
            if outcome != "open":
                return outcome, None
            attempt = state.find_open(attempt_id)
            if attempt is not None and self.clock() > attempt.lease_expires_at:
                self.expire(session_id)
                continue
            return outcome, attempt.lease_expires_at if attempt is not None else None


#: what running each command does (``Tracker.run``)
_EXECUTE: dict[type, Callable[[Tracker, Any, str, SessionScope], Any]] = {
    cmd.Observe: Tracker._observe,
    cmd.RequestCompaction: Tracker._request_compaction,
    cmd.Commit: Tracker._end_attempt,
    cmd.Reject: Tracker._end_attempt,
    cmd.Wait: Tracker._wait,
    cmd.ReportUsage: Tracker._report,
    cmd.ReportRejection: Tracker._report,
    cmd.State: Tracker._state,
    cmd.History: Tracker._history,
}


def _at_revision(m: Measurement, raw_basis: Any, revision: int, parsed: bool = False) -> Measurement:
    """Resolve a bare basis at the revision of the state being decided on. ``parsed``: ``m.basis``
    is ``raw_basis`` parsed (at revision 1, or explicit), so at ``m.basis.revision`` it is ``m``'s."""
    if parsed and revision == m.basis.revision:
        return m
    b = Basis.parse(raw_basis, revision)
    return m if b == m.basis else dataclasses.replace(m, basis=b)


def _decision(outcome: Outcome, session_id: str) -> Decision:
    if outcome.decision is None:  # an observe that recorded neither a decision nor a refusal
        raise IntegrityError(f"session {session_id}: recorded observe has no decision", session_id=session_id)
    return outcome.decision
