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
``tracker_count_drift_ratio{model, counter}``  billed ÷ counted of every usage report (histogram; the
                                               measurement's raw count, ``counter`` estimate|exact)
``tracker_provider_rejections_total{model}``   requests the provider rejected as too long

``model`` is a closed set: the model registry's name of the measured model (an alias reads as its
entry's name), ``other`` for any model the registry does not list (a measurement given as numbers).

The names, labels and meanings are what the dashboard and alert rules under ``deploy/`` query.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, Protocol

from tracker.core.events import (
    CompactionRejected,
    CompactionStarted,
    ContextMeasured,
    CountFailed,
    ProviderRejected,
    UsageReported,
)
from tracker.core.ledger import kind_of
from tracker.errors import SummaryTooLarge
from tracker.hooks import TrackerHooks

if TYPE_CHECKING:  # pragma: no cover
    from tracker.core.outcome import Outcome


class ModelNames(Protocol):
    """What the ``model`` label needs of a model registry (``tracker.counting.registry.ModelRegistry``
    has it; the composition root passes the one the Tracker counts with)."""

    def __contains__(self, model: object) -> bool: ...

    def get(self, model: str) -> Any: ...  # an entry with a ``name``


OCCUPANCY_BUCKETS = (1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 9500, 10000)
#: billed ÷ counted, close around 1 (an exact counter drifts by a few per cent at most)
DRIFT_BUCKETS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0, 1.02, 1.05, 1.1, 1.25, 1.5, 2.0)
OTHER_MODEL = "other"


class DecisionMetrics(TrackerHooks):
    """Decisions, count failures, attempts opened and ended, occupancy, expired leases, the
    provider's numbers (drift of billed against counted, rejections).

    One per registry (:func:`decision_metrics`): a registry refuses a second metric of a name.
    ``models``: the model registry the ``model`` label's values come from (none given: every model reads ``other``).
    """

    def __init__(self, registry: Any, models: ModelNames | None = None) -> None:
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
        self.drift = Histogram(
            "tracker_count_drift_ratio",
            "Billed input tokens / counted tokens of each usage report, by model and counter kind",
            ["model", "counter"],
            registry=r,
            buckets=DRIFT_BUCKETS,
        )
        self.rejections = Counter(
            "tracker_provider_rejections_total",
            "Requests the provider rejected as too long for the context, by model",
            ["model"],
            registry=r,
        )
        self._models = models
        self._children: dict[tuple[Any, ...], Any] = {}
        self._labels: dict[str, str] = {}

    def use_models(self, models: ModelNames) -> None:
        """Take the ``model`` label's values from ``models`` (the registry the Tracker counts with)."""
        self._models = models
        self._labels = {}

    def model_label(self, model: str) -> str:
        """``model``'s registry name, or ``other``: the label's values are the registry's, a closed set."""
        label = self._labels.get(model)
        if label is None:
            models = self._models
            label = models.get(model).name if models is not None and model in models else OTHER_MODEL
            if len(self._labels) < 10_000:  # the names asked about are open; the labels are not
                self._labels[model] = label
        return label

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
            elif isinstance(e, UsageReported):
                if e.counted_tokens > 0:
                    child = self._child(self.drift, self.model_label(e.model), kind_of(e.quality))
                    child.observe(e.billed_tokens / e.counted_tokens)
            elif isinstance(e, ProviderRejected):
                self._child(self.rejections, self.model_label(e.model)).inc()
        # the call's own outcome (not the superseded or expired attempts it closed on the way)
        if op == "commit":
            if outcome.error is None:
                self._child(self.attempt_outcomes, "committed").inc()
            elif isinstance(outcome.error, SummaryTooLarge):
                self._child(self.attempt_outcomes, "summary_too_large").inc()
        elif op == "reject" and outcome.error is None:
            self._child(self.attempt_outcomes, "rejected").inc()

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, kept: the label values are closed sets, and ``labels`` takes a lock."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children.setdefault(key, metric.labels(*labels))
        return child


_BY_REGISTRY: weakref.WeakKeyDictionary[Any, DecisionMetrics] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def decision_metrics(registry: Any = None, *, models: ModelNames | None = None) -> DecisionMetrics:
    """The one :class:`DecisionMetrics` of ``registry`` (default: ``prometheus_client.REGISTRY``);
    ``models``: the model registry its ``model`` labels come from from now on (see ``use_models``)."""
    if registry is None:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    with _LOCK:
        found = _BY_REGISTRY.get(registry)
        if found is None:
            found = _BY_REGISTRY[registry] = DecisionMetrics(registry, models)
        elif models is not None:
            found.use_models(models)
        return found
