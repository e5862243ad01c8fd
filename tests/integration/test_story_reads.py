"""The session page's story read through the store's narrow reads equals the one read off every event.

``tracker.audit.story.read_story`` (the console's session page and ``tracker replay --html``)
reads the counts by type, the lifecycle events, a sample of the measurements and the projection;
``build_story`` reads every event. On real SQLite and PostgreSQL (``db_url``), for sessions the
decision core wrote (``tracker.bench.console.build_session``: compactions, rejections with
``summarizer_error``, context-limit errors, a count failure every 97 steps), everything the page
shows -- counts, attempts table, count failures, markers, drops, where the session stands, the
loop breaker's episode and the plain-language account -- must be the same; only the chart's
measurement points differ (a sample that keeps the newest measurement and every peak that opened
an attempt or met the limit). One session runs on; a copy of its first events ends right at a
``ContextLimitError``, so the account's "why nothing was eligible" paragraph is compared too.
"""

from __future__ import annotations

import pytest

from tests.support.bench import build_session
from tracker.audit.story import MAX_POINTS, account, build_story, read_story
from tracker.bootstrap import build_views
from tracker.core import SessionProjector
from tracker.store import NewEvent, open_store, upgrade

SHOWN = (
    "counts",
    "attempts",
    "failures",
    "failure_kinds",
    "reject_reasons",
    "drops",
    "markers",
    "first_at",
    "last_at",
    "version",
    "revision",
    "pressure",
    "occupancy_bp",
    "last_tokens",
    "last_limit",
    "policy",
    "limit_event",
    "episode",
    "last_commit",
)


@pytest.fixture
def store(db_url):
    upgrade(db_url)
    s = open_store(db_url, projector=SessionProjector())
    yield s
    s.close()


@pytest.fixture
def views(store):
    """The narrow reads: the read side's views on the store's database."""
    return build_views(store)


def test_read_story_matches_the_full_read(store, views):
    sid = "long"
    build_session(store, sid, 6000)
    full = build_story(sid, store.read_stream(sid), table_rows=0)
    narrow = read_story(store, sid, shown="shown-id", views=views)
    assert narrow.session_id == "shown-id"
    narrow.session_id = sid
    for name in SHOWN:
        assert getattr(narrow, name) == getattr(full, name), name
    assert account(narrow) == account(full)
    assert narrow.counts["rejected"] > 0 and narrow.counts["context_limit"] > 0 and narrow.counts["count_failed"] > 0
    # the chart: at most the cap, ending at the newest measurement, and every measurement that
    # opened an attempt or met the limit while there are fewer of them than the peak budget
    assert narrow.sampled and len(narrow.points) <= MAX_POINTS
    last = max(views.read_types(sid, ["ContextMeasured"], 5900), key=lambda e: e.version)
    assert narrow.points[-1].version == last.version
    drawn = {p.version for p in narrow.points}
    peaks = [e.version - 1 for e in views.read_types(sid, ["CompactionStarted", "ContextLimitReached"])]
    assert set(peaks) <= drawn
    assert max(p.used for p in narrow.points) == max(
        e.data["measurement"]["input_tokens"] for e in views.read_types(sid, ["ContextMeasured"])
    )


def test_read_story_of_a_session_that_ended_at_its_hard_limit(store, views):
    build_session(store, "src", 6000)
    limits = [e.version for e in views.read_types("src", ["ContextLimitReached"])]
    rejected_before = [
        e.version for e in views.read_types("src", ["CompactionRejected"]) if limits and e.version < limits[-1]
    ]
    assert limits and rejected_before
    end = limits[-1]
    copy = [NewEvent(e.type, e.data) for e in store.read_stream("src", 1, end)]
    version = 0
    for i in range(0, len(copy), 500):
        version = store.append("ended", version, copy[i : i + 500]).last_version
    full = build_story("ended", store.read_stream("ended"), table_rows=0)
    narrow = read_story(store, "ended", views=views)
    for name in SHOWN:
        assert getattr(narrow, name) == getattr(full, name), name
    said = account(narrow)
    assert said == account(full)
    assert "reached its hard limit" in said[0] and narrow.pressure == "hard_limit"
    assert "rejected (summarizer_error" in said[1]


def test_read_story_of_an_unknown_session_and_a_short_one(store, views):
    assert account(read_story(store, "nobody", views=views)) == ["Session nobody has no recorded events."]
    build_session(store, "short", 40)
    full = build_story("short", store.read_stream("short"), table_rows=0)
    narrow = read_story(store, "short", table_rows=10, views=views)
    for name in SHOWN:
        assert getattr(narrow, name) == getattr(full, name), name
    assert narrow.points == full.points  # fewer measurements than the sample: every one is drawn
    assert [r[0] for r in narrow.rows] == list(range(1, 11))


def test_read_story_of_a_session_with_the_providers_reports(store, views):
    """Usage reports (billed dots, the measurements table) and a provider rejection (its marker, the
    account's sentence) read the same through the narrow reads as off every event."""
    import random

    from tests.support.bench import CODING_AGENT, SimProvider, session
    from tracker.counting.backends import InProcessCounting
    from tracker.counting.registry import ModelRegistry
    from tracker.service import Tracker

    t = Tracker(store, counting=InProcessCounting(ModelRegistry.load()))
    sim = SimProvider()
    requests = session(random.Random(1), CODING_AGENT, 70)
    for i, request in enumerate(requests[:69]):
        t.observe("billed", request=request, model="claude-sonnet-4-5", basis=f"m{i}")
        t.report_usage("billed", basis=f"m{i}", input_tokens=sim.billed(request))
    t.report_rejection("billed", basis="m68", input_tokens=70_000, input_limit=69_000)
    t.observe("billed", request=requests[69], model="claude-sonnet-4-5", basis="m69")
    full = build_story("billed", store.read_stream("billed"), table_rows=0)
    narrow = read_story(store, "billed", views=views)
    for name in (*SHOWN, "rejections", "measured_rows", "billed"):
        assert getattr(narrow, name) == getattr(full, name), name
    assert account(narrow) == account(full)
    assert narrow.counts["usage_reports"] == 69 and narrow.counts["provider_rejections"] == 1
    assert len(narrow.measured_rows) == 50 and narrow.measured_rows[-1].limit == 69_000  # the learned limit
    assert [r.basis for r in narrow.measured_rows if r.rejection] == ["r1:m68"]
    assert sum(r.billed is not None for r in narrow.measured_rows) == 49  # all but the last, unreported
    assert [m.kind for m in narrow.markers] == ["provider_rejected", "open"]  # m69 compacts at the learned limit
    assert any("rejected the request of r1:m68 as too long: 70,000 > 69,000" in line for line in account(narrow))
