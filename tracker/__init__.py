"""Context Tracker: decide when LLM agents must compact their context, and keep the record.

Everything a caller of ``Tracker`` needs is importable from here: the ``Tracker`` and its
settings, the values its methods return, the loop-guard planner, and every error it raises.
Heavy parts (SQLAlchemy, Redis, Celery) load only when ``Tracker`` is first used.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from tracker.core.decide import Result
from tracker.core.loopguard import LoopGuardEntry, ReclaimPlan, plan_reclaim
from tracker.core.model import Basis, Measurement, ModelRef
from tracker.core.outcome import Decision
from tracker.core.policy import Policy
from tracker.core.reports import Report
from tracker.core.state import Attempt, SessionState
from tracker.errors import (
    AttemptError,
    AttemptNotOpen,
    ConcurrencyConflict,
    ContextLimitError,
    ContextLimitUnknown,
    CountError,
    CountTimeout,
    FleetError,
    FleetExists,
    HttpError,
    IntegrityError,
    InvalidCountModel,
    InvalidInput,
    InvalidPolicy,
    InvalidSessionId,
    InvalidSetting,
    MalformedMeasurement,
    ManualAttemptOpen,
    MethodNotAllowed,
    NotAttemptHolder,
    NotFound,
    PayloadTooLarge,
    QualityMismatch,
    RankFileError,
    SchemaOutOfDate,
    StaleBasis,
    StoreError,
    StoreUnavailable,
    SummaryTooLarge,
    TrackerError,
    Unauthorized,
    UnknownAttempt,
    UnknownFleet,
    UnknownKey,
    UnknownSession,
    WaitTimeout,
)

if TYPE_CHECKING:  # pragma: no cover
    from tracker.bootstrap import Tracker
    from tracker.client import AsyncTrackerClient, TrackerClient
    from tracker.settings import Settings

try:
    __version__ = version("context-tracker")
except PackageNotFoundError:  # pragma: no cover - running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    # the service and its settings
    "Tracker",
    "TrackerClient",
    "AsyncTrackerClient",
    "Settings",
    "Policy",
    # what its methods return
    "Report",
    "Result",
    "Decision",
    "Attempt",
    "SessionState",
    "Basis",
    "Measurement",
    "ModelRef",
    # the loop guard
    "plan_reclaim",
    "LoopGuardEntry",
    "ReclaimPlan",
    # errors (the tree is in tracker.errors)
    "TrackerError",
    "InvalidInput",
    "InvalidPolicy",
    "InvalidSetting",
    "InvalidSessionId",
    "PayloadTooLarge",
    "CountError",
    "CountTimeout",
    "InvalidCountModel",
    "QualityMismatch",
    "MalformedMeasurement",
    "ContextLimitUnknown",
    "RankFileError",
    "ContextLimitError",
    "StaleBasis",
    "AttemptError",
    "UnknownAttempt",
    "AttemptNotOpen",
    "NotAttemptHolder",
    "ManualAttemptOpen",
    "SummaryTooLarge",
    "WaitTimeout",
    "StoreError",
    "StoreUnavailable",
    "ConcurrencyConflict",
    "SchemaOutOfDate",
    "IntegrityError",
    "UnknownSession",
    "FleetError",
    "UnknownFleet",
    "UnknownKey",
    "FleetExists",
    "HttpError",
    "Unauthorized",
    "NotFound",
    "MethodNotAllowed",
]


def __getattr__(name: str) -> Any:  # lazy: `import tracker` never pulls in databases, Redis or HTTP
    if name == "Tracker":  # the service's Tracker with ``from_settings``, defined at the composition root
        from tracker.bootstrap import Tracker

        return Tracker
    if name in ("TrackerClient", "AsyncTrackerClient"):
        from tracker import client

        return getattr(client, name)
    if name == "Settings":
        from tracker.settings import Settings

        return Settings
    raise AttributeError(name)
