"""What a framework adapter is besides its framework: the guard, the summariser and the session it was
given, and one :class:`~tracker.integrations._provider.ModelCall` per request it sees."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tracker.integrations._provider import ModelCall
from tracker.integrations.compaction import (
    ContextGuard,
    GuardOptions,
    Outcome,
    Replacement,
    Spans,
    View,
    replaced,
    summarize_with,
)

M = TypeVar("M")


class Guarded:
    """Mixin of the adapters (LangChain's middleware, pydantic-ai's capability)."""

    guard: ContextGuard
    summarizer: Any
    session_id: str | None

    def _guarded(
        self, tracker: Any, model: str, summarizer: Any, session_id: str | None, options: GuardOptions
    ) -> None:
        self.guard = ContextGuard(tracker, model=model, **options)
        self.summarizer = summarizer
        self.session_id = session_id

    def _model_call(
        self,
        session_id: str,
        view: View,
        messages: Sequence[M],
        stand_in: Callable[[str], M],
        summarizer: Callable[[list[M], int], Any],
    ) -> ModelCall:
        """The call settling ``view`` (made of ``messages``); ``stand_in(text)`` is the framework message of a
        summary adopted in the call, ``summarizer(messages, budget)`` writes one (sync or async)."""
        return ModelCall(self.guard, session_id, view, summarize_with(summarizer, Spans(view, messages, stand_in)))


def compacted(messages: list[M], out: Outcome, summary: Callable[[Replacement, list[M]], M]) -> list[M] | None:
    """The framework's history after the outcome's replacements, or None when nothing was replaced."""
    return replaced(messages, out.replacements, summary) if out.replacements else None
