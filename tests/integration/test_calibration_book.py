"""The calibration book a process decides with: the log's provider reports, on both backends.

A process's own report counts at once, even while another transaction holds back the log's safe
horizon (PostgreSQL: an open transaction with an id anywhere in the database); another process's
report counts once its refresh reads past it; each report is folded once; an idempotency key
reused for another report is refused.
"""

from __future__ import annotations

import itertools

import psycopg
import pytest

from tests.support.db import settled
from tracker.calibrations import CalibrationBook, ledger_of
from tracker.core import Policy, SessionProjector
from tracker.errors import InvalidInput
from tracker.service import Tracker
from tracker.store import open_store, upgrade

MODEL = "anthropic/claude-sonnet-4-5"
LIMIT = 100_000


def _measurement(basis: str, used: int) -> dict:
    return {
        "basis": basis,
        "model": MODEL,
        "input_tokens": used,
        "input_limit": LIMIT,
        "quality": "heuristic_estimate",
    }


def _tracker(url: str, refresh_s: float = 3600.0) -> Tracker:
    store = open_store(url, projector=SessionProjector())
    return Tracker(store, policy=Policy(), calibrations=CalibrationBook(store, refresh_s=refresh_s))


def _report(t: Tracker, sid: str, n: int, ratio: float = 0.75) -> None:
    for i in range(n):
        used = 10_000 + 100 * i
        t.observe(sid, measurement=_measurement(f"m{i}", used))
        t.report_usage(sid, basis=f"m{i}", input_tokens=int(used * ratio))


def _holding_the_horizon(sqlalchemy_url: str) -> psycopg.Connection | None:
    """On PostgreSQL: a connection inside a transaction that has an id (the log's safe horizon stops at it)."""
    if not sqlalchemy_url.startswith("postgresql"):
        return None
    conn = psycopg.connect(sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://"))
    conn.execute("SELECT pg_current_xact_id()")  # an id, so pg_snapshot_xmin stays at or before it
    return conn


@pytest.fixture
def url(db_url):
    upgrade(db_url)
    return db_url


@pytest.mark.feed  # holds the feed back: on a private cluster
def test_own_reports_count_at_once_and_others_after_a_refresh(url):
    db_url = url
    mine, other = _tracker(db_url), _tracker(db_url, refresh_s=0.0)
    held = _holding_the_horizon(db_url)
    try:
        _report(mine, "s1", 20)
        # this process decides with its 20 reports, though the log's safe horizon has not passed them
        d = mine.observe("s2", measurement=_measurement("x", 50_000)).decision
        assert d.calibration is not None and d.calibration["samples"] == 20
        assert d.input_tokens < d.counted_tokens == 50_000
        if held is not None:  # the other process cannot see them yet: it decides on the raw count
            d2 = other.observe("s3", measurement=_measurement("x", 50_000)).decision
            assert d2.calibration is None and d2.input_tokens == 50_000
    finally:
        if held is not None:
            held.close()
    # once the log's safe horizon has passed them, the other process's next refresh folds them. That
    # horizon is the whole server's: a transaction of any other client (a server or worker another test
    # is stopping) holds it back for a moment, so the other process decides until it sees them
    fresh = itertools.count()
    d3 = settled(
        lambda: other.observe(f"s4-{next(fresh)}", measurement=_measurement("x", 50_000)).decision,
        lambda decision: decision.calibration is not None,
    )
    assert d3.calibration is not None and d3.calibration["samples"] == 20
    # each report folded once: the book that folded them early and caught up since agrees with the log
    mine.calibrations.refresh(force=True)
    (row,) = mine.calibration()
    (logged,) = ledger_of(mine.store).summaries()
    assert row.usage_reports == logged.usage_reports == 20
    assert row.calibration == logged.calibration
    mine.close()
    other.close()


def test_a_retried_report_is_recorded_and_counted_once_and_a_reused_key_is_refused(url):
    db_url = url
    t = _tracker(db_url)
    t.observe("s", measurement=_measurement("m1", 40_000))
    first = t.report_usage("s", basis="m1", input_tokens=30_000, idempotency_key="k1")
    again = t.report_usage("s", basis="m1", input_tokens=30_000, idempotency_key="k1")
    assert again == first
    versions = [e.version for e in t.history("s")]
    with pytest.raises(InvalidInput) as info:
        t.report_usage("s", basis="m1", input_tokens=31_000, idempotency_key="k1")
    assert info.value.field == "idempotency_key" and "input_tokens" in info.value.problem
    with pytest.raises(InvalidInput):
        t.report_rejection("s", basis="m1", input_tokens=50_000, idempotency_key="k1")  # another kind of call
    assert [e.version for e in t.history("s")] == versions
    rej = t.report_rejection(
        "s", basis="m1", message="prompt is too long: 120000 tokens > 90000 maximum", idempotency_key="k2"
    )
    assert (
        t.report_rejection(
            "s", basis="r1:m1", message="prompt is too long: 120000 tokens > 90000 maximum", idempotency_key="k2"
        )
        == rej
    )
    with pytest.raises(InvalidInput, match="message"):
        t.report_rejection("s", basis="m1", message="prompt is too long: 1 tokens > 0 maximum", idempotency_key="k2")
    (row,) = t.calibration()
    assert (row.usage_reports, row.rejections, row.learned_limit) == (1, 1, 90_000)
    t.close()
