"""The model call a filter settled, and the SDK ``Model`` that recovers it once from a context-length error.

The filter sets :data:`PENDING` (a context variable: the run's task, and the hooks' tasks it starts,
see it; two runs at once do not) to what it sent; :class:`RecoveringModel` and the usage hooks read it.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from agents import Model

from tracker.integrations._provider import ModelCall
from tracker.integrations.compaction import digest
from tracker.integrations.openai_agents.items import items_of


class Recovers(Protocol):
    """The filter, as the model wrapper sees it: what to retry a refused input with (None: re-raise)."""

    async def recover(self, pending: Pending, exc: BaseException) -> list[Any] | None: ...


@dataclass
class Pending:
    """The model call a filter settled in this task: what the SDK sends next is ``sent`` (digest ``sent_digest``)."""

    filter: Recovers
    call: ModelCall
    sent: list[Any]
    sent_digest: str

    def sends(self, input: Any) -> bool:
        """Whether ``input`` (the items the SDK hands the model or the hooks) is what this call sent."""
        return isinstance(input, list) and digest(items_of(input)) == self.sent_digest


PENDING: contextvars.ContextVar[Pending | None] = contextvars.ContextVar("context_tracker_call", default=None)


class RecoveringModel(Model):
    """An SDK ``Model`` whose call of a filtered input recovers once from a context-length error."""

    def __init__(self, inner: Model, owner: Recovers) -> None:
        self.inner, self.owner = inner, owner

    def _pending(self, input: Any) -> Pending | None:
        pending = PENDING.get()
        return pending if pending is not None and pending.filter is self.owner and pending.sends(input) else None

    async def _retry_input(self, input: Any, exc: Exception) -> list[Any] | None:
        pending = self._pending(input)
        return await self.owner.recover(pending, exc) if pending is not None else None

    async def get_response(self, system_instructions: str | None, input: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self.inner.get_response(system_instructions, input, *args, **kwargs)
        except Exception as exc:
            retry = await self._retry_input(input, exc)
            if retry is None:
                raise
        return await self.inner.get_response(system_instructions, retry, *args, **kwargs)

    async def stream_response(
        self, system_instructions: str | None, input: Any, *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """A failure before the stream's first event is recovered like ``get_response``'s; a later one propagates."""
        stream = self.inner.stream_response(system_instructions, input, *args, **kwargs)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            return
        except Exception as exc:
            retry = await self._retry_input(input, exc)
            if retry is None:
                raise
            async for event in self.inner.stream_response(system_instructions, retry, *args, **kwargs):
                yield event
            return
        yield first
        async for event in stream:
            yield event

    def get_retry_advice(self, request: Any) -> Any:
        return self.inner.get_retry_advice(request)

    async def close(self) -> None:
        await self.inner.close()

    async def _cleanup_on_run_end(self, owner: object) -> None:
        await self.inner._cleanup_on_run_end(owner)
