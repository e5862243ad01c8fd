"""Issue 12: the one-call append, optimistic observes, lock hand-off, and reads that stay flat at scale.

Real parts throughout: PostgreSQL (scratch databases), SQLite, a private redis-server whose
command statistics are read back, and several real processes racing on one session.
"""

from __future__ import annotations

import json
import os
import sys

import psycopg
import pytest
import redis

from tests.support.bench import CountingProjector
from tests.support.cli import run_tracker
from tests.support.measurements import measurement
from tests.support.procs import PrivateRedis, racing_context
from tracker.core import SessionProjector
from tracker.errors import ConcurrencyConflict
from tracker.store import NewEvent, open_store, upgrade, verify_projections

pytestmark = pytest.mark.serial  # CPU-sensitive: never beside an ordinary test (tests/support/plugin.py)


def ev(**data) -> NewEvent:  # noqa: ANN003
    return NewEvent("Tick", {"n": 1, **data})


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


# -- the one-call append ---------------------------------------------------------------------------


@pytest.mark.postgres
def test_a_stale_append_returns_the_current_state_without_an_error(pg_url):
    """ct_append answers a stale version with the current version and state: no SQL error, so
    the transaction is still usable afterwards and nothing reaches the server's error log."""
    upgrade(pg_url)
    store = open_store(pg_url, projector=CountingProjector())
    try:
        store.append("s", 0, [ev(), ev()])
        with pytest.raises(ConcurrencyConflict) as info:
            store.append("s", 1, [ev()])
        assert info.value.details["actual"] == 2
        assert info.value.current_state == store.load("s")[0]
        assert info.value.current_state["events"] == 2
        with psycopg.connect(_libpq(pg_url)) as conn:  # one explicit transaction
            row = conn.execute(
                "SELECT out_status, out_version, out_state FROM ct_append('s', 1, '[\"s\",2,\"Tick\",{}]', NULL, "
                "'{}', 'normal', 1, 0, 0)"
            ).fetchone()
            assert row[0] == "conflict" and row[1] == 2 and json.loads(row[2])["events"] == 2
            assert conn.execute("SELECT 1").fetchone() == (1,)  # not aborted: no error was raised
            conn.rollback()
        assert store.stream_version("s") == 2
        assert verify_projections(store, CountingProjector()) == []
    finally:
        store.close()


@pytest.mark.postgres
def test_a_used_key_replays_even_on_a_stale_version(pg_url):
    upgrade(pg_url)
    store = open_store(pg_url, projector=CountingProjector())
    try:
        first = store.append("k", 0, [ev(), ev()], idempotency_key="key-1")
        store.append("k", 2, [ev()])
        again = store.append("k", 0, [ev(), ev()], idempotency_key="key-1")
        assert again.replayed and (again.first_version, again.last_version) == (1, 2)
        assert again.positions == first.positions
        assert store.stream_version("k") == 3
    finally:
        store.close()


def test_a_caller_folded_state_is_stored_as_given(db_url):
    """``projected=``: the service's own fold is stored (no second fold), and verify agrees."""
    upgrade(db_url)
    store = open_store(db_url, projector=CountingProjector())
    try:
        r = store.append("p", 0, [ev()])
        state = CountingProjector().apply(r.state, _stored("p", 2))
        r2 = store.append("p", 1, [ev()], projected=state)
        assert r2.state == state and store.load("p") == (state, 2)
        assert verify_projections(store, CountingProjector()) == []
    finally:
        store.close()


def _stored(sid: str, version: int):  # noqa: ANN202
    from datetime import UTC, datetime

    from tracker.store import StoredEvent

    return StoredEvent(0, sid, version, "Tick", {"n": 1}, datetime.now(UTC), None)


# -- the fleet feed --------------------------------------------------------------------------------


@pytest.mark.feed  # reads the feed at once after writing: on a private cluster
def test_a_fleet_feed_reads_only_that_fleets_events(db_url):
    upgrade(db_url)
    store = open_store(db_url)
    try:
        for sid in ("fa:1", "fb:1", "fa:2", "nofleet", "fab:1", "fa:3:x"):
            store.append(sid, 0, [ev()])
        assert [e.session_id for e in store.read_all(0, 100, session_prefix="fa:")] == ["fa:1", "fa:2", "fa:3:x"]
        assert [e.session_id for e in store.read_all(0, 100, session_prefix="fb:")] == ["fb:1"]
        assert [e.session_id for e in store.read_all(0, 100, session_prefix="fa:3:")] == ["fa:3:x"]
        assert [e.session_id for e in store.read_all(0, 100, session_prefix="fa")] == [
            "fa:1",
            "fa:2",
            "fab:1",
            "fa:3:x",
        ]
        first = store.read_all(0, 1, session_prefix="fa:")
        assert [e.session_id for e in store.read_all(first[0].position, 100, session_prefix="fa:")] == [
            "fa:2",
            "fa:3:x",
        ]
    finally:
        store.close()


def test_the_migration_backfills_the_fleet_of_earlier_events(db_url):
    from sqlalchemy import create_engine, text

    upgrade(db_url, "0002_fleets")
    engine = create_engine(db_url)
    with engine.begin() as conn:
        for pos, sid in enumerate(("f1:a", "plain", "f2:b:c"), start=1):
            conn.execute(
                text(
                    "INSERT INTO events (position, session_id, version, type, data, recorded_at) "
                    "VALUES (:p, :s, 1, 'Tick', '{}', CURRENT_TIMESTAMP)"
                ),
                {"p": pos, "s": sid},
            )
    upgrade(db_url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT session_id, fleet FROM events ORDER BY position")).all()
    engine.dispose()
    assert [tuple(r) for r in rows] == [("f1:a", "f1"), ("plain", ""), ("f2:b:c", "f2")]


# -- the service: optimistic first, the lock only under contention ---------------------------------


def _commands(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}


@pytest.fixture
def private_redis():
    server = PrivateRedis().start()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.postgres
def test_an_uncontended_observe_makes_no_redis_round_trip(pg_url, private_redis):
    from tracker.coordination import RedisCoordinator
    from tracker.service import Tracker

    upgrade(pg_url)
    t = Tracker(open_store(pg_url, projector=SessionProjector()), coordinator=RedisCoordinator(private_redis.url))
    client = redis.Redis.from_url(private_redis.url)
    try:
        before = _commands(client)
        for i in range(30):
            t.observe(f"u{i % 3}", measurement=measurement(f"m{i}", 100 + i))
        after = _commands(client)
    finally:
        t.close()
        client.close()
    used = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert {k: n for k, n in used.items() if n and k not in ("info",)} == {}


def _racer(db_url: str, redis_url: str, sid: str, seed: int, rounds: int, barrier, done) -> None:  # noqa: ANN001
    from tracker.coordination import RedisCoordinator
    from tracker.service import Tracker

    t = Tracker(open_store(db_url, projector=SessionProjector()), coordinator=RedisCoordinator(redis_url))
    try:
        t.state(sid)
        barrier.wait(60)
        for i in range(rounds):
            t.observe(sid, measurement=measurement(f"m{seed}-{i}", 100 + (i * 37 + seed) % 600))
    finally:
        t.close()
    done.put(rounds)


@pytest.mark.postgres
@pytest.mark.slow
def test_contenders_queue_on_the_lock_without_polling_it(pg_url, private_redis):
    """8 processes on one session: every observe lands once, the log folds to the projection,
    and the lock is handed over by wake-ups -- a few SETs per observe, not a polling loop."""
    procs, rounds = 8, 40
    upgrade(pg_url)
    ctx = racing_context()
    barrier, done = ctx.Barrier(procs), ctx.Queue()
    client = redis.Redis.from_url(private_redis.url)
    before = _commands(client)
    racers = [
        ctx.Process(target=_racer, args=(pg_url, private_redis.url, "hot", seed, rounds, barrier, done))
        for seed in range(procs)
    ]
    for p in racers:
        p.start()
    finished = [done.get(timeout=300) for _ in racers]
    for p in racers:
        p.join(60)
    after = _commands(client)
    client.close()
    assert sum(finished) == procs * rounds
    store = open_store(pg_url, projector=SessionProjector())
    try:
        measured = [e for e in store.read_stream("hot") if e.type == "ContextMeasured"]
        assert len(measured) == procs * rounds
        assert verify_projections(store, SessionProjector()) == []
    finally:
        store.close()
    sets = after.get("set", 0) - before.get("set", 0)
    assert sets <= 3 * procs * rounds, (sets, after)  # the polling lock made ~20 SETs per observe


# -- reads at scale --------------------------------------------------------------------------------


def test_sessions_are_read_in_keyset_batches(sqlite_url):
    from tracker import queries
    from tracker.bootstrap import build_views

    upgrade(sqlite_url)
    store = open_store(sqlite_url, projector=CountingProjector())
    views = build_views(store)
    try:
        for i in range(7):
            store.append(f"s{i}", 0, [ev()])
        whole = queries.list_sessions(views, limit=100)
        assert [r["session_id"] for r in queries.iter_sessions(views, batch=2)] == [r["session_id"] for r in whole]
        assert len(list(queries.iter_sessions(views, batch=2, limit=5))) == 5
    finally:
        store.close()


def test_sessions_json_is_one_array_streamed(sqlite_url, tmp_path):
    upgrade(sqlite_url)
    store = open_store(sqlite_url, projector=CountingProjector())
    try:
        for i in range(3):
            store.append(f"j{i}", 0, [ev()])
    finally:
        store.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKER_")}
    env["TRACKER_DATABASE_URL"] = sqlite_url
    out = run_tracker(
        [sys.executable, "-m", "tracker.cli", "sessions", "--json"], capture_output=True, text=True, env=env, check=True
    )
    rows = json.loads(out.stdout)
    assert sorted(r["session_id"] for r in rows) == ["j0", "j1", "j2"]


@pytest.mark.postgres
@pytest.mark.slow
def test_the_scale_bench_reads_through_the_new_indexes():
    """The plans, not the timings: the fleet feed's generic plan stays on (fleet, position),
    a history batch is a closed version range, the pressure filter reads its index."""
    from tracker.bench import LOCAL_PG
    from tracker.bench.scale import run_scale_bench

    result = run_scale_bench(LOCAL_PG, scales=(10_000, 20_000))
    assert set(result["scales"]) == {"10000", "20000"}
    plans = {name: "\n".join(lines) for name, lines in result["explain"].items()}
    assert "fleet_position" in plans["feed_idle_fleet"]  # ix_events_fleet_position, or its partitions' (0011)
    assert "version <= $3" in plans["history_batch"]
    assert "ix_sessions_pressure_updated_at" in plans["pressure_page"]
