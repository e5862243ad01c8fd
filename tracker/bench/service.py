"""Service bench: ``Tracker.observe`` decisions/s and latency on Postgres + Redis.

1, 4 and 16 real processes, each a fleet worker observing its own sessions (measurement
given, so counting is excluded), with the Redis session lock, the load → decide → append
path and the projection, measured in one timed window after a common start. Next to it, in
the same run, the raw psycopg single-row INSERT + COMMIT baseline from the store bench (the
cheapest durable write the database can do), giving ``observe_vs_raw`` per process count.

Each process builds its ``Tracker`` with ``Tracker.from_settings(Settings.of(...))``, the same
composition root every entry point uses.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import TYPE_CHECKING, Any

from tracker.bench.procs import barrier_pool, create_scratch_db, drop_scratch_db, wait_at_start_line
from tracker.bench.stats import latency_ms, over_rounds, ratio, throughput
from tracker.settings import normalize_database_url

if TYPE_CHECKING:  # pragma: no cover
    from tracker.settings import Settings

PROCESS_COUNTS = (1, 4, 16)
ROUNDS = 3  # windows per process count; the figures are their medians


def _observer(args: tuple[str, str | None, str, float]) -> tuple[int, list[float]]:
    db_url, redis_url, prefix, duration = args
    from tracker.settings import Settings

    return observe_for(Settings.of(database_url=db_url, redis_url=redis_url), prefix, duration)


def observe_for(settings: Settings, prefix: str, duration: float) -> tuple[int, list[float]]:
    """In a pool process: a ``Tracker`` of ``settings`` observes 8 sessions named after ``prefix``,
    once each untimed, then from the common start line for ``duration`` s; (observes, latencies)."""
    from tracker.service import Tracker

    t = Tracker.from_settings(settings)
    fp = hashlib.sha256(prefix.encode()).hexdigest()
    sessions = [f"{prefix}-{i}" for i in range(8)]
    latencies: list[float] = []
    used = 1000

    def one(i: int) -> None:
        # a session that climbs and stays under its compact level: the common case, proceed
        m = {
            "basis": f"m{i}",
            "input_tokens": used + (i % 500) * 100,
            "input_limit": 200_000,
            "quality": "exact_local",
            "model": {"provider": "openai", "name": "gpt-4o"},
            "fingerprint": fp,
        }
        t.observe(sessions[i % len(sessions)], measurement=m)

    try:
        for i in range(len(sessions)):  # untimed: sessions exist, connections warm
            one(i)
        wait_at_start_line(300)  # every process is ready: start together
        end = time.time() + duration
        i = len(sessions)
        while time.time() < end:
            t0 = time.perf_counter()
            one(i)
            latencies.append(time.perf_counter() - t0)
            i += 1
    finally:
        t.close()
    return len(latencies), latencies


def run_service_bench(
    pg_url: str,
    redis_url: str | None,
    quick: bool = False,
    raw_insert_per_s: dict[str, float] | None = None,
    process_counts: tuple[int, ...] = PROCESS_COUNTS,
) -> dict[str, Any]:
    """observe/s and p50/p99 per process count, next to the store bench's raw INSERT baseline.

    Each process count is measured ``ROUNDS`` times on the same pool of processes; its figures
    are the medians of the rounds (``[min, max]`` under ``spread``).
    """
    from tracker.store import upgrade

    duration = 1.0 if quick else 4.0
    name, url = create_scratch_db(pg_url, "ct_bench")
    db_url = normalize_database_url(url)
    try:
        upgrade(db_url)
        out: dict[str, Any] = {"processes": {}, "observe_vs_raw": {}, "redis": bool(redis_url), "rounds": ROUNDS}
        spread: dict[str, Any] = {}
        for n in process_counts:
            measured = []
            with barrier_pool(n) as pool:
                for r in range(ROUNDS):
                    args = [(db_url, redis_url, f"svc-{n}-{r}-{uuid.uuid4().hex[:6]}-{i}", duration) for i in range(n)]
                    results = pool.map(_observer, args, chunksize=1)
                    lat = [x for res in results for x in res[1]]
                    measured.append(
                        {
                            "observe_per_s": round(throughput(sum(res[0] for res in results), duration)),
                            **latency_ms(lat),
                        }
                    )
            figures = over_rounds(measured)
            spread[str(n)] = figures.pop("spread")
            figures.pop("rounds")
            out["processes"][str(n)] = figures
        out["spread"] = {"processes": spread}
    finally:
        drop_scratch_db(pg_url, name)
    if raw_insert_per_s is None:  # the baseline comes from the store bench, run now in this same run
        from tracker.bench.store import run_store_bench

        raw_insert_per_s = run_store_bench(pg_url, quick, writer_counts=process_counts)["raw_insert_per_s"]
    for n in process_counts:
        out["observe_vs_raw"][str(n)] = ratio(out["processes"][str(n)]["observe_per_s"], raw_insert_per_s.get(str(n)))
    out["raw_insert_per_s"] = {k: round(v) for k, v in raw_insert_per_s.items()}
    return out
