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
See :mod:`tracker.integrations.compaction` for the whole protocol.

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

``tracker`` may be sync (``Tracker``, ``TrackerClient``: its calls run in a worker thread) or async
(``AsyncTrackerClient``: awaited on the run's loop). The modules: :mod:`.filter` (the filter),
:mod:`.model` (``wrap_model``'s recovering ``Model``), :mod:`.hooks` (the usage hooks), :mod:`.items`
(SDK input items as the tracker's request).

Server-managed conversations (``conversation_id=``, ``previous_response_id=``) send only the
new items, so the filter cannot see (or shorten) the history: use the tracker with
client-side history (the default, or an SDK ``Session``).
"""

from tracker.integrations.openai_agents.filter import ContextTrackerFilter
from tracker.integrations.openai_agents.hooks import ContextTrackerHooks, LLMUsage
from tracker.integrations.openai_agents.items import input_item, items_of, summary_input_item, to_request, view_of

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
