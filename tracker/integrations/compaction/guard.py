"""The protocol with the tracker, sans-I/O: :meth:`Guard.steps` yields what to do, is sent what happened.

Before a model call an adapter turns the request into a :class:`~.view.View` and drives
``guard.steps(session_id, view)`` (:func:`~.drive.drive_sync` or :func:`~.drive.drive_async` run
each step against the tracker, the counter, the share and the summariser). The steps:

1. :class:`Observe` the complete request on the session, with ``basis = r<revision>:h<digest>``:
   the digest is a hash of the history's *content* (never of framework message ids), so two
   processes holding the same history send the same basis and the tracker's once-per-basis
   rule deduplicates them; the revision is the compaction generation of the history (the one
   written on its newest summary, else 1), so a compacted history has a new basis;
2. ``proceed`` → the generator returns the :class:`~.view.Outcome`: the adapter sends its view;
3. ``compact`` → chooses the span to summarise (:func:`~.view.cut_points`: never the leading system
   entries, never the recent tail, never a tool call apart from its results), :class:`Count` s what
   it keeps, asks for a :class:`Summarize` within the room the attempt's ``history_budget`` leaves,
   counts the compacted request, :class:`Publish` es it to the share and :class:`Commit` s it with that
   count as ``tokens_after``; a summariser that raises or returns nothing is a :class:`Reject` as
   ``summarizer_error``, a compacted request over the budget as ``summary_over_budget``
   (``count_failed``, ``nothing_to_summarize`` likewise); then observes again (the compacted request
   is a new basis and is counted like any other);
4. ``wait`` → :class:`Wait` for the other holder's attempt to end, then observe again;
5. ``StaleBasis`` (another process compacted this history) → :class:`FindCommit`: the commit that
   moved the history on, read from the session's history after the last version this guard saw, and
   :class:`Fetch` its summary from the share the holder published it to; then observe again. With
   nothing to adopt the ``StaleBasis`` is raised (a session names one conversation: a different
   history sent on a session that has compacted is refused this way — start it on a new session);
6. ``ContextLimitError`` (hard limit, nothing eligible) and count failures propagate to the
   caller: a request the tracker refused is never sent.

A step's failure is thrown into the generator at the ``yield`` (``generator.throw``), so the rules
above read as plain ``try``/``except``. The generator does no I/O and keeps no clock: a test drives it
by hand (tests/unit/test_guard_steps.py).

``tokens_after`` is counted with the same counter the tracker uses (:func:`default_counter`): an
embedded :class:`~tracker.service.Tracker` counts with its own counting backend (in-process or the
Celery workers); for a remote client the request is counted in this process with the model registry
(``models_file=``), which gives the server's number for the local counters (``exact_local``,
``heuristic``). Pass ``count_tokens=`` to count any other way.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from typing import Any, Literal, TypedDict

from tracker.core.decide import Result
from tracker.core.events import CompactionCommitted
from tracker.core.model import Basis
from tracker.core.policy import Policy
from tracker.core.state import Attempt, SessionState
from tracker.errors import (
    AttemptNotOpen,
    CountError,
    InvalidInput,
    NotAttemptHolder,
    StaleBasis,
    SummaryTooLarge,
    TrackerError,
    UnknownAttempt,
    WaitTimeout,
)
from tracker.integrations.compaction.shares import PROCESS_SHARE, SummaryShare, share_payload, shared_span
from tracker.integrations.compaction.view import Outcome, Replacement, View, cut_points

log = logging.getLogger("tracker.integrations")

SUMMARY_MARGIN_TOKENS = 24  # what the summary message costs beside its text (role, prefix, framing)
MIN_SUMMARY_TOKENS = 32  # a cut that leaves less room than this for the summary is not tried
SESSIONS_SEEN = 4096  # sessions whose last seen version a guard remembers

# reject_reason values this module records
SUMMARIZER_ERROR = "summarizer_error"
SUMMARY_OVER_BUDGET = "summary_over_budget"
COUNT_FAILED = "count_failed"
NOTHING_TO_SUMMARIZE = "nothing_to_summarize"


# -- the steps: what the guard asks for, and (in the comment) what it is sent back -------------


# ``tracker.observe(session, request=, model=, basis=)`` → its ``Result``
@dataclass(frozen=True)
class Observe:
    request: dict[str, Any]
    model: str
    basis: str


# ``tracker.wait(session, attempt_id, timeout=)`` → how it ended (``WaitTimeout`` is fine)
@dataclass(frozen=True)
class Wait:
    attempt_id: str
    timeout: float


# The request's ``input_tokens`` with the tracker's counter → int (or ``CountError``)
@dataclass(frozen=True)
class Count:
    request: dict[str, Any]


# A summary of ``view.items[start:end]`` within ``budget`` tokens → its text
@dataclass(frozen=True)
class Summarize:
    view: View
    start: int
    end: int
    budget: int


# ``share.put(session, attempt_id, payload)``, before the commit
@dataclass(frozen=True)
class Publish:
    attempt_id: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class _Held:  # a step on the attempt this holder opened
    attempt_id: str
    fencing_token: int


# ``tracker.commit(session, attempt_id, fencing_token, tokens_after)`` → the ``SessionState``
@dataclass(frozen=True)
class Commit(_Held):
    tokens_after: int


# ``tracker.reject(session, attempt_id, fencing_token, reason)``
@dataclass(frozen=True)
class Reject(_Held):
    reason: str


# The session's ``CompactionCommitted`` to ``revision``, read from ``from_version`` on → it, or None
@dataclass(frozen=True)
class FindCommit:
    revision: int
    from_version: int


# ``share.get(session, attempt_id)`` → the published payload, or None
@dataclass(frozen=True)
class Fetch:
    attempt_id: str


# ``tracker.report_usage`` / ``report_rejection`` (``session, **options``) → the ``Report``
#   (:class:`Unsupported` when the tracker takes no such report)
@dataclass(frozen=True)
class Report:
    method: Literal["report_usage", "report_rejection"]
    options: dict[str, Any]


Step = Observe | Wait | Count | Summarize | Publish | Commit | Reject | FindCommit | Fetch | Report


class Unsupported(TrackerError):
    """The tracker has no method for a step (a ``Report`` to a tracker that takes no reports)."""


class SummaryFailed(Exception):
    """Internal: the compaction could not be made; ``reason`` is the recorded reject_reason."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# -- counting the compacted request ----------------------------------------------------------


def default_counter(
    tracker: Any, model: str, models_file: str | os.PathLike[str] | None = None
) -> Callable[[dict[str, Any]], int]:
    """``count(request) -> tokens`` with the counter the tracker uses for ``model``.

    Embedded tracker: its own counting backend and policy. Anything else (a remote client):
    an in-process count over the model registry (shipped models plus ``models_file``).
    """
    counting = getattr(tracker, "counting", None)
    if counting is not None and hasattr(counting, "measure"):
        policy = getattr(tracker, "policy", None) or Policy()
    else:
        from tracker.counting.backends import InProcessCounting
        from tracker.counting.registry import ModelRegistry

        counting = InProcessCounting(ModelRegistry.load(models_file))
        policy = Policy()
    basis = Basis(1, "compaction-count")

    def count(request: dict[str, Any]) -> int:
        return int(counting.measure(request, model=model, basis=basis, policy=policy).input_tokens)

    return count


# -- the guard -----------------------------------------------------------------------------------


class GuardOptions(TypedDict, total=False):
    """The guard's settings an adapter passes through (``Unpack[GuardOptions]``)."""

    keep_last: int
    share: SummaryShare | None
    count_tokens: Callable[[dict[str, Any]], int] | None
    wait_timeout_s: float
    models_file: str | os.PathLike[str] | None


class Guard:
    """Observe every model call; compact, wait or adopt as the tracker decides: :meth:`steps`.

    ``tracker`` is an embedded ``Tracker``, a ``TrackerClient`` or an ``AsyncTrackerClient``
    (:class:`~tracker.protocol.TrackerProtocol` / :class:`~tracker.protocol.AsyncTrackerProtocol`):
    the drivers call it, :meth:`steps` never does (:class:`~.drive.ContextGuard` is this guard with
    its drivers). ``model`` is the tracker's registry name of the model.
    """

    def __init__(
        self,
        tracker: Any,
        *,
        model: str,
        keep_last: int = 6,
        count_tokens: Callable[[dict[str, Any]], int] | None = None,
        share: SummaryShare | None = None,
        wait_timeout_s: float = 30.0,
        max_rounds: int = 16,
        models_file: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise InvalidInput("model", "the tracker's registry name of the model is required")
        if not isinstance(keep_last, int) or keep_last < 0:
            raise InvalidInput("keep_last", f"must be >= 0, got {keep_last!r}")
        self.tracker = tracker
        self.model = model
        self.keep_last = keep_last
        self.share: SummaryShare = share if share is not None else PROCESS_SHARE
        self.wait_timeout_s = wait_timeout_s
        self.max_rounds = max_rounds
        self._count, self._models_file = count_tokens, models_file
        self._lock = threading.Lock()
        # session -> (version, revision) of the newest observation or commit this guard saw
        self._seen: OrderedDict[str, tuple[int, int]] = OrderedDict()

    def count(self, request: dict[str, Any]) -> int:
        """The ``Count`` step: the tracker's own counter (built on first use), or ``count_tokens``."""
        with self._lock:
            if self._count is None:
                self._count = default_counter(self.tracker, self.model, self._models_file)
            count = self._count
        return count(request)

    # -- the steps ---------------------------------------------------------------------------
    def steps(self, session_id: str, view: View) -> Generator[Step, Any, Outcome]:
        """Settle the request with the tracker: the view to send and the replacements made."""
        out = Outcome(view)
        for _ in range(self.max_rounds):
            try:
                result: Result = yield Observe(out.view.request(), self.model, out.view.basis())
            except StaleBasis:
                rep = yield from self._adopt(session_id, out.view)
                if rep is None:
                    raise
                out.applied(rep)
                continue
            self._saw(session_id, result.version, out.view.revision)
            if result.action == "proceed":
                return out
            if result.action == "wait":
                waiting_on = result.decision.waiting_on
                if waiting_on is not None:
                    try:
                        yield Wait(waiting_on.attempt_id, self.wait_timeout_s)
                    except WaitTimeout:
                        pass
                continue
            if result.action == "compact":
                rep = yield from self._compact(session_id, out.view, result)
                if rep is not None:
                    out.applied(rep)
                continue
            raise TrackerError(f"unexpected action {result.action!r}")  # pragma: no cover
        raise TrackerError(
            f"session {session_id}: the request did not settle in {self.max_rounds} rounds", session_id=session_id
        )

    def _saw(self, session_id: str, version: int, revision: int) -> None:
        with self._lock:
            self._seen[session_id] = (version, revision)
            self._seen.move_to_end(session_id)
            while len(self._seen) > SESSIONS_SEEN:
                self._seen.popitem(last=False)

    def _known_version(self, session_id: str, revision: int) -> int:
        """Where the commit to ``revision + 1`` can first be: after the newest version seen at ``revision``
        or before (a version seen at a later revision says nothing of it)."""
        with self._lock:
            version, seen_at = self._seen.get(session_id, (1, 0))
        return max(1, version) if seen_at <= revision else 1

    # -- compact -----------------------------------------------------------------------------
    def _compact(self, session_id: str, view: View, result: Result) -> Generator[Step, Any, Replacement | None]:
        attempt = result.attempt
        if attempt is None:  # pragma: no cover - the tracker opens one with every compact
            raise TrackerError(f"session {session_id}: compact without an attempt", session_id=session_id)
        try:
            rep = yield from self._summarise(view, attempt, result)
        except SummaryFailed as exc:
            log.warning("session %s: compaction %s rejected: %s", session_id, attempt.attempt_id, exc)
            try:
                yield Reject(attempt.attempt_id, attempt.fencing_token, exc.reason)
            except (AttemptNotOpen, NotAttemptHolder, UnknownAttempt):
                pass  # it ended meanwhile (lease expired); observing again settles the rest
            return None
        yield Publish(attempt.attempt_id, share_payload(view, rep))
        try:
            state: SessionState = yield Commit(attempt.attempt_id, attempt.fencing_token, rep.tokens_after or 0)
        except SummaryTooLarge:
            return None  # recorded by the tracker as the rejection summary_too_large
        except (AttemptNotOpen, NotAttemptHolder, UnknownAttempt) as exc:  # lease expired / superseded
            log.warning("session %s: commit of %s refused: %s", session_id, attempt.attempt_id, exc)
            return None
        self._saw(session_id, state.version, state.revision)
        return replace(rep, revision=state.revision)

    def _summarise(self, view: View, attempt: Attempt, result: Result) -> Generator[Step, Any, Replacement]:
        decision = result.decision
        budget = attempt.history_budget if attempt.history_budget is not None else decision.hard_level
        target = min(budget, decision.rearm_level - 1)  # aim to end the pressure episode
        head = view.head
        cuts = cut_points(view.items, self.keep_last)
        # a cut that summarises less than the preferred one keeps more, so it cannot leave more room:
        # the candidates are the preferred cut, then those summarising more (into the recent tail)
        candidates = [end for end in cuts if end >= cuts[0]] if cuts else []
        try:
            chosen = None
            kept_tokens: dict[int, int] = {}
            for goal in dict.fromkeys((target, budget)):
                for end in candidates:
                    if end not in kept_tokens:
                        kept_tokens[end] = yield Count(view.request(view.items[:head] + view.items[end:]))
                    room = goal - kept_tokens[end] - SUMMARY_MARGIN_TOKENS
                    if room >= MIN_SUMMARY_TOKENS:
                        chosen = (end, room)
                        break
                if chosen is not None:
                    break
        except CountError as exc:
            raise SummaryFailed(COUNT_FAILED, str(exc)) from exc
        if chosen is None:
            if not cuts:
                raise SummaryFailed(NOTHING_TO_SUMMARIZE)
            raise SummaryFailed(SUMMARY_OVER_BUDGET, f"what must be kept leaves no room within {budget} tokens")
        end, room = chosen
        try:
            text = yield Summarize(view, head, end, room)
        except Exception as exc:  # noqa: BLE001 - any summariser failure is a recorded rejection
            raise SummaryFailed(SUMMARIZER_ERROR, f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(text, str) or not text.strip():
            raise SummaryFailed(SUMMARIZER_ERROR, "the summariser returned no text")
        rep = Replacement(
            head,
            end,
            text.strip(),
            view.revision + 1,
            attempt_id=attempt.attempt_id,
            tokens_before=attempt.tokens_before,
        )
        try:
            tokens_after = yield Count(view.apply(rep).request())
        except CountError as exc:
            raise SummaryFailed(COUNT_FAILED, str(exc)) from exc
        if tokens_after > budget:
            raise SummaryFailed(SUMMARY_OVER_BUDGET, f"the compacted request is {tokens_after} tokens, budget {budget}")
        return replace(rep, tokens_after=tokens_after)

    # -- adopt another holder's compaction -----------------------------------------------------
    def _adopt(self, session_id: str, view: View) -> Generator[Step, Any, Replacement | None]:
        """The compaction that moved this history's revision on, if it applies to this history."""
        committed: CompactionCommitted | None = yield FindCommit(
            view.revision + 1, self._known_version(session_id, view.revision)
        )
        if committed is None:
            return None
        found = shared_span(view, (yield Fetch(committed.attempt_id)))
        if found is None:
            return None
        start, end, summary = found
        return Replacement(
            start,
            end,
            summary,
            view.revision + 1,
            attempt_id=committed.attempt_id,
            tokens_before=committed.tokens_before,
            tokens_after=committed.tokens_after,
            adopted=True,
        )
