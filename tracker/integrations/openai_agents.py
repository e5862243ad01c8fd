"""OpenAI Agents SDK: ``ContextTrackerFilter`` (a ``call_model_input_filter``) and ``ContextTrackerHooks``.

::

    from agents import Agent, RunConfig, Runner
    from tracker import Tracker
    from tracker.integrations.openai_agents import ContextTrackerFilter, ContextTrackerHooks

    tracker = Tracker.from_settings()
    tracker_filter = ContextTrackerFilter(tracker, model="gpt-4o", session_id="s-42")
    agent = Agent(name="...", model=tracker_filter.wrap_model("gpt-4o"))  # recovers from one context-length error
    config = RunConfig(call_model_input_filter=tracker_filter)
    result = await Runner.run(agent, "...", run_config=config,
                              hooks=ContextTrackerHooks(tracker, model="gpt-4o", session_id="s-42"))

Before every model call the SDK hands the filter a ``CallModelData`` (the agent, the run's
context and the ``ModelInputData``: instructions and Responses-style input items); the filter
observes the complete request — the instructions, every input item and the agent's tools and
handoffs — on the session and returns the ``ModelInputData`` to send. On ``compact`` the older
items are summarised by ``summarizer`` (a callable ``(items, budget_tokens) -> str``, sync or
async, or an SDK ``Model``; default the agent's own model) and replaced by one user message
``{"role": "user", "content": "Summary of the earlier conversation ..."}``. A ``function_call``
(any ``*_call`` item with a ``call_id``) is never separated from its ``function_call_output``,
nor a ``reasoning`` item from the item it precedes. On ``wait`` it waits; another process's
compaction of the same history is adopted; ``ContextLimitError`` propagates out of ``Runner.run``.
See :mod:`tracker.integrations._compaction` for the whole protocol.

The SDK rebuilds the model input from the run's full item list on every turn (the filter's
output is sent, never kept), so the filter remembers, per session, the replacements it made
and re-applies them to each new input whose items still match; a history it has not seen
(another process, a restarted one) gets them by the protocol's adoption from the tracker's
history and the ``share``.

**The session id.** The SDK passes the ``Session`` given to ``Runner.run(session=...)``
neither to the filter (``CallModelData`` holds the agent, the context and the input) nor to
the hooks (they get the ``RunContextWrapper``). So the session id is, in order: ``session_id=``;
``session=`` (an SDK ``Session``: its ``session_id``, the id the SDK itself groups the run by);
the run context's ``session_id`` (``Runner.run(..., context=...)``: an attribute or a mapping
key); the current trace's ``group_id`` (``RunConfig(group_id=...)``, only while tracing is on).
With none of them the call is refused with ``InvalidInput("session_id")``.

**The provider's numbers.** The hooks report every call's ``Usage`` (``tracker.report_usage``; the
SDK's ``input_tokens`` includes ``input_tokens_details.cached_tokens``, so the tracker is sent the
uncached rest and the cached tokens as ``cache_read_tokens``). A context-length error cannot be
recovered by the filter (the SDK calls the model after it returns, and its own retries resend the
same input): wrap the agent's model, ``Agent(model=tracker_filter.wrap_model(model))``, and a
provider's "too long" error (``openai.BadRequestError`` ``context_length_exceeded``) on an input the
filter settled is reported (``tracker.report_rejection``), the history compacted and the call made
once more with the compacted input (see :mod:`tracker.integrations._provider`); a second failure
propagates out of ``Runner.run``.

Server-managed conversations (``conversation_id=``, ``previous_response_id=``) send only the
new items, so the filter cannot see (or shorten) the history: use the tracker with
client-side history (the default, or an SDK ``Session``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, Unpack

from agents import Agent, Model, ModelResponse, ModelSettings, RunContextWrapper, RunHooks
from agents.handoffs import Handoff, handoff
from agents.models.interface import ModelTracing
from agents.run_config import CallModelData, ModelInputData

from tracker.errors import InvalidInput
from tracker.integrations._compaction import (
    SUMMARY_PREFIX,
    ContextGuard,
    GuardOptions,
    Replacement,
    Spans,
    View,
    default_counter,
    digest,
    summary_prompt,
)
from tracker.integrations._openai_items import (
    input_item,
    items_of,
    json_text,
    summary_input_item,
    to_request,
    transcript,
    view_of,
)
from tracker.integrations._provider import ModelCall, Usage, report_usage_kwargs
from tracker.protocol import TrackerProtocol

__all__ = [
    "ContextTrackerFilter",
    "ContextTrackerHooks",
    "LLMUsage",
    "input_item",
    "items_of",
    "summary_input_item",
    "to_request",
    "view_of",
]

log = logging.getLogger("tracker.integrations")
T = TypeVar("T")

# -- the tracker, sync or async ----------------------------------------------------------------


def _is_async(tracker: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(tracker, "observe", None))


class _OnLoop:
    """A blocking :class:`TrackerProtocol` over an async tracker (``AsyncTrackerClient``), for the
    guard's worker thread: each call runs on the agent's event loop, which awaits that thread."""

    def __init__(self, inner: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._inner, self._loop = inner, loop

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # (the arguments are passed on as given: the async tracker checks them as the sync one would)
    def observe(self, session_id: str, **kw: Any) -> Any:
        return self._run(self._inner.observe(session_id, **kw))

    def request_compaction(self, session_id: str, **kw: Any) -> Any:
        return self._run(self._inner.request_compaction(session_id, **kw))

    def commit(self, session_id: str, *args: Any, **kw: Any) -> Any:
        return self._run(self._inner.commit(session_id, *args, **kw))

    def reject(self, session_id: str, *args: Any, **kw: Any) -> Any:
        return self._run(self._inner.reject(session_id, *args, **kw))

    def wait(self, session_id: str, *args: Any, **kw: Any) -> str:
        return self._run(self._inner.wait(session_id, *args, **kw))

    def state(self, session_id: str) -> Any:
        return self._run(self._inner.state(session_id))

    def report_usage(self, session_id: str, **kw: Any) -> Any:
        return self._run(self._inner.report_usage(session_id, **kw))

    def report_rejection(self, session_id: str, **kw: Any) -> Any:
        return self._run(self._inner.report_rejection(session_id, **kw))

    def history(self, session_id: str, from_version: int = 1) -> Iterator[Any]:
        async def collect() -> list[Any]:
            return [e async for e in self._inner.history(session_id, from_version)]

        return iter(self._run(collect()))

    def __getattr__(self, name: str) -> Any:
        if name not in ("report_usage", "report_rejection"):
            raise AttributeError(name)
        report = getattr(self._inner, name)  # AttributeError when the tracker takes no such report

        def call(session_id: str, **kw: Any) -> Any:
            return self._run(report(session_id, **kw))

        return call


def _context_session(context: Any) -> str | None:
    if isinstance(context, Mapping):
        value = context.get("session_id")
    else:
        value = getattr(context, "session_id", None)
    return value if isinstance(value, str) and value else None


def _trace_group() -> str | None:
    from agents.tracing import get_current_trace

    with contextlib.suppress(Exception):  # no trace, or a no-op trace (tracing disabled)
        group = getattr(get_current_trace(), "group_id", None)
        return group if isinstance(group, str) and group else None
    return None


def _resolve_session(explicit: str | None, sdk_session: Any, context: Any, owner: str) -> str:
    if explicit:
        return explicit
    if sdk_session is not None:
        value = getattr(sdk_session, "session_id", None)
        if isinstance(value, str) and value.strip():
            return value.strip()
    found = _context_session(context) or _trace_group()
    if not found:
        raise InvalidInput(
            "session_id",
            f"{owner} has no session: pass session_id= or session= (the SDK Session), put session_id on the run's "
            "context, or set RunConfig(group_id=...) with tracing on",
        )
    return found


# -- the filter --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Made:
    """A replacement this filter made or adopted: ``items[start:end]`` (digest ``span``) → the summary."""

    rep: Replacement
    span: str


@dataclass
class _Settled:
    """What one call settled: for the hooks (the basis it was observed with)."""

    basis: str
    revision: int


_SETTLED: dict[tuple[str, str], _Settled] = {}  # (session, digest of the sent items) → the basis, newest few
_SETTLED_LOCK = threading.Lock()
_SETTLED_MAX = 4096


def _remember(session: str, items_digest: str, settled: _Settled) -> None:
    with _SETTLED_LOCK:
        _SETTLED.pop((session, items_digest), None)
        _SETTLED[(session, items_digest)] = settled
        while len(_SETTLED) > _SETTLED_MAX:
            _SETTLED.pop(next(iter(_SETTLED)))


def _recall(session: str, items_digest: str) -> _Settled | None:
    with _SETTLED_LOCK:
        return _SETTLED.get((session, items_digest))


@dataclass
class _Call:
    """The model call a filter settled in this task: what the SDK sends next is ``sent``."""

    filter: ContextTrackerFilter
    call: ModelCall
    items: list[Any]
    sent: list[Any]


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("context_tracker_call", default=None)


class _RecoveringModel(Model):
    """An SDK ``Model`` whose call of a filtered input recovers once from a context-length error."""

    def __init__(self, inner: Model, owner: ContextTrackerFilter) -> None:
        self.inner, self.owner = inner, owner

    def _pending(self, input: Any) -> _Call | None:
        pending = _CALL.get()
        if pending is None or pending.filter is not self.owner or not isinstance(input, list):
            return None
        return pending if digest(items_of(input)) == digest(items_of(pending.sent)) else None

    async def get_response(self, system_instructions: str | None, input: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self.inner.get_response(system_instructions, input, *args, **kwargs)
        except Exception as exc:
            pending = self._pending(input)
            retry = await self.owner._recover(pending, exc) if pending is not None else None
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
            pending = self._pending(input)
            retry = await self.owner._recover(pending, exc) if pending is not None else None
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


class ContextTrackerFilter:
    """``RunConfig(call_model_input_filter=ContextTrackerFilter(tracker, model=...))``.

    ``tracker``: an embedded ``Tracker``, a ``TrackerClient`` or an ``AsyncTrackerClient``;
    ``model``: the tracker's registry name of the agent's model. ``summarizer``: a callable
    ``(items, budget_tokens) -> str`` (sync or async; ``items`` are the SDK input items being
    summarised) or an SDK ``Model``; default the agent's own model (an ``Agent.model`` given as a
    name is resolved with ``model_provider``, default the SDK's ``MultiProvider``: if
    ``RunConfig(model=...)`` overrides the agent's model, pass ``summarizer=`` that model).
    ``session_id`` / ``session``: see the module's docstring. ``keep_last``, ``share``,
    ``count_tokens``, ``wait_timeout_s``, ``models_file``: as for
    :class:`~tracker.integrations._compaction.ContextGuard`. ``max_sessions``: how many sessions'
    replacements the filter remembers (the oldest is forgotten first; a forgotten one is adopted back
    from the tracker's history and the ``share`` on its next call).
    """

    def __init__(
        self,
        tracker: TrackerProtocol | Any,
        *,
        model: str,
        session_id: str | None = None,
        summarizer: Any = None,
        session: Any = None,
        model_provider: Any = None,
        max_sessions: int = 1024,
        **options: Unpack[GuardOptions],
    ) -> None:
        if session_id is not None and (not isinstance(session_id, str) or not session_id):
            raise InvalidInput("session_id", f"must be a non-empty string, got {session_id!r}")
        if summarizer is not None and not (isinstance(summarizer, Model) or callable(summarizer)):
            raise InvalidInput(
                "summarizer", f"must be a callable (items, budget_tokens) -> str or an SDK Model, got {summarizer!r}"
            )
        if not isinstance(max_sessions, int) or isinstance(max_sessions, bool) or max_sessions < 1:
            raise InvalidInput("max_sessions", f"must be a positive integer, got {max_sessions!r}")
        self.tracker = tracker
        self._async = _is_async(tracker)
        self._models_file = options.pop("models_file", None)
        self._counter = options.pop("count_tokens", None)
        self._guard_args: dict[str, Any] = {"model": model, **options}
        self._counter_lock = threading.Lock()
        # validates model / keep_last now; an async tracker gets a guard per call, bound to the call's loop
        self.guard = ContextGuard(tracker, count_tokens=self._count, **self._guard_args)
        self.model = model
        self.summarizer = summarizer
        self.session_id = session_id
        self.session = session
        self.model_provider = model_provider
        self._made: dict[str, list[_Made]] = {}
        self._made_lock = threading.Lock()
        self._max_sessions = max_sessions

    # -- the SDK's call ----------------------------------------------------------------------
    async def __call__(self, data: CallModelData[Any]) -> ModelInputData:
        loop = asyncio.get_running_loop()
        session = _resolve_session(self.session_id, self.session, data.context, "the model call")
        agent = data.agent
        raw = list(data.model_data.input)
        instructions = data.model_data.instructions
        tools = await _agent_tools(agent, data.context)
        schema = _output_schema(agent)

        items, revision = self._reapply(session, raw)
        view = view_of(items, instructions, tools, revision=revision, output_schema=schema)

        guard = self.guard if not self._async else self._loop_guard(loop)
        # the SDK items of the view being compacted now (it may hold a summary adopted in this call,
        # which stands for itself: summary_item is summary_input_item's image)
        spans = Spans(guard, view, items, lambda text: {"role": "user", "content": text})

        def summarize(start: int, end: int, budget: int) -> str:
            return self._summarize(spans(start, end), budget, agent, loop)

        call = ModelCall(guard, session, view, summarize)
        out = await asyncio.to_thread(call.settle)  # the tracker's calls block
        sent = self._applied(session, view, items, out.replacements)
        _remember(session, digest(out.view.items), _Settled(out.view.basis(), out.view.revision))
        _CALL.set(_Call(self, call, items, sent))  # for the model wrapper (``wrap_model``), in this run's task
        return ModelInputData(input=sent, instructions=instructions)

    def _applied(self, session: str, view: View, items: list[Any], reps: Sequence[Replacement]) -> list[Any]:
        """The SDK items after ``reps`` (each refers to the history the one before left), each recorded."""
        current = view
        for rep in reps:
            self._record(session, _Made(rep, digest(current.items[rep.start : rep.end])))
            items = items[: rep.start] + [summary_input_item(rep.summary)] + items[rep.end :]
            current = current.apply(rep)
        return items

    async def _recover(self, pending: _Call, exc: BaseException) -> list[Any] | None:
        """The model refused what this filter sent as too long: the compacted input to retry with, or None."""
        call = pending.call
        sent = call.outcome
        out = await asyncio.to_thread(call.recover, exc)
        if out is None or sent is None:
            return None
        retry = self._applied(call.session_id, sent.view, pending.sent, out.replacements[len(sent.replacements) :])
        settled = _Settled(out.view.basis(), out.view.revision)
        _remember(call.session_id, digest(out.view.items), settled)
        _remember(call.session_id, digest(sent.view.items), settled)  # the hooks' call of the refused input got this
        pending.sent = retry
        return retry

    def wrap_model(self, model: Model | str) -> Model:
        """``model`` (an SDK ``Model``, or a name for ``model_provider``) recovering from one context-length error.

        ``Agent(model=tracker_filter.wrap_model(model))``: when the provider refuses the input this filter
        sent as too long, the rejection is reported, the history compacted and the call made once more
        with the compacted input (see :mod:`tracker.integrations._provider`). The filter alone cannot:
        the SDK calls the model after the filter returns, and retries with the same input."""
        if isinstance(model, str):
            provider = self.model_provider
            if provider is None:
                from agents import MultiProvider

                provider = self.model_provider = MultiProvider()
            model = provider.get_model(model)
        if not isinstance(model, Model):
            raise InvalidInput("model", f"must be an SDK Model or a model name, got {model!r}")
        return _RecoveringModel(model, self)

    def _loop_guard(self, loop: asyncio.AbstractEventLoop) -> ContextGuard:
        return ContextGuard(_OnLoop(self.tracker, loop), count_tokens=self._count, **self._guard_args)

    def _count(self, request: dict[str, Any]) -> int:
        """The guard's ``tokens_after`` counter, built once: the tracker's own for an embedded one,
        the model registry (``models_file``) in this process for a remote one."""
        with self._counter_lock:
            if self._counter is None:
                self._counter = default_counter(self.tracker, self.model, self._models_file)
            counter = self._counter
        return counter(request)

    # -- the replacements made so far, re-applied to the SDK's full input each turn ----------
    def _record(self, session: str, made: _Made) -> None:
        with self._made_lock:
            self._made.setdefault(session, []).append(made)
            while len(self._made) > self._max_sessions:
                self._made.pop(next(iter(self._made)))

    def _reapply(self, session: str, raw: list[Any]) -> tuple[list[Any], int]:
        with self._made_lock:
            made = list(self._made.get(session, ()))
        items, revision = raw, 1
        its = items_of(raw)
        for n, m in enumerate(made):
            rep = m.rep
            if rep.end > len(items) or digest(its[rep.start : rep.end]) != m.span:
                with self._made_lock:  # this history is not the one compacted: forget the rest
                    self._made[session] = made[:n]
                break
            items = items[: rep.start] + [summary_input_item(rep.summary)] + items[rep.end :]
            its = its[: rep.start] + items_of([items[rep.start]]) + its[rep.end :]
            revision = rep.revision
        return items, revision

    # -- summaries -----------------------------------------------------------------------------
    def _summarize(self, items: list[Any], budget: int, agent: Agent[Any], loop: asyncio.AbstractEventLoop) -> str:
        """Runs in the worker thread; anything async runs on the agent's own loop, which awaits this thread."""
        summarizer = self.summarizer
        if summarizer is None or isinstance(summarizer, Model):
            model = summarizer if summarizer is not None else self._agent_model(agent)
            prompt = summary_prompt(transcript(items), budget)
            return asyncio.run_coroutine_threadsafe(_ask(model, prompt), loop).result()
        result = summarizer(items, budget)
        if inspect.isawaitable(result):
            return asyncio.run_coroutine_threadsafe(_awaited(result), loop).result()
        return str(result)

    def _agent_model(self, agent: Agent[Any]) -> Model:
        if isinstance(agent.model, Model):
            return agent.model
        provider = self.model_provider
        if provider is None:
            from agents import MultiProvider

            provider = self.model_provider = MultiProvider()
        model: Model = provider.get_model(agent.model)
        return model


async def _agent_tools(agent: Agent[Any], context: Any) -> list[Any]:
    """The tools and handoffs the SDK sends with this agent's model call."""
    wrapper = RunContextWrapper(context=context)
    tools: list[Any] = list(await agent.get_all_tools(wrapper))
    for h in agent.handoffs:
        tools.append(h if isinstance(h, Handoff) else handoff(h))
    return tools


def _output_schema(agent: Agent[Any]) -> str | None:
    if agent.output_type is None or agent.output_type is str:
        return None
    from agents.agent_output import AgentOutputSchema, AgentOutputSchemaBase

    with contextlib.suppress(Exception):  # an output type the SDK cannot describe: it fails the run itself
        output = agent.output_type
        schema = output if isinstance(output, AgentOutputSchemaBase) else AgentOutputSchema(output)
        if schema.is_plain_text():
            return None
        return json_text(schema.json_schema())
    return None


async def _ask(model: Model, prompt: str) -> str:
    response = await model.get_response(
        None,
        [{"role": "user", "content": prompt}],
        ModelSettings(),
        [],
        None,
        [],
        ModelTracing.DISABLED,
        previous_response_id=None,
        conversation_id=None,
        prompt=None,
    )
    texts = [
        str(getattr(part, "text", ""))
        for out in response.output
        if getattr(out, "type", None) == "message"
        for part in getattr(out, "content", None) or []
        if getattr(part, "type", None) == "output_text"
    ]
    return "".join(texts)


async def _awaited(value: Awaitable[str]) -> str:
    return str(await value)


# -- the usage hooks ---------------------------------------------------------------------------


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


class ContextTrackerHooks(RunHooks[Any]):
    """``Runner.run(..., hooks=ContextTrackerHooks(tracker, model=...))``: the usage of every LLM call.

    ``on_llm_start`` notes the request the model is sent (and, from the
    :class:`ContextTrackerFilter` that settled it, the basis it was observed with: ``r<revision>:h<digest>``;
    without the filter, ``r1:h<digest>`` for a history holding no summary); ``on_llm_end`` takes the
    response's ``Usage`` (input, cached input, output and reasoning tokens), records an
    :class:`LLMUsage` in ``usages`` (the newest ``keep`` of them) and reports it:
    ``tracker.report_usage(session_id, basis=..., input_tokens=<input - cached>, cache_read_tokens=<cached>,
    output_tokens=...)`` (the SDK's ``input_tokens`` counts the cached tokens; the tracker's does not).
    A call the filter's :meth:`~ContextTrackerFilter.wrap_model` retried after a context-length error
    is reported on the basis of the compacted input it sent. A report that fails is logged, never
    raised into the run; a tracker without ``report_usage`` is sent nothing.
    """

    def __init__(
        self,
        tracker: TrackerProtocol | Any,
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
        self._pending: weakref.WeakKeyDictionary[Any, list[tuple[str, str, str | None]]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    @property
    def reports_usage(self) -> bool:
        """Whether the tracker takes usage reports (``report_usage``)."""
        return callable(getattr(self.tracker, "report_usage", None))

    async def on_llm_start(
        self, context: RunContextWrapper[Any], agent: Agent[Any], system_prompt: str | None, input_items: list[Any]
    ) -> None:
        session = _resolve_session(self.session_id, self.session, context.context, "the LLM call")
        items = items_of(input_items)
        d = digest(items)
        settled = _recall(session, d)
        if settled is not None:
            basis: str | None = settled.basis
        elif not any(SUMMARY_PREFIX in json_text(m.get("content")) for it in items for m in it.messages):
            basis = View(system=None, items=items).basis()
        else:
            basis = None  # a compacted history this process did not settle: its revision is unknown here
        with self._lock:
            self._pending.setdefault(context, []).append((session, d, basis))

    async def on_llm_end(self, context: RunContextWrapper[Any], agent: Agent[Any], response: ModelResponse) -> None:
        with self._lock:
            pending = self._pending.get(context) or []
            if pending:
                session, d, basis = pending.pop(0)
                settled = _recall(session, d)  # a retried call: the basis of the input it sent in the end
                basis = settled.basis if settled is not None else basis
            else:
                session, basis = _resolve_session(self.session_id, self.session, context.context, "the LLM call"), None
        u = response.usage
        details = getattr(u, "input_tokens_details", None)
        cached = getattr(details, "cached_tokens", 0) or 0
        written = getattr(details, "cache_write_tokens", 0) or 0
        reasoning = getattr(getattr(u, "output_tokens_details", None), "reasoning_tokens", 0) or 0
        usage = LLMUsage(
            session_id=session,
            model=self.model,
            basis=basis,
            input_tokens=int(u.input_tokens),
            output_tokens=int(u.output_tokens),
            cached_input_tokens=int(cached),
            reasoning_tokens=int(reasoning),
            total_tokens=int(u.total_tokens),
            requests=int(u.requests),
            response_id=response.response_id,
            agent=getattr(agent, "name", None),
            cache_write_tokens=int(written),
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
        kwargs = report_usage_kwargs(usage.basis, billed)
        try:
            if inspect.iscoroutinefunction(report):
                await report(usage.session_id, **kwargs)
            else:
                await asyncio.to_thread(report, usage.session_id, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a usage report never breaks the agent's run
            log.warning("session %s: usage report failed: %s: %s", usage.session_id, type(exc).__name__, exc)
