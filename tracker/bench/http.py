"""HTTP API bench: ``observe`` through ``tracker serve`` vs. the same call in-process.

Both halves run in the same call against the same scratch database (and Redis): a server
subprocess (one uvicorn worker) driven by one httpx client with keep-alive, then a ``Tracker``
in this process built by ``Tracker.from_settings`` from the same settings the server reads. The
measurement is given, so counting is excluded: the figures compare the HTTP layer (parsing,
auth, JSON, the thread pool) with the service + store + coordination work both paths share.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from tracker.bench.procs import create_scratch_db, drop_scratch_db, free_port, start_server, stop_server
from tracker.bench.stats import ratio, summary
from tracker.settings import ENV_PREFIX, Settings

SESSIONS = 20


def _measurement(i: int) -> dict[str, Any]:
    return {"basis": f"m{i}", "input_tokens": 10_000 + i, "input_limit": 1_000_000_000, "quality": "exact_local"}


def _server_env(settings: Settings) -> dict[str, str]:
    """The server's whole environment: this process's, minus every ``TRACKER_*``, plus the bench's store and Redis."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(ENV_PREFIX)}
    env[ENV_PREFIX + "DATABASE_URL"] = settings.store.database_url
    if settings.coordination.redis_url:
        env[ENV_PREFIX + "REDIS_URL"] = settings.coordination.redis_url
    return env


def _timed(call: Any, warmup: int, n: int) -> dict[str, Any]:
    for i in range(warmup):
        call(i)
    latencies: list[float] = []
    started = time.perf_counter()
    for i in range(warmup, warmup + n):
        t0 = time.perf_counter()
        call(i)
        latencies.append(time.perf_counter() - t0)
    return summary(latencies, time.perf_counter() - started)


def run_http_bench(pg_url: str, redis_url: str | None, quick: bool = False) -> dict[str, Any]:
    """observe/s and latency over HTTP and in-process, measured in this same run."""
    import httpx

    from tracker.service import Tracker
    from tracker.store import make_engine, upgrade
    from tracker.store.fleets import FleetStore

    n = 300 if quick else 3000
    warmup = 30
    run = uuid.uuid4().hex[:8]
    name, url = create_scratch_db(pg_url, "ct_bench")
    try:
        settings = Settings.of(database_url=url, redis_url=redis_url)  # normalized to psycopg 3 there
        upgrade(settings.store.database_url)
        engine = make_engine(settings.store.database_url)
        try:
            fleets = FleetStore(engine)
            fleets.create_fleet(f"bench-{run}")
            _, token = fleets.create_key(f"bench-{run}")
        finally:
            engine.dispose()

        port = free_port()
        proc = start_server(_server_env(settings), port, "--log-level", "warning")
        try:
            with httpx.Client(
                base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}, timeout=30
            ) as client:

                def over_http(i: int) -> None:
                    r = client.post(
                        f"/v1/sessions/http-{run}-{i % SESSIONS}/observe", json={"measurement": _measurement(i)}
                    )
                    if r.status_code != 200:
                        raise RuntimeError(f"observe over HTTP answered {r.status_code}: {r.text[:300]}")

                http = _timed(over_http, warmup, n)
        finally:
            stop_server(proc)

        with Tracker.from_settings(settings) as tracker:
            direct = _timed(
                lambda i: tracker.observe(f"direct-{run}-{i % SESSIONS}", measurement=_measurement(i)), warmup, n
            )
    finally:
        drop_scratch_db(pg_url, name)

    return {
        "http_observe_per_s": round(http["per_s"]),
        "http_ms_p50": http["ms_p50"],
        "http_ms_p99": http["ms_p99"],
        "direct_observe_per_s": round(direct["per_s"]),
        "direct_ms_p50": direct["ms_p50"],
        "direct_ms_p99": direct["ms_p99"],
        "http_vs_direct": ratio(http["per_s"], direct["per_s"]),
        "observes": n,
        "sessions": SESSIONS,
        "redis": bool(redis_url),
    }
