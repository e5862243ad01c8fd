"""``ContextTrackerFilter``: the Agents SDK's ``call_model_input_filter``, settling each model input with the tracker."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Unpack

from agents import Agent, Model, ModelSettings, RunContextWrapper
from agents.handoffs import Handoff, handoff
from agents.models.interface import ModelTracing
from agents.run_config import CallModelData, ModelInputData

from tracker.errors import InvalidInput
from tracker.integrations._provider import ModelCall
from tracker.integrations.compaction import (
    ContextGuard,
    GuardOptions,
    Replacement,
    Spans,
    View,
    digest,
    drive_async,
    replaced,
    summarize_with,
    summary_prompt,
)
from tracker.integrations.openai_agents.items import items_of, json_text, summary_input_item, transcript, view_of
from tracker.integrations.openai_agents.model import PENDING, Pending, RecoveringModel
from tracker.protocol import AsyncTrackerProtocol, TrackerProtocol

# -- the session -------------------------------------------------------------------------------


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


def resolve_session(explicit: str | None, sdk_session: Any, context: Any, owner: str) -> str:
    """The session id: ``session_id=``, the SDK ``Session``'s, the run context's, the trace's group (in order)."""
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


class ContextTrackerFilter:
    """``RunConfig(call_model_input_filter=ContextTrackerFilter(tracker, model=...))``.

    ``tracker``: an embedded ``Tracker``, a ``TrackerClient`` or an ``AsyncTrackerClient``;
    ``model``: the tracker's registry name of the agent's model. ``summarizer``: a callable
    ``(items, budget_tokens) -> str`` (sync or async; ``items`` are the SDK input items being
    summarised) or an SDK ``Model``; default the agent's own model (an ``Agent.model`` given as a
    name is resolved with ``model_provider``, default the SDK's ``MultiProvider``: if
    ``RunConfig(model=...)`` overrides the agent's model, pass ``summarizer=`` that model).
    ``session_id`` / ``session``: see the package's docstring. ``keep_last``, ``share``,
    ``count_tokens``, ``wait_timeout_s``, ``models_file``: as for
    :class:`~tracker.integrations.compaction.ContextGuard`. ``max_sessions``: how many sessions'
    replacements the filter remembers (the oldest is forgotten first; a forgotten one is adopted back
    from the tracker's history and the ``share`` on its next call).
    """

    def __init__(
        self,
        tracker: TrackerProtocol | AsyncTrackerProtocol | Any,
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
        self.guard = ContextGuard(tracker, model=model, **options)
        self.tracker = tracker
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
        session = resolve_session(self.session_id, self.session, data.context, "the model call")
        agent = data.agent
        instructions = data.model_data.instructions
        tools = await _agent_tools(agent, data.context)
        items, revision = self._reapply(session, list(data.model_data.input))
        view = view_of(items, instructions, tools, revision=revision, output_schema=_output_schema(agent))
        # the SDK items of the view being compacted (it may hold a summary adopted in this call,
        # which stands for itself: summary_item is summary_input_item's image)
        spans = Spans(view, items, lambda text: {"role": "user", "content": text})
        call = ModelCall(self.guard, session, view, summarize_with(self._asking(agent), spans))
        out = await drive_async(call.effects, call.settle())
        sent = self._applied(session, view, items, out.replacements)
        PENDING.set(Pending(self, call, sent, digest(out.view.items)))  # for wrap_model and the hooks, in this task
        return ModelInputData(input=sent, instructions=instructions)

    def _applied(self, session: str, view: View, items: list[Any], reps: Sequence[Replacement]) -> list[Any]:
        """The SDK items after ``reps`` (each refers to the history the one before left), each recorded."""
        current = view
        for rep in reps:
            self._record(session, _Made(rep, digest(current.items[rep.start : rep.end])))
            current = current.apply(rep)
        return replaced(items, reps, lambda rep, _span: summary_input_item(rep.summary))

    async def recover(self, pending: Pending, exc: BaseException) -> list[Any] | None:
        """The model refused what this filter sent as too long: the compacted input to retry with, or None."""
        call = pending.call
        sent = call.outcome
        out = await drive_async(call.effects, call.recover(exc))
        if out is None or sent is None:
            return None
        pending.sent = self._applied(
            call.session_id, sent.view, pending.sent, out.replacements[len(sent.replacements) :]
        )
        return pending.sent

    def wrap_model(self, model: Model | str) -> Model:
        """``model`` (an SDK ``Model``, or a name for ``model_provider``) recovering from one context-length error.

        ``Agent(model=tracker_filter.wrap_model(model))``: when the provider refuses the input this filter
        sent as too long, the rejection is reported, the history compacted and the call made once more
        with the compacted input (see :mod:`tracker.integrations._provider`). The filter alone cannot:
        the SDK calls the model after the filter returns, and retries with the same input."""
        if isinstance(model, str):
            model = self._provider().get_model(model)
        if not isinstance(model, Model):
            raise InvalidInput("model", f"must be an SDK Model or a model name, got {model!r}")
        return RecoveringModel(model, self)

    def _provider(self) -> Any:
        if self.model_provider is None:
            from agents import MultiProvider

            self.model_provider = MultiProvider()
        return self.model_provider

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
    def _asking(self, agent: Agent[Any]) -> Callable[[list[Any], int], Any]:
        """The summariser as ``(items, budget) -> text``: a callable as it is; an SDK ``Model`` (or, with
        none given, the agent's own) is asked the summary prompt."""
        summarizer = self.summarizer
        if summarizer is not None and not isinstance(summarizer, Model):
            return summarizer

        async def ask(items: list[Any], budget: int) -> str:
            model = summarizer if summarizer is not None else self._agent_model(agent)
            return await _ask(model, summary_prompt(transcript(items), budget))

        return ask

    def _agent_model(self, agent: Agent[Any]) -> Model:
        if isinstance(agent.model, Model):
            return agent.model
        model: Model = self._provider().get_model(agent.model)
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
