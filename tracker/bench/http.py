"""HTTP API bench: ``observe`` through ``tracker serve`` vs. the same call in-process.

Both halves run in the same call against the same scratch database (and Redis): a server
subprocess (one uvicorn worker) driven by one httpx client with keep-alive, then a ``Tracker``
in this process built by ``Tracker.from_settings`` from the same settings the server reads. The
measurement is given, so counting is excluded: the figures compare the HTTP layer (parsing,
auth, JSON, the thread pool) with the service + store + coordination work both paths share.

One client calls one at a time, so ``http_vs_direct`` is a ratio of latencies: the client's
CPU, the server's and the database's add up in every call. The CPU figures split it: what the
server process spends per observe (``http_server_cpu_ms``, from ``/proc``; None elsewhere),
what the HTTP client spends (``http_client_cpu_ms``), and what the in-process call spends
(``direct_cpu_ms``). Two more paths, in the same run, take the client and then the framework
out: the API driven by a raw keep-alive ``http.client`` connection (``http_raw_client_*``),
and the same connection against a bare ASGI app doing the same validation and the same
``Commands.observe`` (``bare_asgi_*``, :mod:`tracker.bench.bare_asgi`): the floor any Python
HTTP server has here.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
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


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (all its threads); None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_ms(before: float | None, after: float | None, n: int) -> float | None:
    return None if before is None or after is None else round((after - before) / n * 1000, 3)


def _timed(call: Any, warmup: int, n: int, server_pid: int | None = None) -> dict[str, Any]:
    """Latency summary of ``n`` calls after ``warmup``, with the CPU per call of this process
    (``client_cpu_ms``) and, given its pid, of the server (``server_cpu_ms``)."""
    for i in range(warmup):
        call(i)
    latencies: list[float] = []
    server_before = process_cpu_s(server_pid) if server_pid is not None else None
    cpu_before = time.process_time()
    started = time.perf_counter()
    for i in range(warmup, warmup + n):
        t0 = time.perf_counter()
        call(i)
        latencies.append(time.perf_counter() - t0)
    out = summary(latencies, time.perf_counter() - started)
    out["client_cpu_ms"] = round((time.process_time() - cpu_before) / n * 1000, 3)
    if server_pid is not None:
        out["server_cpu_ms"] = _cpu_ms(server_before, process_cpu_s(server_pid), n)
    return out


class _Port:
    def __init__(self, number: int, pid: int) -> None:
        self.number, self.pid = number, pid


@contextmanager
def _served(settings: Settings, factory: str | None = None) -> Iterator[_Port]:
    """``tracker serve`` (or uvicorn on ``factory``) on a free loopback port, for the block."""
    number = free_port()
    proc = start_server(_server_env(settings), number, "--log-level", "warning", factory=factory)
    try:
        yield _Port(number, proc.pid)
    finally:
        stop_server(proc)


@contextmanager
def _raw_poster(port: int, headers: dict[str, str]) -> Iterator[Any]:
    """``post(path, i)``: observe measurement ``i`` on one keep-alive ``http.client`` connection."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(path: str, i: int) -> None:
        conn.request("POST", path, body=json.dumps({"measurement": _measurement(i)}), headers=headers)
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"observe over HTTP answered {response.status}: {body[:300]!r}")

    try:
        yield post
    finally:
        conn.close()


def run_http_bench(pg_url: str, redis_url: str | None, quick: bool = False) -> dict[str, Any]:
    """observe/s and latency over HTTP and in-process, measured in this same run."""
    import httpx

    from tracker.bootstrap import build_storage
    from tracker.service import Tracker
    from tracker.store import upgrade

    n = 300 if quick else 3000
    warmup = 30
    run = uuid.uuid4().hex[:8]
    name, url = create_scratch_db(pg_url, "ct_bench")
    try:
        settings = Settings.of(database_url=url, redis_url=redis_url)  # normalized to psycopg 3 there
        upgrade(settings.store.database_url)
        with build_storage(settings.store) as db:
            db.fleets.create_fleet(f"bench-{run}")
            _, token = db.fleets.create_key(f"bench-{run}")

        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        # the API with httpx (what a Python agent's client does), the API with a raw keep-alive
        # connection (the client's share taken out), the bare ASGI floor with the same connection
        with (
            _served(settings) as port,
            httpx.Client(base_url=f"http://127.0.0.1:{port.number}", headers=headers, timeout=30) as c,
        ):

            def over_httpx(i: int) -> None:
                r = c.post(f"/v1/sessions/http-{run}-{i % SESSIONS}/observe", json={"measurement": _measurement(i)})
                if r.status_code != 200:
                    raise RuntimeError(f"observe over HTTP answered {r.status_code}: {r.text[:300]}")

            http = _timed(over_httpx, warmup, n, server_pid=port.pid)
            with _raw_poster(port.number, headers) as post:
                http_raw = _timed(lambda i: post(f"/v1/sessions/raw-{run}-{i % SESSIONS}/observe", i), warmup, n)
        bare = "tracker.bench.bare_asgi:create_app"
        with _served(settings, factory=bare) as port, _raw_poster(port.number, headers) as post:
            floor = _timed(lambda i: post(f"/v1/sessions/floor-{run}-{i % SESSIONS}/observe", i), warmup, n, port.pid)

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
        # CPU per observe: the server process and the HTTP client (over HTTP), this process (direct)
        "http_server_cpu_ms": http["server_cpu_ms"],
        "http_client_cpu_ms": http["client_cpu_ms"],
        "direct_cpu_ms": direct["client_cpu_ms"],
        "http_raw_client_observe_per_s": round(http_raw["per_s"]),
        "http_raw_client_vs_direct": ratio(http_raw["per_s"], direct["per_s"]),
        "bare_asgi_observe_per_s": round(floor["per_s"]),
        "bare_asgi_server_cpu_ms": floor["server_cpu_ms"],
        "bare_asgi_vs_direct": ratio(floor["per_s"], direct["per_s"]),
        "direct_observe_per_s": round(direct["per_s"]),
        "direct_ms_p50": direct["ms_p50"],
        "direct_ms_p99": direct["ms_p99"],
        "http_vs_direct": ratio(http["per_s"], direct["per_s"]),
        "observes": n,
        "sessions": SESSIONS,
        "redis": bool(redis_url),
    }
