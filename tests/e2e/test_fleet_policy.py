"""A policy per fleet: `tracker fleet create/policy` and a real `tracker serve` (PostgreSQL + Redis).

One server for the module; its own fleets (server policy: compact at 8000 bp) come from the harness,
the fleets with a policy of their own are made here with the real CLI. ``TRACKER_API_KEY_CACHE_S=0``:
a policy change reaches the server's next new session at once (the cache is tested by its bound).
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from tests.support.api import ApiServer, api_server, observe
from tests.support.cli import Cli
from tests.support.measurements import sid

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

LIMIT = 100_000


API_SERVER = {"fleets": (f"plain-{uuid.uuid4().hex[:6]}",), "TRACKER_API_KEY_CACHE_S": "0"}  # the plugin's ``server``


@pytest.fixture(scope="module")
def cli(server: ApiServer) -> Cli:
    return Cli(server.env, timeout=120)


def new_fleet(cli: Cli, *flags: str) -> tuple[dict[str, Any], str]:
    """A fleet made with ``tracker fleet create NAME *flags`` and a key for it: (its record, the token)."""
    fleet = cli.json("fleet", "create", f"pf-{uuid.uuid4().hex[:8]}", *flags, "--json")
    return fleet, cli.json("key", "create", fleet["name"], "--json")["token"]


def started_policy(c: httpx.Client, session: str) -> dict[str, Any]:
    r = c.get(f"/v1/sessions/{session}/history", params={"limit": 10})
    assert r.status_code == 200, r.text
    first = r.json()["events"][0]
    assert first["type"] == "SessionStarted"
    return first["data"]["policy"]


def test_a_fleet_at_7000_compacts_at_70_percent_while_another_on_the_same_server_compacts_at_80(server, cli):
    fleet, token = new_fleet(cli, "--compact-at", "7000", "--rearm-below", "5000")
    assert fleet["policy"]["compact_at_bp"] == 7000 and fleet["policy"]["rearm_below_bp"] == 5000
    with server.client(token) as own, server.client(server.token_a) as plain:
        s, t = sid(), sid()
        assert observe(own, s, "m1", 69_000)["action"] == "proceed"
        assert observe(plain, t, "m1", 69_000)["action"] == "proceed"
        at70 = observe(own, s, "m2", 70_000)
        assert at70["action"] == "compact" and at70["compact_level"] == 70_000, at70
        assert observe(plain, t, "m2", 70_000)["action"] == "proceed"
        assert observe(plain, t, "m3", 79_000)["action"] == "proceed"
        at80 = observe(plain, t, "m4", 80_000)
        assert at80["action"] == "compact" and at80["compact_level"] == 80_000, at80
        # the policy each session started with is on its record
        assert started_policy(own, s)["compact_at_bp"] == 7000
        assert started_policy(plain, t)["compact_at_bp"] == 8000
        assert own.get(f"/v1/sessions/{s}").json()["policy"]["compact_at_bp"] == 7000
    # replay and verify read the recorded policy: nothing differs
    assert cli.json("verify", "--json")["differences"] == []
    replayed = cli.lines("replay", s, "--fleet", fleet["name"], "--json")
    assert '"compact_at_bp": 7000' in json.dumps(replayed[-1]) and '"compact"' in json.dumps(replayed[-1])


def test_a_policy_change_applies_to_new_sessions_only(server, cli):
    fleet, token = new_fleet(cli, "--compact-at", "7000", "--rearm-below", "5000")
    with server.client(token) as c:
        old = sid()
        assert observe(c, old, "m1", 1_000)["action"] == "proceed"  # started under 7000
        changed = cli.json("fleet", "policy", fleet["name"], "--compact-at", "9000", "--json")
        assert changed["version"] == 2 and changed["policy"]["compact_at_bp"] == 9000
        assert changed["policy"]["rearm_below_bp"] == 5000  # the fields not given are the fleet's own
        new = sid()
        assert observe(c, new, "m1", 75_000)["action"] == "proceed"  # 9000 now
        assert observe(c, old, "m2", 75_000)["action"] == "compact"  # it keeps the 7000 it started with
        assert observe(c, new, "m2", 90_000)["action"] == "compact"
        assert started_policy(c, old)["compact_at_bp"] == 7000
        assert started_policy(c, new)["compact_at_bp"] == 9000
        # --reset: back to the server's policy, for new sessions
        reset = cli.json("fleet", "policy", fleet["fleet_id"], "--reset", "--json")
        assert reset["version"] == 3 and reset["policy"] is None
        third = sid()
        assert observe(c, third, "m1", 75_000)["action"] == "proceed"
        assert started_policy(c, third)["compact_at_bp"] == 8000
        assert observe(c, third, "m2", 80_000)["action"] == "compact"


def test_the_history_shows_who_changed_what_and_when(server, cli):
    before = datetime.now(UTC) - timedelta(seconds=5)
    fleet, _ = new_fleet(cli, "--compact-at", "7500", "--by", "ops-alice")
    cli.run("fleet", "policy", fleet["name"], "--turn-delta", "0.25", "--max-automatic-per-episode", "5", "--by", "bob")
    cli.run("fleet", "policy", fleet["name"], "--observe-only", "--by", "carol")
    rows = cli.json("fleet", "policy", fleet["name"], "--history", "--json")
    assert [(r["version"], r["actor"]) for r in rows] == [(1, "ops-alice"), (2, "bob"), (3, "carol")]
    after = datetime.now(UTC) + timedelta(seconds=5)
    ats = [datetime.fromisoformat(r["at"]) for r in rows]
    assert all(before <= at <= after for at in ats) and ats == sorted(ats)
    assert rows[0]["policy"]["compact_at_bp"] == 7500 and rows[0]["policy"]["turn_delta"] is None
    assert rows[1]["policy"]["turn_delta"] == 0.25 and rows[1]["policy"]["max_automatic_per_episode"] == 5
    assert rows[2]["policy"]["automatic"] is False and rows[2]["policy"]["compact_at_bp"] == 7500
    human = cli.run("fleet", "policy", fleet["name"], "--history").stdout
    assert "ops-alice" in human and "carol" in human and "automatic True -> False" in human
    shown = cli.json("fleet", "policy", fleet["name"], "--json")
    assert shown["version"] == 3 and shown["actor"] == "carol" and shown["policy"] == rows[2]["policy"]
    # without --by the actor is user@host; every field has a flag
    cli.run(
        "fleet",
        "policy",
        fleet["name"],
        "--automatic",
        "--counter-policy",
        "require_exact",
        "--reserved-output",
        "1000",
        "--safety-margin",
        "0",
        "--count-timeout-s",
        "3.5",
        "--attempt-lease-s",
        "120",
        "--rearm-below",
        "4000",
        "--turn-delta",
        "off",
    )
    last = cli.json("fleet", "policy", fleet["name"], "--json")
    assert "@" in last["actor"] and last["version"] == 4
    assert last["policy"] == {
        "automatic": True,
        "compact_at_bp": 7500,
        "rearm_below_bp": 4000,
        "counter_policy": "require_exact",
        "reserved_output": 1000,
        "safety_margin": 0,
        "count_timeout_s": 3.5,
        "turn_delta": None,
        "max_automatic_per_episode": 5,
        "attempt_lease_s": 120.0,
    }


BAD = [
    (("--rearm-below", "7000"), "rearm_below_bp"),  # not below compact_at (7000)
    (("--compact-at", "10000"), "compact_at_bp"),
    (("--compact-at", "-5"), "compact_at_bp"),
    (("--reserved-output", "-1"), "reserved_output"),
    (("--max-automatic-per-episode", "0"), "max_automatic_per_episode"),
    (("--turn-delta", "2"), "turn_delta"),
    (("--turn-delta", "often"), "turn_delta"),
    (("--count-timeout-s", "nan"), "count_timeout_s"),
    (("--attempt-lease-s", "-1"), "attempt_lease_s"),
    (("--counter-policy", "whatever"), "counter_policy"),
    (("--safety-margin", "0"), "safety_margin"),  # 0 only with require_exact
]


def test_bad_values_are_refused_naming_the_field_and_nothing_is_written(server, cli):
    fleet, token = new_fleet(cli, "--compact-at", "7000", "--rearm-below", "5000")
    history = cli.json("fleet", "policy", fleet["name"], "--history", "--json")
    fleets = cli.json("fleet", "list", "--json")
    for flags, field in BAD:
        out = cli.run("fleet", "policy", fleet["name"], *flags, "--json", ok=False)
        err = json.loads(out.stdout)
        assert out.returncode == 2 and err["code"] == "invalid_policy" and err["field"] == field, (flags, err)
        assert err["error"] == "InvalidPolicy"
        name = f"bad-{uuid.uuid4().hex[:8]}"
        made = cli.run("fleet", "create", name, "--compact-at", "7000", *flags, "--json", ok=False)
        assert json.loads(made.stdout)["field"] == field, flags
    # exactly as the server's policy refuses the same value
    from tracker.core import Policy
    from tracker.errors import InvalidPolicy

    with pytest.raises(InvalidPolicy) as refused:
        Policy(compact_at_bp=10000)
    out = cli.run("fleet", "policy", fleet["name"], "--compact-at", "10000", "--json", ok=False)
    assert json.loads(out.stdout)["message"] == refused.value.to_dict()["message"]
    human = cli.run("fleet", "policy", fleet["name"], "--compact-at", "10000", ok=False)
    assert "invalid_policy" in human.stderr and "compact_at_bp" in human.stderr
    # flags with --history or --reset: refused too
    both = cli.run("fleet", "policy", fleet["name"], "--reset", "--compact-at", "7500", "--json", ok=False)
    assert json.loads(both.stdout)["code"] == "invalid_input"
    # nothing written: the same history, no new fleet, and the fleet's sessions still start at 7000
    assert cli.json("fleet", "policy", fleet["name"], "--history", "--json") == history
    assert cli.json("fleet", "list", "--json") == fleets
    with server.client(token) as c:
        s = sid()
        assert observe(c, s, "m1", 70_000)["action"] == "compact"
        assert c.get("/v1/policy").json()["policy"]["compact_at_bp"] == 7000
    unknown = cli.run("fleet", "policy", "no-such-fleet", "--json", ok=False)
    assert json.loads(unknown.stdout)["code"] == "unknown_fleet"


def test_get_policy_shows_each_fleet_its_own(server, cli):
    fleet, token = new_fleet(cli, "--compact-at", "6500", "--rearm-below", "3000")
    with server.client(token) as own, server.client(server.token_a) as plain:
        mine = own.get("/v1/policy")
        assert mine.status_code == 200, mine.text
        body = mine.json()
        assert body["source"] == "fleet" and body["version"] == 1 and body["changed_at"]
        assert body["policy"]["compact_at_bp"] == 6500 and body["policy"]["rearm_below_bp"] == 3000
        theirs = plain.get("/v1/policy").json()
        assert theirs == {
            "source": "server",
            "version": 0,
            "changed_at": None,
            "policy": {
                "automatic": True,
                "compact_at_bp": 8000,
                "rearm_below_bp": 6000,
                "counter_policy": "allow_conservative",
                "reserved_output": 16384,
                "safety_margin": 8192,
                "count_timeout_s": 2.0,
                "turn_delta": None,
                "max_automatic_per_episode": 3,
                "attempt_lease_s": 60.0,
            },
        }
        cli.run("fleet", "policy", fleet["fleet_id"], "--compact-at", "6000")
        now = own.get("/v1/policy").json()
        assert now["version"] == 2 and now["policy"]["compact_at_bp"] == 6000
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        r = anon.get("/v1/policy")
        assert r.status_code == 401 and r.json()["code"] == "unauthorized"
        doc = anon.get("/openapi.json").json()
    op = doc["paths"]["/v1/policy"]["get"]
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/PolicyOut")
    fields = doc["components"]["schemas"]["PolicyFieldsOut"]["properties"]
    assert {"compact_at_bp", "rearm_below_bp", "turn_delta", "automatic", "max_automatic_per_episode"} <= set(fields)


def test_a_server_caches_a_fleet_policy_at_most_the_key_cache_time(cli):
    """With the default cache (1 s), a change reaches new sessions within about a second, not never."""
    with api_server(fleets=(), TRACKER_API_KEY_CACHE_S="1") as server:
        c2 = Cli(server.env, timeout=120)
        fleet, token = new_fleet(c2, "--compact-at", "7000", "--rearm-below", "5000")
        with server.client(token) as c:
            assert observe(c, sid(), "m1", 70_000)["action"] == "compact"  # cached now
            c2.run("fleet", "policy", fleet["name"], "--compact-at", "9000")
            deadline = time.monotonic() + 10
            while observe(c, sid(), "m1", 70_000)["action"] == "compact":
                assert time.monotonic() < deadline, "the change never reached new sessions"
                time.sleep(0.2)


def test_the_clients_read_the_fleet_policy_as_the_core_policy(server, cli):
    """``TrackerClient.policy()`` / ``AsyncTrackerClient.policy()``: a fleet with its own, one without, a bad key."""
    import asyncio

    from tracker.client import AsyncTrackerClient, FleetPolicy, TrackerClient
    from tracker.core import Policy
    from tracker.errors import Unauthorized

    before = datetime.now(UTC) - timedelta(seconds=5)
    fleet, token = new_fleet(cli, "--compact-at", "6500", "--rearm-below", "3000", "--turn-delta", "0.25")
    with TrackerClient(server.url, token) as own, TrackerClient(server.url, server.token_a) as plain:
        mine = own.policy()
        assert isinstance(mine, FleetPolicy) and isinstance(mine.policy, Policy)
        assert mine.source == "fleet" and mine.version == 1
        assert mine.changed_at is not None and before <= mine.changed_at <= datetime.now(UTC) + timedelta(seconds=5)
        assert mine.policy == Policy(compact_at_bp=6500, rearm_below_bp=3000, turn_delta=0.25)
        theirs = plain.policy()
        assert theirs == FleetPolicy(source="server", version=0, changed_at=None, policy=Policy())
        cli.run("fleet", "policy", fleet["name"], "--compact-at", "6000")
        now = own.policy()
        assert now.version == 2 and now.policy.compact_at_bp == 6000 and now.policy.rearm_below_bp == 3000
        assert now.changed_at is not None and mine.changed_at <= now.changed_at
    with TrackerClient(server.url, "not-a-key", backoff_s=0.01) as bad, pytest.raises(Unauthorized):
        bad.policy()

    async def remote() -> tuple[FleetPolicy, FleetPolicy]:
        async with (
            AsyncTrackerClient(server.url, token) as own,
            AsyncTrackerClient(server.url, server.token_a) as plain,
        ):
            got = await own.policy(), await plain.policy()
        async with AsyncTrackerClient(server.url, "not-a-key", backoff_s=0.01) as bad:
            with pytest.raises(Unauthorized):
                await bad.policy()
        return got

    mine_async, theirs_async = asyncio.run(remote())
    assert mine_async == now and theirs_async == theirs
