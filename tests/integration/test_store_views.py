"""The read side's views (``SessionViews``: ``tracker.store.views.SqlSessionViews``), on real SQLite
and real PostgreSQL (``db_url``).

The views are SQL only: listings and the session page's narrow reads are statements on the event
store's database (through its indexes: migrations 0005 and the sessions' keyset index), built on
the store's engine by ``tracker.bootstrap.build_views``. The ``EventStore`` contract itself, which
the in-memory store meets too, is ``tests/integration/test_store_contract.py``.
"""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.support.db import feed_shows, settled, transaction_open_elsewhere
from tests.support.toy_store import ToyProjector, ev, execute_sql, fold
from tracker.bootstrap import build_views
from tracker.calibrations import ledger_of
from tracker.core.events import UsageReported
from tracker.core.model import SessionScope
from tracker.errors import InvalidInput, InvalidSessionId
from tracker.queries import fleet_gauges
from tracker.store import NewEvent, open_store, upgrade, verify_projections
from tracker.store import views as store_views


@pytest.fixture
def store(db_url):
    upgrade(db_url)
    s = open_store(db_url, projector=ToyProjector())
    yield s
    s.close()


@pytest.fixture
def views(store):
    return build_views(store)


def test_views_read_the_stores_database_and_refuse_bad_input(store, views):
    store.append("one", 0, [ev("Pressure", level="compact")])
    assert [r["session_id"] for r in views.list_sessions()] == ["one"]
    for kwargs, field in (
        ({"limit": 0}, "limit"),
        ({"limit": True}, "limit"),
        ({"active_since": "yesterday"}, "active_since"),
        ({"session_prefix": ""}, "session_prefix"),
    ):
        with pytest.raises(InvalidInput) as info:
            views.list_sessions(**kwargs)
        assert info.value.field == field
    assert views.session_summary()["pressure"] == [("", "compact", 1, 0)]


def test_the_gauges_file_each_session_under_the_fleet_calibration_and_the_feed_file_it_under(store, views):
    """One fleet rule, ``SessionScope.fleet_of``: the gauges (grouped in SQL), the calibration ledger
    (folded from the feed) and the per-fleet feed (the events' ``fleet`` column) agree on every id --
    a library id with a namespace, an HTTP fleet's session and a plain id."""
    ids = ("team:s1", "f0123456789:s1", "s1")
    report = UsageReported(
        basis="r1:m1", model="m1", quality="heuristic_estimate", counted_tokens=10_000, input_tokens=9_000
    )
    last = 0
    for sid in ids:
        appended = store.append(sid, 0, [ev("Pressure", level="compact"), NewEvent(report.TYPE, report.to_data())])
        last = appended.positions[-1]
    fleets = sorted(SessionScope.fleet_of(sid) for sid in ids)
    assert fleets == ["", "f0123456789", "team"]

    summary = views.session_summary()
    assert sorted(ns for ns, _, _, _ in summary["pressure"]) == fleets
    assert feed_shows(store, last)
    assert sorted(m.fleet for m in ledger_of(store).summaries()) == fleets
    for sid in ids:
        fleet = SessionScope.fleet_of(sid)
        assert [m.fleet for m in ledger_of(store, scope=SessionScope(fleet or None)).summaries()] == (
            [fleet] if fleet else fleets
        )
        if fleet:
            assert {e.session_id for e in store.read_all(0, 100, session_prefix=SessionScope(fleet).prefix)} == {sid}

    # the gauges name the known fleets; an id outside them (a library namespace too) counts under "none"
    gauges = fleet_gauges(views, {"f0123456789": "acme"}, time.time())
    assert {(f, p): n for f, p, n in gauges["sessions"] if n} == {("acme", "compact"): 1, ("none", "compact"): 2}


def test_listed_rows_are_the_projection_and_equal_the_fold_of_the_log(store, views):
    rng = random.Random(11)
    projector = ToyProjector()
    versions: dict[str, int] = {}
    kinds = ["Tick", "Started", "Compacted", "Pressure"]
    for _ in range(60):
        sid = f"p{rng.randint(0, 5)}"
        batch = []
        for _ in range(rng.randint(1, 3)):
            kind = rng.choice(kinds)
            data: dict[str, Any] = {"n": rng.randint(0, 100)}
            if kind == "Pressure":
                data["level"] = rng.choice(["normal", "compact", "hard_limit"])
            batch.append(NewEvent(kind, data))
        r = store.append(sid, versions.get(sid, 0), batch)
        versions[sid] = r.last_version
        assert r.state == fold(projector, sid, list(store.read_stream(sid)))
    rows = {row["session_id"]: row for row in views.list_sessions()}
    assert set(rows) == set(versions)
    for sid, version in versions.items():
        expected = fold(projector, sid, list(store.read_stream(sid)))
        assert store.load(sid) == (expected, version)
        row = rows[sid]
        assert row["version"] == version and row["state"] == expected
        for name, value in projector.columns(expected).items():
            assert row[name] == value, (sid, name)
    assert sorted(sid for sid, _ in store.log_versions()) == sorted(versions)
    assert verify_projections(store, projector) == []


def test_list_sessions_filters(store, views):
    store.append("calm", 0, [ev("Pressure", level="normal")])
    store.append("busy-1", 0, [ev("Pressure", level="compact")])
    store.append("busy-2", 0, [ev("Pressure", level="compact"), ev("Started")])
    store.append("full", 0, [ev("Pressure", level="hard_limit")])
    assert {r["session_id"] for r in views.list_sessions()} == {"calm", "busy-1", "busy-2", "full"}
    assert {r["session_id"] for r in views.list_sessions(pressure="compact")} == {"busy-1", "busy-2"}
    assert [r["session_id"] for r in views.list_sessions(pressure="hard_limit")] == ["full"]
    assert views.list_sessions(pressure="nothing") == []
    now = datetime.now(UTC)
    assert len(views.list_sessions(active_since=now - timedelta(minutes=5))) == 4
    assert views.list_sessions(active_since=now + timedelta(minutes=5)) == []
    assert len(views.list_sessions(pressure="compact", active_since=now - timedelta(minutes=5))) == 2
    assert len(views.list_sessions(limit=3)) == 3
    # most recently updated first
    store.append("calm", 1, [ev()])
    assert views.list_sessions(limit=1)[0]["session_id"] == "calm"
    row = next(r for r in views.list_sessions() if r["session_id"] == "busy-2")
    assert row["open_attempts"] == 1 and row["revision"] == 1 and row["version"] == 2
    assert row["created_at"].tzinfo is not None and row["updated_at"] >= row["created_at"]


def test_list_sessions_keyset_pages_within_a_prefix(store, views, db_url):
    """``session_prefix`` + ``after``: pages that neither overlap nor skip, only the prefix's sessions,
    also when rows share one ``updated_at`` (the id breaks the tie)."""
    for i in range(7):
        store.append(f"fa:s{i}", 0, [ev("Pressure", level="compact" if i % 2 else "normal")])
        store.append(f"fb:s{i}", 0, [ev()])
    store.append("fa", 0, [ev()])  # the bare prefix without ':' is another session
    store.append("fa:s3", 1, [ev()])  # most recent activity
    whole = views.list_sessions(session_prefix="fa:")
    assert [r["session_id"] for r in whole][0] == "fa:s3" and len(whole) == 7
    keys = [(r["updated_at"], r["session_id"]) for r in whole]
    assert keys == sorted(keys, key=lambda k: (-k[0].timestamp(), k[1]))
    paged, after = [], None
    while True:
        page = views.list_sessions(session_prefix="fa:", limit=3, after=after)
        paged += [r["session_id"] for r in page]
        if len(page) < 3:
            break
        after = (page[-1]["updated_at"], page[-1]["session_id"])
    assert paged == [r["session_id"] for r in whole]
    odd = views.list_sessions(session_prefix="fa:", pressure="compact", limit=2)
    rest = views.list_sessions(
        session_prefix="fa:", pressure="compact", after=(odd[-1]["updated_at"], odd[-1]["session_id"])
    )
    assert sorted(r["session_id"] for r in odd + rest) == ["fa:s1", "fa:s3", "fa:s5"]
    # ties on updated_at (a busy fleet): the id orders them, and the keyset goes on after the id
    tie = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    execute_sql(
        db_url,
        "UPDATE sessions SET updated_at = :t WHERE session_id IN ('fa:s1', 'fa:s2', 'fa:s4', 'fa:s6')",
        t=tie if db_url.startswith("postgresql") else tie.replace(tzinfo=None),
    )
    paged, after = [], None
    while True:
        page = views.list_sessions(session_prefix="fa:", limit=3, after=after)
        paged += [r["session_id"] for r in page]
        if len(page) < 3:
            break
        after = (page[-1]["updated_at"], page[-1]["session_id"])
    assert paged[:4] == ["fa:s1", "fa:s2", "fa:s4", "fa:s6"] and sorted(paged) == sorted(r["session_id"] for r in whole)
    assert (
        views.list_sessions(session_prefix="fa:", limit=10, after=(tie, "fa:s2"))[:2]
        == views.list_sessions(session_prefix="fa:", limit=10)[2:4]
    )
    assert views.list_sessions(session_prefix="FA:") == []  # exact, case-sensitive
    assert views.list_sessions(session_prefix="f_:") == []  # '_' is no wildcard
    with pytest.raises(InvalidInput):
        views.list_sessions(session_prefix="bad prefix")
    with pytest.raises(InvalidInput):
        views.list_sessions(after=("yesterday", "x"))  # type: ignore[arg-type]


KINDS = ("Measured", "Started", "Committed", "Rejected", "CountFailed")


@pytest.fixture
def mixed(store):
    """A session of 300 events of five types in a seeded random mix (each carries its ``i`` and,
    for the attempt types, an ``attempt_id``), appended in uneven batches; and a neighbour session."""
    rng = random.Random(15)
    kinds = ["Measured"] * 200 + ["Started"] * 40 + ["Committed"] * 25 + ["Rejected"] * 15 + ["CountFailed"] * 20
    rng.shuffle(kinds)
    news = [ev(k, i=i, attempt_id=f"a{i % 37}") if k != "Measured" else ev(k, i=i) for i, k in enumerate(kinds)]
    version, i = 0, 0
    while i < len(news):
        n = rng.randint(1, 60)
        version = store.append("mix", version, news[i : i + n]).last_version
        i += n
    store.append("mix-other", 0, [ev("Started", attempt_id="a1"), ev("Measured")])
    return list(store.read_stream("mix"))


def test_count_by_type(store, views, mixed):
    want: dict[str, int] = {}
    for e in mixed:
        want[e.type] = want.get(e.type, 0) + 1
    assert views.count_by_type("mix") == want
    assert sum(views.count_by_type("mix").values()) == 300
    upto = [e for e in mixed if e.version <= 120]
    assert views.count_by_type("mix", 120) == {k: sum(1 for e in upto if e.type == k) for k in {e.type for e in upto}}
    assert views.count_by_type("nobody") == {}
    with pytest.raises(InvalidSessionId):
        views.count_by_type("bad id!")


def test_read_types_pages_in_version_order(store, views, mixed, monkeypatch):
    monkeypatch.setattr(store_views, "READ_BATCH", 7)  # force several batches
    want = [e for e in mixed if e.type in ("Started", "Rejected")]
    got = list(views.read_types("mix", ["Started", "Rejected"]))
    assert [(e.version, e.type, e.data) for e in got] == [(e.version, e.type, e.data) for e in want]
    assert all(e.session_id == "mix" for e in got)
    assert [e.version for e in views.read_types("mix", ["Started"], 100, 200)] == [
        e.version for e in mixed if e.type == "Started" and 100 <= e.version <= 200
    ]
    assert [e.version for e in views.read_types("mix", ["Measured"], 50, limit=9)] == [
        e.version for e in mixed if e.type == "Measured" and e.version >= 50
    ][:9]
    assert list(views.read_types("mix", ["Nothing"])) == []
    for bad in ([], "Started", [""], None):
        with pytest.raises(InvalidInput):
            views.read_types("mix", bad)
    with pytest.raises(InvalidInput):
        views.read_types("mix", ["Started"], 0)
    with pytest.raises(InvalidInput):
        views.read_types("mix", ["Started"], limit=0)


def test_last_of_types(store, views, mixed):
    fails = [e.version for e in mixed if e.type in ("CountFailed", "Committed")]
    assert [e.version for e in views.last_of_types("mix", ["CountFailed", "Committed"], 5)] == fails[-5:]
    assert [e.version for e in views.last_of_types("mix", ["Measured"])] == [
        [e.version for e in mixed if e.type == "Measured"][-1]
    ]
    below = [e.version for e in mixed if e.type == "Started" and e.version <= 150]
    assert [e.version for e in views.last_of_types("mix", ["Started"], 3, 150)] == below[-3:]
    assert [e.version for e in views.last_of_types("mix", ["Started"], 1000)] == [
        e.version for e in mixed if e.type == "Started"
    ]
    assert views.last_of_types("nobody", ["Started"]) == []


@pytest.mark.parametrize("points", [1, 7, 50, 199, 200, 500])
def test_sample_of_type_spreads_evenly_and_keeps_the_ends(store, views, mixed, points):
    measured = [e.version for e in mixed if e.type == "Measured"]  # 200 of them
    got = views.sample_of_type("mix", "Measured", points)
    assert views.sample_of_type("mix", "Measured", points, total=200) == got  # the count given, not read
    versions = [e.version for e in got]
    assert all(e.type == "Measured" and e.session_id == "mix" for e in got)
    assert versions == sorted(set(versions))
    assert versions[0] == measured[0] and versions[-1] == measured[-1]
    # the first of each of `points` equal runs by rank, and the last one
    ranks = [measured.index(v) for v in versions]
    n = len(measured)
    want = [r for r in range(n) if r in (0, n - 1) or (r * points) // n > ((r - 1) * points) // n]
    assert ranks == want and len(ranks) <= points + 1
    if 3 < points < n:  # runs of equal length: the gaps between picks differ by at most one (the last excepted)
        gaps = {b - a for a, b in zip(ranks[:-2], ranks[1:-1], strict=True)}
        assert max(gaps) - min(gaps) <= 1
    upto = [v for v in measured if v <= 100]
    assert [e.version for e in views.sample_of_type("mix", "Measured", 1000, 100)] == upto
    assert views.sample_of_type("mix", "Nothing", 10) == []
    with pytest.raises(InvalidInput):
        views.sample_of_type("mix", "Measured", 0)


def test_read_versions(store, views, mixed):
    by_version = {e.version: e for e in mixed}
    want = [1, 2, 150, 300]
    assert [(e.version, e.type) for e in views.read_versions("mix", [300, 2, 150, 1, 2, 301, 0])] == [
        (v, by_version[v].type) for v in want
    ]
    many = list(range(1, 301, 1))  # more than one IN list
    assert [e.version for e in views.read_versions("mix", many)] == many
    assert [e.version for e in views.read_versions("mix", many, ["Rejected"])] == [
        e.version for e in mixed if e.type == "Rejected"
    ]
    assert views.read_versions("mix", []) == []


def test_find_by_data(store, views, mixed):
    kinds = ["Started", "Committed", "Rejected"]
    want = [e.version for e in mixed if e.type in kinds and e.data.get("attempt_id") == "a5"]
    assert want
    assert [e.version for e in views.find_by_data("mix", kinds, "attempt_id", "a5")] == want
    assert [e.version for e in views.find_by_data("mix", kinds, "attempt_id", "a5", limit=1)] == want[:1]
    assert [e.session_id for e in views.find_by_data("mix-other", kinds, "attempt_id", "a1")] == ["mix-other"]
    assert views.find_by_data("mix", kinds, "attempt_id", "a5'; --") == []
    assert views.find_by_data("mix", ["Measured"], "attempt_id", "a5") == []
    for key in ("", "a.b", "x'y", 3):
        with pytest.raises(InvalidInput):
            views.find_by_data("mix", kinds, key, "a5")


@pytest.mark.feed
def test_the_feed_held_back_by_a_transaction_in_another_database_and_the_gauges_say_so(store, views, db_url):
    """PostgreSQL's feed shows an event once every transaction that took an id before it has ended,
    on the whole server: a transaction left open in *another* database holds this one's feed back.
    ``feed_held`` (and the ``tracker_feed_held_*`` gauges built on it) says how many events and
    for how long; SQLite's feed shows every committed event."""
    first = store.append("a", 0, [ev("Tick")])
    assert feed_shows(store, first.positions[-1])
    assert settled(views.feed_held, lambda held: held == (0, None)) == (0, None)
    if not db_url.startswith("postgresql"):
        return
    with transaction_open_elsewhere(db_url) as end:
        held = store.append("a", 1, [ev("Tick"), ev("Tick")])
        time.sleep(0.3)
        assert store.read_all(first.positions[-1]) == []  # held back (read_stream is not)
        assert [e.version for e in store.read_stream("a")] == [1, 2, 3]
        count, oldest = views.feed_held()
        assert count == 2 and oldest is not None
        gauges = fleet_gauges(views, {}, time.time())
        assert gauges["feed_held"][0] == 2 and 0.3 <= gauges["feed_held"][1] < 60
        end()
        assert feed_shows(store, held.positions[-1])
        assert [e.position for e in store.read_all(first.positions[-1])] == list(held.positions)
        assert settled(views.feed_held, lambda held: held == (0, None)) == (0, None)
