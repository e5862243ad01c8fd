"""Agent-framework integrations: the tracker decides, the framework's own loop compacts.

* :mod:`tracker.integrations.langchain` — ``ContextTrackerMiddleware`` for LangChain v1
  ``create_agent(..., middleware=[...])`` (``pip install 'context-tracker[langchain]'``);
* :mod:`tracker.integrations.pydantic_ai` — ``ContextTrackerCapability`` for pydantic-ai
  ``Agent(..., capabilities=[...])``, also usable as a history processor
  (``pip install 'context-tracker[pydantic-ai]'``).

* :mod:`tracker.integrations.openai_agents` — ``ContextTrackerFilter`` (a ``call_model_input_filter``,
  with ``wrap_model``) and ``ContextTrackerHooks`` for the OpenAI Agents SDK
  (``pip install 'context-tracker[openai-agents]'``).

They are thin adapters over the framework-free :mod:`tracker.integrations.compaction` (what to
keep; the protocol with the tracker as a generator of steps, and its sync and async drivers) and
:mod:`tracker.integrations._provider` (each call's usage reported, one provider context-length error
recovered by compacting and retrying once). Each takes a sync or an async tracker (``Tracker``,
``TrackerClient``, ``AsyncTrackerClient``).
Importing this package imports neither framework; the core install never needs them.
"""

from tracker.integrations.compaction import (
    ContextGuard,
    DirectoryShare,
    Item,
    MemoryShare,
    RedisShare,
    Replacement,
    SummaryShare,
    View,
    cut_points,
    default_counter,
)

__all__ = [
    "ContextGuard",
    "DirectoryShare",
    "Item",
    "MemoryShare",
    "RedisShare",
    "Replacement",
    "SummaryShare",
    "View",
    "cut_points",
    "default_counter",
]
