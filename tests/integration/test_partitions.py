"""The partitioned log on PostgreSQL (migrations 0011, 0012): monthly partitions of ``events`` by
``recorded_at``, kept ahead by the store, a DEFAULT partition, and the uniqueness the partitioned
table cannot hold in an index, kept by the ``ct_events_unique`` triggers -- proved with racing
processes; the online conversion from 0010 with an appender running through it, and back.
(The store contract, the hash chain, the feed's views and the racing writers + tailer of
tests/integration/test_store_concurrency.py run on this table too, unchanged.)
"""

from __future__ import annotations

import threading
import time
import traceback
from datetime import UTC, datetime

import psycopg
import pytest

from tests.support.db import feed_shows, transaction_open_elsewhere
from tests.support.procs import racing_context
from tests.support.toy_store import ToyProjector, ev
from tracker.errors import ConcurrencyConflict
from tracker.settings import normalize_database_url
from tracker.store import migrate, open_store, upgrade, verify_projections
from tracker.store.verify import verify_chains

pytestmark = pytest.mark.postgres

PREVIOUS = "0010_hash_chain"


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _rows(url: str, sql: str, params: tuple | None = None) -> list[tuple]:
    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description is not None else []


def _partitions(url: str) -> dict[str, str]:
    """name -> bound of each partition of events."""
    rows = _rows(
        url,
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i JOIN pg_class c "
        "ON c.oid = i.inhrelid WHERE i.inhparent = 'events'::regclass",
    )
    return dict(rows)


def _month_name(year: int, month: int, ahead: int = 0) -> str:
    y, m = divmod(year * 12 + month - 1 + ahead, 12)
    return f"events_y{y:04d}m{m + 1:02d}"


def _log(url: str) -> list[tuple]:
    return _rows(url, "SELECT position, session_id, version, type, data, hash, txid FROM events ORDER BY position")


@pytest.fixture
def head(pg_url):
    upgrade(pg_url)
    return pg_url


# -- the partitions -----------------------------------------------------------------------------------


def test_events_is_partitioned_by_month_and_the_store_keeps_months_ahead(head):
    assert _rows(head, "SELECT relkind FROM pg_class WHERE relname = 'events'") == [("p",)]
    now = datetime.now(UTC)
    parts = _partitions(head)
    assert parts["events_default"] == "DEFAULT"
    for ahead in range(4):
        assert _month_name(now.year, now.month, ahead) in parts
    # the furthest month gone: a new store's first append makes it again
    far = _month_name(now.year, now.month, 3)
    _rows(head, f"ALTER TABLE events DETACH PARTITION {far}")
    _rows(head, f"DROP TABLE {far}")
    store = open_store(head, projector=ToyProjector())
    try:
        store.append("p-1", 0, [ev()])
        assert far in _partitions(head)
        assert _rows(head, "SELECT tableoid::regclass::text FROM events") == [(_month_name(now.year, now.month),)]
    finally:
        store.close()


def test_an_event_without_its_months_partition_goes_to_default_and_moves_out_when_it_is_made(head):
    store = open_store(head, projector=ToyProjector())
    try:
        store.append("old", 0, [ev(), ev()])
        _rows(head, "UPDATE events SET recorded_at = '2020-01-15T00:00:00Z' WHERE session_id = 'old'")
        where = "SELECT tableoid::regclass::text, count(*) FROM events WHERE session_id = 'old' GROUP BY 1"
        assert _rows(head, where) == [("events_default", 2)]
        made = _rows(head, "SELECT ct_events_ensure_partitions('2019-12-20', '2020-01-02')")
        assert made == [(2,)]  # December 2019 and January 2020
        assert _rows(head, where) == [("events_y2020m01", 2)]
        assert [e.version for e in store.read_stream("old")] == [1, 2]
        assert store.append("old", 2, [ev()]).last_version == 3
        assert verify_chains(store)["broken"] == []
    finally:
        store.close()


# -- uniqueness across partitions ---------------------------------------------------------------------

_RAW = (
    "INSERT INTO events (session_id, version, type, data, recorded_at, idempotency_key) "
    "VALUES (%s, %s, 'Tick', '{}', %s, %s)"
)


def test_duplicates_across_partitions_are_refused_like_the_unique_indexes_did(head):
    store = open_store(head, projector=ToyProjector())
    try:
        store.append("u", 0, [ev()], idempotency_key="k1")
        store.append("u", 1, [ev()])
    finally:
        store.close()
    before = _log(head)
    cases = [
        (_RAW, ("u", 2, "2020-03-01T00:00:00Z", None), "uq_events_session_id_version"),
        (_RAW, ("u", 3, "2020-03-01T00:00:00Z", "k1"), "uq_events_session_id_idempotency_key"),
        (
            "INSERT INTO events (position, session_id, version, type, data, recorded_at) "
            "VALUES (%s, 'other', 1, 'Tick', '{}', '2020-03-01T00:00:00Z')",
            (before[0][0],),
            "pk_events",
        ),
        ("UPDATE events SET version = 1 WHERE session_id = %s AND version = 2", ("u",), "uq_events_session_id_version"),
        (  # two rows of one statement
            "INSERT INTO events (session_id, version, type, data, recorded_at) VALUES "
            "(%s, 9, 'Tick', '{}', now()), (%s, 9, 'Tick', '{}', '2020-03-01T00:00:00Z')",
            ("v", "v"),
            "uq_events_session_id_version",
        ),
    ]
    for sql, params, constraint in cases:
        with pytest.raises(psycopg.errors.UniqueViolation) as info:
            _rows(head, sql, params)
        assert info.value.diag.constraint_name == constraint
    with psycopg.connect(_libpq(head)) as conn:  # REPEATABLE READ cannot see what the checks need
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="READ COMMITTED"):
            conn.execute(_RAW, ("w", 1, "2020-03-01T00:00:00Z", None))
    assert _log(head) == before


def _fill_seq_tuples(url: str) -> int:
    """20 statements of 50 new events each into the current month, on one connection, in one
    transaction, after ``VACUUM FULL events`` (every partition's statistics say empty): the tuples
    that sequential scans of the partitions read meanwhile (``pg_stat_xact_user_tables``)."""
    _rows(url, "VACUUM FULL events")
    with psycopg.connect(_libpq(url)) as conn:
        for k in range(20):
            conn.execute(
                "INSERT INTO events (session_id, version, type, data, recorded_at) "
                "SELECT %s, g, 'Tick', '{}', now() FROM generate_series(1, 50) g",
                (f"fill-{k}",),
            )
        (read,) = conn.execute(
            "SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_xact_user_tables WHERE relname LIKE 'events%'"
        ).fetchone()
        conn.rollback()
    return int(read)


def test_the_checks_probe_the_indexes_whatever_the_statistics_say_and_0011_did_not(head):
    """Migration 0012: the checks are index probes per written row, planned with enable_seqscan
    off; 0011's joins, planned once for partitions that looked empty, read them whole each time."""
    assert _rows(head, "SELECT proconfig FROM pg_proc WHERE proname = 'ct_events_unique'") == [
        (["enable_seqscan=off"],)
    ]
    assert _fill_seq_tuples(head) == 0
    migrate.downgrade(head, "0011_partitioned_events")
    try:
        assert _rows(head, "SELECT proconfig FROM pg_proc WHERE proname = 'ct_events_unique'") == [(None,)]
        assert _fill_seq_tuples(head) > 10_000  # (20 statements, each reading what the earlier ones wrote)
    finally:
        upgrade(head)
    assert _fill_seq_tuples(head) == 0


def _raw_racer(url: str, month: str, go, hold_s: float, out) -> None:  # noqa: ANN001
    """Insert (race, 1) into ``month`` behind the store's back, hold the transaction, commit."""
    try:
        with psycopg.connect(url) as conn:
            assert go.wait(30)
            conn.execute(_RAW, ("race", 1, f"{month}-15T00:00:00Z", None))
            time.sleep(hold_s)  # every racer inserts before any commits
            conn.commit()
        out.put("won")
    except psycopg.errors.UniqueViolation:
        out.put("refused")
    except BaseException:  # noqa: BLE001
        out.put(traceback.format_exc())


def test_racing_processes_inserting_one_version_into_different_partitions_one_wins(head):
    months = ["2021-01", "2021-02", "2021-03", "2021-04", "2021-05", "2021-06"]
    _rows(head, "SELECT ct_events_ensure_partitions('2021-01-01', '2021-06-01')")
    ctx = racing_context()
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_raw_racer, args=(_libpq(head), m, go, 0.5, out)) for m in months]
    for p in procs:
        p.start()
    go.set()
    results = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == ["refused"] * 5 + ["won"], results
    assert _rows(head, "SELECT count(*) FROM events WHERE session_id = 'race'") == [(1,)]


def _store_racer(url: str, go, out) -> None:  # noqa: ANN001
    """Append to the one stream ``shared`` through the store, 10 wins, retrying lost races."""
    try:
        store = open_store(normalize_database_url(url), projector=ToyProjector())
        store.before_commit = lambda sid, positions: time.sleep(0.003)  # widen the race
        assert go.wait(30)
        known, wins = 0, []
        while len(wins) < 10:
            try:
                r = store.append("shared", known, [ev(), ev()])
            except ConcurrencyConflict as exc:
                known = exc.actual
                continue
            wins.append((r.first_version, r.last_version))
            known = r.last_version
        store.close()
        out.put(wins)
    except BaseException:  # noqa: BLE001
        out.put(traceback.format_exc())


@pytest.mark.feed
def test_racing_processes_appending_to_one_stream_that_spans_partitions(head):
    """The stream's first events sit in an old month's partition, the new ones in this month's:
    six processes race for its versions; each version is won once, the feed is gap- and duplicate-free."""
    store = open_store(head, projector=ToyProjector())
    try:
        store.append("shared", 0, [ev(), ev()])
        _rows(head, "SELECT ct_events_ensure_partitions('2020-06-01', '2020-06-01')")
        _rows(head, "UPDATE events SET recorded_at = '2020-06-15T00:00:00Z' WHERE session_id = 'shared'")
        ctx = racing_context()
        go, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_store_racer, args=(_libpq(head), go, out)) for _ in range(6)]
        for p in procs:
            p.start()
        go.set()
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        assert all(isinstance(r, list) for r in results), results
        won = sorted(v for r in results for first, last in r for v in range(first, last + 1))
        assert won == list(range(3, 3 + 6 * 10 * 2))  # every version won exactly once
        log = _rows(head, "SELECT version, tableoid::regclass::text FROM events WHERE session_id = 'shared'")
        assert sorted(v for v, _ in log) == list(range(1, 123))
        assert {t for v, t in log if v <= 2} == {"events_y2020m06"}
        assert feed_shows(store, max(p for (p,) in _rows(head, "SELECT position FROM events")))
        feed = store.read_all(0, limit=10_000)
        positions = [e.position for e in feed]
        assert positions == sorted(set(positions)) and len(feed) == 122
        assert verify_chains(store)["broken"] == [] and verify_projections(store, ToyProjector()) == []
    finally:
        store.close()


# -- the conversion ---------------------------------------------------------------------------------


def test_the_conversion_keeps_every_event_while_an_appender_runs_and_downgrades_back(pg_url):
    migrate.upgrade(pg_url, PREVIOUS)
    old = open_store(pg_url, projector=ToyProjector(), check_schema=False)  # the running old version
    try:
        for i in range(40):
            old.append(f"f{i % 3}:s{i}", 0, [ev(n=i), ev(n=i + 1)], idempotency_key=f"k{i}" if i % 4 == 0 else None)
        # events of three months (the conversion makes a partition for each month since the oldest)
        _rows(pg_url, "UPDATE events SET recorded_at = recorded_at - interval '70 days' WHERE session_id LIKE 'f0:%'")
        _rows(pg_url, "UPDATE events SET recorded_at = recorded_at - interval '35 days' WHERE session_id LIKE 'f1:%'")
        stop, errors, appended = threading.Event(), [], []

        def appender() -> None:  # appends go on through the conversion (ct_append is unchanged)
            version = 0
            while not stop.is_set():
                try:
                    key = f"live-{version}" if version % 2 else None  # keyed appends lock in another order
                    version = old.append("live", version, [ev()], idempotency_key=key).last_version
                    appended.append(version)
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)
                    return

        thread = threading.Thread(target=appender)
        thread.start()
        time.sleep(0.2)
        assert migrate.upgrade(pg_url) == migrate.head_revision()
        time.sleep(0.2)
        stop.set()
        thread.join(30)
        assert errors == [] and len(appended) > 2
        assert _rows(pg_url, "SELECT relkind FROM pg_class WHERE relname = 'events'") == [("p",)]
        after = _log(pg_url)
        assert [r[1:3] for r in after if r[1] == "live"] == [("live", v) for v in appended]
        assert len({r[0] for r in after}) == len(after) == 80 + len(appended)
        assert len(_partitions(pg_url)) >= 3 + 4 + 1  # the two older months, this one and three ahead, DEFAULT
        store = open_store(pg_url, projector=ToyProjector())
        try:
            assert verify_chains(store)["broken"] == [] and verify_projections(store, ToyProjector()) == []
            assert store.append("f0:s0", 2, [ev()], idempotency_key="k0").replayed
            assert store.append("f0:s0", 2, [ev()]).last_version == 3
        finally:
            store.close()
        converted = _log(pg_url)
        assert migrate.downgrade(pg_url, PREVIOUS) == PREVIOUS
        assert _rows(pg_url, "SELECT relkind FROM pg_class WHERE relname = 'events'") == [("r",)]
        assert _log(pg_url) == converted
        assert old.append("live", appended[-1], [ev()]).last_version == appended[-1] + 1
        with pytest.raises(psycopg.errors.UniqueViolation):  # the unique constraint is back
            _rows(pg_url, _RAW, ("live", 1, "2020-01-01T00:00:00Z", None))
    finally:
        old.close()


@pytest.mark.feed
def test_the_conversion_copies_everything_while_a_transaction_elsewhere_holds_the_feed_back(pg_url):
    """Step 2 copies only what the feed shows; with the feed held back by a transaction open in
    another database, the swap copies the rest under its locks: nothing is lost either way."""
    migrate.upgrade(pg_url, PREVIOUS)
    old = open_store(pg_url, projector=ToyProjector(), check_schema=False)
    try:
        old.append("before", 0, [ev(), ev()])
        with transaction_open_elsewhere(pg_url):
            for i in range(30):
                old.append(f"held-{i}", 0, [ev(n=i)])
            before = _log(pg_url)
            assert migrate.upgrade(pg_url) == migrate.head_revision()
        assert _log(pg_url) == before and len(before) == 32
    finally:
        old.close()
    store = open_store(pg_url, projector=ToyProjector())
    try:
        assert feed_shows(store, before[-1][0])
        assert [(e.position, e.session_id, e.version) for e in store.read_all(0)] == [r[:3] for r in before]
        assert verify_chains(store)["broken"] == []
    finally:
        store.close()
