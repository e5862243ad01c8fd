"""LangChain v1: ``ContextTrackerMiddleware`` for ``create_agent(..., middleware=[...])``.

::

    from tracker import Tracker
    from tracker.integrations.langchain import ContextTrackerMiddleware

    tracker = Tracker.from_settings()
    agent = create_agent(model, tools, middleware=[ContextTrackerMiddleware(tracker, model="gpt-4o")])
    agent.invoke({"messages": [...]}, config={"configurable": {"thread_id": "session-42"}})

Before every model call (``wrap_model_call``) the complete request — system message, the
messages and the bound tools — is observed on the session (``session_id=``, else the run's
``thread_id``). On ``compact`` the older history is summarised by ``summarizer`` (a chat model,
or a callable ``(messages, budget_tokens) -> str``; default: the agent's own model), the model
is called with the compacted history, and the agent state's messages are replaced
(``RemoveMessage(REMOVE_ALL_MESSAGES)`` then the compacted history, as LangChain's own
``SummarizationMiddleware`` does); the summary is a ``HumanMessage`` whose
``additional_kwargs["context_tracker"]["revision"]`` is the history's new revision. On ``wait`` it
waits, on ``ContextLimitError`` it raises to the caller of ``invoke``; see
:mod:`tracker.integrations.compaction` for the whole protocol.

After every model call the reply's ``usage_metadata`` is reported (``tracker.report_usage``, on the
basis the request was observed with; LangChain's ``input_tokens`` includes the cached tokens, so the
tracker is sent ``input_tokens - cache_read - cache_creation`` beside the two cache counts). A
provider's context-length error (``openai.BadRequestError`` ``context_length_exceeded``, Anthropic's
``prompt is too long: ...``) is reported (``tracker.report_rejection``), the history compacted and
the call retried once; see :mod:`tracker.integrations._provider`. A report that fails is logged.

``tracker`` may be sync (``Tracker``, ``TrackerClient``: both ``invoke`` and ``ainvoke``) or async
(``AsyncTrackerClient``: ``ainvoke``; its calls are awaited on the agent's loop).

Put it last in ``middleware=[...]`` (innermost) so it observes exactly what reaches the model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Unpack

from langchain.agents.middleware.types import (
    AgentMiddleware,
    ExtendedModelResponse,
    ModelRequest,
    ModelResponse,
)
from langchain_core.messages import (
    AIMessage,
    AnyMessage,
    BaseMessage,
    HumanMessage,
    RemoveMessage,
    SystemMessage,
    ToolMessage,
    get_buffer_string,
)
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.graph.message import REMOVE_ALL_MESSAGES
from langgraph.types import Command

from tracker.errors import InvalidInput
from tracker.integrations._adapter import Guarded, compacted
from tracker.integrations._provider import ModelCall, Usage, call_async, call_sync
from tracker.integrations.compaction import GuardOptions, Item, Outcome, View, marked_revision, summary_prompt
from tracker.integrations.compaction.view import summary_mark, summary_text
from tracker.protocol import AsyncTrackerProtocol, TrackerProtocol

__all__ = ["ContextTrackerMiddleware", "message_item", "summary_message", "to_request", "usage_of"]

Summarizer = Any  # a BaseChatModel / Runnable, or Callable[[list[BaseMessage], int], str | Awaitable[str]]


# -- LangChain messages → the tracker's request shape ------------------------------------------


def _block(block: Any, role: str) -> dict[str, Any] | None:
    if isinstance(block, str):
        return {"type": "text", "text": block}
    if not isinstance(block, dict):
        return {"type": "text", "text": str(block)}
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "text": str(block.get("text", ""))}
    if kind == "image_url":
        return {"type": "image_url", "image_url": block.get("image_url")}
    if kind == "image":  # LangChain v1 standard block: url or base64 data
        if block.get("url"):
            return {"type": "image", "source": {"type": "url", "url": block["url"]}}
        data = block.get("base64") or block.get("data")
        if data:
            return {
                "type": "image",
                "source": {"type": "base64", "media_type": block.get("mime_type", "image/png"), "data": data},
            }
    if kind in ("tool_call", "tool_use", "function_call") and role == "assistant":
        return None  # the message's tool_calls carry these
    # anything else (reasoning, files, provider blocks) counts as its JSON text: conservative
    return {"type": "text", "text": json.dumps(block, sort_keys=True, default=str)}


def _content(content: Any, role: str) -> Any:
    if content is None or isinstance(content, str):
        return content or ""
    parts = [p for p in (_block(b, role) for b in content) if p is not None]
    return parts


def _call_id(call: Any, index: int) -> str:
    if call.get("id"):
        return str(call["id"])
    raw = json.dumps([call.get("name"), call.get("args")], sort_keys=True, default=str)
    return f"call-{index}-{hashlib.sha256(raw.encode()).hexdigest()[:12]}"


def message_item(m: BaseMessage, *, pinned: bool = False) -> Item:
    """One LangChain message as the tracker's request message(s), with the tool calls it makes/answers."""
    if isinstance(m, SystemMessage):
        return Item(({"role": "system", "content": _content(m.content, "system")},), pinned=pinned)
    if isinstance(m, ToolMessage):
        msg: dict[str, Any] = {
            "role": "tool",
            "tool_call_id": str(m.tool_call_id),
            "content": _content(m.content, "tool"),
        }
        if getattr(m, "status", None) == "error":
            msg["is_error"] = True
        return Item((msg,), results=frozenset({str(m.tool_call_id)}))
    if isinstance(m, AIMessage):
        msg = {"role": "assistant", "content": _content(m.content, "assistant")}
        calls = []
        for i, tc in enumerate(m.tool_calls or []):
            calls.append(
                {
                    "id": _call_id(tc, i),
                    "type": "function",
                    "function": {
                        "name": tc["name"],
                        "arguments": json.dumps(tc.get("args") or {}, sort_keys=True, default=str),
                    },
                }
            )
        if calls:
            msg["tool_calls"] = calls
        return Item((msg,), calls=frozenset(str(c["id"]) for c in calls))
    role = "user" if isinstance(m, HumanMessage) else {"ai": "assistant", "system": "system"}.get(m.type, "user")
    return Item(({"role": role, "content": _content(m.content, role)},))


def _tool(t: Any) -> dict[str, Any]:
    if isinstance(t, dict) and (isinstance(t.get("function"), dict) or "input_schema" in t or "parameters" in t):
        return t
    return convert_to_openai_tool(t)


def revision_of(messages: Sequence[BaseMessage]) -> int:
    """The history's revision: the one written on its newest summary message, else 1."""
    return marked_revision(getattr(m, "additional_kwargs", None) for m in messages)


def view_of(messages: Sequence[BaseMessage], system: BaseMessage | None = None, tools: Sequence[Any] = ()) -> View:
    items = []
    leading = True
    for m in messages:
        leading = leading and isinstance(m, SystemMessage)
        items.append(message_item(m, pinned=leading))
    sys = _content(system.content, "system") if system is not None else None
    return View(system=sys, items=tuple(items), tools=tuple(_tool(t) for t in tools), revision=revision_of(messages))


def to_request(
    messages: Sequence[BaseMessage], system: BaseMessage | None = None, tools: Sequence[Any] = ()
) -> dict[str, Any]:
    """The complete request (tracker shape) LangChain sends for these messages, system message and tools."""
    return view_of(messages, system, tools).request()


def summary_message(text: str, revision: int) -> HumanMessage:
    """The message a summary becomes in the agent state."""
    return HumanMessage(content=summary_text(text), additional_kwargs=summary_mark(revision))


def _summary(rep: Any, _span: list[AnyMessage]) -> AnyMessage:
    return summary_message(rep.summary, rep.revision)


# -- the middleware ------------------------------------------------------------------------------


class ContextTrackerMiddleware(AgentMiddleware, Guarded):
    """Observe every model call with the tracker; compact, wait or stop as it decides.

    ``tracker``: an embedded ``Tracker``, a ``TrackerClient`` or an ``AsyncTrackerClient``; ``model``:
    the tracker's registry name of the agent's model. ``summarizer``: a chat model, or a callable
    ``(messages, budget_tokens) -> str`` (may be async); default the agent's own model.
    ``keep_last``: entries always kept verbatim at the end (moved so a tool call and its
    results stay together). ``share``: where a compaction is published for other processes on
    the same session (:class:`~tracker.integrations.RedisShare` across machines); default
    in-process. ``count_tokens``: how ``tokens_after`` is counted (default: the tracker's own
    counter, see :func:`~tracker.integrations.default_counter`); ``wait_timeout_s``, ``models_file``:
    as for :class:`~tracker.integrations.compaction.ContextGuard`.
    """

    def __init__(
        self,
        tracker: TrackerProtocol | AsyncTrackerProtocol,
        *,
        model: str,
        summarizer: Summarizer | None = None,
        session_id: str | None = None,
        **options: Unpack[GuardOptions],
    ) -> None:
        super().__init__()
        self._guarded(tracker, model, summarizer, session_id, options)

    @property
    def name(self) -> str:
        return "ContextTrackerMiddleware"

    # -- hooks -------------------------------------------------------------------------------
    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]) -> Any:
        messages = list(request.messages)
        call = self._call(request, messages, asynchronous=False)
        out, response = call_sync(call, lambda out: handler(_sending(request, messages, out)), usage_of)
        return _answer(response, messages, out)

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
    ) -> Any:
        messages = list(request.messages)
        call = self._call(request, messages, asynchronous=True)
        out, response = await call_async(call, lambda out: handler(_sending(request, messages, out)), usage_of)
        return _answer(response, messages, out)

    # -- work ------------------------------------------------------------------------------
    def _session(self, request: ModelRequest) -> str:
        if self.session_id:
            return self.session_id
        info = getattr(getattr(request, "runtime", None), "execution_info", None)
        thread_id = getattr(info, "thread_id", None)
        if not thread_id:
            try:
                from langgraph.config import get_config

                thread_id = (get_config().get("configurable") or {}).get("thread_id")
            except RuntimeError:
                thread_id = None
        if not thread_id:
            raise InvalidInput(
                "session_id",
                "no thread_id in the run's config: pass session_id= to the middleware "
                "or config={'configurable': {'thread_id': ...}} to invoke",
            )
        return str(thread_id)

    def _call(self, request: ModelRequest, messages: list[AnyMessage], *, asynchronous: bool) -> ModelCall:
        """The model call: observe (and compact / wait / adopt), report usage, recover from one rejection."""
        view = view_of(messages, request.system_message, request.tools)
        summarizer = _asking(self.summarizer if self.summarizer is not None else request.model, asynchronous)
        return self._model_call(self._session(request), view, messages, lambda text: HumanMessage(text), summarizer)


def _asking(summarizer: Summarizer, asynchronous: bool) -> Callable[[list[AnyMessage], int], Any]:
    """A chat model (any Runnable) as a summariser ``(messages, budget) -> text``: ``ainvoke`` on the
    async path, ``invoke`` on the sync one; a callable is used as it is."""
    if not hasattr(summarizer, "invoke"):
        return summarizer

    def prompt(messages: list[AnyMessage], budget: int) -> list[BaseMessage]:
        return [HumanMessage(content=summary_prompt(get_buffer_string(messages), budget))]

    if asynchronous:

        async def ask(messages: list[AnyMessage], budget: int) -> str:
            return _reply_text(await summarizer.ainvoke(prompt(messages, budget)))

        return ask
    return lambda messages, budget: _reply_text(summarizer.invoke(prompt(messages, budget)))


def _reply_text(reply: Any) -> str:
    return reply if isinstance(reply, str) else str(reply.text)


def _sending(request: ModelRequest, messages: list[AnyMessage], out: Outcome) -> ModelRequest:
    new = compacted(messages, out, _summary)
    return request if new is None else request.override(messages=new)


def _answer(response: Any, messages: list[AnyMessage], out: Outcome) -> Any:
    new = compacted(messages, out, _summary)
    return response if new is None else _replacing(response, new)


def _ai_message(response: Any) -> AIMessage | None:
    if isinstance(response, ExtendedModelResponse):
        response = response.model_response
    if isinstance(response, AIMessage):
        return response
    found = [m for m in getattr(response, "result", None) or () if isinstance(m, AIMessage)]
    return found[-1] if found else None


def usage_of(response: Any) -> Usage | None:
    """The usage of a model response: its ``AIMessage``'s ``usage_metadata``.

    LangChain's ``input_tokens`` is the sum of all input token types (langchain-core's
    ``UsageMetadata``), cached ones included: ``input_token_details.cache_read`` and
    ``.cache_creation`` are taken out of it (:meth:`Usage.inclusive`)."""
    message = _ai_message(response)
    meta = getattr(message, "usage_metadata", None) if message is not None else None
    if not meta:
        return None
    details = meta.get("input_token_details") or {}
    return Usage.inclusive(
        meta.get("input_tokens"),
        output_tokens=meta.get("output_tokens"),
        cache_read_tokens=details.get("cache_read"),
        cache_write_tokens=details.get("cache_creation"),
    )


def _replacing(response: Any, new_messages: list[AnyMessage]) -> ExtendedModelResponse:
    """The model's response, plus a state update replacing the history with the compacted one."""
    if isinstance(response, AIMessage):
        response = ModelResponse(result=[response])
    return ExtendedModelResponse(
        model_response=response,
        command=Command(update={"messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES), *new_messages, *response.result]}),
    )
