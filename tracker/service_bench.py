"""Service benchmark: ``Tracker.observe`` decisions/s and latency on Postgres + Redis.

1, 4 and 16 real processes, each a fleet worker observing its own sessions
(measurement given, so counting is excluded), with the Redis session lock,
the load → decide → append path and the projection, measured in one timed
window after a common start. Next to it, in the same run, the raw psycopg
single-row INSERT + COMMIT baseline from the store bench (the cheapest durable
write the database can do), giving ``observe_vs_raw`` per process count.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
import uuid
from typing import Any

from tracker.store.bench import _create_scratch, _drop_scratch

PROCESS_COUNTS = (1, 4, 16)


_barrier: Any = None


def _init(barrier: Any) -> None:
    global _barrier  # per worker process: the start line shared by every process of one run
    _barrier = barrier


def _observer(args: tuple[str, str | None, str, float]) -> tuple[int, list[float]]:
    db_url, redis_url, prefix, duration = args
    from tracker.coordination import coordinator_from_url
    from tracker.core import SessionProjector
    from tracker.service import Tracker
    from tracker.store import open_store

    t = Tracker(open_store(db_url, projector=SessionProjector()), coordinator=coordinator_from_url(redis_url))
    fp = hashlib.sha256(prefix.encode()).hexdigest()
    sessions = [f"{prefix}-{i}" for i in range(8)]
    n = 0
    latencies: list[float] = []
    used = 1000

    def one(i: int) -> None:
        sid = sessions[i % len(sessions)]
        # a session that climbs and stays under its compact level: the common case, proceed
        m = {"basis": f"m{i}", "input_tokens": used + (i % 500) * 100, "input_limit": 200_000,
             "quality": "exact_local", "model": {"provider": "openai", "name": "gpt-4o"}, "fingerprint": fp}
        t.observe(sid, measurement=m)

    for i in range(len(sessions)):  # untimed: sessions exist, connections warm
        one(i)
    _barrier.wait(300)  # every process is ready: start together
    end = time.time() + duration
    i = len(sessions)
    while time.time() < end:
        t0 = time.perf_counter()
        one(i)
        latencies.append(time.perf_counter() - t0)
        i += 1
        n += 1
    t.close()
    return n, latencies


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(p * len(s)))]


def run_service_bench(pg_url: str, redis_url: str | None, quick: bool = False,
                      raw_insert_per_s: dict[str, float] | None = None,
                      process_counts: tuple[int, ...] = PROCESS_COUNTS) -> dict[str, Any]:
    from tracker.store.migrate import upgrade

    duration = 1.0 if quick else 4.0
    name, url = _create_scratch(pg_url)
    sa_url = url.replace("postgresql://", "postgresql+psycopg://", 1)
    try:
        upgrade(sa_url)
        out: dict[str, Any] = {"processes": {}, "observe_vs_raw": {}, "redis": bool(redis_url)}
        ctx = mp.get_context("spawn")
        for n in process_counts:
            args = [(sa_url, redis_url, f"svc-{n}-{uuid.uuid4().hex[:6]}-{i}", duration) for i in range(n)]
            with ctx.Pool(n, initializer=_init, initargs=(ctx.Barrier(n),)) as pool:
                results = pool.map(_observer, args, chunksize=1)
            total = sum(r[0] for r in results)
            lat = [x for r in results for x in r[1]]
            out["processes"][str(n)] = {
                "observe_per_s": round(total / duration),
                "ms_p50": round(_pct(lat, 0.50) * 1000, 2),
                "ms_p99": round(_pct(lat, 0.99) * 1000, 2),
            }
        if raw_insert_per_s is None:  # the baseline comes from the store bench, run now in this same run
            from tracker.store.bench import run_store_bench

            raw_insert_per_s = run_store_bench(pg_url, quick)["raw_insert_per_s"]
        for n in process_counts:
            raw = raw_insert_per_s.get(str(n))
            if raw:
                out["observe_vs_raw"][str(n)] = round(out["processes"][str(n)]["observe_per_s"] / raw, 3)
        out["raw_insert_per_s"] = {k: round(v) for k, v in raw_insert_per_s.items()}
        return out
    finally:
        _drop_scratch(pg_url, name)
