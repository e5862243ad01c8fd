"""Service bench: ``Tracker.observe`` decisions/s and latency on Postgres + Redis.

1, 4 and 16 real processes, each a fleet worker observing its own sessions (measurement
given, so counting is excluded), with the Redis session lock, the load → decide → append
path and the projection, measured in one timed window after a common start. Next to it, in
each round, by the same processes on the same database, the raw psycopg single-row INSERT +
COMMIT baseline of the store bench (the cheapest durable write the database can do), giving
``observe_vs_raw`` per process count as a ratio within each round. ``wal_bytes_per_observe``:
the WAL one observe writes (one process, after the rounds), beside the store section's ``wal_bytes``.

Each process builds its ``Tracker`` with ``build_tracker(Settings.of(...))``, the same
composition root every entry point uses.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tracker.bench.procs import barrier_pool, create_scratch_db, drop_scratch_db, wait_at_start_line
from tracker.bench.stats import latency_ms, over_rounds, ratio, throughput
from tracker.settings import normalize_database_url

if TYPE_CHECKING:  # pragma: no cover
    from tracker.service import Tracker
    from tracker.settings import Settings

PROCESS_COUNTS = (1, 4, 16)
SESSIONS_PER_PROCESS = 8  # each process observes its own sessions in turn
ROUNDS = 3  # windows per process count; the figures are their medians


def _observer(args: tuple[str, str | None, str, float]) -> tuple[int, list[float]]:
    db_url, redis_url, prefix, duration = args
    from tracker.settings import Settings

    return observe_for(Settings.of(database_url=db_url, redis_url=redis_url), prefix, duration)


def observer(t: Tracker, prefix: str) -> Callable[[int], None]:
    """``one(i)``: the ``i``-th observe of ``t`` on the sessions named after ``prefix`` -- a session
    that climbs and stays under its compact level (the common case: proceed), measurement given.
    Each session is observed once here, untimed (they exist, the connections are warm): the
    caller's observes start at ``i = SESSIONS_PER_PROCESS``."""
    fp = hashlib.sha256(prefix.encode()).hexdigest()
    sessions = [f"{prefix}-{i}" for i in range(SESSIONS_PER_PROCESS)]

    def one(i: int) -> None:
        m = {
            "basis": f"m{i}",
            "input_tokens": 1000 + (i % 500) * 100,
            "input_limit": 200_000,
            "quality": "exact_local",
            "model": {"provider": "openai", "name": "gpt-4o"},
            "fingerprint": fp,
        }
        t.observe(sessions[i % len(sessions)], measurement=m)

    for i in range(SESSIONS_PER_PROCESS):
        one(i)
    return one


def observe_for(settings: Settings, prefix: str, duration: float) -> tuple[int, list[float]]:
    """In a pool process: a ``Tracker`` of ``settings`` observes its sessions named after ``prefix``,
    once each untimed, then from the common start line for ``duration`` s; (observes, latencies)."""
    from tracker.bootstrap import build_tracker

    t = build_tracker(settings)
    latencies: list[float] = []
    try:
        one = observer(t, prefix)
        wait_at_start_line(300)  # every process is ready: start together
        end = time.time() + duration
        i = SESSIONS_PER_PROCESS
        while time.time() < end:
            t0 = time.perf_counter()
            one(i)
            latencies.append(time.perf_counter() - t0)
            i += 1
    finally:
        t.close()
    return len(latencies), latencies


def _wal_per_observe(settings: Settings, url: str) -> int:
    """Bytes of WAL per observe (one process, its sessions started first): the event and the
    projection row's update with the session's state, in one commit."""
    from tracker.bench.store import wal_per_op
    from tracker.bootstrap import build_tracker

    t = build_tracker(settings)
    try:
        one = observer(t, f"wal-{uuid.uuid4().hex[:6]}")
        return wal_per_op(url, lambda i: one(SESSIONS_PER_PROCESS + i))
    finally:
        t.close()


def run_service_bench(
    pg_url: str,
    redis_url: str | None,
    quick: bool = False,
    process_counts: tuple[int, ...] = PROCESS_COUNTS,
) -> dict[str, Any]:
    """observe/s and p50/p99 per process count, next to a raw INSERT baseline measured beside it.

    Each process count is measured ``ROUNDS`` times on the same pool of processes, each round an
    observe window and a raw psycopg INSERT + COMMIT window (the store bench's writer, same
    processes, same database), alternating which goes first; figures are the medians of the
    rounds (``[min, max]`` under ``spread``), ``observe_vs_raw`` the median of the rounds' own ratios.
    """
    import psycopg

    from tracker.bench.store import _RAW_TABLE, _raw_writer, _window
    from tracker.settings import Settings
    from tracker.store import upgrade

    duration = 1.0 if quick else 4.0
    name, url = create_scratch_db(pg_url, "ct_bench")
    db_url = normalize_database_url(url)
    try:
        upgrade(db_url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(_RAW_TABLE)
        out: dict[str, Any] = {
            "processes": {},
            "observe_vs_raw": {},
            "raw_insert_per_s": {},
            "redis": bool(redis_url),
            "rounds": ROUNDS,
        }
        spread: dict[str, Any] = {"processes": {}, "observe_vs_raw": {}, "raw_insert_per_s": {}}
        for n in process_counts:
            measured = []
            with barrier_pool(n) as pool:
                for r in range(ROUNDS):
                    raw_first = r % 2 == 1
                    raw = _window(pool, _raw_writer, url, n, duration, "raw") if raw_first else None
                    args = [(db_url, redis_url, f"svc-{n}-{r}-{uuid.uuid4().hex[:6]}-{i}", duration) for i in range(n)]
                    results = pool.map(_observer, args, chunksize=1)
                    if raw is None:
                        raw = _window(pool, _raw_writer, url, n, duration, "raw")
                    lat = [x for res in results for x in res[1]]
                    observed = throughput(sum(res[0] for res in results), duration)
                    measured.append(
                        {
                            "observe_per_s": round(observed),
                            **latency_ms(lat),
                            "raw_insert_per_s": round(raw),
                            "observe_vs_raw": ratio(observed, raw),
                        }
                    )
            figures = over_rounds(measured)
            rounds_spread = figures.pop("spread")
            figures.pop("rounds")
            key = str(n)
            out["raw_insert_per_s"][key] = figures.pop("raw_insert_per_s")
            out["observe_vs_raw"][key] = figures.pop("observe_vs_raw")
            spread["raw_insert_per_s"][key] = rounds_spread.pop("raw_insert_per_s")
            spread["observe_vs_raw"][key] = rounds_spread.pop("observe_vs_raw")
            out["processes"][key] = figures
            spread["processes"][key] = rounds_spread
        out["spread"] = spread
        # what one observe writes, next to the raw row's WAL (the store section's ``wal_bytes``)
        out["wal_bytes_per_observe"] = _wal_per_observe(Settings.of(database_url=db_url, redis_url=redis_url), url)
    finally:
        drop_scratch_db(pg_url, name)
    return out
