"""Hostile input and fair sharing (issue 11): a real `tracker serve` on loopback, real PostgreSQL and Redis.

Two parts:

* one regression test per finding of the security probe (metrics labels, long-polls that
  starve other fleets, NUL / surrogates / deep nesting / lenient numbers in bodies, idempotency
  keys bound to the whole call, what /readyz and 503s disclose, bodies that never arrive);
* a hostile-input suite that grows with the API: every endpoint of the served OpenAPI
  document x bad keys, the other fleet's ids, bad bodies and bad query strings. Every
  refusal must have the documented error shape (``{code, error, message}``, a ``code`` from
  ``ERROR_STATUS``), never be a 5xx, and leave the store's event count unchanged.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.api import api_server, observe, settled_feed
from tests.support.bench import stop_server
from tests.support.measurements import measure, sid
from tests.support.procs import free_port
from tracker.http.errors import codes_by_status

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

LIMIT = 100_000
KNOWN_CODES = {code for codes in codes_by_status().values() for code in codes}
CASES_TRIED: list[str] = []  # every hostile case sent, for the count printed at the end


# -- servers --------------------------------------------------------------------------------------


@dataclass
class Server:
    url: str
    db_url: str
    engine: Any
    token_a: str
    token_b: str
    revoked: str
    proc: subprocess.Popen

    def client(self, token: str | None, timeout: float = 30) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def event_count(self) -> int:
        from sqlalchemy import text

        with self.engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM events")).scalar_one())


def _serve(extra_env: dict[str, str] | None = None, redis: bool = True):
    from tracker.store.fleets import FleetStore

    with api_server(fleets=("alpha", "beta"), redis=redis, TRACKER_ATTEMPT_LEASE_S="3600", **(extra_env or {})) as s:
        fleets = FleetStore(s.engine)
        record, revoked = fleets.create_key("alpha")
        fleets.revoke_key(record["key_id"])
        yield Server(s.url, s.db_url, s.engine, s.token_a, s.token_b, revoked, s.proc)


@pytest.fixture(scope="module")
def server():
    yield from _serve({"TRACKER_MAX_WAITS_PER_FLEET": "4", "TRACKER_BODY_TIMEOUT_S": "2"})


def compacting(c: httpx.Client) -> tuple[str, dict[str, Any]]:
    """A fresh session with an open automatic attempt: ``(session_id, attempt)``."""
    s = sid("c")
    d = observe(c, s, "m1", 90_000)
    assert d["action"] == "compact", d
    return s, d["attempt"]


def refused(
    server: Server, r: httpx.Response, status: int | None = None, code: str | None = None, field: str | None = None
) -> dict[str, Any]:
    """A refusal with the documented shape; ``status``/``code``/``field`` when given."""
    assert r.status_code < 500, (r.status_code, r.text)
    assert r.status_code >= 400, (r.status_code, r.text)
    body = r.json()
    assert {"code", "error", "message"} <= set(body), body
    assert body["code"] in KNOWN_CODES, body
    if status is not None:
        assert r.status_code == status, r.text
    if code is not None:
        assert body["code"] == code, body
    if field is not None:
        assert body.get("field") == field, body
    return body


def unchanged(server: Server):
    """``with unchanged(server):`` the store's event count is the same afterwards."""

    class _Guard:
        def __enter__(self) -> None:
            self.before = server.event_count()

        def __exit__(self, *exc: Any) -> None:
            if exc[0] is None:
                assert server.event_count() == self.before, "a refused request wrote events"

    return _Guard()


# -- finding 1: metrics labels come from a closed set ----------------------------------------------


def _raw_requests(url: str, lines: list[bytes]) -> None:
    """Each request line in turn on one connection, reading each answer; stops where the server closes
    the connection (a parser that refuses a request answers and closes: the next send then meets a
    closed socket, and the close shows as an empty read or as a reset, whichever the timing gives)."""
    try:
        _send_in_turn(url, lines)
    except (ConnectionResetError, BrokenPipeError):
        return


def _send_in_turn(url: str, lines: list[bytes]) -> None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        for line in lines:
            s.sendall(line + b"\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            s.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = s.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, rest = data.partition(b"\r\n\r\n")
            length = next(
                (int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0
            )
            while len(rest) < length:
                rest += s.recv(65536)


def test_metrics_labels_are_a_closed_set(server):
    # made-up methods (an HTTP parser may refuse them before the app), then real HTTP methods
    # the app does not serve (WebDAV, PURGE): every parser passes those on, so they must be ``other``
    # (a parser that refuses one closes the connection: each kind goes on its own)
    made_up = [f"M{i:06d}".encode() for i in range(200)]
    _raw_requests(server.url, [m + b" /healthz HTTP/1.1" for m in made_up])
    _raw_requests(server.url, [m + b" /healthz HTTP/1.1" for m in (b"PROPFIND", b"MKCOL", b"PURGE", b"LOCK")])
    _raw_requests(server.url, [b"GET /no/such/%d HTTP/1.1" % i for i in range(50)])
    CASES_TRIED.extend(["metrics"] * 250)
    with server.client(None) as c:
        text = c.get("/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    seen_methods, seen_routes = set(), set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "method" in sample.labels:
                seen_methods.add(sample.labels["method"])
            if "route" in sample.labels:
                seen_routes.add(sample.labels["route"])
    assert seen_methods <= {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "other"}, seen_methods
    assert "other" in seen_methods
    assert not any(r.startswith("/no/such") for r in seen_routes), seen_routes
    assert len(text) < 200_000


# -- finding 2: long-polls neither hold threads nor starve other fleets ----------------------------

WAITER = textwrap.dedent(
    """
    import asyncio, sys, httpx
    url, token, path, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

    async def one(c):
        while True:
            try:
                r = await c.get(path, params={"timeout": 30})
            except httpx.HTTPError:
                await asyncio.sleep(0.2)
                continue
            if r.status_code != 408:
                print(r.status_code, r.text[:200], flush=True)
                return

    async def main():
        limits = httpx.Limits(max_connections=n + 5, max_keepalive_connections=n + 5)
        headers = {"Authorization": "Bearer " + token}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as c:
            await asyncio.gather(*(one(c) for _ in range(n)))

    asyncio.run(main())
    """
)


def _open_waits(c: httpx.Client) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(c.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "tracker_http_waits_open":
                return sample.value
    return -1.0


def _p99(c: httpx.Client, session: str, label: str, n: int = 150) -> float:
    samples = []
    for i in range(n):
        started = time.perf_counter()
        r = c.post(f"/v1/sessions/{session}/observe", json=measure(f"{label}-{i}", 1000))
        samples.append(time.perf_counter() - started)
        assert r.status_code == 200, r.text
    samples.sort()
    return samples[int(0.99 * (n - 1))]


@pytest.fixture(scope="module")
def roomy_server():
    yield from _serve({"TRACKER_MAX_WAITS_PER_FLEET": "300"})


@pytest.mark.serial(alone=True)  # a latency ratio: nothing runs beside it
def test_open_waits_of_one_fleet_leave_another_fleets_observe_p99_within_2x(roomy_server):
    server = roomy_server
    with server.client(server.token_a) as a, server.client(server.token_b) as b:
        s, attempt = compacting(a)
        path = f"/v1/sessions/{s}/compactions/{attempt['attempt_id']}/wait"
        bs = sid("b")
        observe(b, bs, "warm", 1000)
        _p99(b, bs, "warm", 30)  # warm the connection pool and caches
        idle = _p99(b, bs, "idle")
        waiters = [
            subprocess.Popen(
                [sys.executable, "-c", WAITER, server.url, server.token_a, path, "100"],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        try:
            deadline = time.monotonic() + 30
            while _open_waits(b) < 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _open_waits(b) == 200
            loaded = _p99(b, bs, "loaded")
            still_open = _open_waits(b)
            # the waits end when the attempt does (woken by the notification, not a poll)
            r = a.post(
                f"/v1/sessions/{s}/compactions/{attempt['attempt_id']}/commit",
                json={"fencing_token": attempt["fencing_token"], "tokens_after": 10_000},
            )
            assert r.status_code == 200, r.text
            outs = [w.communicate(timeout=30)[0] for w in waiters]
        finally:
            for w in waiters:
                if w.poll() is None:
                    w.kill()
                    w.wait()
    print(f"\nfleet B observe p99: idle {idle * 1000:.1f} ms, with 200 open waits of fleet A {loaded * 1000:.1f} ms")
    assert still_open == 200
    assert all(line.startswith("200") and "committed" in line for out in outs for line in out.splitlines())
    assert sum(len(out.splitlines()) for out in outs) == 200
    assert loaded <= 2 * idle + 0.02, (idle, loaded)  # 20 ms of slack for a shared, noisy machine


def test_waits_beyond_the_fleets_cap_get_429_with_retry_after(server, a, b):
    s, attempt = compacting(a)
    path = f"/v1/sessions/{s}/compactions/{attempt['attempt_id']}/wait"
    waiter = subprocess.Popen(
        [sys.executable, "-c", WAITER, server.url, server.token_a, path, "4"], stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 20
        while _open_waits(a) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        with unchanged(server):
            r = a.get(path, params={"timeout": 1})
            refused(server, r, 429, "too_many_waits")
            assert int(r.headers["Retry-After"]) >= 1
        # another fleet's waits are not counted against this one: B gets its own answer (404: not its session)
        refused(server, b.get(path, params={"timeout": 0}), 404)
        bs, battempt = compacting(b)
        rb = b.get(f"/v1/sessions/{bs}/compactions/{battempt['attempt_id']}/wait", params={"timeout": 0})
        refused(server, rb, 408, "wait_timeout")
        a.post(
            f"/v1/sessions/{s}/compactions/{attempt['attempt_id']}/reject",
            json={"fencing_token": attempt["fencing_token"], "reject_reason": "gave up"},
        ).raise_for_status()
        out = waiter.communicate(timeout=30)[0]
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()
    assert out.count("rejected:gave up") == 4


@pytest.fixture(scope="module")
def embedded_server():
    yield from _serve(redis=False)


def test_wait_without_redis_wakes_on_commit_and_polls_for_outside_writers(embedded_server):
    from tracker import Tracker
    from tracker.settings import Settings

    server = embedded_server
    with server.client(server.token_a) as a:
        s, attempt = compacting(a)
        path = f"/v1/sessions/{s}/compactions/{attempt['attempt_id']}/wait"
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(a.get, path, params={"timeout": 20})
            time.sleep(0.5)
            r = a.post(
                f"/v1/sessions/{s}/compactions/{attempt['attempt_id']}/commit",
                json={"fencing_token": attempt["fencing_token"], "tokens_after": 100},
            )
            assert r.status_code == 200, r.text
            assert fut.result().json()["status"] == "committed"
            # a writer outside the server (another process's Tracker): no notification, the poll finds it
            s2, attempt2 = compacting(a)
            from sqlalchemy import text

            with server.engine.connect() as conn:
                internal = conn.execute(
                    text("SELECT session_id FROM sessions WHERE session_id LIKE :p"), {"p": f"%:{s2}"}
                ).scalar_one()
            fut = pool.submit(
                a.get, f"/v1/sessions/{s2}/compactions/{attempt2['attempt_id']}/wait", params={"timeout": 20}
            )
            time.sleep(0.5)
            with Tracker.from_settings(Settings.of(database_url=server.db_url)) as outside:
                outside.reject(internal, attempt2["attempt_id"], attempt2["fencing_token"], "outside")
            assert fut.result().json()["outcome"] == "rejected:outside"


# -- findings 3, 11: NUL and control characters are refused at the door, naming the field ---------


def test_nul_in_idempotency_key_is_422_naming_the_field(server, a):
    s, attempt = compacting(a)
    base = f"/v1/sessions/{s}"
    key = "k\x00ey"
    cases = [
        (f"{base}/observe", measure("m2", 10, idempotency_key=key)),
        (f"{base}/compactions", {"idempotency_key": key}),
        (
            f"{base}/compactions/{attempt['attempt_id']}/commit",
            {"fencing_token": 1, "tokens_after": 1, "idempotency_key": key},
        ),
        (
            f"{base}/compactions/{attempt['attempt_id']}/reject",
            {"fencing_token": 1, "reject_reason": "x", "idempotency_key": key},
        ),
    ]
    for path, body in cases:
        with unchanged(server):
            refused(server, a.post(path, json=body), 422, "invalid_input", "idempotency_key")
        CASES_TRIED.append(path)


def test_nul_and_control_characters_in_names_and_reasons_name_the_input_field(server, a):
    s, attempt = compacting(a)
    cases = [
        (
            f"/v1/sessions/{s}/observe",
            {"measurement": {"basis": "m2", "input_tokens": 1, "input_limit": LIMIT, "model": "gpt\x00-4o"}},
            "model",  # fields inside a measurement are named as the service names them (like basis.revision)
        ),
        (
            f"/v1/sessions/{s}/observe",
            {"measurement": {"basis": "m2", "input_tokens": 1, "input_limit": LIMIT, "model": {"name": "a\x1b[31m"}}},
            "model.name",
        ),
        (
            f"/v1/sessions/{s}/observe",
            {"request": {"messages": [{"role": "user", "content": "hi"}]}, "model": "gpt\x00", "basis": "m2"},
            "model",
        ),
        (
            f"/v1/sessions/{s}/observe",
            {"request": {"messages": [{"role": "user", "content": "hi"}]}, "model": "\x1b]0;pwned\x07", "basis": "m2"},
            "model",
        ),
        (
            f"/v1/sessions/{s}/compactions/{attempt['attempt_id']}/reject",
            {"fencing_token": attempt["fencing_token"], "reject_reason": "bad\x00"},
            "reject_reason",
        ),
        (
            f"/v1/sessions/{s}/compactions/{attempt['attempt_id']}/reject",
            {"fencing_token": attempt["fencing_token"], "reject_reason": "\x1b[2J\x1b[31mred"},
            "reject_reason",
        ),
    ]
    for path, body, field in cases:
        with unchanged(server):
            refused(server, a.post(path, json=body), 422, "invalid_input", field)
        CASES_TRIED.append(path)


def test_the_library_refuses_control_characters_before_the_store(server):
    """The same refusals hold below HTTP (the service), naming the argument, not ``events[0].data``."""
    from tracker import Tracker
    from tracker.errors import InvalidInput
    from tracker.settings import Settings

    with Tracker.from_settings(Settings.of(database_url=server.db_url)) as t:
        s = f"lib-{uuid.uuid4().hex[:8]}"
        d = t.observe(s, measurement={"basis": "m1", "input_tokens": 90_000, "input_limit": LIMIT})
        attempt = d.decision.attempt
        for call, field in (
            (lambda: t.reject(s, attempt.attempt_id, attempt.fencing_token, "x\x00y"), "reject_reason"),
            (
                lambda: t.commit(s, attempt.attempt_id, attempt.fencing_token, 5, idempotency_key="\x00"),
                "idempotency_key",
            ),
            (
                lambda: t.observe(
                    s, measurement={"basis": "m2", "input_tokens": 1, "input_limit": LIMIT, "model": "a\x00"}
                ),
                "model",
            ),
        ):
            with unchanged(server), pytest.raises(InvalidInput) as info:
                call()
            assert info.value.field == field, info.value.to_dict()


# -- findings 4, 5: deep nesting and lone surrogates are bad input, refused before counting -------


def _nested(depth: int) -> Any:
    value: Any = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"x": value}}
    return value


def test_deeply_nested_request_is_422_before_counting(server, a):
    s = sid()
    args = "[" * 5000 + "]" * 5000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
    deep = '{"type": "object", "properties": {"x": ' * 600 + "{}" + "}}" * 600  # 1,200 objects deep, as sent
    raw = (
        '{"request": {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
        '"function": {"name": "f", "parameters": ' + deep + '}}]}, "model": "gpt-4o", "basis": "m1"}'
    )
    with unchanged(server):
        r = a.post(f"/v1/sessions/{s}/observe", content=raw.encode(), headers={"content-type": "application/json"})
        out = refused(server, r, 422, "invalid_input")  # deeper than the JSON parser goes: the body is refused
    cases = [
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f", "input_schema": _nested(200)}]},
            "tools[0].input_schema",
        ),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "u", "name": "f", "input": _nested(300)}],
                    }
                ]
            },
            "messages[0].content[0].input",
        ),
    ]
    for request, field in cases:
        body = {"request": request, "model": "gpt-4o", "basis": "m1"}
        with unchanged(server):
            out = refused(server, a.post(f"/v1/sessions/{s}/observe", json=body), 422, "invalid_input")
        assert out["field"].startswith(field), out
        assert "nest" in out["message"], out
        CASES_TRIED.append(field)


def test_lone_surrogate_in_content_is_422_and_records_nothing(server, a):
    s = sid()
    raw = b'{"request": {"messages": [{"role": "user", "content": "a\\ud800b"}]}, "model": "gpt-4o", "basis": "m1"}'
    with unchanged(server):
        r = a.post(f"/v1/sessions/{s}/observe", content=raw, headers={"content-type": "application/json"})
        out = refused(server, r, 422, "invalid_input")
    assert out["field"].endswith("messages[0].content"), out
    for raw_body, field in (
        (b'{"measurement": {"basis": "m\\udc00", "input_tokens": 1, "input_limit": 10}}', "measurement.basis"),
        (
            b'{"measurement": {"basis": "m1", "input_tokens": 1, "input_limit": 10}, "idempotency_key": "\\ud800"}',
            "idempotency_key",
        ),
    ):
        with unchanged(server):
            r = a.post(f"/v1/sessions/{s}/observe", content=raw_body, headers={"content-type": "application/json"})
            refused(server, r, 422, "invalid_input", field)
    CASES_TRIED.extend(["surrogate"] * 3)


# -- finding 6: a feed page costs the same whatever other fleets hold ------------------------------


def _events_rows_read(engine: Any) -> int:
    from sqlalchemy import text

    with engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        return int(
            conn.execute(
                text(
                    # the events table's partitions (migration 0011): the parent has no rows of its own
                    "SELECT coalesce(sum(coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)), 0) "
                    "FROM pg_stat_user_tables WHERE relid IN "
                    "(SELECT inhrelid FROM pg_inherits WHERE inhparent = 'events'::regclass)"
                )
            ).scalar_one()
        )


def _feed_rows_examined(server: Server, fleet: str) -> int:
    """Rows of ``events`` Postgres read for one page of the feed (its own statistics, whatever the query)."""
    from tracker import queries
    from tracker.bootstrap import build_store
    from tracker.core.model import SessionScope
    from tracker.settings import Settings

    before = _events_rows_read(server.engine)
    store = build_store(Settings.of(database_url=server.db_url).store)
    try:
        queries.feed_page(store, 0, 50, scope=SessionScope(fleet))
    finally:
        store.close()  # its connections end, and a backend that ends reports its statistics
    after, deadline = before, time.monotonic() + 5
    while after == before and time.monotonic() < deadline:
        time.sleep(0.1)
        after = _events_rows_read(server.engine)
    return after - before


def test_a_feed_page_costs_the_same_whatever_other_fleets_hold(server, a, b):
    from sqlalchemy import text

    from tracker.core.model import SessionScope

    for i in range(5):
        observe(b, sid("feed"), f"m{i}", 10)
    with server.engine.connect() as conn:
        last = conn.execute(text("SELECT session_id FROM events ORDER BY position DESC LIMIT 1")).scalar_one()
    fleet = SessionScope.fleet_of(last)  # fleet B
    quiet = _feed_rows_examined(server, fleet)
    # another fleet writes 20,000 events (copies of one of its rows, stored as an append stores them)
    s = sid("noisy")
    observe(a, s, "m0", 10)
    with server.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO events (session_id, version, type, data, recorded_at) "
                "SELECT session_id || '-' || g, version, type, data, recorded_at "
                "FROM events, generate_series(1, 20000) g WHERE session_id LIKE :s"
            ),
            {"s": f"%:{s}"},
        )
        conn.execute(text("ANALYZE events"))
    busy = _feed_rows_examined(server, fleet)
    print(f"\nfeed page of fleet B: {quiet} rows read alone, {busy} with 20,000 more events of fleet A")
    assert quiet > 0
    assert busy <= 2 * quiet + 100, (quiet, busy)


# -- finding 12: a string or a boolean is not a number ---------------------------------------------


def test_numbers_are_not_parsed_leniently(server, a):
    s = sid()
    for extra, field in (
        ({"compaction_threshold": "0.5"}, "compaction_threshold"),
        ({"compaction_threshold": True}, "compaction_threshold"),
        ({"scope": "coding", "scope_confidence": "0.9"}, "scope_confidence"),
        ({"scope": "coding", "scope_confidence": False}, "scope_confidence"),
    ):
        with unchanged(server):
            refused(
                server,
                a.post(f"/v1/sessions/{s}/observe", json=measure("m1", 10, **extra)),
                422,
                "invalid_input",
                field,
            )
        CASES_TRIED.append(field)
    assert observe(a, s, "m1", 10, compaction_threshold=1)["threshold_bp"] > 0  # an integer is a number


# -- finding 13: an idempotency key is bound to the whole call ------------------------------------


def test_idempotency_key_is_bound_to_the_whole_call(server, a):
    s = sid()
    first = observe(a, s, "m1", 10, idempotency_key="k1", compaction_threshold=0.7)
    assert observe(a, s, "m1", 10, idempotency_key="k1", compaction_threshold=0.7) == first  # the same call: replayed
    for changed in (
        measure("m2", 10, idempotency_key="k1", compaction_threshold=0.7),  # another basis
        measure("m1", 10, idempotency_key="k1", compaction_threshold=0.6),  # another threshold
        measure("m1", 10, idempotency_key="k1"),  # no threshold
        measure("m1", 10, idempotency_key="k1", compaction_threshold=0.7, overhead_tokens=5),
        measure("m1", 10, idempotency_key="k1", compaction_threshold=0.7, scope="recent-turns", scope_confidence=0.9),
        {
            "measurement": {"basis": "m1", "input_tokens": 10, "input_limit": LIMIT, "quality": "heuristic_estimate"},
            "idempotency_key": "k1",
            "compaction_threshold": 0.7,
        },
    ):
        with unchanged(server):
            refused(server, a.post(f"/v1/sessions/{s}/observe", json=changed), 422, "invalid_input", "idempotency_key")
        CASES_TRIED.append("idem")


# -- finding 14: what 503s disclose, and bodies that never arrive ----------------------------------


def test_readyz_and_503_bodies_disclose_no_database_detail(tmp_path):
    from tracker.store import make_engine
    from tracker.store.fleets import FleetStore

    port = free_port()
    dead = free_port()
    env = {
        **os.environ,
        "TRACKER_DATABASE_URL": f"postgresql://nobody@127.0.0.1:{dead}/secretdb",
        "TRACKER_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
    }
    env.pop("TRACKER_BROKER_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracker.cli", "serve", "--port", str(port), "--no-access-log"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _ = (make_engine, FleetStore)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        api = httpx.post(
            f"http://127.0.0.1:{port}/v1/sessions/x/observe",
            json=measure("m1", 1),
            headers={"Authorization": "Bearer tk_" + "a" * 40},
            timeout=10,
        )
    finally:
        stop_server(proc)
    assert ready.status_code == 503
    assert api.status_code == 503, api.text
    for text_ in (ready.text, api.text):
        for secret in (str(dead), "secretdb", "nobody", "psycopg", "OperationalError", "Connection refused"):
            assert secret not in text_, (secret, text_)
    checks = ready.json()["checks"]
    assert checks["database"]["code"] == "store_unavailable" and checks["redis"]["code"] == "redis_unavailable"
    assert api.json()["code"] == "store_unavailable"


def test_a_body_that_never_arrives_is_answered_within_the_bound(server, a):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock, unchanged(server):
        sock.sendall(
            (
                f"POST /v1/sessions/{sid()}/observe HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.token_a}\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
            ).encode()
        )
        started = time.monotonic()
        data = b""
        while b"}" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        elapsed = time.monotonic() - started
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b"body_timeout" in data
    assert elapsed < 20  # TRACKER_BODY_TIMEOUT_S is 2 here; without the bound this waits for the 30 s socket timeout
    CASES_TRIED.append("slow body")


# -- the hostile-input suite ----------------------------------------------------------------------

BAD_KEYS: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("bare scheme", {"Authorization": "Bearer"}),
    ("basic scheme", {"Authorization": "Basic dXNlcjpwYXNz"}),
    ("garbage", {"Authorization": "Bearer garbage"}),
    ("long garbage", {"Authorization": "Bearer " + "x" * 5000}),
    ("well-formed unknown", {"Authorization": "Bearer tk_" + "0" * 40}),
    ("latin-1 bytes", {"Authorization": b"Bearer \xe9\xe9\xe9"}),
    ("two tokens", {"Authorization": "Bearer a b"}),
]

BAD_BODIES: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("not json", b"{nope"),
    ("array", b"[]"),
    ("null", b"null"),
    ("string", b'"x"'),
    ("number", b"1e999999"),
    ("huge int", b'{"fencing_token": ' + b"9" * 5000 + b"}"),
    ("deep array", b"[" * 100_000 + b"]" * 100_000),
    ("deep object", b'{"a":' * 20_000 + b"1" + b"}" * 20_000),
    ("nul key", b'{"\\u0000": 1}'),
    ("lone surrogate", b'{"idempotency_key": "\\udfff"}'),
    ("invalid utf-8", b'{"idempotency_key": "\xff\xfe"}'),
    ("extra field", b'{"surprise": true}'),
    ("nan", b'{"compaction_threshold": NaN, "fencing_token": NaN, "tokens_after": NaN}'),
    ("wrong types", b'{"fencing_token": "1", "tokens_after": "2", "reject_reason": 3, "measurement": 4, "basis": 5}'),
    ("bool ints", b'{"fencing_token": true, "tokens_after": false, "reject_reason": "r"}'),
    ("negative", b'{"fencing_token": -1, "tokens_after": -1, "overhead_tokens": -5}'),
    ("too large", b'{"fencing_token": 9007199254740993, "tokens_after": 9007199254740993}'),
    ("control chars", b'{"reject_reason": "\\u001b[31m", "fencing_token": 1, "basis": "\\u0007"}'),
    ("measurement nul", b'{"measurement": {"basis": "a\\u0000", "input_tokens": 1, "input_limit": 2}}'),
    ("measurement strings", b'{"measurement": {"basis": "a", "input_tokens": "1", "input_limit": "2"}}'),
    (
        "measurement bad fp",
        b'{"measurement": {"basis": "a", "input_tokens": 1, "input_limit": 2, "fingerprint": "zz"}}',
    ),
    ("request not object", b'{"request": [], "model": "gpt-4o", "basis": "a"}'),
    (
        "request surrogate",
        b'{"request": {"messages": [{"role": "user", "content": "\\ud83d"}]}, "model": "gpt-4o", "basis": "a"}',
    ),
    (
        "request deep",
        b'{"request": {"messages": [{"role": "user", "content": '
        + b"[" * 3000
        + b"]" * 3000
        + b'}]}, "model": "gpt-4o", "basis": "a"}',
    ),
]

BAD_QUERIES: list[dict[str, str]] = [
    {"timeout": "-1"},
    {"timeout": "nan"},
    {"timeout": "inf"},
    {"timeout": "1e400"},
    {"timeout": "abc"},
    {"timeout": "31"},
    {"limit": "0"},
    {"limit": "-1"},
    {"limit": "100000000000000000000"},
    {"limit": "1.5"},
    {"after": "-1"},
    {"after": "99999999999999999999999"},
    {"from_version": "0"},
    {"from_version": "x"},
    {"from_version": "\x00"},
    {"pressure": "bogus"},
    {"since": "yesterday"},
    {"since": "99999-01-01T00:00:00Z"},
    {"cursor": "\x00\x01"},
    {"cursor": "not-a-cursor"},
]

BAD_IDS: list[str] = [
    "%00",
    "a%00b",
    "x" * 190,
    "caf%C3%A9",
    "%E2%80%AE",
    "a%20b",
    "%1b%5b31m",
    "..",
]


FLEET_WIDE = ("/v1/events", "/v1/sessions", "/v1/policy", "/v1/calibration")  # no session in the path: the caller's own


def _endpoints(s: str, attempt_id: str) -> list[tuple[str, str]]:
    base = f"/v1/sessions/{s}"
    return [
        ("POST", f"{base}/observe"),
        ("POST", f"{base}/usage"),
        ("POST", f"{base}/rejection"),
        ("POST", f"{base}/compactions"),
        ("POST", f"{base}/compactions/{attempt_id}/commit"),
        ("POST", f"{base}/compactions/{attempt_id}/reject"),
        ("GET", f"{base}/compactions/{attempt_id}/wait"),
        ("GET", base),
        ("GET", f"{base}/history"),
        ("GET", "/v1/events"),
        ("GET", "/v1/sessions"),
        ("GET", "/v1/policy"),
        ("GET", "/v1/calibration"),
    ]


def test_every_endpoint_is_covered_by_the_hostile_suite(server):
    """The suite grows with the API: a /v1 route the served document lists but the suite omits fails here."""
    with server.client(None) as c:
        paths = c.get("/openapi.json").json()["paths"]
    served = {(m.upper(), p) for p, ops in paths.items() if p.startswith("/v1/") for m in ops}
    covered = {(m, p) for m, p in _endpoints("{session_id}", "{attempt_id}")}
    assert served <= covered, f"add these to the hostile suite: {sorted(served - covered)}"


def test_hostile_suite_bad_keys(server):
    s, attempt = "x", "y"
    with server.client(server.token_a) as a:
        s, att = compacting(a)
        attempt = att["attempt_id"]
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for method, path in _endpoints(s, attempt):
            for label, headers in [*BAD_KEYS, ("revoked", {"Authorization": f"Bearer {server.revoked}"})]:
                with unchanged(server):
                    r = c.request(method, path, headers=headers, content=b'{"fencing_token": 1}')
                    refused(server, r, 401, "unauthorized")
                    assert r.headers["WWW-Authenticate"] == "Bearer", label
                CASES_TRIED.append(f"{method} {path} {label}")


def test_hostile_suite_other_fleets_ids(server, a, b):
    s, attempt = compacting(a)
    bodies = {
        "commit": {"fencing_token": attempt["fencing_token"], "tokens_after": 5},
        "reject": {"fencing_token": attempt["fencing_token"], "reject_reason": "x"},
    }
    for method, path in _endpoints(s, attempt["attempt_id"]):
        if path.endswith(("/observe", "/compactions", "/usage", "/rejection")) or path in FLEET_WIDE:
            continue  # these act on the caller's own session of that name (or its own feed)
        body = bodies.get(path.rsplit("/", 1)[-1])
        with unchanged(server):
            r = b.request(method, path, json=body, params={"timeout": 0} if path.endswith("/wait") else None)
            out = refused(server, r, 404)
            assert out["code"] in ("unknown_session", "unknown_attempt"), out
            assert f":{s}" not in json.dumps(out)  # never another fleet's internal id (its fleet prefix)
        CASES_TRIED.append(f"{method} {path} other fleet")
    # nothing of A's shows in B's feed or history (read once A's own feed shows the session: the feed's
    # horizon has passed A's events by then)
    settled_feed(a, lambda events: any(e["session_id"] == s for e in events))
    assert all(not e["session_id"].endswith(s) for e in b.get("/v1/events", params={"limit": 1000}).json()["events"])


def test_hostile_suite_bad_bodies(server, a):
    s, attempt = compacting(a)
    posts = [(m, p) for m, p in _endpoints(s, attempt["attempt_id"]) if m == "POST"]
    for method, path in posts:
        for label, body in BAD_BODIES:
            if path.endswith("/compactions") and label in ("empty", "null"):
                continue  # no body means "no options": a manual attempt opens, by design
            with unchanged(server):
                r = a.request(method, path, content=body, headers={"content-type": "application/json"})
                refused(server, r)
            CASES_TRIED.append(f"{method} {path} {label}")
        # the same bodies as the wrong content type
        with unchanged(server):
            refused(server, a.request(method, path, content=b"fencing_token=1", headers={"content-type": "text/plain"}))
        CASES_TRIED.append(f"{method} {path} text/plain")


def test_hostile_suite_bad_query_strings_and_ids(server, a):
    s, attempt = compacting(a)
    gets = [(m, p) for m, p in _endpoints(s, attempt["attempt_id"]) if m == "GET"]
    for method, path in gets:
        for params in BAD_QUERIES:
            if path.endswith("/wait") and "timeout" not in params:
                params = {**params, "timeout": "0"}  # an ignored parameter must not turn into a 30 s long-poll
            with unchanged(server):
                r = a.request(method, path, params=params)
                if r.status_code == 200 or (r.status_code == 408 and path.endswith("/wait")):
                    continue  # a parameter this route does not take is ignored
                refused(server, r, 422, "invalid_input")
            CASES_TRIED.append(f"{method} {path} {params}")
    for bad in BAD_IDS:
        for method, path in _endpoints(bad, attempt["attempt_id"]):
            if path in FLEET_WIDE:
                continue
            with unchanged(server):
                r = a.request(method, path, json={})
                refused(server, r)
                assert r.status_code in (404, 422), r.text
            CASES_TRIED.append(f"{method} {path}")
        for method, path in _endpoints(s, bad):
            if "/compactions/" not in path:
                continue
            with unchanged(server):
                r = a.request(method, path, json={"fencing_token": 1, "tokens_after": 1, "reject_reason": "r"})
                refused(server, r)
            CASES_TRIED.append(f"{method} {path}")


def test_zz_report_the_number_of_hostile_cases():
    print(f"\nhostile cases tried: {len(CASES_TRIED)}")
    assert len(CASES_TRIED) > 0
