"""The history, framework-free: items, the view a framework is about to send, replacements, cut points.

Adapters turn a framework's messages into :class:`Item` s (one per framework message, already in
the tracker's request shape) and the request into a :class:`View`; the guard decides on views and
hands back :class:`Replacement` s, which the adapters apply to their own messages (:func:`replaced`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from tracker.counting.request import CanonicalRequest

SUMMARY_PREFIX = "Summary of the earlier conversation (written by the context tracker):\n\n"
MARKER = "context_tracker"  # the key framework messages carry the summary's revision under

M = TypeVar("M")


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


def summary_text(text: str) -> str:
    """What the model reads of a summary: :data:`SUMMARY_PREFIX`, then the summary."""
    return SUMMARY_PREFIX + text


def summary_mark(revision: int) -> dict[str, Any]:
    """The metadata a framework's summary message carries: the history's revision it starts."""
    return {MARKER: {"revision": revision}}


def summary_item(text: str) -> Item:
    """The item a summary message becomes (adapters build their framework message to match)."""
    return Item(({"role": "user", "content": summary_text(text)},))


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
    """The view to send and the replacements that made it from the view given (oldest first)."""

    view: View
    replacements: list[Replacement] = field(default_factory=list)

    def applied(self, rep: Replacement) -> None:
        self.view = self.view.apply(rep)
        self.replacements.append(rep)


def replaced(messages: list[M], reps: Sequence[Replacement], summary: Callable[[Replacement, list[M]], M]) -> list[M]:
    """A framework's messages after ``reps`` (each refers to the history the one before left):
    ``summary(rep, span)`` is the framework message a replacement's summary becomes."""
    for rep in reps:
        messages = messages[: rep.start] + [summary(rep, messages[rep.start : rep.end])] + messages[rep.end :]
    return messages


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


class Spans(Generic[M]):
    """The framework messages a summary is asked about: ``spans(view, start, end)``.

    ``view`` is the view being compacted (the ``Summarize`` step's): after a compaction adopted earlier
    in the same call it is not the view the messages were given with, so messages are found by item,
    not by position. A summary item the call adopted has no framework message: ``stand_in(text)`` makes
    one (``text`` is what the model reads, prefix included).
    """

    def __init__(self, view: View, messages: Sequence[M], stand_in: Callable[[str], M]) -> None:
        self._stand_in = stand_in
        self._of = {id(it): m for it, m in zip(view.items, messages, strict=True)}
        self._view = view  # keeps the items alive, so their ids stay theirs

    def __call__(self, view: View, start: int, end: int) -> list[M]:
        out = []
        for it in view.items[start:end]:
            m = self._of.get(id(it))
            out.append(m if m is not None else self._stand_in(str(it.messages[0]["content"])))
        return out


def summary_prompt(transcript: str, budget_tokens: int) -> str:
    """The instruction a chat-model summariser gets."""
    words = max(20, int(budget_tokens * 0.6))
    return (
        "Summarise the conversation below so an agent can continue the task from the summary alone. "
        "Keep the user's goal, decisions made, facts learned from tool results, files touched and the next "
        f"steps. Use at most {words} words. Reply with the summary only.\n\n<conversation>\n{transcript}\n</conversation>"
    )
