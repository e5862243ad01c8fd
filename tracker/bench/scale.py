"""Scale bench: audit reads on event logs of 10k, 1M (and 10M) events, built with SQL from a real seed.

``run_scale_bench(pg_url, quick)`` creates one scratch database per scale on the server of
``pg_url`` (dropped afterwards). Each log is shaped like a busy deployment: three fleets
(``fa``, ``fb``, ``fc``) whose sessions take turns writing, one idle fleet (``fi``) whose few
events are the very first ones, three long sessions (up to 100k events each) written last,
and one projection row per session (1% at ``hard_limit``, 10% at ``compact``: the pressure
filter reads a page of those). The events and
the projection rows are copies of what a real :class:`~tracker.service.Tracker` recorded
for a seed session on that database (so the JSON is the real thing), replicated by
``INSERT … SELECT generate_series`` -- minutes, not hours, for 10M events.

Each read is timed through the store (the prepared statements the tracker uses), best of
``REPEATS`` after a warm-up, and reported in ms per scale with its ratio to the smallest
scale (``vs_smallest``: the target is ≤ 1.5 for every read of one session, one page or a
tail). Next to the new reads, ``old_*`` time the statement shapes the tracker used before
migration 0003 (prefix scan for a fleet's feed, open upper bound for history batches), on the
same data. ``server_ms`` is the server's execution time of the feed, a history batch and the
pressure filter (``EXPLAIN ANALYZE`` of the generic plan a prepared statement uses), which a
busy client machine does not disturb (``server_vs_smallest``); at the largest scale,
``explain`` holds their whole ``EXPLAIN (ANALYZE, BUFFERS)``.

Building a log is one long writing transaction per step, and ``read_all`` on PostgreSQL only
returns events older than the oldest running transaction of the *whole server*: while the
bench builds, every tailer of that server stalls (never loses events). Point
``TRACKER_BENCH_PG`` at a server nobody tails.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import islice
from typing import Any

from tracker.bench.procs import create_scratch_db, drop_scratch_db
from tracker.settings import normalize_database_url

QUICK_SCALES = (10_000, 1_000_000)
FULL_SCALES = (10_000, 1_000_000, 10_000_000)
REPEATS = 15
PAGE = 100
LONG_SESSIONS = 3
FLEETS = ("fa", "fb", "fc")
IDLE_FLEET = "fi"

# The bulk: positions 11.. take turns over the busy fleets' sessions (version = turn number).
_BULK = """
INSERT INTO events (position, session_id, version, type, data, recorded_at, idempotency_key, batch_size, txid, fleet)
SELECT p, (%(fleets)s::text[])[1 + (p %% %(sessions)s) %% 3] || ':s' || (p %% %(sessions)s), 1 + (p - 11) / %(sessions)s,
       %(type)s, %(data)s::jsonb, now() - make_interval(secs => (%(n)s - p) / 100.0), NULL, 1, 1,
       (%(fleets)s::text[])[1 + (p %% %(sessions)s) %% 3]
FROM generate_series(11, 10 + %(bulk)s) AS p
"""
_LONG = """
INSERT INTO events (position, session_id, version, type, data, recorded_at, idempotency_key, batch_size, txid, fleet)
SELECT %(start)s + v, %(sid)s, v, %(type)s, %(data)s::jsonb, now(), NULL, 1, 1, 'fa'
FROM generate_series(1, %(len)s) AS v
"""
_IDLE = """
INSERT INTO events (position, session_id, version, type, data, recorded_at, idempotency_key, batch_size, txid, fleet)
SELECT v, 'fi:idle', v, %(type)s, %(data)s::jsonb, now() - interval '1 day', NULL, 1, 1, 'fi'
FROM generate_series(1, 10) AS v
"""
_SESSIONS = """
INSERT INTO sessions (session_id, version, state, pressure, revision, occupancy_bp, open_attempts, created_at, updated_at)
SELECT e.session_id, max(e.version), %(state)s::jsonb,
       CASE WHEN abs(hashtext(e.session_id)) %% 100 = 0 THEN 'hard_limit'
            WHEN abs(hashtext(e.session_id)) %% 100 < 11 THEN 'compact' ELSE 'normal' END,
       1, 5000, 0, min(e.recorded_at), max(e.recorded_at)
FROM events e GROUP BY e.session_id
"""


def _seed(db_url: str) -> tuple[str, str, str]:
    """(event type, event data JSON, state JSON) of a real observe on this database."""
    from tracker.bootstrap import build_tracker
    from tracker.settings import Settings

    with build_tracker(Settings.of(database_url=db_url)) as t:
        m = {
            "basis": "m1",
            "input_tokens": 81_234,
            "input_limit": 200_000,
            "quality": "exact_local",
            "model": {"provider": "openai", "name": "gpt-4.1"},
            "fingerprint": "9f2c4b1e" * 8,
        }
        t.observe("seed", measurement=m)
        last = list(t.store.read_stream("seed"))[-1]
        state, _ = t.store.load("seed")
    import json

    return last.type, json.dumps(last.data), json.dumps(state)


def _build(url: str, db_url: str, n: int) -> dict[str, Any]:
    """Fill the scratch database at ``url`` with an ``n``-event log; returns its shape."""
    import psycopg

    etype, data, state = _seed(db_url)
    long_len = max(2_500, min(100_000, n // 10))  # every scale reads full 2,000-event history batches
    bulk = n - 10 - LONG_SESSIONS * long_len
    sessions = 3 * max(400, n // 300)  # a multiple of 3: each session stays in one fleet
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM events")
        conn.execute("DELETE FROM sessions")
        conn.execute(_IDLE, {"type": etype, "data": data})
        conn.execute(
            _BULK,
            {"fleets": list(FLEETS), "sessions": sessions, "type": etype, "data": data, "n": n, "bulk": bulk},
        )
        start = 10 + bulk
        longs = []
        for i in range(LONG_SESSIONS):
            sid = f"fa:long{i}"
            conn.execute(_LONG, {"start": start, "sid": sid, "len": long_len, "type": etype, "data": data})
            start += long_len
            longs.append(sid)
        conn.execute(_SESSIONS, {"state": state})
        conn.execute("SELECT setval('events_position_seq', %s)", (start,))
        conn.execute("VACUUM ANALYZE events")
        conn.execute("VACUUM ANALYZE sessions")
        count = conn.execute("SELECT count(*) FROM sessions").fetchall()[0][0]
    return {"events": start, "sessions": count, "long_session_events": long_len, "longs": longs}


def _best_ms(call: Callable[[], Any]) -> float:
    call()  # warm: the statement is prepared, the pages are cached
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1000, 3)


def _reads(url: str, db_url: str, shape: dict[str, Any]) -> dict[str, float]:
    """ms per read, through the store (and, for ``old_*``, the statement shapes before 0003)."""
    import psycopg

    from tracker.bootstrap import build_storage
    from tracker.core import SessionProjector
    from tracker.settings import Settings

    db = build_storage(Settings.of(database_url=db_url).store, projector=SessionProjector())
    store = db.store
    long_sid = shape["longs"][0]
    mid = min(int(shape["long_session_events"] * 0.4), shape["long_session_events"] - 2000)
    last = shape["events"]
    try:
        out = {
            "feed_idle_fleet": _best_ms(lambda: store.read_all(10, PAGE, session_prefix=IDLE_FLEET + ":")),
            "feed_busy_fleet": _best_ms(lambda: store.read_all(0, PAGE, session_prefix="fb:")),
            "tail": _best_ms(lambda: store.read_all(last - PAGE, PAGE)),
            "history_batch": _best_ms(lambda: list(islice(store.read_stream(long_sid, mid + 1), 2000))),
            "load_session": _best_ms(lambda: store.load(long_sid)),
            "pressure_page": _best_ms(lambda: db.views.list_sessions(pressure="compact", limit=PAGE)),
        }
        with psycopg.connect(url, autocommit=True) as conn:
            out["old_feed_idle_fleet"] = _best_ms(
                lambda: conn.execute(
                    "SELECT position FROM events WHERE position > %s AND starts_with(session_id, %s) "
                    "AND txid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint ORDER BY position LIMIT %s",
                    (10, IDLE_FLEET + ":", PAGE),
                    prepare=True,
                ).fetchall()
            )
            out["old_history_batch"] = _best_ms(
                lambda: conn.execute(
                    "SELECT position, data FROM events WHERE session_id = %s AND version > %s AND version <= %s "
                    "ORDER BY version LIMIT %s",
                    (long_sid, mid, 2**31 - 1, 2000),
                ).fetchall()
            )
    finally:
        store.close()
    return out


def _explain(url: str, shape: dict[str, Any]) -> dict[str, list[str]]:
    import psycopg

    long_sid = shape["longs"][0]
    mid = min(int(shape["long_session_events"] * 0.4), shape["long_session_events"] - 2000)
    statements = {
        # the generic plan, as a prepared statement runs after five uses
        "feed_idle_fleet": (
            "SELECT position, session_id, version, type, data, recorded_at, idempotency_key FROM events "
            "WHERE fleet >= $1 AND fleet <= $1 AND position > $2 "
            "AND txid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint ORDER BY fleet, position LIMIT $3",
            (IDLE_FLEET, 10, PAGE),
        ),
        "history_batch": (
            "SELECT position, session_id, version, type, data, recorded_at, idempotency_key FROM events "
            "WHERE session_id = $1 AND version > $2 AND version <= $3 ORDER BY version LIMIT $4",
            (long_sid, mid, mid + 2000, 2000),
        ),
        "pressure_page": (
            "SELECT * FROM sessions WHERE pressure = $1 ORDER BY updated_at DESC, session_id LIMIT $2",
            ("compact", PAGE),
        ),
    }
    out: dict[str, list[str]] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        for name, (sql, params) in statements.items():
            conn.execute(f"PREPARE q_{name} AS {sql}")
            args = ", ".join(psycopg.sql.quote(p) for p in params)
            rows = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE q_{name}({args})").fetchall()
            out[name] = [r[0] for r in rows]
    return out


def _execution_ms(plan: list[str]) -> float:
    line = next(x for x in plan if x.startswith("Execution Time:"))
    return float(line.split(":")[1].split()[0])


def run_scale_bench(pg_url: str, quick: bool = False, scales: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Build each scale's log and time the audit reads on it (see the module doc)."""
    from tracker.store import upgrade

    scales = scales or (QUICK_SCALES if quick else FULL_SCALES)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"scales": {}}
    for n in scales:
        name, url = create_scratch_db(pg_url, "ct_bench_scale")
        db_url = normalize_database_url(url)
        try:
            upgrade(db_url)
            b0 = time.perf_counter()
            shape = _build(url, db_url, n)
            reads = _reads(url, db_url, shape)
            plans = _explain(url, shape)
            result["scales"][str(n)] = {
                "events": shape["events"],
                "sessions": shape["sessions"],
                "build_s": round(time.perf_counter() - b0, 1),
                "ms": reads,
                # the server's own execution time (EXPLAIN ANALYZE): unaffected by client CPU load
                "server_ms": {name: _execution_ms(lines) for name, lines in plans.items()},
            }
            if n == scales[-1]:
                result["explain"] = plans
        finally:
            drop_scratch_db(pg_url, name)
    for key, out in (("ms", "vs_smallest"), ("server_ms", "server_vs_smallest")):
        smallest = result["scales"][str(scales[0])][key]
        result[out] = {}
        for n in scales[1:]:
            ms = result["scales"][str(n)][key]
            result[out][str(n)] = {k: round(ms[k] / smallest[k], 2) if smallest[k] else None for k in ms}
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return result
