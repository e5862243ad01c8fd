"""The event store through PgBouncer in transaction pooling (``TRACKER_DATABASE_POOLER=transaction``).

PgBouncer (``pool_mode = transaction``) is started on a free loopback port in front of the
shared PostgreSQL; each test's scratch database is created and migrated directly, then used
through PgBouncer. Without the setting, psycopg's server-side prepared statements break on
the second server connection (shown below: the topology is real); with it the one-call
append, a multi-process race, a PgBouncer restart and killed server connections all pass.
"""

from __future__ import annotations

import time

import pytest

from tests.support.db import PG_ADMIN_URL
from tests.support.loopback import missing
from tests.support.measurements import measurement
from tests.support.pgbouncer import PgBouncer, terminate_backends
from tests.support.races import run_race, scratch_database
from tracker import Tracker
from tracker.core import SessionProjector
from tracker.errors import StoreError
from tracker.settings import Settings, normalize_database_url
from tracker.store import check_schema, make_engine, open_store, upgrade, verify_projections

pytestmark = [pytest.mark.serial, pytest.mark.postgres]


@pytest.fixture(scope="module")
def bouncer():
    absent = missing("pgbouncer")
    if absent:
        pytest.skip("pgbouncer is not installed (Debian package pgbouncer)")
    with PgBouncer(pool_mode="transaction", pool_size=4) as b:
        yield b


@pytest.fixture
def db(bouncer):
    """(name, direct URL, URL through PgBouncer) of a scratch database migrated directly."""
    with scratch_database(PG_ADMIN_URL) as (name, libpq):
        direct = normalize_database_url(libpq)
        upgrade(direct)
        yield name, direct, bouncer.url(name)


def _trackers(url: str, pooler: str, n: int = 2) -> list[Tracker]:
    """``n`` trackers (each its own engine and connections) wired from settings, as a process would be."""
    return [Tracker.from_settings(Settings.of(database_url=url, database_pooler=pooler)) for _ in range(n)]


def test_without_the_setting_appends_fail_on_prepared_statements(db):
    """The issue as an operator met it: psycopg prepares, the pooler hands the name to another client."""
    _, _, url = db
    trackers = _trackers(url, "none")
    try:
        with pytest.raises(StoreError, match=r'prepared statement "_pg3_\d+" (already exists|does not exist)'):
            for i in range(10):
                trackers[i % 2].observe("s", measurement=measurement(f"b{i}", 100 + i))
    finally:
        for t in trackers:
            t.close()


def test_the_one_call_append_works_through_pgbouncer_in_transaction_mode(db):
    _, direct, url = db
    trackers = _trackers(url, "transaction", n=3)
    try:
        versions = []
        for i in range(30):  # well past psycopg's prepare threshold (5), on three client connections
            versions.append(trackers[i % 3].observe("s", measurement=measurement(f"b{i}", 100 + i)).version)
        assert versions == sorted(versions) and len(set(versions)) == 30
    finally:
        for t in trackers:
            t.close()
    store = open_store(direct, projector=SessionProjector())
    try:
        assert [e.type for e in store.read_stream("s")].count("ContextMeasured") == 30
        assert verify_projections(store, SessionProjector()) == []
    finally:
        store.close()


def test_the_engine_prepares_nothing_behind_a_transaction_pooler(db):
    _, _, url = db
    engine = make_engine(url, pooler="transaction")
    try:
        with engine.connect() as conn:
            assert conn.connection.driver_connection.prepare_threshold is None
    finally:
        engine.dispose()
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            assert conn.connection.driver_connection.prepare_threshold == 5  # psycopg's default: direct
    finally:
        engine.dispose()


def test_migrations_also_run_through_pgbouncer(bouncer):
    """One transaction (with a transaction-scoped advisory lock): a transaction pooler keeps it on one backend."""
    with scratch_database(PG_ADMIN_URL) as (name, _):
        url = bouncer.url(name)
        upgrade(url)
        engine = make_engine(url, pooler="transaction")
        try:
            check_schema(engine)
        finally:
            engine.dispose()


@pytest.mark.slow
def test_a_race_of_processes_through_pgbouncer_keeps_single_flight(db):
    _, direct, url = db
    summary, counts, _ = run_race(url, None, procs=6, duration_s=3.0, pooler="transaction")
    print("race through pgbouncer:", summary, counts)
    assert counts["compact"] == summary["automatic_attempts"] >= 1
    assert summary["acknowledged_writes"] > 50
    assert counts["unavailable"] == 0


@pytest.mark.slow
def test_a_race_survives_a_pgbouncer_restart_and_killed_server_connections(db, bouncer):
    name, direct, url = db

    def faults(start_at: float) -> dict:
        time.sleep(max(0.0, start_at + 1.0 - time.time()))
        bouncer.restart(down_s=0.3)  # every client and server connection drops at once
        time.sleep(1.0)
        killed = terminate_backends(PG_ADMIN_URL, name)  # the server connections PgBouncer pooled
        return {"killed_backends": killed}

    summary, counts, happened = run_race(url, None, procs=4, duration_s=4.0, pooler="transaction", during=faults)
    print("race through pgbouncer with faults:", summary, counts, happened)
    assert happened["killed_backends"] >= 1
    # every acknowledged attempt is in the log; an attempt whose COMMIT went through while its
    # connection was killed is in the log too, but its racer saw the store unavailable, not "compact"
    # (a commit's outcome is unknown to a client whose connection drops during it)
    assert 1 <= counts["compact"] <= summary["automatic_attempts"] <= counts["compact"] + counts["unavailable"]
    assert summary["acknowledged_writes"] > 50


@pytest.mark.slow
def test_the_pooler_bench_measures_both_sides_in_one_run(bouncer):
    from tracker.bench.pooler import run_pooler_bench

    out = run_pooler_bench(PG_ADMIN_URL, quick=True, process_counts=(1,))
    assert set(out) == {"direct", "pgbouncer_transaction", "pgbouncer_vs_direct"}
    for side in ("direct", "pgbouncer_transaction"):
        fig = out[side]["1"]
        assert fig["observe_per_s"] > 0 and 0 < fig["ms_p50"] <= fig["ms_p99"], fig
        # the rate and the latencies are two measurements of the same calls: one process whose median
        # observe takes p50 ms spends at least half its calls that long, so it cannot make more than
        # 2000 / p50 a second (10 % for the last call, which may end past the window)
        assert fig["observe_per_s"] * fig["ms_p50"] <= 2000 * 1.1, fig
    assert isinstance(out["pgbouncer_vs_direct"]["1"], float) and out["pgbouncer_vs_direct"]["1"] > 0
