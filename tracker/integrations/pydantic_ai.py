"""pydantic-ai: ``ContextTrackerCapability``, a capability that is also a history processor.

::

    from tracker import Tracker
    from tracker.integrations.pydantic_ai import ContextTrackerCapability

    tracker = Tracker.from_settings()
    agent = Agent(model, capabilities=[ContextTrackerCapability(tracker, model="gpt-4o")])

As a capability (``capabilities=[...]``) its ``before_model_request`` hook sees the complete
request — system prompt parts, the instructions, the history and the tool definitions — and
observes it on the session (``session_id=``, else the run's ``conversation_id``). The same
object is a history processor ``(ctx, messages) -> messages``: pydantic-ai 2 takes it as
``capabilities=[ProcessHistory(processor)]`` (1.x: ``history_processors=[processor]``); a
history processor is not shown the tools or the instructions, so only the messages are
counted that way — prefer the capability.

On ``compact`` the older messages are summarised by ``summarizer`` (a callable
``(messages, budget_tokens) -> str``, sync or async, or a pydantic-ai ``Agent``; default the
run's own model) and replaced, in the request and in the run's history (``ctx.messages``), by
one ``ModelRequest`` carrying the system prompt parts and the summary, whose
``metadata["context_tracker"]["revision"]`` is the history's new revision. On ``wait`` it waits;
``ContextLimitError`` propagates to the caller of ``agent.run``. See
:mod:`tracker.integrations.compaction` for the whole protocol.

As a capability it also closes the loop with the provider (:mod:`tracker.integrations._provider`):
``after_model_request`` reports each response's ``RequestUsage`` (``tracker.report_usage``, on the
basis the request was observed with; pydantic-ai's ``input_tokens`` includes the cache reads and
writes, so the tracker is sent ``input_tokens - cache_read_tokens - cache_write_tokens`` beside
them), and ``on_model_request_error`` takes a provider's context-length error
(``ModelContextWindowExceededError``, or a message such as ``prompt is too long: ...``): it is reported
(``tracker.report_rejection``), the history compacted, and the request attempted once more
(``RetryModelRequest``; ``prepare_model_request`` sends the compacted history). A second failure
propagates; a report that fails is logged. A history processor sees no responses: it only observes.

``tracker`` may be sync (``Tracker``, ``TrackerClient``: its calls run in a worker thread) or async
(``AsyncTrackerClient``: awaited on the run's loop).
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Unpack

from pydantic_ai import RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.exceptions import RetryModelRequest
from pydantic_ai.messages import (
    BinaryContent,
    ImageUrl,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    SystemPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)

from tracker.errors import InvalidInput
from tracker.integrations._adapter import Guarded, compacted
from tracker.integrations._provider import ModelCall, Usage
from tracker.integrations.compaction import GuardOptions, Item, View, drive_async, marked_revision, summary_prompt
from tracker.integrations.compaction.view import summary_mark, summary_text
from tracker.protocol import AsyncTrackerProtocol, TrackerProtocol

__all__ = ["ContextTrackerCapability", "message_item", "summary_message", "to_request", "usage_of"]


# -- pydantic-ai messages → the tracker's request shape ----------------------------------------


def _user_content(content: Any) -> Any:
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for c in content:
        if isinstance(c, str):
            parts.append({"type": "text", "text": c})
        elif isinstance(c, ImageUrl):
            parts.append({"type": "image", "source": {"type": "url", "url": c.url}})
        elif isinstance(c, BinaryContent) and c.is_image:
            parts.append(
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": c.media_type, "data": base64.b64encode(c.data).decode()},
                }
            )
        else:  # documents, audio, video, cache points: counted as their description (conservative)
            parts.append({"type": "text", "text": repr(c)})
    return parts


# Parts that record changes of instructions, tools or settings: what they record is counted from the
# request parameters (instruction parts, tool definitions), not from the history.
_BOOKKEEPING_PARTS = frozenset(
    {
        "InstructionDeltaPart",
        "InstructionBaselinePart",
        "ToolAvailabilityDeltaPart",
        "CapabilityLoadDeltaPart",
        "ModelSettingsDeltaPart",
    }
)


def message_item(m: ModelMessage) -> Item:
    """One pydantic-ai message as the tracker's request message(s); system prompt parts are left out
    (they are the request's ``system``)."""
    if isinstance(m, ModelResponse):
        content: list[dict[str, Any]] = []
        calls: set[str] = set()
        for rp in m.parts:
            if isinstance(rp, TextPart):
                content.append({"type": "text", "text": rp.content})
            elif isinstance(rp, ToolCallPart):
                content.append(
                    {"type": "tool_call", "id": rp.tool_call_id, "name": rp.tool_name, "arguments": rp.args_as_dict()}
                )
                calls.add(rp.tool_call_id)
            else:  # thinking, native tool calls and returns, files: their content as JSON text (conservative)
                content.append({"type": "text", "text": json.dumps(getattr(rp, "content", repr(rp)), default=str)})
        return Item(({"role": "assistant", "content": content},), calls=frozenset(calls))
    out: list[dict[str, Any]] = []
    results: set[str] = set()
    for p in m.parts:
        if isinstance(p, SystemPromptPart) or type(p).__name__ in _BOOKKEEPING_PARTS:
            continue
        if isinstance(p, UserPromptPart):
            out.append({"role": "user", "content": _user_content(p.content)})
        elif isinstance(p, RetryPromptPart):
            if p.tool_name is not None:
                out.append(
                    {"role": "tool", "tool_call_id": p.tool_call_id, "content": p.model_response(), "is_error": True}
                )
                results.add(p.tool_call_id)
            else:
                out.append({"role": "user", "content": p.model_response()})
        elif isinstance(p, ToolReturnPart) or (hasattr(p, "tool_call_id") and hasattr(p, "model_response_str")):
            call_id = str(getattr(p, "tool_call_id"))  # noqa: B009 - duck-typed tool returns
            out.append({"role": "tool", "tool_call_id": call_id, "content": getattr(p, "model_response_str")()})  # noqa: B009
            results.add(call_id)
        elif hasattr(p, "model_response"):  # feedback about an unusable response
            out.append({"role": "user", "content": str(getattr(p, "model_response")())})  # noqa: B009
        else:
            text = getattr(p, "content", None)
            out.append({"role": "user", "content": text if isinstance(text, str) else repr(p)})
    return Item(tuple(out), results=frozenset(results))


def _system(messages: Sequence[ModelMessage], instructions: Sequence[str]) -> list[dict[str, Any]]:
    parts = [
        {"type": "text", "text": p.content}
        for m in messages
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, SystemPromptPart)
    ]
    return parts + [{"type": "text", "text": text} for text in instructions if text]


def _tool(t: Any) -> dict[str, Any]:
    return {"name": t.name, "description": t.description or "", "input_schema": t.parameters_json_schema}


def revision_of(messages: Sequence[ModelMessage]) -> int:
    """The history's revision: the one written on its newest summary message, else 1."""
    return marked_revision(getattr(m, "metadata", None) for m in messages)


def view_of(messages: Sequence[ModelMessage], instructions: Sequence[str] = (), tools: Sequence[Any] = ()) -> View:
    return View(
        system=_system(messages, instructions) or None,
        items=tuple(message_item(m) for m in messages),
        tools=tuple(_tool(t) for t in tools),
        revision=revision_of(messages),
    )


def to_request(
    messages: Sequence[ModelMessage], instructions: Sequence[str] = (), tools: Sequence[Any] = ()
) -> dict[str, Any]:
    """The complete request (tracker shape): messages, instruction texts and ``ToolDefinition`` s."""
    return view_of(messages, instructions, tools).request()


def summary_message(text: str, revision: int, system_parts: Sequence[SystemPromptPart] = ()) -> ModelRequest:
    """The message a summary becomes: the system prompt parts it displaced, then the summary."""
    return ModelRequest(parts=[*system_parts, UserPromptPart(summary_text(text))], metadata=summary_mark(revision))


def _transcript(messages: Sequence[ModelMessage]) -> str:
    lines = []
    for m in messages:
        for d in message_item(m).messages:
            content = d.get("content")
            text = content if isinstance(content, str) else json.dumps(content, default=str)
            lines.append(f"{d['role']}: {text}")
    return "\n".join(lines)


# -- the capability / history processor --------------------------------------------------------


class ContextTrackerCapability(AbstractCapability[Any], Guarded):
    """Observe every model request with the tracker; compact, wait or stop as it decides.

    ``tracker``: an embedded ``Tracker``, a ``TrackerClient`` or an ``AsyncTrackerClient``; ``model``:
    the tracker's registry name of the agent's model. ``summarizer``: a callable ``(messages,
    budget_tokens) -> str`` (sync or async) or a pydantic-ai ``Agent``; default the run's own model.
    ``keep_last``, ``share``, ``count_tokens``, ``wait_timeout_s``, ``models_file``: as for
    :class:`~tracker.integrations.compaction.ContextGuard`.
    """

    def __init__(
        self,
        tracker: TrackerProtocol | AsyncTrackerProtocol,
        *,
        model: str,
        summarizer: Any = None,
        session_id: str | None = None,
        **options: Unpack[GuardOptions],
    ) -> None:
        self._guarded(tracker, model, summarizer, session_id, options)
        self._steps: dict[tuple[str, int], _Step] = {}
        self._lock = threading.Lock()

    @classmethod
    def get_serialization_name(cls) -> str | None:
        return None  # holds a tracker: not spec-serializable

    # -- as a capability ---------------------------------------------------------------------
    async def before_model_request(self, ctx: RunContext[Any], request_context: Any) -> Any:
        params = request_context.model_request_parameters
        instructions = [p.content for p in (params.instruction_parts or [])]
        tools = [*params.function_tools, *params.output_tools]
        messages = list(request_context.messages)
        call = self._call(ctx, messages, instructions, tools, request_context.model)
        out = await drive_async(call.effects, call.settle())
        step = _Step(call, messages)
        self._remember(ctx, step)
        new = compacted(messages, out, _summary)
        if new is not None:
            step.sending = new
            request_context.messages = list(new)
            ctx.messages[:] = new
        return request_context

    async def prepare_model_request(self, ctx: RunContext[Any], request_context: Any) -> Any:
        """Each attempt starts from the request ``before_model_request`` left: a retry sends the compacted one."""
        step = self._steps.get(_step_key(ctx))
        if step is not None and step.retrying:
            request_context.messages = list(step.sending or step.messages)
        return request_context

    async def on_model_request_error(self, ctx: RunContext[Any], *, request_context: Any, error: Exception) -> Any:
        """A context-length error: report it, compact, and make one more attempt (``RetryModelRequest``)."""
        key = _step_key(ctx)
        step = self._steps.get(key)
        if step is None:
            raise error
        try:
            out = await drive_async(step.call.effects, step.call.recover(error))
        except BaseException:
            self._steps.pop(key, None)
            raise
        if out is None:
            self._steps.pop(key, None)
            raise error
        new = compacted(step.messages, out, _summary)
        step.sending, step.retrying = new, True
        if new is not None:
            ctx.messages[:] = new
        raise RetryModelRequest() from error

    async def after_model_request(self, ctx: RunContext[Any], *, request_context: Any, response: ModelResponse) -> Any:
        """Report the response's usage (``RequestUsage``) on the basis of the request that got it."""
        step = self._steps.pop(_step_key(ctx), None)
        if step is not None:
            await drive_async(step.call.effects, step.call.succeeded(response, usage_of))
        return response

    # -- as a history processor ----------------------------------------------------------------
    async def __call__(self, ctx: RunContext[Any], messages: list[ModelMessage]) -> list[ModelMessage]:
        messages = list(messages)
        call = self._call(ctx, messages, (), (), ctx.model)
        out = await drive_async(call.effects, call.settle())
        new = compacted(messages, out, _summary)
        return messages if new is None else new

    # -- work ------------------------------------------------------------------------------
    def _session(self, ctx: RunContext[Any]) -> str:
        session = self.session_id or getattr(ctx, "conversation_id", None) or getattr(ctx, "run_id", None)
        if not session:
            raise InvalidInput("session_id", "the run has no conversation_id: pass session_id= to the capability")
        return str(session)

    def _remember(self, ctx: RunContext[Any], step: _Step) -> None:
        with self._lock:
            self._steps[_step_key(ctx)] = step
            while len(self._steps) > _STEPS_MAX:  # steps whose call never ended (a cancelled run)
                self._steps.pop(next(iter(self._steps)))

    def _call(
        self,
        ctx: RunContext[Any],
        messages: list[ModelMessage],
        instructions: Sequence[str],
        tools: Sequence[Any],
        model: Any,
    ) -> ModelCall:
        """The model call: observe (and compact / wait / adopt), report usage, recover from one rejection."""
        view = view_of(messages, instructions, tools)

        def stand_in(text: str) -> ModelMessage:
            return ModelRequest(parts=[UserPromptPart(text)])

        return self._model_call(self._session(ctx), view, messages, stand_in, self._asking(model))

    def _asking(self, model: Any) -> Callable[[list[ModelMessage], int], Any]:
        """The summariser as ``(messages, budget) -> text``: a callable as it is; a pydantic-ai ``Agent``
        runs the summary prompt; none asks the run's own model (``pydantic_ai.direct.model_request``)."""
        summarizer = self.summarizer
        if summarizer is not None and not (hasattr(summarizer, "run") and hasattr(summarizer, "run_sync")):
            return summarizer

        async def ask(messages: list[ModelMessage], budget: int) -> str:
            prompt = summary_prompt(_transcript(messages), budget)
            if summarizer is not None:  # a pydantic-ai Agent
                return str((await summarizer.run(prompt)).output)
            from pydantic_ai.direct import model_request

            reply = await model_request(model, [ModelRequest(parts=[UserPromptPart(prompt)])])
            return "".join(p.content for p in reply.parts if isinstance(p, TextPart))

        return ask


_STEPS_MAX = 4096


@dataclass
class _Step:
    """One request step of a run: its model call, the history it began with, what it sends."""

    call: ModelCall
    messages: list[ModelMessage]
    sending: list[ModelMessage] | None = None  # the compacted history, when compacted
    retrying: bool = False


def _step_key(ctx: RunContext[Any]) -> tuple[str, int]:
    return (str(ctx.run_id) if ctx.run_id is not None else f"ctx-{id(ctx)}", ctx.run_step)


def _summary(rep: Any, span: list[ModelMessage]) -> ModelMessage:
    """A replacement's summary message: with the system prompt parts of the span it replaced."""
    system_parts = [p for m in span if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, SystemPromptPart)]
    return summary_message(rep.summary, rep.revision, system_parts)


def usage_of(response: ModelResponse) -> Usage | None:
    """The usage of a model response: its ``RequestUsage``, whose ``input_tokens`` includes the cache
    reads and writes (pydantic-ai's convention, for every provider): they are taken out of it. A
    response that omitted usage (``unmeasured_requests``) reports nothing."""
    u = response.usage
    if getattr(u, "unmeasured_requests", 0):
        return None
    return Usage.inclusive(
        u.input_tokens,
        output_tokens=u.output_tokens,
        cache_read_tokens=u.cache_read_tokens,
        cache_write_tokens=u.cache_write_tokens,
    )
