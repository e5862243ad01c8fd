"""Finding a fleet's sessions: ``GET /v1/sessions`` and the CLI's ``--fleet``.

A real ``tracker serve`` (uvicorn) on loopback over a fresh PostgreSQL database and Redis;
sessions are created over HTTP by two fleets that use the same session ids, then listed
over HTTP (raw, and through ``TrackerClient`` / ``AsyncTrackerClient``) and found with the
real CLI (``tracker sessions/history/replay/export --fleet``) in subprocesses.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from tests.support.api import assert_error, cli_json, observe, run_cli, settled_feed
from tests.support.measurements import sid
from tracker import AsyncTrackerClient, TrackerClient

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

# the plugin's ``server`` (two fleets made with the real CLI, a key each) and its ``a`` / ``b`` clients
SUFFIX = uuid.uuid4().hex[:6]
API_SERVER = {"fleets": (f"alpha-{SUFFIX}", f"beta-{SUFFIX}"), "via_cli": True, "TRACKER_COUNT_TIMEOUT_S": "10"}


def listing(c: httpx.Client, limit: int = 1000, **params: Any) -> list[dict[str, Any]]:
    """Every page of ``GET /v1/sessions``; pages must not overlap."""
    rows: list[dict[str, Any]] = []
    cursor = None
    while True:
        r = c.get("/v1/sessions", params={"limit": limit, **params, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        page = r.json()
        assert len(page["sessions"]) <= limit
        rows += page["sessions"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    ids = [row["session_id"] for row in rows]
    assert len(ids) == len(set(ids)), "pages overlap"
    return rows


@pytest.fixture
def fresh(server):
    """A fleet of its own (an empty listing to start from) and a client with its key."""
    fleet = cli_json(server.env, "fleet", "create", f"fresh-{uuid.uuid4().hex[:6]}")
    key = cli_json(server.env, "key", "create", fleet["name"])
    with server.client(key["token"]) as c:
        yield fleet, key["token"], c


def test_listing_shows_the_agents_ids_filters_and_pages(fresh, server):
    fleet, token, c = fresh
    assert c.get("/v1/sessions").json() == {"sessions": [], "next_cursor": None}
    busy = [f"busy-{i}" for i in range(3)]
    calm = [f"calm-{i}" for i in range(5)]
    for s in calm:
        observe(c, s, "m1", 1_000)
    for s in busy:
        assert observe(c, s, "m1", 90_000)["action"] == "compact"
    whole = listing(c)
    assert [r["session_id"] for r in whole[:3]] == busy[::-1]  # most recently active first
    assert sorted(r["session_id"] for r in whole) == sorted(busy + calm)
    row = whole[0]
    assert row == {
        "session_id": "busy-2",
        "version": 3,
        "pressure": "compact",
        "occupancy_bp": 9000,
        "revision": 1,
        "open_attempts": 1,
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
    }
    assert datetime.fromisoformat(row["updated_at"]) >= datetime.fromisoformat(row["created_at"])
    assert fleet["fleet_id"] not in json.dumps(whole)
    # pages of 3 read exactly the whole listing, in order
    assert listing(c, limit=3) == whole
    assert listing(c, limit=1) == whole
    # filters
    assert [r["session_id"] for r in listing(c, pressure="compact", limit=2)] == busy[::-1]
    assert sorted(r["session_id"] for r in listing(c, pressure="normal")) == calm
    assert listing(c, pressure="hard_limit") == []
    middle = next(r for r in whole if r["session_id"] == "busy-0")["updated_at"]
    assert [r["session_id"] for r in listing(c, since=middle)] == busy[::-1]
    assert listing(c, since=(datetime.now(UTC) + timedelta(hours=1)).isoformat()) == []
    # activity moves a session to the front
    observe(c, "calm-0", "m2", 2_000)
    assert listing(c, limit=2)[0]["session_id"] == "calm-0"

    # the typed clients read the same listing, page by page
    with TrackerClient(server.url, token) as client:
        assert [r["session_id"] for r in client.sessions(page_size=2)] == [r["session_id"] for r in listing(c)]
        assert [r["session_id"] for r in client.sessions(pressure="compact")] == busy[::-1]
        since = datetime.fromisoformat(middle)
        recent = ["calm-0", *busy[::-1]]
        assert [r["session_id"] for r in client.sessions(since=since)] == recent
        assert [r["session_id"] for r in client.sessions(since=since.timestamp() - 1e-6)] == recent

    async def read_async() -> list[str]:
        async with AsyncTrackerClient(server.url, token) as ac:
            return [r["session_id"] async for r in ac.sessions(page_size=3, pressure="normal")]

    assert sorted(asyncio.run(read_async())) == calm


def test_bad_query_values_are_422_naming_the_field(fresh):
    _, _, c = fresh
    observe(c, "s1", "m1", 1_000)
    for params, field in (
        ({"pressure": "bogus"}, "pressure"),
        ({"since": "yesterday"}, "since"),
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"cursor": "not-a-cursor"}, "cursor"),
        ({"cursor": "W10"}, "cursor"),  # base64 of "[]"
        ({"cursor": ""}, "cursor"),
    ):
        assert_error(c.get("/v1/sessions", params=params), 422, "invalid_input", field)


def test_listing_is_fleet_isolated(a, b, server):
    shared, only_a, only_b = sid("same-name"), sid("only-a"), sid("only-b")
    observe(a, shared, "m1", 90_000)  # A: compact, 3 events
    observe(b, shared, "m1", 1_000)  # B: normal, 2 events
    observe(a, only_a, "m1", 1_000)
    observe(b, only_b, "m1", 1_000)
    rows_a = {r["session_id"]: r for r in listing(a, limit=2)}
    rows_b = {r["session_id"]: r for r in listing(b, limit=2)}
    assert {shared, only_a} <= set(rows_a) and only_b not in rows_a
    assert {shared, only_b} <= set(rows_b) and only_a not in rows_b
    assert (rows_a[shared]["pressure"], rows_a[shared]["version"]) == ("compact", 3)
    assert (rows_b[shared]["pressure"], rows_b[shared]["version"]) == ("normal", 2)
    for fleet in (server.fleet_a, server.fleet_b):  # no listing shows a fleet's namespace
        assert fleet["fleet_id"] not in json.dumps([rows_a, rows_b])
    # a cursor of A's listing, replayed by B, only positions B's own listing
    first = a.get("/v1/sessions", params={"limit": 1}).json()
    assert first["next_cursor"] is not None
    seen_by_b = b.get("/v1/sessions", params={"limit": 1000, "cursor": first["next_cursor"]}).json()["sessions"]
    assert only_a not in {r["session_id"] for r in seen_by_b}
    assert {r["session_id"] for r in seen_by_b} <= set(rows_b)


# -- the CLI finds them: --fleet on sessions, history, replay, export ------------------------------


def test_cli_finds_http_sessions_with_fleet(a, b, server):
    env, name_a, name_b = server.env, server.fleet_a["name"], server.fleet_b["name"]
    s, only_a = sid("session"), sid("agent-only-a")
    observe(a, s, "m1", 90_000)
    observe(a, only_a, "m1", 1_000)
    observe(b, s, "m1", 1_000)
    api_history = a.get(f"/v1/sessions/{s}/history").json()["events"]

    # without --fleet: "no session", and the error names the fleets that have it
    plain = run_cli(env, "history", s, ok=False)
    assert plain.returncode == 2
    text = " ".join(plain.stderr.split())
    assert f"no session {s}" in text and f"--fleet {name_a}" in text and f"--fleet {name_b}" in text
    err = json.loads(run_cli(env, "history", only_a, "--json", ok=False).stdout)
    assert err["code"] == "unknown_session" and err["fleets"] == [name_a] and f"--fleet {name_a}" in err["message"]
    for cmd in ("replay", "history"):
        nowhere = json.loads(run_cli(env, cmd, sid("nowhere"), "--json", ok=False).stdout)
        assert nowhere["code"] == "unknown_session" and "fleets" not in nowhere and "--fleet" not in nowhere["message"]
    # the fleet's session doesn't exist in the other fleet either
    other = json.loads(run_cli(env, "history", only_a, "--fleet", name_b, "--json", ok=False).stdout)
    assert other["code"] == "unknown_session" and other["session_id"] == only_a
    bad = json.loads(run_cli(env, "history", s, "--fleet", "no-such-fleet", "--json", ok=False).stdout)
    assert bad["code"] == "unknown_fleet"

    # history --fleet (by name, or by id): the agent's ids, the API's events
    lines = run_cli(env, "history", s, "--fleet", name_a, "--json").stdout.splitlines()
    assert [json.loads(line) for line in lines] == api_history
    by_id = run_cli(env, "history", s, "--fleet", server.fleet_a["fleet_id"], "--json").stdout.splitlines()
    assert by_id == lines
    human = run_cli(env, "history", s, "--fleet", name_a).stdout
    assert s in human and "CompactionStarted" in human and server.fleet_a["fleet_id"] not in human
    b_lines = run_cli(env, "history", s, "--fleet", name_b, "--json").stdout.splitlines()
    assert [json.loads(line)["type"] for line in b_lines] == ["SessionStarted", "ContextMeasured"]

    # replay --fleet: the state the API shows
    steps = [json.loads(line) for line in run_cli(env, "replay", s, "--fleet", name_a, "--json").stdout.splitlines()]
    state = a.get(f"/v1/sessions/{s}").json()
    assert steps[-1]["version"] == state["version"] and steps[-1]["state"]["session_id"] == s
    assert steps[-1]["state"]["pressure"] == state["pressure"] == "compact"

    # sessions --fleet: the fleet's own, by the agent's ids
    listed = {r["session_id"]: r for r in cli_json(env, "sessions", "--fleet", name_a)}
    assert {s, only_a} <= set(listed) and listed[s]["pressure"] == "compact"
    assert set(listed) == {r["session_id"] for r in listing(a)}
    listed_b = {r["session_id"] for r in cli_json(env, "sessions", "--fleet", name_b)}
    assert s in listed_b and only_a not in listed_b
    compact_a = cli_json(env, "sessions", "--fleet", name_a, "--pressure", "compact")
    assert s in {r["session_id"] for r in compact_a} and only_a not in {r["session_id"] for r in compact_a}
    table = run_cli(env, "sessions", "--fleet", name_a).stdout
    assert only_a in table and server.fleet_a["fleet_id"] not in table

    # export --fleet: the fleet's feed, by the agent's ids
    versions = {x: a.get(f"/v1/sessions/{x}").json()["version"] for x in (s, only_a)}
    feed = settled_feed(
        a, lambda events: all(sum(e["session_id"] == x for e in events) == v for x, v in versions.items())
    )
    exported = [json.loads(line) for line in run_cli(env, "export", "--fleet", name_a).stdout.splitlines()]
    assert exported == feed and {s, only_a} <= {e["session_id"] for e in exported}
    everything = [json.loads(line) for line in run_cli(env, "export").stdout.splitlines()]
    assert len(everything) > len(exported)  # without --fleet: every fleet, ids as stored
    assert f"{server.fleet_a['fleet_id']}:{s}" in {e["session_id"] for e in everything}
