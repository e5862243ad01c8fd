"""The provider's numbers on the decision metrics: drift of billed against counted, rejections.

A real Tracker (SQLite store, in-process counting with the shipped registry) with the metrics
hook on a registry of the test's own; usage reports billed by the simulated provider.
"""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from tests.support.bench import CODING_AGENT, SimProvider, session
from tracker.counting.backends import InProcessCounting
from tracker.counting.registry import ModelRegistry
from tracker.errors import InvalidInput
from tracker.metrics import DRIFT_BUCKETS, DecisionMetrics, decision_metrics
from tracker.service import Tracker
from tracker.store import open_store, upgrade


@pytest.fixture
def tracked(tmp_path):
    url = f"sqlite:///{tmp_path / 't.db'}"
    upgrade(url)
    registry = CollectorRegistry()
    models = ModelRegistry.load({"house-model": {"provider": "anthropic", "window": 100_000, "counter": "heuristic"}})
    hook = DecisionMetrics(registry, models)
    t = Tracker(open_store(url), counting=InProcessCounting(models), hooks=[hook])
    try:
        yield t, registry, hook
    finally:
        t.close()


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sample's value; a sample that is not there (a misspelt metric or label name) fails."""
    value = registry.get_sample_value(name, labels)
    assert value is not None, f"no sample {name}{labels}"
    return value


def test_usage_reports_observe_billed_over_counted_by_model_and_counter_kind(tracked):
    t, registry, _ = tracked
    rng = random.Random(7)
    sim = SimProvider()
    ratios = []
    for i, request in enumerate(session(rng, CODING_AGENT, 6)):
        d = t.observe("s-est", request=request, model="claude-sonnet-4-5", basis=f"m{i}")
        billed = sim.billed(request)
        t.report_usage("s-est", basis=f"m{i}", input_tokens=billed)
        ratios.append(billed / d.decision.counted_tokens)
    # an exact counter, billed 3 % over what it counted
    d = t.observe("s-exact", request=session(rng, CODING_AGENT, 1)[0], model="gpt-4o", basis="x")
    counted = d.decision.counted_tokens
    t.report_usage("s-exact", basis="x", input_tokens=counted, cache_read_tokens=counted * 3 // 100)

    est = {"model": "claude-sonnet-4-5", "counter": "estimate"}
    assert sample(registry, "tracker_count_drift_ratio_count", **est) == 6
    assert sample(registry, "tracker_count_drift_ratio_sum", **est) == pytest.approx(sum(ratios))
    assert all(0.6 < r < 0.9 for r in ratios), ratios  # the heuristic runs over what the provider bills
    for le in DRIFT_BUCKETS:
        got = sample(registry, "tracker_count_drift_ratio_bucket", le=str(le), **est)
        assert got == sum(r <= le for r in ratios), le
    exact = {"model": "gpt-4o", "counter": "exact"}
    assert sample(registry, "tracker_count_drift_ratio_count", **exact) == 1
    assert sample(registry, "tracker_count_drift_ratio_bucket", le="1.02", **exact) == 0  # billed (cache included)
    assert sample(registry, "tracker_count_drift_ratio_bucket", le="1.05", **exact) == 1


def test_a_bill_equal_to_the_count_is_in_the_bucket_at_exactly_1(tracked):
    """A bucket edge at exactly 1: a bill equal to an exact count is told apart from one just under it."""
    t, registry, _ = tracked
    m = {"basis": "b", "input_tokens": 1000, "input_limit": 10_000, "model": "gpt-4o", "quality": "exact_local"}
    t.observe("s-one", measurement=m)
    t.report_usage("s-one", basis="b", input_tokens=1000)
    exact = {"model": "gpt-4o", "counter": "exact"}
    assert sample(registry, "tracker_count_drift_ratio_bucket", le="1.0", **exact) == 1
    assert sample(registry, "tracker_count_drift_ratio_bucket", le="0.98", **exact) == 0


def test_a_rejection_counts_once_and_a_refused_report_counts_nothing(tracked):
    t, registry, hook = tracked
    t.observe(
        "s-rej",
        request={"messages": [{"role": "user", "content": "hello " * 2000}]},
        model="claude-sonnet-4-5",
        basis="m1",
    )
    basis = "m1"
    t.report_rejection(
        "s-rej", basis=basis, message="prompt is too long: 2300 tokens > 2200 maximum", idempotency_key="k1"
    )
    t.report_rejection(
        "s-rej", basis=basis, message="prompt is too long: 2300 tokens > 2200 maximum", idempotency_key="k1"
    )  # a retry answered from the record is not a second rejection
    assert sample(registry, "tracker_provider_rejections_total", model="claude-sonnet-4-5") == 1
    with pytest.raises(InvalidInput):
        t.report_usage("s-rej", basis="no-such-basis", input_tokens=10)
    # a rejection's numbers are a calibration sample, but not a usage report: no drift observed (the
    # series is made empty first, so that the check reads a sample: a wrong label name raises here)
    hook.drift.labels(model="claude-sonnet-4-5", counter="estimate")
    assert sample(registry, "tracker_count_drift_ratio_count", model="claude-sonnet-4-5", counter="estimate") == 0


def test_the_model_label_is_the_registrys_name_or_other(tracked):
    t, registry, hook = tracked
    assert hook.model_label("claude-sonnet-4-5") == "claude-sonnet-4-5"
    assert hook.model_label("house-model") == "house-model"  # a models-file entry is a registry name
    assert hook.model_label("made-up-model-9000") == "other"
    # measurements given as numbers name any model: the label stays closed
    for i, name in enumerate(("free-text-1", "free-text-2")):
        m = {"basis": f"b{i}", "input_tokens": 1000, "input_limit": 10_000, "model": name, "quality": "exact_local"}
        t.observe(f"s-free-{i}", measurement=m)
        t.report_usage(f"s-free-{i}", basis=f"b{i}", input_tokens=1010)
    assert sample(registry, "tracker_count_drift_ratio_count", model="other", counter="exact") == 2
    names = {s.labels.get("model") for m in registry.collect() for s in m.samples if "model" in s.labels}
    assert names == {"other"}


def test_decision_metrics_takes_the_model_registry_it_is_given():
    registry = CollectorRegistry()
    first = decision_metrics(registry)
    assert first.model_label("house-model") == "other"  # the shipped registry has no such model
    again = decision_metrics(
        registry, models=ModelRegistry.load({"house-model": {"provider": "x", "window": 1000, "counter": "heuristic"}})
    )
    assert again is first and first.model_label("house-model") == "house-model"
