"""Framework-free compaction for agent frameworks: what to keep, and the protocol with the tracker.

The adapters (:mod:`tracker.integrations.langchain`, :mod:`tracker.integrations.pydantic_ai`)
turn the request a framework is about to send into a :class:`View` — the system prompt, the
tools and the history as a list of :class:`Item` (one per framework message, already in the
tracker's request shape) — and call :meth:`ContextGuard.before_call`. The guard:

1. observes the complete request on the session, with ``basis = r<revision>:h<digest>``:
   the digest is a hash of the history's *content* (never of framework message ids), so two
   processes holding the same history send the same basis and the tracker's once-per-basis
   rule deduplicates them; the revision is the compaction generation of the history (the one
   written on its newest summary, else 1), so a compacted history has a new basis;
2. ``proceed`` → returns; the adapter sends the (possibly compacted) request;
3. ``compact`` → chooses the span to summarise (:func:`cut_points`: never the leading system
   entries, never the recent tail, never a tool call apart from its results), asks the
   summariser for a summary within the room the attempt's ``history_budget`` leaves, counts
   the compacted request and commits it with that count as ``tokens_after``; a summariser that
   raises or returns nothing is rejected as ``summarizer_error``, a compacted request over the
   budget as ``summary_over_budget`` (``count_failed``, ``nothing_to_summarize`` likewise);
   then observes again (the compacted request is a new basis and is counted like any other);
4. ``wait`` → waits for the other holder's attempt to end, then observes again;
5. ``StaleBasis`` (another process compacted this history) → adopts that compaction from the
   :class:`SummaryShare` the holder published it to, then observes again; with nothing to
   adopt the ``StaleBasis`` is raised (a session names one conversation: a different history
   sent on a session that has compacted is refused this way — start it on a new session);
6. ``ContextLimitError`` (hard limit, nothing eligible) and count failures propagate to the
   caller: a request the tracker refused is never sent.

``tokens_after`` is counted with the same counter the tracker uses: an embedded
:class:`~tracker.service.Tracker` counts with its own counting backend (in-process or the
Celery workers); for a remote client the request is counted in this process with the model
registry (``models_file=``), which gives the server's number for the local counters
(``exact_local``, ``heuristic``). Pass ``count_tokens=`` to count any other way.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, Protocol, TypedDict, TypeVar

from tracker.core.model import Basis
from tracker.core.policy import Policy
from tracker.counting.request import CanonicalRequest
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
from tracker.protocol import TrackerProtocol

log = logging.getLogger("tracker.integrations")

SUMMARY_PREFIX = "Summary of the earlier conversation (written by the context tracker):\n\n"
MARKER = "context_tracker"  # the key framework messages carry the summary's revision under
SUMMARY_MARGIN_TOKENS = 24  # what the summary message costs beside its text (role, prefix, framing)
MIN_SUMMARY_TOKENS = 32  # a cut that leaves less room than this for the summary is not tried

# reject_reason values this module records
SUMMARIZER_ERROR = "summarizer_error"
SUMMARY_OVER_BUDGET = "summary_over_budget"
COUNT_FAILED = "count_failed"
NOTHING_TO_SUMMARIZE = "nothing_to_summarize"


# -- the history, framework-free --------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One framework message: the request messages it becomes and the tool calls it makes / answers."""

    messages: tuple[dict[str, Any], ...]
    calls: frozenset[str] = frozenset()  # ids of tool calls this entry makes
    results: frozenset[str] = frozenset()  # ids of tool calls this entry answers
    pinned: bool = False  # a leading system entry: kept, never summarised


def marked_revision(marks: Iterable[Mapping[str, Any] | None]) -> int:
    """A history's revision from its messages' metadata, oldest first (a framework's own field):
    the one written under :data:`MARKER` on its newest summary message, else 1."""
    for meta in reversed(list(marks)):
        mark = (meta or {}).get(MARKER)
        if isinstance(mark, dict) and isinstance(mark.get("revision"), int):
            return mark["revision"]
    return 1


def summary_item(text: str) -> Item:
    """The item a summary message becomes (adapters build their framework message to match)."""
    return Item(({"role": "user", "content": SUMMARY_PREFIX + text},))


def digest(items: Sequence[Item]) -> str:
    """A stable id of a history: the hash of its canonical request form (content, never ids)."""
    messages = [m for it in items for m in it.messages]
    return CanonicalRequest.from_dict({"messages": messages}).fingerprint[:32]


@dataclass(frozen=True)
class View:
    """The complete request a framework is about to send: system prompt, history, tools."""

    system: Any  # str | list of text parts | None
    items: tuple[Item, ...]
    tools: tuple[dict[str, Any], ...] = ()
    revision: int = 1  # the compaction generation of this history

    def request(self, items: Sequence[Item] | None = None) -> dict[str, Any]:
        its = self.items if items is None else items
        return {"system": self.system, "messages": [m for it in its for m in it.messages], "tools": list(self.tools)}

    @property
    def head(self) -> int:
        """Index of the first entry that may be summarised (after the leading pinned ones)."""
        n = 0
        while n < len(self.items) and self.items[n].pinned:
            n += 1
        return n

    def basis(self) -> str:
        return f"r{self.revision}:h{digest(self.items)}"

    def apply(self, rep: Replacement) -> View:
        items = self.items[: rep.start] + (summary_item(rep.summary),) + self.items[rep.end :]
        return replace(self, items=items, revision=rep.revision)


@dataclass(frozen=True)
class Replacement:
    """``items[start:end]`` became one summary message; the history is now at ``revision``."""

    start: int
    end: int
    summary: str
    revision: int
    attempt_id: str | None = None
    tokens_before: int | None = None
    tokens_after: int | None = None
    adopted: bool = False  # made by another holder, taken from the share


@dataclass
class Outcome:
    view: View
    replacements: list[Replacement] = field(default_factory=list)


def cut_points(items: Sequence[Item], keep_last: int) -> list[int]:
    """Where the summarised span ``items[head:end]`` may end, best first.

    A cut is valid when no tool call before it is answered after it (a call and its results
    — a whole batch — stay on one side). Preferred: the valid cut keeping at least
    ``keep_last`` entries, nearest first; then cuts keeping fewer, down to summarising all.
    """
    n = len(items)
    head = 0
    while head < n and items[head].pinned:
        head += 1
    valid = []
    for end in range(head + 1, n + 1):
        made = frozenset().union(*(it.calls for it in items[:end]))
        answered_later = frozenset().union(*(it.results for it in items[end:]))
        if not (made & answered_later):
            valid.append(end)
    target = n - keep_last
    before = sorted((e for e in valid if e <= target), reverse=True)
    after = sorted(e for e in valid if e > target)
    return before + after


# -- sharing a compaction with the other holders of the same history --------------------------


class SummaryShare(Protocol):
    """Where a holder publishes its compaction (before committing) so others can adopt it."""

    def put(self, session_id: str, attempt_id: str, payload: dict[str, Any]) -> None: ...

    def get(self, session_id: str, attempt_id: str) -> dict[str, Any] | None: ...


class MemoryShare:
    """Within one process (threads, or one agent whose state update was lost)."""

    def __init__(self) -> None:
        self._data: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def put(self, session_id: str, attempt_id: str, payload: dict[str, Any]) -> None:
        with self._lock:
            self._data[(session_id, attempt_id)] = dict(payload)

    def get(self, session_id: str, attempt_id: str) -> dict[str, Any] | None:
        with self._lock:
            found = self._data.get((session_id, attempt_id))
            return dict(found) if found is not None else None


class RedisShare:
    """Across processes and machines: one Redis key per attempt, expiring after ``ttl_s``."""

    def __init__(self, url: str, *, prefix: str = "context-tracker:compaction:", ttl_s: float = 7 * 24 * 3600) -> None:
        import redis

        self._redis = redis.Redis.from_url(url)
        self._prefix = prefix
        self._ttl_ms = int(ttl_s * 1000)

    def _key(self, session_id: str, attempt_id: str) -> str:
        return f"{self._prefix}{session_id}:{attempt_id}"

    def put(self, session_id: str, attempt_id: str, payload: dict[str, Any]) -> None:
        self._redis.set(self._key(session_id, attempt_id), json.dumps(payload), px=self._ttl_ms)

    def get(self, session_id: str, attempt_id: str) -> dict[str, Any] | None:
        raw = self._redis.get(self._key(session_id, attempt_id))
        return json.loads(raw) if raw else None


class DirectoryShare:
    """Across processes of one machine: one JSON file per attempt under ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._dir = Path(path)
        self._dir.mkdir(parents=True, exist_ok=True)

    def _file(self, session_id: str, attempt_id: str) -> Path:
        return self._dir / f"{session_id}__{attempt_id}.json"  # both are [A-Za-z0-9._:-]

    def put(self, session_id: str, attempt_id: str, payload: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self._dir, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f)
        os.replace(tmp, self._file(session_id, attempt_id))

    def get(self, session_id: str, attempt_id: str) -> dict[str, Any] | None:
        try:
            return json.loads(self._file(session_id, attempt_id).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None


_PROCESS_SHARE = MemoryShare()


def _offsets(items: Sequence[Item]) -> list[int]:
    """Where each item starts in the history's request messages (and, last, their count)."""
    out = [0]
    for it in items:
        out.append(out[-1] + len(it.messages))
    return out


def share_payload(view: View, rep: Replacement) -> dict[str, Any]:
    """What a holder publishes of its compaction: language-neutral (docs/canonical-request.md, section 6).

    ``start`` / ``end`` are positions in the history's *request messages*, not framework messages:
    adapters of different frameworks split the same history into different items (an AI SDK tool
    message holding two results is one item of two request messages, LangChain's two ToolMessages
    are two items), and the request messages are what the basis is the digest of.
    """
    offsets = _offsets(view.items)
    return {
        "from_revision": view.revision,
        "start": offsets[rep.start],
        "end": offsets[rep.end],
        "span": digest(view.items[rep.start : rep.end]),
        "summary": rep.summary,
    }


def shared_span(view: View, payload: Any) -> tuple[int, int, str] | None:
    """The items ``[start, end)`` a shared compaction replaces in ``view`` and its summary, or None when it
    does not apply:
    made from another revision, its positions not on this history's item boundaries, or its span's digest
    not this history's (a different history under the same session)."""
    if not isinstance(payload, Mapping) or payload.get("from_revision") != view.revision:
        return None
    start, end, summary = payload.get("start"), payload.get("end"), payload.get("summary")
    offsets = _offsets(view.items)
    if not (type(start) is int and type(end) is int and 0 <= start < end and start in offsets and end in offsets):
        return None
    first, stop = offsets.index(start), offsets.index(end)
    if not isinstance(summary, str) or digest(view.items[first:stop]) != payload.get("span"):
        return None
    return first, stop, summary


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


# -- the protocol ------------------------------------------------------------------------------


class SummaryFailed(Exception):
    """Internal: the compaction could not be made; ``reason`` is the recorded reject_reason."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


Summarize = Callable[[int, int, int], str]  # (start, end, budget_tokens) -> summary text
M = TypeVar("M")


class GuardOptions(TypedDict, total=False):
    """The :class:`ContextGuard` settings an adapter passes through (``Unpack[GuardOptions]``)."""

    keep_last: int
    share: SummaryShare | None
    count_tokens: Callable[[dict[str, Any]], int] | None
    wait_timeout_s: float
    models_file: str | os.PathLike[str] | None


class ContextGuard:
    """Observe every model call; compact, wait or adopt as the tracker decides.

    ``tracker`` is anything following :class:`~tracker.protocol.TrackerProtocol` (an embedded
    ``Tracker`` or a ``TrackerClient``); ``model`` is the tracker's registry name of the model.
    """

    def __init__(
        self,
        tracker: TrackerProtocol,
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
        if keep_last < 0:
            raise InvalidInput("keep_last", f"must be >= 0, got {keep_last!r}")
        self.tracker = tracker
        self.model = model
        self.keep_last = keep_last
        self._count = count_tokens
        self._models_file = models_file
        self.share: SummaryShare = share if share is not None else _PROCESS_SHARE
        self.wait_timeout_s = wait_timeout_s
        self.max_rounds = max_rounds
        self._local = threading.local()

    def compacting(self) -> View | None:
        """The view the summariser is being asked about, in the thread calling it (else None).

        ``summarize(start, end, budget)`` indexes this view: it is the request as given to
        :meth:`before_call` unless a compaction was adopted earlier in the same call.
        """
        return getattr(self._local, "view", None)

    def count(self, request: dict[str, Any]) -> int:
        if self._count is None:
            self._count = default_counter(self.tracker, self.model, self._models_file)
        return self._count(request)

    def before_call(self, session_id: str, view: View, summarize: Summarize) -> Outcome:
        """Settle the request with the tracker; return the view to send and the replacements made."""
        out = Outcome(view)
        for _ in range(self.max_rounds):
            try:
                result = self.tracker.observe(
                    session_id, request=out.view.request(), model=self.model, basis=out.view.basis()
                )
            except StaleBasis:
                rep = self._adopt(session_id, out.view)
                if rep is None:
                    raise
                self._applied(out, rep)
                continue
            if result.action == "proceed":
                return out
            if result.action == "wait":
                waiting_on = result.decision.waiting_on
                if waiting_on is not None:
                    try:
                        self.tracker.wait(session_id, waiting_on.attempt_id, timeout=self.wait_timeout_s)
                    except WaitTimeout:
                        pass
                continue
            if result.action == "compact":
                rep = self._compact(session_id, out.view, result, summarize)
                if rep is not None:
                    self._applied(out, rep)
                continue
            raise TrackerError(f"unexpected action {result.action!r}")  # pragma: no cover
        raise TrackerError(
            f"session {session_id}: the request did not settle in {self.max_rounds} rounds", session_id=session_id
        )

    @staticmethod
    def _applied(out: Outcome, rep: Replacement) -> None:
        out.view = out.view.apply(rep)
        out.replacements.append(rep)

    # -- compact ---------------------------------------------------------------------------
    def _compact(self, session_id: str, view: View, result: Any, summarize: Summarize) -> Replacement | None:
        attempt = result.attempt
        self._local.view = view
        try:
            rep = self._summarise(view, attempt, result.decision, summarize)
        except SummaryFailed as exc:
            log.warning("session %s: compaction %s rejected: %s", session_id, attempt.attempt_id, exc)
            self._reject(session_id, attempt, exc.reason)
            return None
        finally:
            self._local.view = None
        self.share.put(session_id, attempt.attempt_id, share_payload(view, rep))
        try:
            state = self.tracker.commit(session_id, attempt.attempt_id, attempt.fencing_token, rep.tokens_after or 0)
        except SummaryTooLarge:
            return None  # recorded by the tracker as the rejection summary_too_large
        except (AttemptNotOpen, NotAttemptHolder, UnknownAttempt) as exc:  # lease expired / superseded
            log.warning("session %s: commit of %s refused: %s", session_id, attempt.attempt_id, exc)
            return None
        return replace(rep, revision=state.revision)

    def _summarise(self, view: View, attempt: Any, decision: Any, summarize: Summarize) -> Replacement:
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
                        kept_tokens[end] = self.count(view.request(view.items[:head] + view.items[end:]))
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
            text = summarize(head, end, room)
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
            tokens_after = self.count(view.apply(rep).request())
        except CountError as exc:
            raise SummaryFailed(COUNT_FAILED, str(exc)) from exc
        if tokens_after > budget:
            raise SummaryFailed(SUMMARY_OVER_BUDGET, f"the compacted request is {tokens_after} tokens, budget {budget}")
        return replace(rep, tokens_after=tokens_after)

    def _reject(self, session_id: str, attempt: Any, reason: str) -> None:
        try:
            self.tracker.reject(session_id, attempt.attempt_id, attempt.fencing_token, reason)
        except (AttemptNotOpen, NotAttemptHolder, UnknownAttempt):
            pass  # it ended meanwhile (lease expired); re-observing settles the rest

    # -- adopt another holder's compaction -------------------------------------------------
    def _adopt(self, session_id: str, view: View) -> Replacement | None:
        """The compaction that moved this history's revision on, if it applies to this history."""
        committed = None
        for event in self.tracker.history(session_id):
            if event.type == "CompactionCommitted" and event.data.get("new_revision") == view.revision + 1:
                committed = event.data
        if committed is None:
            return None
        payload = self.share.get(session_id, committed["attempt_id"])
        found = shared_span(view, payload)
        if found is None:
            return None
        start, end, summary = found
        return Replacement(
            start,
            end,
            summary,
            view.revision + 1,
            attempt_id=committed["attempt_id"],
            tokens_before=committed.get("tokens_before"),
            tokens_after=committed.get("tokens_after"),
            adopted=True,
        )


class Spans(Generic[M]):
    """The framework messages a ``summarize(start, end, budget)`` call is about.

    ``start`` and ``end`` index the view being compacted (:meth:`ContextGuard.compacting`): after a
    compaction adopted earlier in the same call that is not the view given, so the messages are
    found by item, not by position in the original history. A summary item the call adopted has no
    framework message: ``summary(text)`` makes one (``text`` is what the model reads, prefix included).
    """

    def __init__(self, guard: ContextGuard, view: View, messages: Sequence[M], summary: Callable[[str], M]) -> None:
        self._guard, self._view, self._summary = guard, view, summary
        self._of = {id(it): m for it, m in zip(view.items, messages, strict=True)}

    def __call__(self, start: int, end: int) -> list[M]:
        now = self._guard.compacting() or self._view
        out = []
        for it in now.items[start:end]:
            m = self._of.get(id(it))
            out.append(m if m is not None else self._summary(str(it.messages[0]["content"])))
        return out


def summary_prompt(transcript: str, budget_tokens: int) -> str:
    """The instruction a chat-model summariser gets."""
    words = max(20, int(budget_tokens * 0.6))
    return (
        "Summarise the conversation below so an agent can continue the task from the summary alone. "
        "Keep the user's goal, decisions made, facts learned from tool results, files touched and the next "
        f"steps. Use at most {words} words. Reply with the summary only.\n\n<conversation>\n{transcript}\n</conversation>"
    )
