"""The decision metrics: what a Tracker records, counted on a ``prometheus_client`` registry.

A hook (:class:`~tracker.hooks.TrackerHooks`) on the service, so a library call, a CLI command
and an HTTP request count alike; the HTTP app's own request metrics (counts, latency, status
codes, error codes) stay in its middleware (``tracker.http``). Counted from the events appended,
so an idempotent retry, answered from the record, is not a second decision.

``tracker_decisions_total{action}``           every recorded decision (``context_limit`` included)
``tracker_count_failures_total{kind}``        count failures recorded, by ``CountError`` kind
``tracker_attempts_started_total{reason}``    compaction attempts opened (automatic, manual)
``tracker_attempt_outcomes_total{outcome}``   attempts ended by a commit or reject call: committed,
                                               rejected, summary_too_large
``tracker_decision_occupancy_bp``              occupancy of each recorded measurement (histogram)
``tracker_leases_expired_total``               attempts rejected as ``lease_expired``

The names, labels and meanings are what the dashboard and alert rules under ``deploy/`` query.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from tracker.core.events import CompactionRejected, CompactionStarted, ContextMeasured, CountFailed
from tracker.errors import SummaryTooLarge
from tracker.hooks import TrackerHooks

if TYPE_CHECKING:  # pragma: no cover
    from tracker.core.outcome import Outcome

OCCUPANCY_BUCKETS = (1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 9500, 10000)


class DecisionMetrics(TrackerHooks):
    """Decisions, count failures, attempts opened and ended, occupancy, expired leases.

    One per registry (:func:`decision_metrics`): a registry refuses a second metric of a name.
    """

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Histogram

        r = registry
        self.decisions = Counter("tracker_decisions_total", "Decisions by action", ["action"], registry=r)
        self.count_failures = Counter("tracker_count_failures_total", "Count failures by kind", ["kind"], registry=r)
        self.attempts_started = Counter(
            "tracker_attempts_started_total", "Compaction attempts opened", ["reason"], registry=r
        )
        self.attempt_outcomes = Counter(
            "tracker_attempt_outcomes_total",
            "Compaction attempts ended through the API, by outcome",
            ["outcome"],
            registry=r,
        )
        self.occupancy = Histogram(
            "tracker_decision_occupancy_bp",
            "Occupancy (basis points of the input limit) of each recorded measurement, at decision time",
            registry=r,
            buckets=OCCUPANCY_BUCKETS,
        )
        self.leases_expired = Counter(
            "tracker_leases_expired_total", "Compaction attempts rejected as lease_expired", registry=r
        )
        self._children: dict[tuple[int, str], Any] = {}

    def after_record(self, op: str, session_id: str, outcome: Outcome) -> None:
        for e in outcome.events:
            if isinstance(e, ContextMeasured):
                self._child(self.decisions, e.action).inc()
                self.occupancy.observe(e.occupancy_bp)
            elif isinstance(e, CompactionStarted):
                self._child(self.attempts_started, e.reason).inc()
            elif isinstance(e, CountFailed):
                self._child(self.count_failures, e.kind).inc()
            elif isinstance(e, CompactionRejected) and e.reject_reason == "lease_expired":
                self.leases_expired.inc()
        # the call's own outcome (not the superseded or expired attempts it closed on the way)
        if op == "commit":
            if outcome.error is None:
                self._child(self.attempt_outcomes, "committed").inc()
            elif isinstance(outcome.error, SummaryTooLarge):
                self._child(self.attempt_outcomes, "summary_too_large").inc()
        elif op == "reject" and outcome.error is None:
            self._child(self.attempt_outcomes, "rejected").inc()

    def _child(self, metric: Any, label: str) -> Any:
        """``metric.labels(label)``, kept: the label values are closed sets, and ``labels`` takes a lock."""
        key = (id(metric), label)
        child = self._children.get(key)
        if child is None:
            child = self._children.setdefault(key, metric.labels(label))
        return child


_BY_REGISTRY: weakref.WeakKeyDictionary[Any, DecisionMetrics] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def decision_metrics(registry: Any = None) -> DecisionMetrics:
    """The one :class:`DecisionMetrics` of ``registry`` (default: ``prometheus_client.REGISTRY``)."""
    if registry is None:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    with _LOCK:
        found = _BY_REGISTRY.get(registry)
        if found is None:
            found = _BY_REGISTRY[registry] = DecisionMetrics(registry)
        return found
