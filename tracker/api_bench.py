"""HTTP API benchmark: ``observe`` through ``tracker serve`` vs. the same call in-process.

Both halves run in the same call against the same database (and Redis): a server
subprocess (one uvicorn worker) driven by one httpx client with keep-alive, then a
``Tracker`` in this process. The measurement is given, so counting is excluded: the
figures compare the HTTP layer (parsing, auth, JSON, the thread pool) with the
service + store + coordination work both paths share.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from typing import Any

SESSIONS = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, int(round(p / 100 * (len(sorted_values) - 1)))))
    return sorted_values[k]


def _summary(latencies_s: list[float], elapsed_s: float) -> tuple[int, float, float]:
    ms = sorted(x * 1000 for x in latencies_s)
    return round(len(ms) / elapsed_s), round(_percentile(ms, 50), 3), round(_percentile(ms, 99), 3)


def _measurement(i: int) -> dict[str, Any]:
    return {"basis": f"m{i}", "input_tokens": 10_000 + i, "input_limit": 1_000_000_000, "quality": "exact_local"}


def start_server(env: dict[str, str], port: int, *extra: str, quiet: bool = True) -> subprocess.Popen:
    """``tracker serve`` in a subprocess on loopback, returned once /readyz answers 200."""
    import httpx

    proc = subprocess.Popen(
        [sys.executable, "-m", "tracker.cli", "serve", "--port", str(port), "--no-access-log", *extra],
        env=env, stdout=subprocess.DEVNULL if quiet else subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tracker serve exited: {(proc.stderr.read() if proc.stderr else '')[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("tracker serve did not become ready within 60 s")


def run_http_bench(pg_url: str, redis_url: str | None, quick: bool) -> dict[str, Any]:
    """observe/s and latency over HTTP and in-process, measured in this same run."""
    import httpx

    from tracker.fleets import FleetStore
    from tracker.service import Tracker
    from tracker.settings import Settings, normalise_database_url
    from tracker.store import make_engine, upgrade

    n = 300 if quick else 3000
    warmup = 30
    run = uuid.uuid4().hex[:8]
    db_url = normalise_database_url(pg_url)
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        fleets = FleetStore(engine)
        fleets.create_fleet(f"bench-{run}")
        _, token = fleets.create_key(f"bench-{run}")
    finally:
        engine.dispose()

    env = {k: v for k, v in os.environ.items() if k not in ("TRACKER_BROKER_URL", "TRACKER_REDIS_URL")}
    env["TRACKER_DATABASE_URL"] = db_url
    if redis_url:
        env["TRACKER_REDIS_URL"] = redis_url
    port = _free_port()
    proc = start_server(env, port, "--log-level", "warning")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"},
                          timeout=30) as client:
            def call(i: int) -> None:
                r = client.post(f"/v1/sessions/http-{run}-{i % SESSIONS}/observe", json={"measurement": _measurement(i)})
                if r.status_code != 200:
                    raise RuntimeError(f"observe over HTTP answered {r.status_code}: {r.text[:300]}")

            for i in range(warmup):
                call(i)
            latencies: list[float] = []
            started = time.perf_counter()
            for i in range(warmup, warmup + n):
                t0 = time.perf_counter()
                call(i)
                latencies.append(time.perf_counter() - t0)
            http = _summary(latencies, time.perf_counter() - started)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    settings = Settings(database_url=db_url, redis_url=redis_url)
    from tracker.counting import InProcessCounting

    with Tracker.from_settings(settings, counting=InProcessCounting()) as tracker:
        for i in range(warmup):
            tracker.observe(f"direct-{run}-{i % SESSIONS}", measurement=_measurement(i))
        latencies = []
        started = time.perf_counter()
        for i in range(warmup, warmup + n):
            t0 = time.perf_counter()
            tracker.observe(f"direct-{run}-{i % SESSIONS}", measurement=_measurement(i))
            latencies.append(time.perf_counter() - t0)
        direct = _summary(latencies, time.perf_counter() - started)

    return {
        "http_observe_per_s": http[0],
        "http_ms_p50": http[1],
        "http_ms_p99": http[2],
        "direct_observe_per_s": direct[0],
        "direct_ms_p50": direct[1],
        "direct_ms_p99": direct[2],
        "http_vs_direct": round(http[0] / direct[0], 3) if direct[0] else None,
        "observes": n,
        "sessions": SESSIONS,
        "redis": bool(redis_url),
    }
