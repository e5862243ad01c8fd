"""``ContextTrackerHooks``: the provider's usage of every LLM call of an Agents SDK run, reported to the tracker."""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from agents import Agent, ModelResponse, RunContextWrapper, RunHooks

from tracker.errors import InvalidInput
from tracker.integrations._provider import ModelCall, Usage, report_usage_kwargs
from tracker.integrations.compaction import SUMMARY_PREFIX, View, call_async
from tracker.integrations.openai_agents.filter import resolve_session
from tracker.integrations.openai_agents.items import items_of, json_text
from tracker.integrations.openai_agents.model import PENDING
from tracker.protocol import AsyncTrackerProtocol, TrackerProtocol

log = logging.getLogger("tracker.integrations")


@dataclass(frozen=True)
class LLMUsage:
    """The provider's usage of one model call, and the basis the tracker observed that call's request with.

    ``input_tokens`` is the SDK's (OpenAI's) input total, which *includes* ``cached_input_tokens``
    (and ``cache_write_tokens``, where the provider reports them); :attr:`usage` is the same in the
    tracker's terms (``input_tokens`` uncached), as reported."""

    session_id: str
    model: str
    basis: str | None
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int = 0
    reasoning_tokens: int = 0
    total_tokens: int = 0
    requests: int = 1
    response_id: str | None = None
    agent: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    cache_write_tokens: int = 0

    @property
    def usage(self) -> Usage | None:
        return Usage.inclusive(
            self.input_tokens,
            output_tokens=self.output_tokens,
            cache_read_tokens=self.cached_input_tokens,
            cache_write_tokens=self.cache_write_tokens,
        )


@dataclass(frozen=True)
class _Started:
    """An LLM call started: its session, the filter's call that settled its input (if any), else its basis."""

    session_id: str
    call: ModelCall | None
    basis: str | None

    @property
    def sent_basis(self) -> str | None:
        """The basis of what was sent in the end: a call the filter's model wrapper retried sent the compacted input."""
        return self.call.basis if self.call is not None else self.basis


class ContextTrackerHooks(RunHooks[Any]):
    """``Runner.run(..., hooks=ContextTrackerHooks(tracker, model=...))``: the usage of every LLM call.

    ``on_llm_start`` notes the request the model is sent (and, from the
    :class:`~tracker.integrations.openai_agents.ContextTrackerFilter` that settled it in this run, the
    basis it was observed with: ``r<revision>:h<digest>``; without the filter, ``r1:h<digest>`` for a
    history holding no summary); ``on_llm_end`` takes the response's ``Usage`` (input, cached input,
    output and reasoning tokens), records an :class:`LLMUsage` in ``usages`` (the newest ``keep`` of
    them) and reports it: ``tracker.report_usage(session_id, basis=..., input_tokens=<input - cached>,
    cache_read_tokens=<cached>, output_tokens=...)`` (the SDK's ``input_tokens`` counts the cached
    tokens; the tracker's does not). A call the filter's ``wrap_model`` retried after a context-length
    error is reported on the basis of the compacted input it sent. A report that fails is logged,
    never raised into the run; a tracker without ``report_usage`` is sent nothing. ``tracker``: sync
    or async, as for the filter.
    """

    def __init__(
        self,
        tracker: TrackerProtocol | AsyncTrackerProtocol | Any,
        *,
        model: str,
        session_id: str | None = None,
        session: Any = None,
        keep: int = 1000,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise InvalidInput("model", "the tracker's registry name of the model is required")
        self.tracker = tracker
        self.model = model
        self.session_id = session_id
        self.session = session
        self.keep = keep
        self.usages: list[LLMUsage] = []
        self._started: weakref.WeakKeyDictionary[Any, list[_Started]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    @property
    def reports_usage(self) -> bool:
        """Whether the tracker takes usage reports (``report_usage``)."""
        return callable(getattr(self.tracker, "report_usage", None))

    async def on_llm_start(
        self, context: RunContextWrapper[Any], agent: Agent[Any], system_prompt: str | None, input_items: list[Any]
    ) -> None:
        session = resolve_session(self.session_id, self.session, context.context, "the LLM call")
        pending = PENDING.get()
        if pending is not None and pending.call.session_id == session and pending.sends(input_items):
            started = _Started(session, pending.call, None)
        else:
            items = items_of(input_items)
            unsummarised = not any(SUMMARY_PREFIX in json_text(m.get("content")) for it in items for m in it.messages)
            # a compacted history this run's filter did not settle: its revision is unknown here
            started = _Started(session, None, View(system=None, items=items).basis() if unsummarised else None)
        with self._lock:
            self._started.setdefault(context, []).append(started)

    async def on_llm_end(self, context: RunContextWrapper[Any], agent: Agent[Any], response: ModelResponse) -> None:
        with self._lock:
            started = self._started.get(context) or []
            first = started.pop(0) if started else None
        if first is not None:
            session, basis = first.session_id, first.sent_basis
        else:
            session, basis = resolve_session(self.session_id, self.session, context.context, "the LLM call"), None
        u = response.usage
        details = getattr(u, "input_tokens_details", None)
        usage = LLMUsage(
            session_id=session,
            model=self.model,
            basis=basis,
            input_tokens=int(u.input_tokens),
            output_tokens=int(u.output_tokens),
            cached_input_tokens=int(getattr(details, "cached_tokens", 0) or 0),
            reasoning_tokens=int(getattr(getattr(u, "output_tokens_details", None), "reasoning_tokens", 0) or 0),
            total_tokens=int(u.total_tokens),
            requests=int(u.requests),
            response_id=response.response_id,
            agent=getattr(agent, "name", None),
            cache_write_tokens=int(getattr(details, "cache_write_tokens", 0) or 0),
        )
        with self._lock:
            self.usages.append(usage)
            del self.usages[: max(0, len(self.usages) - self.keep)]
        await self._report(usage)

    async def _report(self, usage: LLMUsage) -> None:
        report = getattr(self.tracker, "report_usage", None)
        billed = usage.usage
        if not callable(report) or billed is None:
            return
        if usage.basis is None:
            log.warning("session %s: usage of an LLM call with no known basis is not reported", usage.session_id)
            return
        try:
            await call_async(report, usage.session_id, **report_usage_kwargs(usage.basis, billed))
        except Exception as exc:  # noqa: BLE001 - a usage report never breaks the agent's run
            log.warning("session %s: usage report failed: %s: %s", usage.session_id, type(exc).__name__, exc)
