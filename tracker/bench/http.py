"""HTTP API bench: ``observe`` through ``tracker serve`` vs. the same call in-process.

Everything runs in the same call against the same scratch database (and Redis): a server
subprocess (one uvicorn worker), the bare ASGI floor in another, and a ``Tracker`` in this
process built by ``build_tracker`` from the same settings the servers read. The
measurement is given, so counting is excluded: the figures compare the HTTP layer (parsing,
auth, JSON, the thread pool, the client) with the service + store + coordination work every
path shares.

One client calls one at a time, so the ``*_vs_direct`` figures are ratios of latencies: the
client's CPU, the server's and the database's add up in every call. The CPU figures split it:
what the server process spends per observe (``*_server_cpu_ms``, from ``/proc``; None
elsewhere), what each client spends (``*_client_cpu_ms``), what the in-process call spends
(``direct_cpu_ms``). The paths: ``TrackerClient`` and ``AsyncTrackerClient`` (what a Python
agent uses; each call carries an idempotency key, so they are compared with the in-process
call given one, ``direct_keyed_*``), plain httpx (``httpx_client_cpu_ms``), a raw keep-alive
``http.client`` connection (``http_raw_client_*``, whose request the API's ``http_server_cpu_ms``
is measured on), and the same raw connection against a bare ASGI app doing the same
validation and the same ``Observe`` command (``bare_asgi_*``, :mod:`tracker.bench.bare_asgi`):
the floor any Python HTTP server has here. Every path is measured in ``ROUNDS`` interleaved
rounds; figures are medians, with their ``[min, max]`` under ``spread``.
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
from tracker.bench.stats import over_rounds, ratio, summary
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


def _timed_async(opened: Any, call: Any, warmup: int, n: int) -> dict[str, Any]:
    """:func:`_timed` for a coroutine function ``call(client, i)``, on a fresh asyncio loop, with the
    client ``opened()`` (an async context manager) opens for the round."""
    import asyncio

    async def calls(client: Any, first: int, count: int, latencies: list[float] | None) -> None:
        for i in range(first, first + count):
            t0 = time.perf_counter()
            await call(client, i)
            if latencies is not None:
                latencies.append(time.perf_counter() - t0)

    async def measured() -> dict[str, Any]:
        async with opened() as client:
            return await timed(client)

    async def timed(client: Any) -> dict[str, Any]:
        await calls(client, 0, warmup, None)
        latencies: list[float] = []
        cpu_before = time.process_time()
        started = time.perf_counter()
        await calls(client, warmup, n, latencies)
        out = summary(latencies, time.perf_counter() - started)
        out["client_cpu_ms"] = round((time.process_time() - cpu_before) / n * 1000, 3)
        return out

    return asyncio.run(measured())


ROUNDS = 3  # each path is measured this many times, interleaved; figures are the medians


def run_http_bench(pg_url: str, redis_url: str | None, quick: bool = False, rounds: int = ROUNDS) -> dict[str, Any]:
    """observe/s, latency and CPU per call over HTTP and in-process, measured in this same run.

    Paths, each measured ``rounds`` times, one round of every path after another (so a noisy
    moment on a shared machine hits one round of each, not every round of one): the API driven
    by ``TrackerClient`` (``http_*``, with the server's CPU), by ``AsyncTrackerClient``
    (``async_client_*``), by plain httpx (``httpx_client_cpu_ms``, what the client's transport
    was) and by a raw keep-alive ``http.client`` connection (``http_raw_client_*``); the bare ASGI
    floor on the same raw connection (``bare_asgi_*``); the same observe in-process (``direct_*``).
    Each figure is the median across the rounds, its ``[min, max]`` under ``spread``; each ratio
    is taken within a round, then its median reported.
    """
    import httpx

    from tracker.bootstrap import build_storage, build_tracker
    from tracker.client import AsyncTrackerClient, TrackerClient
    from tracker.store import upgrade

    n = 300 if quick else 1000  # per round
    warmup = 30
    run = uuid.uuid4().hex[:8]
    name, url = create_scratch_db(pg_url, "ct_bench")
    measured: list[dict[str, Any]] = []
    try:
        settings = Settings.of(database_url=url, redis_url=redis_url)  # normalized to psycopg 3 there
        upgrade(settings.store.database_url)
        with build_storage(settings.store) as db:
            db.fleets.create_fleet(f"bench-{run}")
            _, token = db.fleets.create_key(f"bench-{run}")

        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        bare = "tracker.bench.bare_asgi:create_app"
        with (
            _served(settings) as api,
            _served(settings, factory=bare) as floor_port,
            build_tracker(settings) as tracker,
            TrackerClient(f"http://127.0.0.1:{api.number}", token, timeout=30) as client,
            httpx.Client(base_url=f"http://127.0.0.1:{api.number}", headers=headers, timeout=30) as hx,
        ):

            def over_client(i: int) -> None:
                client.observe(f"http-{run}-{i % SESSIONS}", measurement=_measurement(i))

            def over_httpx(i: int) -> None:
                r = hx.post(f"/v1/sessions/httpx-{run}-{i % SESSIONS}/observe", json={"measurement": _measurement(i)})
                if r.status_code != 200:
                    raise RuntimeError(f"observe over HTTP answered {r.status_code}: {r.text[:300]}")

            async def over_async(c: AsyncTrackerClient, i: int) -> None:
                await c.observe(f"async-{run}-{i % SESSIONS}", measurement=_measurement(i))

            def direct_call(i: int) -> None:
                tracker.observe(f"direct-{run}-{i % SESSIONS}", measurement=_measurement(i))

            def direct_keyed(i: int) -> None:  # the clients' call: every one carries an idempotency key
                key = uuid.uuid4().hex
                tracker.observe(f"keyed-{run}-{i % SESSIONS}", measurement=_measurement(i), idempotency_key=key)

            for _ in range(rounds):
                http = _timed(over_client, warmup, n, server_pid=api.pid)
                async_http = _timed_async(
                    lambda: AsyncTrackerClient(f"http://127.0.0.1:{api.number}", token, timeout=30),
                    over_async,
                    warmup,
                    n,
                )
                plain = _timed(over_httpx, warmup, n)
                with _raw_poster(api.number, headers) as post:
                    http_raw = _timed(
                        lambda i: post(f"/v1/sessions/raw-{run}-{i % SESSIONS}/observe", i), warmup, n, api.pid
                    )
                with _raw_poster(floor_port.number, headers) as post:
                    floor = _timed(
                        lambda i: post(f"/v1/sessions/floor-{run}-{i % SESSIONS}/observe", i),
                        warmup,
                        n,
                        floor_port.pid,
                    )
                direct = _timed(direct_call, warmup, n)
                keyed = _timed(direct_keyed, warmup, n)
                measured.append(_round(http, async_http, plain, http_raw, floor, direct, keyed))
    finally:
        drop_scratch_db(pg_url, name)
    return {**over_rounds(measured), "observes": n, "sessions": SESSIONS, "redis": bool(redis_url)}


def _round(
    http: dict[str, Any],
    async_http: dict[str, Any],
    plain: dict[str, Any],
    http_raw: dict[str, Any],
    floor: dict[str, Any],
    direct: dict[str, Any],
    keyed: dict[str, Any],
) -> dict[str, Any]:
    """One round's figures, and the ratios the targets are stated in (within the round).

    Two pairs compare like with like. The raw connection and the floor send the same bytes (a
    measurement, no idempotency key): ``http_server_cpu_ms`` (the API's server CPU on that
    request) against ``bare_asgi_server_cpu_ms``, and both against ``direct_*`` (the same call
    in-process). The clients send an idempotency key with every call, which costs the server
    a lookup: they are compared with ``direct_keyed_*``, the in-process call with a key
    (``client_server_cpu_ms``: the server's CPU per client call).
    """
    return {
        "http_observe_per_s": round(http["per_s"]),
        "http_ms_p50": http["ms_p50"],
        "http_ms_p99": http["ms_p99"],
        # CPU per observe: the server process (same request as the floor's), the clients, in-process
        "http_server_cpu_ms": http_raw["server_cpu_ms"],
        "client_server_cpu_ms": http["server_cpu_ms"],
        "http_client_cpu_ms": http["client_cpu_ms"],
        "async_client_cpu_ms": async_http["client_cpu_ms"],
        "async_client_observe_per_s": round(async_http["per_s"]),
        "httpx_client_cpu_ms": plain["client_cpu_ms"],
        "direct_cpu_ms": direct["client_cpu_ms"],
        "direct_keyed_cpu_ms": keyed["client_cpu_ms"],
        "http_raw_client_observe_per_s": round(http_raw["per_s"]),
        "http_raw_client_cpu_ms": http_raw["client_cpu_ms"],
        "http_raw_client_vs_direct": ratio(http_raw["per_s"], direct["per_s"]),
        "bare_asgi_observe_per_s": round(floor["per_s"]),
        "bare_asgi_server_cpu_ms": floor["server_cpu_ms"],
        "bare_asgi_vs_direct": ratio(floor["per_s"], direct["per_s"]),
        "direct_observe_per_s": round(direct["per_s"]),
        "direct_ms_p50": direct["ms_p50"],
        "direct_ms_p99": direct["ms_p99"],
        "direct_keyed_observe_per_s": round(keyed["per_s"]),
        # TrackerClient over HTTP against the same call (with its idempotency key) in-process
        "http_vs_direct": ratio(http["per_s"], keyed["per_s"]),
        # the targets' ratios: the API's server CPU over the floor's; each client's CPU over the
        # in-process call's and over the raw connection's
        "server_cpu_vs_floor": ratio(http_raw["server_cpu_ms"], floor["server_cpu_ms"]),
        "client_cpu_vs_direct": ratio(http["client_cpu_ms"], keyed["client_cpu_ms"]),
        "async_client_cpu_vs_direct": ratio(async_http["client_cpu_ms"], keyed["client_cpu_ms"]),
        "client_cpu_vs_raw": ratio(http["client_cpu_ms"], http_raw["client_cpu_ms"]),
        "async_client_cpu_vs_raw": ratio(async_http["client_cpu_ms"], http_raw["client_cpu_ms"]),
    }
