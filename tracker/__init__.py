"""Context Tracker: decide when LLM agents must compact their context, and keep the record.

Public surface (SPEC §10): ``Policy``, ``Tracker``, ``plan_reclaim``,
``LoopGuardEntry`` and the typed errors.
"""

from __future__ import annotations

from typing import Any

from tracker.core.policy import Policy
from tracker.errors import (
    ContextLimitError,
    ContextLimitUnknown,
    CountTimeout,
    InvalidCountModel,
    InvalidInput,
    MalformedMeasurement,
    QualityMismatch,
    StaleBasis,
    TrackerError,
)

__version__ = "0.1.0"

__all__ = [
    "Policy",
    "Tracker",
    "plan_reclaim",
    "LoopGuardEntry",
    "ContextLimitError",
    "CountTimeout",
    "InvalidCountModel",
    "QualityMismatch",
    "MalformedMeasurement",
    "ContextLimitUnknown",
    "StaleBasis",
    "InvalidInput",
    "TrackerError",
]


def __getattr__(name: str) -> Any:  # lazy: importing the core never pulls in databases or HTTP
    if name == "Tracker":
        from tracker.service import Tracker

        return Tracker
    if name in ("plan_reclaim", "LoopGuardEntry"):
        from tracker.core import loopguard

        return getattr(loopguard, name)
    raise AttributeError(name)
