"""The bench's figures and fixture, computed in-process (the bench itself runs in tests/e2e/test_bench.py)."""

from __future__ import annotations

import pytest

from tracker.bench.stats import latency_ms, percentile, ratio, throughput


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([3.0], 50) == 3.0
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert percentile([10, 20], 25) == 12.5
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_latency_throughput_and_ratio():
    assert latency_ms([0.001, 0.002, 0.003]) == {"ms_p50": 2.0, "ms_p99": 2.98}
    assert latency_ms([]) == {"ms_p50": None, "ms_p99": None}
    assert throughput(300, 2.0) == 150.0
    assert ratio(1, 3) == 0.333 and ratio(1, 0) is None and ratio(None, 2) is None


def test_store_fixture_is_an_event_the_core_records():
    from tracker.bench.store import EVENT
    from tracker.core.events import ContextMeasured
    from tracker.queries import event_of

    event = event_of(EVENT)
    assert isinstance(event, ContextMeasured)
    assert event.to_data() == EVENT.data
    assert str(event.measurement.basis) == "r3:msg-000187" and event.action == "proceed"
