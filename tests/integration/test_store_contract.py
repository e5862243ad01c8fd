"""The EventStore contract, run against real SQLite and real PostgreSQL (``db_url``)."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from tracker.errors import ConcurrencyConflict, InvalidInput, InvalidSessionId, SchemaOutOfDate, StoreError
from tracker.settings import normalize_database_url
from tracker.store import NewEvent, StoredEvent, migrate, open_store, upgrade, verify_projections
from tracker.store import sql as store_sql


class ToyProjector:
    """Counts events by type; 'pressure' follows the last Pressure event's level."""

    def initial(self, session_id: str) -> dict[str, Any]:
        return {"session_id": session_id, "count": 0, "by_type": {}, "pressure": "normal", "last_version": 0, "sum": 0}

    def apply(self, state: dict[str, Any], event: StoredEvent) -> dict[str, Any]:
        by_type = dict(state["by_type"])
        by_type[event.type] = by_type.get(event.type, 0) + 1
        pressure = event.data.get("level", state["pressure"]) if event.type == "Pressure" else state["pressure"]
        return {
            **state,
            "count": state["count"] + 1,
            "by_type": by_type,
            "pressure": pressure,
            "last_version": event.version,
            "sum": state["sum"] + int(event.data.get("n", 0)),
        }

    def columns(self, state: dict[str, Any]) -> dict[str, Any]:
        return {
            "pressure": state["pressure"],
            "revision": 1 + state["by_type"].get("Compacted", 0),
            "occupancy_bp": state["sum"] if state["count"] else None,
            "open_attempts": state["by_type"].get("Started", 0) - state["by_type"].get("Compacted", 0),
        }


def fold(projector: ToyProjector, session_id: str, events: list[StoredEvent]) -> dict[str, Any]:
    state = projector.initial(session_id)
    for e in events:
        state = projector.apply(state, e)
    return json.loads(json.dumps(state))


def ev(type_: str = "Tick", **data: Any) -> NewEvent:
    return NewEvent(type_, data)


@pytest.fixture
def store(db_url):
    upgrade(db_url)
    s = open_store(db_url, projector=ToyProjector())
    yield s
    s.close()


def count_rows(url: str, table: str) -> int:
    engine = create_engine(normalize_database_url(url))
    try:
        with engine.connect() as conn:
            return conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
    finally:
        engine.dispose()


def execute_sql(url: str, sql: str, **params: Any) -> None:
    engine = create_engine(normalize_database_url(url))
    try:
        with engine.begin() as conn:
            conn.execute(text(sql), params)
    finally:
        engine.dispose()


# -- append / read ---------------------------------------------------------------------------------


def test_append_then_read_stream(store):
    before = datetime.now(UTC) - timedelta(seconds=5)
    r = store.append("s-1", 0, [ev("Started", n=1), ev("Tick", n=2, nested={"a": [1, 2, None], "u": "ünï"})])
    assert (r.session_id, r.first_version, r.last_version, r.replayed) == ("s-1", 1, 2, False)
    assert len(r.positions) == 2 and r.positions[0] < r.positions[1]
    assert r.state == fold(ToyProjector(), "s-1", list(store.read_stream("s-1")))

    events = list(store.read_stream("s-1"))
    assert [(e.version, e.type, e.position) for e in events] == [
        (1, "Started", r.positions[0]),
        (2, "Tick", r.positions[1]),
    ]
    assert events[1].data == {"n": 2, "nested": {"a": [1, 2, None], "u": "ünï"}}
    for e in events:
        assert e.session_id == "s-1"
        assert e.recorded_at.tzinfo is not None and e.recorded_at.utcoffset() == timedelta(0)
        assert before <= e.recorded_at <= datetime.now(UTC) + timedelta(seconds=5)
        assert e.idempotency_key is None
    assert store.stream_version("s-1") == 2
    assert store.stream_version("nobody") == 0
    assert list(store.read_stream("nobody")) == []
    assert store.load("nobody") == (None, 0)


def test_versions_are_gap_free_across_many_appends(store):
    rng = random.Random(7)
    version = 0
    for _ in range(30):
        batch = [ev("Tick", n=rng.randint(0, 9)) for _ in range(rng.randint(1, 5))]
        r = store.append("gapless", version, batch)
        assert r.first_version == version + 1 and r.last_version == version + len(batch)
        version = r.last_version
    versions = [e.version for e in store.read_stream("gapless")]
    assert versions == list(range(1, version + 1))
    positions = [e.position for e in store.read_stream("gapless")]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)


def test_stale_expected_version_raises_concurrency_conflict_and_writes_nothing(store, db_url):
    store.append("c", 0, [ev(), ev()])
    events_before = count_rows(db_url, "events")
    with pytest.raises(ConcurrencyConflict) as info:
        store.append("c", 1, [ev()])
    assert info.value.expected == 1 and info.value.actual == 2
    assert info.value.to_dict()["actual"] == 2
    with pytest.raises(ConcurrencyConflict) as info:  # a brand-new stream must start from 0
        store.append("c", 0, [ev()])
    assert (info.value.expected, info.value.actual) == (0, 2)
    with pytest.raises(ConcurrencyConflict) as info:  # ahead of the stream: would leave a gap
        store.append("c", 5, [ev()])
    assert (info.value.expected, info.value.actual) == (5, 2)
    with pytest.raises(ConcurrencyConflict):
        store.append("fresh", 3, [ev()])
    assert count_rows(db_url, "events") == events_before
    assert store.stream_version("fresh") == 0 and store.load("fresh") == (None, 0)
    assert store.append("c", 2, [ev()]).last_version == 3


def test_concurrency_conflict_seen_through_a_second_store(store, db_url):
    """Another process's store has the session cached at an old version: still a conflict."""
    other = open_store(db_url, projector=ToyProjector())
    try:
        other.append("shared", 0, [ev()])
        store.load("shared")  # caches version 1 here
        other.append("shared", 1, [ev()])
        with pytest.raises(ConcurrencyConflict) as info:
            store.append("shared", 1, [ev()])
        assert info.value.actual == 2
        r = store.append("shared", 2, [ev(n=5)])
        assert r.state == fold(ToyProjector(), "shared", list(store.read_stream("shared")))
    finally:
        other.close()


def test_idempotent_retry_returns_original_result_and_writes_nothing(store, db_url):
    first = store.append("idem", 0, [ev("Started"), ev("Tick", n=3), ev("Tick")], idempotency_key="req-1")
    store.append("idem", 3, [ev("Tick", n=1)])  # the stream moves on
    n_events = count_rows(db_url, "events")
    again = store.append("idem", 0, [ev("Started"), ev("Tick", n=3), ev("Tick")], idempotency_key="req-1")
    assert again.replayed is True
    assert (again.first_version, again.last_version, again.positions) == (
        first.first_version,
        first.last_version,
        first.positions,
    )
    assert again.state == first.state  # the state right after the original append, not the current one
    assert count_rows(db_url, "events") == n_events
    # the key is per session, and a new key is a new append
    other = store.append("idem-2", 0, [ev()], idempotency_key="req-1")
    assert other.replayed is False
    assert store.append("idem", 4, [ev()], idempotency_key="req-2").first_version == 5
    stored = list(store.read_stream("idem"))
    assert [e.idempotency_key for e in stored] == ["req-1", None, None, None, "req-2"]


def test_idempotent_retry_from_another_store_instance(store, db_url):
    r = store.append("idem-x", 0, [ev()], idempotency_key="k")
    other = open_store(db_url, projector=ToyProjector())
    try:
        again = other.append("idem-x", 0, [ev()], idempotency_key="k")
        assert again.replayed and again.positions == r.positions and again.state == r.state
        # a stale cache in the first store must not hide the key either
        other.append("idem-x", 1, [ev()])
        again = store.append("idem-x", 1, [ev()], idempotency_key="k")
        assert again.replayed and again.last_version == 1
    finally:
        other.close()


def test_read_stream_ranges(store, monkeypatch):
    version = 0
    for i in range(5):
        version = store.append("range", version, [ev(n=i * 10 + j) for j in range(5)]).last_version
    assert version == 25
    monkeypatch.setattr(store_sql, "READ_BATCH", 4)  # force several batches
    assert [e.version for e in store.read_stream("range")] == list(range(1, 26))
    assert [e.version for e in store.read_stream("range", 10)] == list(range(10, 26))
    assert [e.version for e in store.read_stream("range", 3, 9)] == list(range(3, 10))
    assert [e.version for e in store.read_stream("range", 8, 8)] == [8]
    assert [e.version for e in store.read_stream("range", 20, 100)] == list(range(20, 26))
    assert list(store.read_stream("range", 26)) == []
    assert list(store.read_stream("range", 9, 3)) == []
    it = store.read_stream("range")
    assert next(it).version == 1  # a lazy iterator
    with pytest.raises(InvalidInput):
        store.read_stream("range", 0)
    with pytest.raises(InvalidSessionId):
        store.read_stream("bad id!")


def test_read_all_is_ordered_and_pages(store):
    rng = random.Random(3)
    versions: dict[str, int] = {}
    for _ in range(40):
        sid = f"s{rng.randint(0, 4)}"
        versions[sid] = store.append(
            sid, versions.get(sid, 0), [ev(n=rng.randint(0, 5)) for _ in range(rng.randint(1, 3))]
        ).last_version
    everything = store.read_all(0, limit=10_000)
    assert len(everything) == sum(versions.values())
    positions = [e.position for e in everything]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    paged: list[StoredEvent] = []
    after = 0
    while True:
        page = store.read_all(after, limit=7)
        if not page:
            break
        assert len(page) <= 7
        paged.extend(page)
        after = page[-1].position
    assert paged == everything
    assert store.read_all(positions[-1]) == []
    assert store.read_all(positions[4], limit=3) == everything[5:8]
    for sid, v in versions.items():  # every stream is complete and in order within the global order
        assert [e.version for e in everything if e.session_id == sid] == list(range(1, v + 1))
    with pytest.raises(InvalidInput):
        store.read_all(-1)
    with pytest.raises(InvalidInput):
        store.read_all(0, limit=0)


def test_read_all_session_prefix_filters_exactly_and_pages(store):
    """``session_prefix``: only sessions whose id starts with it -- case-sensitive, '_' / '%' literal."""
    rng = random.Random(5)
    sids = ["fa:one", "fa:two", "fb:one", "FA:one", "fa_x", "f_:one", "fa", "fa:"]
    versions: dict[str, int] = {}
    for _ in range(60):
        sid = rng.choice(sids)
        versions[sid] = store.append(
            sid, versions.get(sid, 0), [ev(n=1) for _ in range(rng.randint(1, 2))]
        ).last_version
    everything = store.read_all(0, limit=10_000)

    def expected(prefix: str) -> list[StoredEvent]:
        return [e for e in everything if e.session_id.startswith(prefix)]

    for prefix in ("fa:", "f_:", "FA:", "fa", "fa:one", "zz:"):
        got = store.read_all(0, limit=10_000, session_prefix=prefix)
        assert got == expected(prefix), prefix
        paged: list[StoredEvent] = []
        after = 0
        while True:  # resumable by position, like the unfiltered feed
            page = store.read_all(after, limit=3, session_prefix=prefix)
            if not page:
                break
            assert len(page) <= 3 and all(e.session_id.startswith(prefix) for e in page)
            paged.extend(page)
            after = page[-1].position
        assert paged == expected(prefix), prefix
    assert {e.session_id for e in store.read_all(0, 10_000, session_prefix="fa:")} <= {"fa:one", "fa:two", "fa:"}
    assert store.read_all(0, 10_000, session_prefix=None) == everything
    for bad in ("", "a%", "x" * 201, 7, "fa:\n"):
        with pytest.raises(InvalidInput):
            store.read_all(0, session_prefix=bad)  # type: ignore[arg-type]


def test_projection_equals_fold_of_the_log(store):
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
    rows = {row["session_id"]: row for row in store.list_sessions()}
    assert set(rows) == set(versions)
    for sid, version in versions.items():
        expected = fold(projector, sid, list(store.read_stream(sid)))
        assert store.load(sid) == (expected, version)
        row = rows[sid]
        assert row["version"] == version and row["state"] == expected
        for name, value in projector.columns(expected).items():
            assert row[name] == value, (sid, name)
    assert sorted(store.session_ids()) == sorted(versions)
    assert verify_projections(store, projector) == []


def test_list_sessions_filters(store):
    store.append("calm", 0, [ev("Pressure", level="normal")])
    store.append("busy-1", 0, [ev("Pressure", level="compact")])
    store.append("busy-2", 0, [ev("Pressure", level="compact"), ev("Started")])
    store.append("full", 0, [ev("Pressure", level="hard_limit")])
    assert {r["session_id"] for r in store.list_sessions()} == {"calm", "busy-1", "busy-2", "full"}
    assert {r["session_id"] for r in store.list_sessions(pressure="compact")} == {"busy-1", "busy-2"}
    assert [r["session_id"] for r in store.list_sessions(pressure="hard_limit")] == ["full"]
    assert store.list_sessions(pressure="nothing") == []
    now = datetime.now(UTC)
    assert len(store.list_sessions(active_since=now - timedelta(minutes=5))) == 4
    assert store.list_sessions(active_since=now + timedelta(minutes=5)) == []
    assert len(store.list_sessions(pressure="compact", active_since=now - timedelta(minutes=5))) == 2
    assert len(store.list_sessions(limit=3)) == 3
    # most recently updated first
    store.append("calm", 1, [ev()])
    assert store.list_sessions(limit=1)[0]["session_id"] == "calm"
    row = next(r for r in store.list_sessions() if r["session_id"] == "busy-2")
    assert row["open_attempts"] == 1 and row["revision"] == 1 and row["version"] == 2
    assert row["created_at"].tzinfo is not None and row["updated_at"] >= row["created_at"]


def test_list_sessions_keyset_pages_within_a_prefix(store):
    """``session_prefix`` + ``after``: pages that neither overlap nor skip, only the prefix's sessions,
    also when rows share one ``updated_at`` (the id breaks the tie)."""
    for i in range(7):
        store.append(f"fa:s{i}", 0, [ev("Pressure", level="compact" if i % 2 else "normal")])
        store.append(f"fb:s{i}", 0, [ev()])
    store.append("fa", 0, [ev()])  # the bare prefix without ':' is another session
    store.append("fa:s3", 1, [ev()])  # most recent activity
    whole = store.list_sessions(session_prefix="fa:")
    assert [r["session_id"] for r in whole][0] == "fa:s3" and len(whole) == 7
    keys = [(r["updated_at"], r["session_id"]) for r in whole]
    assert keys == sorted(keys, key=lambda k: (-k[0].timestamp(), k[1]))
    paged, after = [], None
    while True:
        page = store.list_sessions(session_prefix="fa:", limit=3, after=after)
        paged += [r["session_id"] for r in page]
        if len(page) < 3:
            break
        after = (page[-1]["updated_at"], page[-1]["session_id"])
    assert paged == [r["session_id"] for r in whole]
    odd = store.list_sessions(session_prefix="fa:", pressure="compact", limit=2)
    rest = store.list_sessions(
        session_prefix="fa:", pressure="compact", after=(odd[-1]["updated_at"], odd[-1]["session_id"])
    )
    assert sorted(r["session_id"] for r in odd + rest) == ["fa:s1", "fa:s3", "fa:s5"]
    # ties on updated_at (a busy fleet): the id orders them, and the keyset goes on after the id
    tie = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    with store.engine.begin() as conn:
        conn.execute(
            text("UPDATE sessions SET updated_at = :t WHERE session_id IN ('fa:s1', 'fa:s2', 'fa:s4', 'fa:s6')"),
            {"t": tie if store.engine.dialect.name == "postgresql" else tie.replace(tzinfo=None)},
        )
    paged, after = [], None
    while True:
        page = store.list_sessions(session_prefix="fa:", limit=3, after=after)
        paged += [r["session_id"] for r in page]
        if len(page) < 3:
            break
        after = (page[-1]["updated_at"], page[-1]["session_id"])
    assert paged[:4] == ["fa:s1", "fa:s2", "fa:s4", "fa:s6"] and sorted(paged) == sorted(r["session_id"] for r in whole)
    assert (
        store.list_sessions(session_prefix="fa:", limit=10, after=(tie, "fa:s2"))[:2]
        == store.list_sessions(session_prefix="fa:", limit=10)[2:4]
    )
    assert store.list_sessions(session_prefix="FA:") == []  # exact, case-sensitive
    assert store.list_sessions(session_prefix="f_:") == []  # '_' is no wildcard
    with pytest.raises(InvalidInput):
        store.list_sessions(session_prefix="bad prefix")
    with pytest.raises(InvalidInput):
        store.list_sessions(after=("yesterday", "x"))  # type: ignore[arg-type]


def test_verify_projections_detects_tampering(store, db_url):
    projector = ToyProjector()
    store.append("ok", 0, [ev(n=1)])
    store.append("tampered", 0, [ev(n=1), ev("Started", n=2)])
    store.append("cols", 0, [ev(n=4)])
    store.append("gone", 0, [ev()])
    assert verify_projections(store, projector) == []

    execute_sql(
        db_url,
        "UPDATE sessions SET state = :s WHERE session_id = 'tampered'",
        s=json.dumps({**store.load("tampered")[0], "count": 99}),
    )
    execute_sql(db_url, "UPDATE sessions SET pressure = 'hard_limit', open_attempts = 7 WHERE session_id = 'cols'")
    execute_sql(db_url, "DELETE FROM sessions WHERE session_id = 'gone'")
    diffs = verify_projections(store, projector)
    found = {(d["session_id"], d["field"]) for d in diffs}
    assert found == {("tampered", "state"), ("cols", "pressure"), ("cols", "open_attempts"), ("gone", "row")}
    state_diff = next(d for d in diffs if d["field"] == "state")
    assert state_diff["stored"]["count"] == 99 and state_diff["expected"]["count"] == 2


def test_store_without_projector_and_rebuild(db_url):
    upgrade(db_url)
    bare = open_store(db_url)
    try:
        r = bare.append("raw", 0, [ev(n=1), ev(n=2)])
        assert r.state is None and r.last_version == 2
        assert bare.append("raw", 2, [ev(n=3)]).last_version == 3
        assert bare.load("raw") == (None, 3)
    finally:
        bare.close()
    projected = open_store(db_url, projector=ToyProjector())
    try:
        state, version = projected.load("raw")  # rebuilt from the log
        assert version == 3 and state == fold(ToyProjector(), "raw", list(projected.read_stream("raw")))
        r = projected.append("raw", 3, [ev(n=4)])
        assert r.state["sum"] == 10 and r.state["count"] == 4
        assert verify_projections(projected, ToyProjector()) == []
    finally:
        projected.close()


def test_schema_check_refuses_an_unupgraded_database(db_url):
    with pytest.raises(SchemaOutOfDate) as info:
        open_store(db_url)
    assert "run `tracker db upgrade`" in str(info.value)
    assert info.value.code == "schema_out_of_date"
    upgrade(db_url)
    open_store(db_url).close()
    # an older revision (here: back to nothing) is refused again
    migrate.downgrade(db_url, "base")
    with pytest.raises(SchemaOutOfDate, match="tracker db upgrade"):
        open_store(db_url)
    # the check can be skipped explicitly (e.g. by `tracker db upgrade` itself)
    open_store(db_url, check_schema=False).close()


def test_schema_check_refuses_an_unknown_newer_revision(db_url):
    upgrade(db_url)
    execute_sql(db_url, "UPDATE alembic_version SET version_num = '9999_from_the_future'")
    with pytest.raises(SchemaOutOfDate, match="does not know"):
        open_store(db_url)


def test_projection_row_out_of_step_is_reported(store, db_url):
    store.append("lost", 0, [ev()])
    execute_sql(db_url, "DELETE FROM sessions WHERE session_id = 'lost'")
    fresh = open_store(db_url, projector=ToyProjector())  # no cached state
    try:
        with pytest.raises(StoreError, match="tracker verify"):
            fresh.append("lost", 1, [ev()])
        assert fresh.stream_version("lost") == 1
    finally:
        fresh.close()


# -- narrow reads of one session (the console's session page) --------------------------------------

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


def test_count_by_type(store, mixed):
    want: dict[str, int] = {}
    for e in mixed:
        want[e.type] = want.get(e.type, 0) + 1
    assert store.count_by_type("mix") == want
    assert sum(store.count_by_type("mix").values()) == 300
    upto = [e for e in mixed if e.version <= 120]
    assert store.count_by_type("mix", 120) == {k: sum(1 for e in upto if e.type == k) for k in {e.type for e in upto}}
    assert store.count_by_type("nobody") == {}
    with pytest.raises(InvalidSessionId):
        store.count_by_type("bad id!")


def test_read_types_pages_in_version_order(store, mixed, monkeypatch):
    monkeypatch.setattr(store_sql, "READ_BATCH", 7)  # force several batches
    want = [e for e in mixed if e.type in ("Started", "Rejected")]
    got = list(store.read_types("mix", ["Started", "Rejected"]))
    assert [(e.version, e.type, e.data) for e in got] == [(e.version, e.type, e.data) for e in want]
    assert all(e.session_id == "mix" for e in got)
    assert [e.version for e in store.read_types("mix", ["Started"], 100, 200)] == [
        e.version for e in mixed if e.type == "Started" and 100 <= e.version <= 200
    ]
    assert [e.version for e in store.read_types("mix", ["Measured"], 50, limit=9)] == [
        e.version for e in mixed if e.type == "Measured" and e.version >= 50
    ][:9]
    assert list(store.read_types("mix", ["Nothing"])) == []
    for bad in ([], "Started", [""], None):
        with pytest.raises(InvalidInput):
            store.read_types("mix", bad)
    with pytest.raises(InvalidInput):
        store.read_types("mix", ["Started"], 0)
    with pytest.raises(InvalidInput):
        store.read_types("mix", ["Started"], limit=0)


def test_last_of_types(store, mixed):
    fails = [e.version for e in mixed if e.type in ("CountFailed", "Committed")]
    assert [e.version for e in store.last_of_types("mix", ["CountFailed", "Committed"], 5)] == fails[-5:]
    assert [e.version for e in store.last_of_types("mix", ["Measured"])] == [
        [e.version for e in mixed if e.type == "Measured"][-1]
    ]
    below = [e.version for e in mixed if e.type == "Started" and e.version <= 150]
    assert [e.version for e in store.last_of_types("mix", ["Started"], 3, 150)] == below[-3:]
    assert [e.version for e in store.last_of_types("mix", ["Started"], 1000)] == [
        e.version for e in mixed if e.type == "Started"
    ]
    assert store.last_of_types("nobody", ["Started"]) == []


@pytest.mark.parametrize("points", [1, 7, 50, 199, 200, 500])
def test_sample_of_type_spreads_evenly_and_keeps_the_ends(store, mixed, points):
    measured = [e.version for e in mixed if e.type == "Measured"]  # 200 of them
    got = store.sample_of_type("mix", "Measured", points)
    assert store.sample_of_type("mix", "Measured", points, total=200) == got  # the count given, not read
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
    assert [e.version for e in store.sample_of_type("mix", "Measured", 1000, 100)] == upto
    assert store.sample_of_type("mix", "Nothing", 10) == []
    with pytest.raises(InvalidInput):
        store.sample_of_type("mix", "Measured", 0)


def test_read_versions(store, mixed):
    by_version = {e.version: e for e in mixed}
    want = [1, 2, 150, 300]
    assert [(e.version, e.type) for e in store.read_versions("mix", [300, 2, 150, 1, 2, 301, 0])] == [
        (v, by_version[v].type) for v in want
    ]
    many = list(range(1, 301, 1))  # more than one IN list
    assert [e.version for e in store.read_versions("mix", many)] == many
    assert [e.version for e in store.read_versions("mix", many, ["Rejected"])] == [
        e.version for e in mixed if e.type == "Rejected"
    ]
    assert store.read_versions("mix", []) == []


def test_find_by_data(store, mixed):
    kinds = ["Started", "Committed", "Rejected"]
    want = [e.version for e in mixed if e.type in kinds and e.data.get("attempt_id") == "a5"]
    assert want
    assert [e.version for e in store.find_by_data("mix", kinds, "attempt_id", "a5")] == want
    assert [e.version for e in store.find_by_data("mix", kinds, "attempt_id", "a5", limit=1)] == want[:1]
    assert [e.session_id for e in store.find_by_data("mix-other", kinds, "attempt_id", "a1")] == ["mix-other"]
    assert store.find_by_data("mix", kinds, "attempt_id", "a5'; --") == []
    assert store.find_by_data("mix", ["Measured"], "attempt_id", "a5") == []
    for key in ("", "a.b", "x'y", 3):
        with pytest.raises(InvalidInput):
            store.find_by_data("mix", kinds, key, "a5")
