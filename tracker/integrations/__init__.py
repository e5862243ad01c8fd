"""Agent-framework integrations: the tracker decides, the framework's own loop compacts.

* :mod:`tracker.integrations.langchain` — ``ContextTrackerMiddleware`` for LangChain v1
  ``create_agent(..., middleware=[...])`` (``pip install 'context-tracker[langchain]'``);
* :mod:`tracker.integrations.pydantic_ai` — ``ContextTrackerCapability`` for pydantic-ai
  ``Agent(..., capabilities=[...])``, also usable as a history processor
  (``pip install 'context-tracker[pydantic-ai]'``).

Both are thin adapters over the framework-free :mod:`tracker.integrations._compaction`.
Importing this package imports neither framework; the core install never needs them.
"""

from tracker.integrations._compaction import (
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
