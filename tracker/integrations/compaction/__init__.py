"""Framework-free compaction for agent frameworks: what to keep, and the protocol with the tracker.

* :mod:`~tracker.integrations.compaction.view` — the history as :class:`Item` s, the :class:`View` a
  framework is about to send, :class:`Replacement` s, :func:`cut_points`, :class:`Spans`;
* :mod:`~tracker.integrations.compaction.guard` — :class:`Guard`, whose ``steps(session, view)``
  is the whole protocol with the tracker as a generator of steps (no I/O);
* :mod:`~tracker.integrations.compaction.drive` — the sync and async drivers that run those steps
  against a tracker (embedded, ``TrackerClient`` or ``AsyncTrackerClient``) and a summariser, and
  :class:`ContextGuard`: the guard with the sync one (``before_call``);
* :mod:`~tracker.integrations.compaction.shares` — where a compaction is published for other holders.
"""

from tracker.integrations.compaction.drive import (
    ContextGuard,
    Effects,
    call_async,
    drive_async,
    drive_sync,
    summarize_with,
)
from tracker.integrations.compaction.guard import (
    COUNT_FAILED,
    NOTHING_TO_SUMMARIZE,
    SUMMARIZER_ERROR,
    SUMMARY_OVER_BUDGET,
    Commit,
    Count,
    Fetch,
    FindCommit,
    Guard,
    GuardOptions,
    Observe,
    Publish,
    Reject,
    Report,
    Step,
    Summarize,
    Unsupported,
    Wait,
    default_counter,
)
from tracker.integrations.compaction.shares import (
    DirectoryShare,
    MemoryShare,
    RedisShare,
    SummaryShare,
    share_payload,
    shared_span,
)
from tracker.integrations.compaction.view import (
    MARKER,
    SUMMARY_PREFIX,
    Item,
    Outcome,
    Replacement,
    Spans,
    View,
    cut_points,
    digest,
    marked_revision,
    replaced,
    summary_item,
    summary_prompt,
)

__all__ = [
    "COUNT_FAILED",
    "MARKER",
    "NOTHING_TO_SUMMARIZE",
    "SUMMARIZER_ERROR",
    "SUMMARY_OVER_BUDGET",
    "SUMMARY_PREFIX",
    "Commit",
    "ContextGuard",
    "Count",
    "DirectoryShare",
    "Effects",
    "Fetch",
    "FindCommit",
    "Guard",
    "GuardOptions",
    "Item",
    "MemoryShare",
    "Observe",
    "Outcome",
    "Publish",
    "RedisShare",
    "Reject",
    "Replacement",
    "Report",
    "Spans",
    "Step",
    "Summarize",
    "SummaryShare",
    "Unsupported",
    "View",
    "Wait",
    "call_async",
    "cut_points",
    "default_counter",
    "digest",
    "drive_async",
    "drive_sync",
    "marked_revision",
    "replaced",
    "share_payload",
    "shared_span",
    "summarize_with",
    "summary_item",
    "summary_prompt",
]
