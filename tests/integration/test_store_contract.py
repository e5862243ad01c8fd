"""The EventStore contract, run against the in-memory store, real SQLite and real PostgreSQL.

``store`` is each of the three (``backend``). A test that is about something only a database
has -- a second store instance on the same database (another process), rows edited behind the
store's back, the schema's migrations -- runs on the two SQL backends only (``sql_store`` on
``db_url``) and says so. The read side's views (listings, narrow reads): ``tests/integration/test_store_views.py``.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from tests.support.toy_store import ToyProjector, ev, execute_sql, fold
from tracker.errors import ConcurrencyConflict, InvalidInput, InvalidSessionId, SchemaOutOfDate, StoreError
from tracker.settings import normalize_database_url
from tracker.store import NewEvent, StoredEvent, migrate, open_store, upgrade, verify_projections
from tracker.store import sql as store_sql


@pytest.fixture
def sql_store(db_url):
    """The store on a real database (SQLite and PostgreSQL only)."""
    upgrade(db_url)
    s = open_store(db_url, projector=ToyProjector())
    yield s
    s.close()


def count_events(store: Any, url: str | None) -> int:
    """How many events the log holds: counted in the table on a database, read whole in memory."""
    if url is None:
        return len(store.read_all(0, limit=10**9))
    return count_rows(url, "events")


def count_rows(url: str, table: str) -> int:
    engine = create_engine(normalize_database_url(url))
    try:
        with engine.connect() as conn:
            return conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
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


def test_stale_expected_version_raises_concurrency_conflict_and_writes_nothing(store, backend):
    store.append("c", 0, [ev(), ev()])
    events_before = count_events(store, backend)
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
    assert count_events(store, backend) == events_before
    assert store.stream_version("fresh") == 0 and store.load("fresh") == (None, 0)
    assert store.append("c", 2, [ev()]).last_version == 3


def test_concurrency_conflict_seen_through_a_second_store(sql_store, db_url):
    """Another process's store has the session cached at an old version: still a conflict.
    (SQL only: two store instances share one database; a MemoryEventStore is its own.)"""
    store = sql_store
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


def test_idempotent_retry_returns_original_result_and_writes_nothing(store, backend):
    first = store.append("idem", 0, [ev("Started"), ev("Tick", n=3), ev("Tick")], idempotency_key="req-1")
    store.append("idem", 3, [ev("Tick", n=1)])  # the stream moves on
    n_events = count_events(store, backend)
    again = store.append("idem", 0, [ev("Started"), ev("Tick", n=3), ev("Tick")], idempotency_key="req-1")
    assert again.replayed is True
    assert (again.first_version, again.last_version, again.positions) == (
        first.first_version,
        first.last_version,
        first.positions,
    )
    assert again.state == first.state  # the state right after the original append, not the current one
    assert count_events(store, backend) == n_events
    # the key is per session, and a new key is a new append
    other = store.append("idem-2", 0, [ev()], idempotency_key="req-1")
    assert other.replayed is False
    assert store.append("idem", 4, [ev()], idempotency_key="req-2").first_version == 5
    stored = list(store.read_stream("idem"))
    assert [e.idempotency_key for e in stored] == ["req-1", None, None, None, "req-2"]


def test_idempotent_retry_from_another_store_instance(sql_store, db_url):
    """(SQL only: a second store instance on the same database.)"""
    store = sql_store
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


@pytest.mark.feed
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


@pytest.mark.feed
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
    rows = {sid: store.projection_row(sid) for sid, _ in store.log_versions()}
    assert set(rows) == set(versions)
    for sid, version in versions.items():
        expected = fold(projector, sid, list(store.read_stream(sid)))
        assert store.load(sid) == (expected, version)
        row = rows[sid]
        assert row["version"] == version and row["state"] == expected
        for name, value in projector.columns(expected).items():
            assert row[name] == value, (sid, name)
    assert list(store.log_versions()) == sorted(versions.items())
    assert verify_projections(store, projector) == []


def test_verify_projections_detects_tampering(sql_store, db_url):
    """(SQL only: the rows are edited behind the store's back.)"""
    store = sql_store
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
    """(SQL only: the same database reopened with a projector; a MemoryEventStore keeps its one.)"""
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
    """(SQL only: schemas and migrations are a database's.)"""
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


def test_projection_row_out_of_step_is_reported(sql_store, db_url):
    """(SQL only: the projection row is deleted behind the store's back.)"""
    store = sql_store
    store.append("lost", 0, [ev()])
    execute_sql(db_url, "DELETE FROM sessions WHERE session_id = 'lost'")
    fresh = open_store(db_url, projector=ToyProjector())  # no cached state
    try:
        with pytest.raises(StoreError, match="tracker verify"):
            fresh.append("lost", 1, [ev()])
        assert fresh.stream_version("lost") == 1
    finally:
        fresh.close()


def test_a_conflict_carries_the_current_state_and_a_key_is_found_again(store):
    r = store.append("cs", 0, [ev("Started", n=1), ev(n=2)], idempotency_key="k-1")
    with pytest.raises(ConcurrencyConflict) as info:
        store.append("cs", 1, [ev()])
    assert (info.value.expected, info.value.actual) == (1, 2)
    assert info.value.current_state == r.state == fold(ToyProjector(), "cs", list(store.read_stream("cs")))
    found = store.find_idempotent("cs", "k-1")
    assert found is not None and found.replayed
    assert (found.first_version, found.last_version, found.positions, found.state) == (1, 2, r.positions, r.state)
    assert store.find_idempotent("cs", "k-2") is None and store.find_idempotent("nobody", "k-1") is None


def test_a_projected_state_is_stored_as_given_and_verify_sees_a_wrong_one(store):
    projector = ToyProjector()
    first = store.append("pj", 0, [ev(n=1)])
    right = fold(
        projector, "pj", [*store.read_stream("pj"), StoredEvent(0, "pj", 2, "Tick", {"n": 2}, datetime.now(UTC), None)]
    )
    r = store.append("pj", 1, [ev(n=2)], projected=right)
    assert r.state == right and store.load("pj") == (right, 2) and first.state["sum"] == 1
    assert verify_projections(store, projector) == []
    wrong = {**right, "sum": 99}
    store.append("pj", 2, [ev(n=3)], projected=wrong)  # the caller's word: verify is what checks it
    assert store.load("pj") == (wrong, 3)
    assert {d["field"] for d in verify_projections(store, projector)} == {"state", "occupancy_bp"}


def test_verification_reads(store):
    assert list(store.log_versions()) == [] and store.projection_row("none") is None
    store.append("vb", 0, [ev("Started", n=3)])
    store.append("va", 0, [ev(), ev("Pressure", level="compact")])
    assert list(store.log_versions()) == [("va", 2), ("vb", 1)]
    row = store.projection_row("vb")
    assert row is not None
    assert {k: row[k] for k in ("session_id", "version", "pressure", "revision", "occupancy_bp", "open_attempts")} == {
        "session_id": "vb",
        "version": 1,
        "pressure": "normal",
        "revision": 1,
        "occupancy_bp": 3,
        "open_attempts": 1,
    }
    assert row["state"] == store.load("vb")[0] and row["created_at"] <= row["updated_at"]
    state, version = store.fold_stream("va")
    assert version == 2 and state == store.load("va")[0]
    assert store.fold_stream("va", 1)[1] == 1
    with pytest.raises(InvalidSessionId):
        store.projection_row("bad id!")


def test_read_inputs_are_checked_alike(store):
    for call, field in (
        (lambda: store.read_all(True), "after_position"),
        (lambda: store.read_all(0, limit=True), "limit"),
        (lambda: store.read_stream("x", True), "from_version"),
        (lambda: store.read_stream("x", 1, "2"), "to_version"),
    ):
        with pytest.raises(InvalidInput) as info:
            call()
        assert info.value.field == field
    for call in (store.load, store.stream_version, store.read_stream):
        with pytest.raises(InvalidSessionId):
            call("x" * 201)
