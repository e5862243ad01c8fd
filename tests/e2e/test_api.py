"""The HTTP API (`tracker serve`) against a real uvicorn server on loopback, real PostgreSQL and Redis.

One server process per module (a fresh, upgraded database); fleets and keys are made
with the real CLI (`tracker fleet create`, `tracker key create/revoke`). Every session
id is unique per test, so the tests share the server without sharing state.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.support.api import (
    ApiServer,
    assert_error,
    cli_json,
    history,
    max_position,
    metric,
    metric_values,
    observe,
    run_cli,
    settled_feed,
)
from tests.support.bench import start_server, stop_server
from tests.support.db import create_pg_database, drop_pg_database
from tests.support.db import sqlalchemy_url as _sqlalchemy_url
from tests.support.measurements import measure, sid
from tests.support.procs import free_port
from tracker.store import head_revision

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

LIMIT = 100_000


Server = ApiServer  # url, db_url, env, fleet_a, fleet_b, token_a, token_b, client(token)

# the plugin's ``server``: fleets and keys made with the real CLI (the second key by fleet id); the server
# counts its first request after loading the encodings: 10 s, not 2, on a loaded machine
SUFFIX = uuid.uuid4().hex[:6]
API_SERVER = {"fleets": (f"alpha-{SUFFIX}", f"beta-{SUFFIX}"), "via_cli": True, "TRACKER_COUNT_TIMEOUT_S": "10"}


# -- probes, OpenAPI -------------------------------------------------------------------------------


def test_healthz_readyz_and_openapi(server):
    with server.client(None) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        ready = c.get("/readyz")
        assert ready.status_code == 200
        body = ready.json()
        assert body["status"] == "ready"
        assert body["checks"]["database"]["status"] == "ok" and body["checks"]["database"]["schema"] == head_revision()
        assert body["checks"]["redis"] == {"status": "ok"}
        doc = c.get("/openapi.json").json()
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for path in (
        "/v1/sessions/{session_id}/observe",
        "/v1/sessions/{session_id}/compactions",
        "/v1/sessions/{session_id}/compactions/{attempt_id}/commit",
        "/v1/sessions/{session_id}/compactions/{attempt_id}/reject",
        "/v1/sessions/{session_id}/compactions/{attempt_id}/wait",
        "/v1/sessions/{session_id}",
        "/v1/sessions/{session_id}/history",
        "/v1/events",
        "/v1/sessions/{session_id}/usage",
        "/v1/sessions/{session_id}/rejection",
        "/v1/calibration",
    ):
        assert path in doc["paths"]
    observe_op = doc["paths"]["/v1/sessions/{session_id}/observe"]["post"]
    assert observe_op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ObserveIn")
    assert observe_op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/DecisionOut")
    assert observe_op["responses"]["409"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")


def test_readyz_says_why_when_the_schema_is_old(server):
    """A server on an unmigrated database starts, answers /healthz, and /readyz 503 says to upgrade."""
    name, url = create_pg_database()
    port = free_port()
    env = {**server.env, "TRACKER_DATABASE_URL": _sqlalchemy_url(url)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracker.cli", "serve", "--port", str(port), "--no-access-log"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        assert r.status_code == 200
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
        assert ready.status_code == 503
        db = ready.json()["checks"]["database"]
        assert db["code"] == "schema_out_of_date" and "tracker db upgrade" in db["message"]
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/sessions/x/observe",
            json=measure("m1", 1),
            headers={"Authorization": f"Bearer {server.token_a}"},
            timeout=10,
        )
        assert_error(r, 503, "schema_out_of_date")
    finally:
        stop_server(proc)
        drop_pg_database(name)


def test_the_readme_error_table_agrees_with_error_status():
    """The status table of docs/http-api.md is documentation of ``ERROR_STATUS``, never a second source: every code agrees."""
    import re
    from pathlib import Path

    from tracker.http.errors import codes_by_status

    status_of_code = {code: status for status, codes in codes_by_status().items() for code in codes}
    doc = (Path(__file__).resolve().parents[2] / "docs" / "http-api.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (\d{3}) \| (`[^|]+`) \|", doc, flags=re.MULTILINE)
    assert rows, "docs/http-api.md has no error table"
    for status, codes in rows:
        for code in re.findall(r"`([a-z_]+)`", codes):
            assert status_of_code.get(code) == int(status), (code, status, status_of_code.get(code))


# -- the lifecycle --------------------------------------------------------------------------------


def test_observe_compact_wait_commit_then_stale_basis(a):
    s = sid("agent-1:task.7")  # ':' and '.' are allowed in session ids
    d = observe(a, s, "m1", 50_000)
    assert (d["session_id"], d["action"], d["pressure"], d["occupancy_bp"], d["basis"]) == (
        s,
        "proceed",
        "normal",
        5000,
        "r1:m1",
    )
    d = observe(a, s, "m2", 85_000)
    assert d["action"] == "compact" and d["trigger"] == "threshold" and d["pressure"] == "compact"
    attempt = d["attempt"]
    assert attempt["reason"] == "automatic" and attempt["basis"] == "r1:m2" and attempt["fencing_token"] == 1
    # the basis is taken: the same history again proceeds; at the hard limit the caller waits
    assert observe(a, s, "m2", 85_000)["action"] == "proceed"
    d = observe(a, s, "m3", 100_000)
    assert d["action"] == "wait" and d["pressure"] == "hard_limit"
    assert d["waiting_on"]["attempt_id"] == attempt["attempt_id"]

    waited: dict[str, Any] = {}
    sending = threading.Event()

    def waiter() -> None:
        with httpx.Client(base_url=str(a.base_url), headers=dict(a.headers), timeout=30) as c2:
            t0 = time.monotonic()
            sending.set()
            r = c2.get(f"/v1/sessions/{s}/compactions/{attempt['attempt_id']}/wait", params={"timeout": 20})
            waited.update(status=r.status_code, body=r.json(), took=time.monotonic() - t0, answered=time.monotonic())

    t = threading.Thread(target=waiter)
    t.start()
    assert sending.wait(30)
    time.sleep(0.5)  # the wait is open on the server (well before the commit)
    committing = time.monotonic()
    r = a.post(
        f"/v1/sessions/{s}/compactions/{attempt['attempt_id']}/commit",
        json={"fencing_token": attempt["fencing_token"], "tokens_after": 30_000},
    )
    assert r.status_code == 200, r.text
    state = r.json()
    assert state["session_id"] == s and state["revision"] == 2 and state["open_attempts"] == []
    t.join(30)
    assert (
        waited["status"] == 200 and waited["body"]["status"] == "committed" and waited["body"]["outcome"] == "committed"
    )
    # it really waited for the commit (answered only after the commit was sent), and no longer
    assert waited["answered"] > committing and waited["took"] < 15

    # measurements of the old history are stale now (recorded, 409)
    body = assert_error(a.post(f"/v1/sessions/{s}/observe", json=measure("r1:m4", 40_000)), 409, "stale_basis")
    assert body["current_revision"] == 2
    d = observe(a, s, "m5", 40_000)
    assert d["action"] == "proceed" and d["basis"] == "r2:m5" and d["revision"] == 2
    types = [e["type"] for e in history(a, s)]
    assert types == [
        "SessionStarted",
        "ContextMeasured",
        "ContextMeasured",
        "CompactionStarted",
        "ContextMeasured",
        "ContextMeasured",
        "CompactionCommitted",
        "MeasurementRefused",
        "ContextMeasured",
    ]
    st = a.get(f"/v1/sessions/{s}").json()
    assert st["session_id"] == s and st["revision"] == 2 and st["version"] == 9 and st["pressure"] == "normal"


def test_reject_then_context_limit_409_is_recorded(a):
    s = sid()
    d = observe(a, s, "m1", 100_000)
    assert d["action"] == "compact" and d["trigger"] == "hard_limit"
    att = d["attempt"]
    # only the holder may reject
    r = a.post(
        f"/v1/sessions/{s}/compactions/{att['attempt_id']}/reject",
        json={"fencing_token": att["fencing_token"] + 5, "reject_reason": "execution_failed"},
    )
    assert_error(r, 409, "not_attempt_holder")
    r = a.post(
        f"/v1/sessions/{s}/compactions/{att['attempt_id']}/reject",
        json={"fencing_token": att["fencing_token"], "reject_reason": "execution_failed"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["exhausted"] == ["r1:m1"]
    r = a.post(
        f"/v1/sessions/{s}/compactions/{att['attempt_id']}/reject",
        json={"fencing_token": att["fencing_token"], "reject_reason": "again"},
    )
    assert_error(r, 409, "attempt_not_open")
    w = a.get(f"/v1/sessions/{s}/compactions/{att['attempt_id']}/wait", params={"timeout": 1})
    assert w.json() == {
        "attempt_id": att["attempt_id"],
        "outcome": "rejected:execution_failed",
        "status": "rejected",
        "reject_reason": "execution_failed",
    }
    # the exhausted basis at the hard limit: nothing eligible -> context_limit, on the record
    body = assert_error(a.post(f"/v1/sessions/{s}/observe", json=measure("m1", 100_500)), 409, "context_limit")
    assert body["basis"] == "r1:m1"
    assert body["input_tokens"] == 100_500 and body["input_limit"] == LIMIT
    events = history(a, s)
    assert events[-1]["type"] == "ContextLimitReached" and events[-2]["data"]["action"] == "context_limit"


def test_wait_timeout_is_408_and_unknown_attempt_404(a):
    s = sid()
    att = observe(a, s, "m1", 90_000)["attempt"]
    t0 = time.monotonic()
    r = a.get(f"/v1/sessions/{s}/compactions/{att['attempt_id']}/wait", params={"timeout": 0.4})
    assert_error(r, 408, "wait_timeout")
    assert 0.3 < time.monotonic() - t0 < 5
    assert_error(a.get(f"/v1/sessions/{s}/compactions/nope/wait", params={"timeout": 0}), 404, "unknown_attempt")
    # the wait is bounded: over 30 s is refused before waiting
    assert_error(
        a.get(f"/v1/sessions/{s}/compactions/{att['attempt_id']}/wait", params={"timeout": 31}),
        422,
        "invalid_input",
        "timeout",
    )


def test_manual_compaction_and_attempt_errors(a):
    s = sid()
    observe(a, s, "m1", 20_000)
    r = a.post(f"/v1/sessions/{s}/compactions", json={})
    assert r.status_code == 201, r.text
    man = r.json()
    assert man["reason"] == "manual" and man["trigger"] == "manual" and man["basis"] == "r1:m1"
    assert man["input_limit"] == LIMIT and man["history_budget"] is not None
    assert_error(a.post(f"/v1/sessions/{s}/compactions"), 409, "manual_attempt_open")
    r = a.post(
        f"/v1/sessions/{s}/compactions/{man['attempt_id']}/commit",
        json={"fencing_token": man["fencing_token"], "tokens_after": LIMIT},
    )
    assert_error(r, 409, "summary_too_large")  # recorded as a rejection
    assert a.get(f"/v1/sessions/{s}").json()["open_attempts"] == []
    assert history(a, s)[-1]["data"]["reject_reason"] == "summary_too_large"
    r = a.post(f"/v1/sessions/{s}/compactions/unknown-attempt/commit", json={"fencing_token": 1, "tokens_after": 5})
    assert_error(r, 404, "unknown_attempt")
    # a second manual attempt, committed: the revision moves on
    man2 = a.post(f"/v1/sessions/{s}/compactions", json={"idempotency_key": "manual-2"}).json()
    again = a.post(f"/v1/sessions/{s}/compactions", json={"idempotency_key": "manual-2"})
    # a retry with the same key gets the original answer: the same attempt, nothing new written
    assert again.status_code == 201, again.text
    assert again.json()["attempt_id"] == man2["attempt_id"]
    r = a.post(
        f"/v1/sessions/{s}/compactions/{man2['attempt_id']}/commit",
        json={"fencing_token": man2["fencing_token"], "tokens_after": 5_000},
    )
    assert r.status_code == 200 and r.json()["revision"] == 2
    # commit/reject on a session that does not exist: 404
    assert_error(
        a.post(f"/v1/sessions/{sid()}/compactions/x/reject", json={"fencing_token": 1, "reject_reason": "r"}),
        404,
        "unknown_attempt",
    )


def test_observe_counts_a_request(a):
    s = sid()
    request = {"system": "You are terse.", "messages": [{"role": "user", "content": "hello " * 50}]}
    r = a.post(f"/v1/sessions/{s}/observe", json={"request": request, "model": "gpt-4o", "basis": "msg-1"})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["action"] == "proceed" and d["basis"] == "r1:msg-1"
    measured = history(a, s)[-1]["data"]["measurement"]
    assert measured["quality"] == "exact_local" and measured["model"] == {"provider": "openai", "name": "gpt-4o"}
    assert 50 <= measured["input_tokens"] <= 200 and len(measured["fingerprint"]) == 64
    # a model nobody knows: a count failure, recorded, 422
    r = a.post(f"/v1/sessions/{s}/observe", json={"request": request, "model": "no-such-model", "basis": "msg-2"})
    assert_error(r, 422, "context_limit_unknown")
    assert history(a, s)[-1]["type"] == "CountFailed"
    # bad input writes nothing
    n = len(history(a, s))
    for body, field in (
        ({"request": request, "basis": "msg-3"}, "model"),
        ({"request": request, "model": "gpt-4o"}, "basis"),
        ({"request": request, "model": "gpt-4o", "basis": "msg-3", **measure("m", 1)}, "request"),
        ({}, "request"),
        (
            {"request": {"messages": [{"role": "robot", "content": "x"}]}, "model": "gpt-4o", "basis": "b"},
            "messages[0].role",
        ),
    ):
        assert_error(a.post(f"/v1/sessions/{s}/observe", json=body), 422, "invalid_input", field)
    assert len(history(a, s)) == n


def test_validation_errors_have_the_same_shape(a, server):
    s = sid()
    before = max_position(server.db_url)
    cases = [
        (a.post(f"/v1/sessions/{s}/observe", json=measure("m1", -1)), "invalid_input", "measurement.input_tokens"),
        (a.post(f"/v1/sessions/{s}/observe", json=measure("m1", 1.5)), "invalid_input", "measurement.input_tokens"),
        (
            a.post(f"/v1/sessions/{s}/observe", json=measure("m1", 10, limit=0)),
            "invalid_input",
            "measurement.input_limit",
        ),
        (a.post(f"/v1/sessions/{s}/observe", json={**measure("m1", 1), "surprise": 1}), "invalid_input", "surprise"),
        (
            a.post(f"/v1/sessions/{s}/observe", content=b"{not json", headers={"content-type": "application/json"}),
            "invalid_input",
            "body",
        ),
        (a.post(f"/v1/sessions/{'x' * 190}/observe", json=measure("m1", 1)), "invalid_session_id", "session_id"),
        (a.post("/v1/sessions/bad%20id/observe", json=measure("m1", 1)), "invalid_session_id", "session_id"),
        (a.post(f"/v1/sessions/{s}/observe", json=measure("r7:m1", 1)), "invalid_input", "basis.revision"),
        (a.post(f"/v1/sessions/{s}/observe", json=measure("m1", 1, compaction_threshold=2.5)), "invalid_input", None),
        (a.get("/v1/events", params={"limit": 0}), "invalid_input", "limit"),
        (a.get("/v1/events", params={"after": "x"}), "invalid_input", "after"),
    ]
    for r, code, field in cases:
        body = assert_error(r, 422, code, field)
        assert body["error"] in ("InvalidInput", "InvalidSessionId")
    assert max_position(server.db_url) == before  # refused input wrote nothing
    assert a.post(f"/v1/sessions/{'x' * 189}/observe", json=measure("m1", 1)).status_code == 200  # the longest allowed
    assert_error(a.get("/v1/nothing-here"), 404, "not_found")
    assert_error(a.delete(f"/v1/sessions/{s}"), 405, "method_not_allowed")


def test_idempotent_observe(a):
    s = sid()
    first = a.post(f"/v1/sessions/{s}/observe", json=measure("m1", 85_000, idempotency_key="req-1")).json()
    again = a.post(f"/v1/sessions/{s}/observe", json=measure("m1", 85_000, idempotency_key="req-1")).json()
    assert first == again and first["action"] == "compact"
    assert len(history(a, s)) == 3


def test_history_pages(a):
    s = sid()
    for i in range(7):
        observe(a, s, f"m{i}", 1000 * (i + 1))
    full = history(a, s)
    assert [e["version"] for e in full] == list(range(1, 9)) and all(e["session_id"] == s for e in full)
    paged, frm = [], 1
    while True:
        page = a.get(f"/v1/sessions/{s}/history", params={"from_version": frm, "limit": 3}).json()
        paged += page["events"]
        frm = page["next_from_version"]
        if not page["has_more"]:
            break
    assert paged == full
    tail = a.get(f"/v1/sessions/{s}/history", params={"from_version": 100}).json()
    assert tail["events"] == [] and tail["has_more"] is False and tail["next_from_version"] == 100
    assert_error(a.get(f"/v1/sessions/{sid()}/history"), 404, "unknown_session")
    assert_error(a.get(f"/v1/sessions/{sid()}"), 404, "unknown_session")


def test_feed_pages_resumably_and_only_shows_the_callers_fleet(a, b):
    s_a, s_b = sid("feed-a"), sid("feed-b")

    def read_feed(c: httpx.Client, after: int, limit: int = 4) -> tuple[list[dict], int]:
        out = []
        while True:
            page = c.get("/v1/events", params={"after": after, "limit": limit}).json()
            out += page["events"]
            after = page["next_after"]
            if not page["has_more"]:
                return out, after

    def read_feed_of(c: httpx.Client, after: int, n: int) -> tuple[list[dict], int]:
        """The feed after ``after`` once it holds ``n`` events: it shows an event when every transaction
        older than it has ended, on the whole PostgreSQL server (other tests' too). Waits up to 30 s."""
        deadline = time.monotonic() + 30
        while True:
            out, resume = read_feed(c, after)
            if len(out) >= n or time.monotonic() > deadline:
                return out, resume
            time.sleep(0.1)

    def head_of(c: httpx.Client, mark: str) -> int:
        """The feed's resume point once it shows everything written before now: a mark session is written
        last and read until it shows (earlier events of the fleet may still be held back until then)."""
        observe(c, mark, "mark", 10)
        after, deadline = 0, time.monotonic() + 30
        while True:
            out, after = read_feed(c, after, 1000)
            if any(e["session_id"] == mark for e in out):
                return after
            assert time.monotonic() < deadline, f"the mark {mark} never showed in the feed"
            time.sleep(0.1)

    start_a = head_of(a, sid("feed-a-mark"))
    start_b = head_of(b, sid("feed-b-mark"))
    for i in range(5):
        observe(a, s_a, f"m{i}", 1000 + i)
        observe(b, s_b, f"m{i}", 1000 + i)
    got_a, resume = read_feed_of(a, start_a, 6)
    assert [e["session_id"] for e in got_a] == [s_a] * 6
    positions = [e["position"] for e in got_a]
    assert positions == sorted(positions)
    assert got_a == history(a, s_a)  # the same events, same order
    # resumable: only what came after
    observe(a, s_a, "m9", 2000)
    more, _ = read_feed_of(a, resume, 1)
    assert [(e["session_id"], e["version"]) for e in more] == [(s_a, 7)]
    got_b, _ = read_feed_of(b, start_b, 6)
    assert {e["session_id"] for e in got_b} == {s_b} and not set(positions) & {e["position"] for e in got_b}
    # B's whole feed never shows a session of A's
    everything_b, _ = read_feed(b, 0, 1000)
    a_positions = {e["position"] for e in read_feed(a, 0, 1000)[0]}
    assert not a_positions & {e["position"] for e in everything_b}


def test_fleets_are_isolated_on_every_session_endpoint(a, b, server):
    s = sid("shared-name")
    d = observe(a, s, "m1", 90_000)
    att = d["attempt"]
    a_state = a.get(f"/v1/sessions/{s}").json()
    a_feed_before = settled_feed(a, lambda events: sum(e["session_id"] == s for e in events) == d["version"])

    # B reads: 404, exactly as for a session that does not exist anywhere
    assert_error(b.get(f"/v1/sessions/{s}"), 404, "unknown_session")
    assert_error(b.get(f"/v1/sessions/{s}/history"), 404, "unknown_session")
    assert_error(
        b.get(f"/v1/sessions/{s}/compactions/{att['attempt_id']}/wait", params={"timeout": 0}), 404, "unknown_attempt"
    )
    # B cannot touch A's attempt, even holding its id and fencing token
    assert_error(
        b.post(
            f"/v1/sessions/{s}/compactions/{att['attempt_id']}/commit",
            json={"fencing_token": att["fencing_token"], "tokens_after": 1},
        ),
        404,
        "unknown_attempt",
    )
    assert_error(
        b.post(
            f"/v1/sessions/{s}/compactions/{att['attempt_id']}/reject",
            json={"fencing_token": att["fencing_token"], "reject_reason": "x"},
        ),
        404,
        "unknown_attempt",
    )
    # B's writes under the same name land in B's own session, never in A's
    d_b = observe(b, s, "m1", 90_000)
    assert d_b["action"] == "compact" and d_b["attempt"]["attempt_id"] != att["attempt_id"] and d_b["version"] == 3
    assert b.post(f"/v1/sessions/{s}/compactions").status_code == 201
    assert b.get(f"/v1/sessions/{s}").json()["version"] == 4
    assert a.get(f"/v1/sessions/{s}").json() == a_state
    assert [e for e in a.get("/v1/events", params={"limit": 1000}).json()["events"]] == a_feed_before
    b_feed = settled_feed(b, lambda events: sum(e["session_id"] == s for e in events) >= 4)
    assert {e["position"] for e in b_feed}.isdisjoint({e["position"] for e in a_feed_before})
    assert [e["type"] for e in b_feed if e["session_id"] == s] == [
        "SessionStarted",
        "ContextMeasured",
        "CompactionStarted",
        "CompactionStarted",
    ]
    # and A's attempt is still A's to commit
    r = a.post(
        f"/v1/sessions/{s}/compactions/{att['attempt_id']}/commit",
        json={"fencing_token": att["fencing_token"], "tokens_after": 10},
    )
    assert r.status_code == 200 and r.json()["session_id"] == s
    # nothing anywhere leaks the internal (fleet-prefixed) id
    fleet_a = server.fleet_a["fleet_id"]
    for text in (
        r.text,
        a.get(f"/v1/sessions/{s}/history").text,
        a.get("/v1/events").text,
        a.post(f"/v1/sessions/{s}/compactions/zzz/commit", json={"fencing_token": 1, "tokens_after": 1}).text,
    ):
        assert fleet_a not in text


def test_missing_garbage_and_revoked_keys_get_401(server):
    s = sid()
    with server.client(None) as anon:
        r = anon.post(f"/v1/sessions/{s}/observe", json=measure("m1", 1))
        assert_error(r, 401, "unauthorized")
        assert r.headers["www-authenticate"] == "Bearer"
        for header in (
            "Bearer",
            "Bearer garbage",
            "Basic dXNlcjpwdw==",
            f"Bearer {server.token_a}x",
            f"Bearer {server.token_a[:-1]}",
            "Bearer ctk_000000000000_" + "A" * 43,
            "Token " + server.token_a,
        ):
            for method, path in (
                ("GET", "/v1/events"),
                ("GET", f"/v1/sessions/{s}"),
                ("POST", f"/v1/sessions/{s}/compactions"),
            ):
                r = anon.request(method, path, headers={"Authorization": header})
                assert_error(r, 401, "unauthorized")
        # the auth check comes before anything else: even invalid bodies get 401 without a key
        assert_error(anon.post(f"/v1/sessions/{s}/observe", json={"junk": True}), 401, "unauthorized")
        assert_error(
            anon.post(f"/v1/sessions/{s}/observe", content=b"{not json", headers={"content-type": "application/json"}),
            401,
            "unauthorized",
        )
        assert_error(anon.get("/v1/no-such-route"), 401, "unauthorized")  # routes are not revealed either
    key = cli_json(server.env, "key", "create", server.fleet_a["name"])
    with server.client(key["token"]) as c:
        assert observe(c, s, "m1", 1)["action"] == "proceed"
        keys = cli_json(server.env, "key", "list", server.fleet_a["name"])
        assert {k["key_id"] for k in keys if k["active"]} >= {key["key_id"]}
        assert all("token" not in k and "token_hash" not in k for k in keys)
        revoked = cli_json(server.env, "key", "revoke", key["key_id"])
        assert revoked["key_id"] == key["key_id"] and revoked["revoked_at"]
        deadline = time.monotonic() + 5  # servers cache a valid key for TRACKER_API_KEY_CACHE_S (1 s)
        while c.get(f"/v1/sessions/{s}").status_code == 200:
            assert time.monotonic() < deadline, "the revoked key is still accepted"
            time.sleep(0.1)
        for _ in range(3):
            assert_error(c.get(f"/v1/sessions/{s}"), 401, "unauthorized")
            assert_error(c.post(f"/v1/sessions/{s}/observe", json=measure("m2", 1)), 401, "unauthorized")
    assert [
        k["active"] for k in cli_json(server.env, "key", "list", server.fleet_a["name"]) if k["key_id"] == key["key_id"]
    ] == [False]
    with server.client(server.token_a) as still:
        assert [e["type"] for e in history(still, s)] == ["SessionStarted", "ContextMeasured"]  # m2 never landed


def test_cli_fleet_and_key_commands(server):
    fleets = cli_json(server.env, "fleet", "list")
    names = {f["name"] for f in fleets}
    assert {server.fleet_a["name"], server.fleet_b["name"]} <= names
    dup = run_cli(server.env, "fleet", "create", server.fleet_a["name"], "--json", ok=False)
    assert dup.returncode == 2 and json.loads(dup.stdout)["code"] == "fleet_exists"
    bad = run_cli(server.env, "fleet", "create", "no spaces", "--json", ok=False)
    assert bad.returncode == 2 and json.loads(bad.stdout)["field"] == "name"
    missing = run_cli(server.env, "key", "create", "no-such-fleet", "--json", ok=False)
    assert missing.returncode == 2 and json.loads(missing.stdout)["code"] == "unknown_fleet"
    unknown = run_cli(server.env, "key", "revoke", "0123456789ab", "--json", ok=False)
    assert unknown.returncode == 2 and json.loads(unknown.stdout)["code"] == "unknown_key"
    human = run_cli(server.env, "key", "create", server.fleet_b["name"])
    assert human.stdout.strip().splitlines()[-1].startswith("ctk_")


def test_body_too_large_is_413_and_writes_nothing(a, server):
    s = sid()
    before = max_position(server.db_url)
    big = json.dumps(
        {
            "request": {"messages": [{"role": "user", "content": "x" * (2 * 1024 * 1024)}]},
            "model": "gpt-4o",
            "basis": "m1",
        }
    ).encode()
    r = a.post(f"/v1/sessions/{s}/observe", content=big, headers={"content-type": "application/json"})
    body = assert_error(r, 413, "payload_too_large")
    assert body["limit"] == 1024 * 1024

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b" " * 65536

    with httpx.Client(base_url=str(a.base_url), headers=dict(a.headers), timeout=30) as c2:
        r = c2.post(f"/v1/sessions/{s}/observe", content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, "payload_too_large")
    assert max_position(server.db_url) == before
    assert_error(a.get(f"/v1/sessions/{s}"), 404, "unknown_session")
    ok = a.post(f"/v1/sessions/{s}/observe", json=measure("m1", 10))  # small bodies still fine
    assert ok.status_code == 200


def test_concurrent_requests_open_one_attempt(a):
    """16 requests at once on one session (thread pool + Redis lock + store version check): one compact."""
    s = sid()
    observe(a, s, "m0", 1000)

    def one(i: int) -> str:
        with httpx.Client(base_url=str(a.base_url), headers=dict(a.headers), timeout=60) as c:
            r = c.post(f"/v1/sessions/{s}/observe", json=measure("m1", 90_000))
            assert r.status_code == 200, r.text
            return r.json()["action"]

    with ThreadPoolExecutor(16) as pool:
        actions = list(pool.map(one, range(16)))
    assert sorted(actions) == ["compact"] + ["proceed"] * 15
    st = a.get(f"/v1/sessions/{s}").json()
    assert len(st["open_attempts"]) == 1 and st["version"] == 2 + 16 + 1


def test_metrics_counters_move(a):
    before = metric_values(a)
    s = sid()
    observe(a, s, "m1", 10_000)  # proceed
    att = observe(a, s, "m2", 90_000)["attempt"]  # compact
    a.post(f"/v1/sessions/{s}/compactions/{att['attempt_id']}/reject", json={"fencing_token": 1, "reject_reason": "no"})
    a.post(f"/v1/sessions/{s}/observe", json=measure("m2", 100_000))  # context_limit
    request = {"messages": [{"role": "user", "content": "hi"}]}
    a.post(f"/v1/sessions/{s}/observe", json={"request": request, "model": "nope", "basis": "m3"})  # count failure
    man = a.post(f"/v1/sessions/{s}/compactions").json()
    a.post(
        f"/v1/sessions/{s}/compactions/{man['attempt_id']}/commit",
        json={"fencing_token": man["fencing_token"], "tokens_after": 5},
    )
    after = metric_values(a)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("tracker_decisions_total", action="proceed") == 1
    assert delta("tracker_decisions_total", action="compact") == 1
    assert delta("tracker_decisions_total", action="context_limit") == 1
    assert delta("tracker_count_failures_total", kind="ContextLimitUnknown") == 1
    assert delta("tracker_attempts_started_total", reason="automatic") == 1
    assert delta("tracker_attempts_started_total", reason="manual") == 1
    assert delta("tracker_attempt_outcomes_total", outcome="rejected") == 1
    assert delta("tracker_attempt_outcomes_total", outcome="committed") == 1
    assert delta("tracker_http_errors_total", code="context_limit") == 1
    route = "/v1/sessions/{session_id}/observe"
    assert delta("tracker_http_requests_total", method="POST", route=route, status="200") == 2
    assert delta("tracker_http_requests_total", method="POST", route=route, status="409") == 1
    assert delta("tracker_http_requests_total", method="POST", route=route, status="422") == 1
    assert delta("tracker_http_request_duration_seconds_count", method="POST", route=route) == 4


def test_serve_with_several_workers_aggregates_metrics(server):
    port = free_port()
    proc = start_server(server.env, port, "--workers", "2")
    try:
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}", timeout=30, headers={"Authorization": f"Bearer {server.token_a}"}
        ) as c:
            s = sid()
            for i in range(12):  # new connections: spread over both worker processes
                r = httpx.post(
                    f"http://127.0.0.1:{port}/v1/sessions/{s}/observe",
                    json=measure(f"m{i}", 10 + i),
                    headers={"Authorization": f"Bearer {server.token_a}"},
                    timeout=30,
                )
                assert r.status_code == 200
            values = metric_values(c)
            assert metric(values, "tracker_decisions_total", action="proceed") == 12
            assert c.get(f"/v1/sessions/{s}").json()["version"] == 13
    finally:
        stop_server(proc)
