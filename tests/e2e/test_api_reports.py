"""The provider's reports over HTTP and the CLI (issue #21): usage, rejection, calibration.

Against a real ``tracker serve`` (uvicorn, PostgreSQL, Redis) with two fleets: a usage report is
recorded once whatever the retries, bad input is refused naming the field and writes nothing, a
rejected basis then decides at the hard limit, twenty usage reports calibrate the next heuristic
count of the same fleet and model -- and never another fleet's, whatever that fleet reports.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from tests.support.api import history
from tests.support.cli import Cli
from tests.support.db import settled
from tests.support.measurements import sid

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

LIMIT = 200_000
MODEL = {"provider": "anthropic", "name": "claude-test"}

SUFFIX = uuid.uuid4().hex[:6]
API_SERVER = {"fleets": (f"rep-a-{SUFFIX}", f"rep-b-{SUFFIX}")}  # the plugin's ``server``, and its ``a`` / ``b``


def observe(
    c: httpx.Client, session: str, basis: str, tokens: int, model: dict[str, str] = MODEL, status: int = 200
) -> dict[str, Any]:
    m = {"basis": basis, "input_tokens": tokens, "input_limit": LIMIT, "quality": "heuristic_estimate", "model": model}
    r = c.post(f"/v1/sessions/{session}/observe", json={"measurement": m})
    assert r.status_code == status, r.text
    return r.json()


def usage(c: httpx.Client, session: str, status: int = 200, **body: Any) -> dict[str, Any]:
    r = c.post(f"/v1/sessions/{session}/usage", json=body)
    assert r.status_code == status, r.text
    return r.json()


def calibration(c: httpx.Client, model: str = MODEL["name"], **expect: int) -> list[dict[str, Any]]:
    """The fleet's calibration rows of ``model``; with ``expect`` (``usage_reports=20``), once its row says so.

    The book reads the log up to the oldest transaction still open in the whole cluster (the feed's
    safe horizon, ``read_all``), so a report just recorded may show a moment later when other
    transactions are in flight: awaited here, on the condition, until a deadline."""

    def read() -> list[dict[str, Any]]:
        r = c.get("/v1/calibration")
        assert r.status_code == 200, r.text
        return [row for row in r.json()["models"] if row["model"] == model]

    def shown(rows: list[dict[str, Any]]) -> bool:
        return not expect or any(all(row[k] == v for k, v in expect.items()) for row in rows)

    rows = settled(read, shown)
    assert shown(rows), f"calibration of {model} never showed {expect}: {rows}"
    return rows


def test_usage_is_recorded_once_and_listed_in_calibration(a, b):
    s = sid()
    observe(a, s, "m1", 27_878)
    first = usage(a, s, basis="m1", input_tokens=20_000, cache_read_tokens=644, output_tokens=12, idempotency_key="u1")
    assert first["type"] == "UsageReported" and first["session_id"] == s and first["version"] == 3
    assert first["basis"] == "r1:m1" and first["counted_tokens"] == 27_878 and first["model"] == "claude-test"
    assert first["quality"] == "heuristic_estimate"
    again = usage(a, s, basis="m1", input_tokens=20_000, cache_read_tokens=644, output_tokens=12, idempotency_key="u1")
    assert again == first
    assert [e["type"] for e in history(a, s)] == ["SessionStarted", "ContextMeasured", "UsageReported"]
    (row,) = calibration(a, usage_reports=1)
    assert row["counter"] == "estimate" and "fleet" not in row
    assert row["median_ratio"] is not None
    # the model as "provider/name" is the measured one too
    usage(a, s, basis="r1:m1", input_tokens=20_100, model="anthropic/claude-test")
    # another fleet's caller does not see this session, nor this fleet's calibration
    r = b.post(f"/v1/sessions/{s}/usage", json={"basis": "m1", "input_tokens": 20_000})
    assert r.status_code == 422 and r.json()["field"] == "basis", r.text  # no such basis in *its* session
    assert calibration(b) == []


BAD_USAGE = [
    ({"input_tokens": 1}, "basis"),
    ({"basis": "m1"}, "input_tokens"),
    ({"basis": "m1", "input_tokens": -1}, "input_tokens"),
    ({"basis": "m1", "input_tokens": "12"}, "input_tokens"),
    ({"basis": "m1", "input_tokens": 1.5}, "input_tokens"),
    ({"basis": "m1", "input_tokens": 4 * LIMIT + 1}, "input_tokens"),
    ({"basis": "m1", "input_tokens": 10, "output_tokens": -1}, "output_tokens"),
    ({"basis": "m1", "input_tokens": 10, "cache_read_tokens": -5}, "cache_read_tokens"),
    ({"basis": "m1", "input_tokens": 10, "cache_write_tokens": True}, "cache_write_tokens"),
    ({"basis": "m1", "input_tokens": 10, "cache_write_tokens": 4 * LIMIT + 1}, "cache_write_tokens"),
    ({"basis": "m2", "input_tokens": 10}, "basis"),
    ({"basis": "r9:m1", "input_tokens": 10}, "basis"),
    ({"basis": "m1\x1b[31m", "input_tokens": 10}, "basis"),
    ({"basis": "m1", "input_tokens": 10, "model": "gpt-4o"}, "model"),
    ({"basis": "m1", "input_tokens": 10, "idempotency_key": ""}, "idempotency_key"),
    ({"basis": "m1", "input_tokens": 10, "surprise": 1}, "surprise"),
]

BAD_REJECTION = [
    ({}, "basis"),
    ({"basis": "m1", "input_tokens": -1}, "input_tokens"),
    ({"basis": "m1", "input_limit": 0}, "input_limit"),
    ({"basis": "m1", "input_limit": "200000"}, "input_limit"),
    ({"basis": "m1", "input_tokens": 4 * LIMIT + 1}, "input_tokens"),
    ({"basis": "m1", "message": 42}, "message"),
    ({"basis": "m1", "message": ""}, "message"),
    ({"basis": "m2", "message": "prompt is too long: 201234 tokens > 200000 maximum"}, "basis"),
    ({"basis": "m1", "model": "other"}, "model"),
]


@pytest.mark.parametrize(("path", "cases"), [("usage", BAD_USAGE), ("rejection", BAD_REJECTION)])
def test_bad_input_names_the_field_and_writes_nothing(a, path, cases):
    s = sid()
    observe(a, s, "m1", 10_000)
    before = history(a, s)
    for body, field in cases:
        r = a.post(f"/v1/sessions/{s}/{path}", json=body)
        assert r.status_code == 422, (body, r.text)
        assert r.json()["code"] == "invalid_input" and r.json()["field"] == field, (body, r.json())
    assert history(a, s) == before  # nothing written
    r = a.post(f"/v1/sessions/{s}/{path}", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["field"] == "body"
    r = a.post(f"/v1/sessions/{'x' * 190}/{path}", json={"basis": "m1", "input_tokens": 1})
    assert r.status_code == 422 and r.json()["code"] == "invalid_session_id"
    assert history(a, s) == before


def test_a_rejected_basis_compacts_then_reaches_the_context_limit(a):
    s = sid()
    assert observe(a, s, "m1", 150_000)["action"] == "proceed"  # (the heuristic count is under the compact level)
    msg = "prompt is too long: 201234 tokens > 200000 maximum"
    r = a.post(f"/v1/sessions/{s}/rejection", json={"basis": "m1", "message": msg, "idempotency_key": "rej-1"})
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["type"] == "ProviderRejected" and report["input_tokens"] == 201_234
    assert report["input_limit"] == LIMIT and report["form"] == "anthropic.prompt_too_long"
    assert report["learned_limit"] is None  # the stated limit is the measured one: nothing lower to learn
    again = a.post(f"/v1/sessions/{s}/rejection", json={"basis": "m1", "message": msg, "idempotency_key": "rej-1"})
    assert again.json() == report
    d = observe(a, s, "m1", 150_000)
    assert d["action"] == "compact" and d["rejected"] is True and d["pressure"] == "hard_limit"
    attempt = d["attempt"]
    r = a.post(
        f"/v1/sessions/{s}/compactions/{attempt['attempt_id']}/reject",
        json={"fencing_token": attempt["fencing_token"], "reject_reason": "execution_failed"},
    )
    assert r.status_code == 200, r.text
    r = a.post(
        f"/v1/sessions/{s}/observe",
        json={
            "measurement": {
                "basis": "m1",
                "input_tokens": 150_000,
                "input_limit": LIMIT,
                "quality": "heuristic_estimate",
                "model": MODEL,
            }
        },
    )
    assert r.status_code == 409 and r.json()["code"] == "context_limit", r.text
    types = [e["type"] for e in history(a, s)]
    assert types.count("ProviderRejected") == 1 and types[-1] == "ContextLimitReached"


def test_a_rejection_below_the_measured_limit_teaches_a_lower_limit(a):
    s = sid()
    model = {"provider": "openai", "name": f"learned-{uuid.uuid4().hex[:6]}"}
    observe(a, s, "m1", 120_000, model=model)
    r = a.post(f"/v1/sessions/{s}/rejection", json={"basis": "m1", "input_tokens": 150_000, "input_limit": 160_000})
    assert r.status_code == 200 and r.json()["learned_limit"] == 160_000, r.text
    (row,) = calibration(a, model["name"], rejections=1)
    assert row["learned_limit"] == 160_000
    d = observe(a, sid(), "m1", 120_000, model=model)  # another session of the fleet: decided against it
    assert d["input_limit"] == 160_000 and d["occupancy_bp"] == 7500


def test_calibration_moves_only_its_own_fleets_decisions(server, a, b):
    """Fleet B reports the most hostile usage still plausible (billed 1.25 x counted) on the same model
    and session ids; fleet A's calibration listing and decisions are exactly what its own reports make them."""
    model = {"provider": "anthropic", "name": f"iso-{uuid.uuid4().hex[:6]}"}
    s = sid("iso")

    def feed(c: httpx.Client, ratio: float) -> None:
        for i in range(20):
            observe(c, s, f"m{i}", 10_000, model=model)
            usage(c, s, basis=f"m{i}", input_tokens=int(10_000 * ratio))

    feed(a, 0.8)
    (before,) = calibration(a, model["name"], usage_reports=20)  # (the server's book has read them all)
    assert before["samples"] == 20 and before["median_ratio"] == 0.8 and before["factor"] == 0.824
    decided = observe(a, sid("iso"), "m1", 10_000, model=model)
    assert decided["counted_tokens"] == 10_000 and decided["input_tokens"] == 8_240
    assert decided["calibration"]["factor_bp"] == 8_240 and decided["calibration"]["samples"] == 20

    feed(b, 1.25)
    (theirs,) = calibration(b, model["name"], usage_reports=20)
    assert theirs["median_ratio"] == 1.25 and theirs["factor"] == 1.25
    assert calibration(a, model["name"]) == [before]  # A's listing unchanged
    again = observe(a, sid("iso"), "m1", 10_000, model=model)
    assert {k: again[k] for k in ("input_tokens", "counted_tokens", "calibration", "occupancy_bp")} == {
        k: decided[k] for k in ("input_tokens", "counted_tokens", "calibration", "occupancy_bp")
    }

    # the CLI: the operator sees both fleets; --fleet one of them, by the ids its agents use
    # (a new process folds the reports once the log's horizon has passed them: that horizon is the whole
    # PostgreSQL server's, and another test's migration beside this one holds it back a moment)
    cli = Cli(server.env)
    everything = settled(
        lambda: [r for r in cli.json("calibration", "--json") if r["model"] == model["name"]],
        lambda rows: sum(r["samples"] for r in rows) >= 40,
    )
    assert sorted(r["fleet_name"] for r in everything) == sorted(f["name"] for f in server.fleets)
    (only_a,) = [
        r for r in cli.json("calibration", "--fleet", server.fleet_a["name"], "--json") if r["model"] == model["name"]
    ]
    assert only_a["factor"] == 0.824 and only_a["fleet"] == server.fleet_a["fleet_id"]
    table = cli.run("calibration", "--fleet", server.fleet_a["name"]).stdout
    (line,) = [line for line in table.splitlines() if model["name"] in line]
    assert "0.824" in line and "1.250" not in line and "estimate" in line


def test_cli_usage_rejection_and_history_lines(server, a):
    cli = Cli(server.env)
    fleet = server.fleet_a["name"]
    s = sid("cli")
    observe(a, s, "m3", 27_878)
    out = cli.run("usage", s, "--basis", "m3", "--input-tokens", 20_000, "--cache-read-tokens", 644, "--fleet", fleet)
    assert "usage r1:m3 billed 20,644 (counted 27,878)" in out.stdout
    report = cli.json(
        "usage", s, "--basis", "m3", "--input-tokens", 1, "--idempotency-key", "k", "--fleet", fleet, "--json"
    )
    assert report["session_id"] == s and report["type"] == "UsageReported" and report["input_tokens"] == 1
    assert (
        cli.json("usage", s, "--basis", "m3", "--input-tokens", 1, "--idempotency-key", "k", "--fleet", fleet, "--json")
        == report
    )
    bad = cli.run("usage", s, "--basis", "m4", "--input-tokens", 1, "--fleet", fleet, "--json", ok=False)
    assert bad.returncode == 2 and '"field": "basis"' in bad.stdout
    bad = cli.run("usage", s, "--basis", "m3", "--input-tokens", -1, "--fleet", fleet, ok=False)
    assert bad.returncode == 2 and "input-tokens" in bad.stderr
    observe(a, s, "m7", 190_000)
    rejected = cli.json(
        "rejection", s, "--basis", "m7", "--message", "prompt is too long: 201234 tokens > 200000 maximum",
        "--fleet", fleet, "--json",
    )  # fmt: skip
    assert rejected["input_tokens"] == 201_234 and rejected["form"] == "anthropic.prompt_too_long"
    both = cli.run(
        "rejection", s, "--basis", "m7", "--message", "x", "--message-file", __file__, "--fleet", fleet, ok=False
    )
    assert both.returncode == 2 and "message" in both.stderr
    assert len(history(a, s)) == 7  # started, m3, two usages, m7 and its attempt, the rejection: no refusal wrote
    lines = cli.run("history", s, "--fleet", fleet).stdout
    assert "usage r1:m3 billed 20,644 (counted 27,878)" in lines
    assert "provider rejected r1:m7: 201,234 > 200,000 (anthropic.prompt_too_long)" in lines


def test_history_shows_the_calibrated_count_beside_the_raw_one(server, a):
    model = {"provider": "anthropic", "name": f"hist-{uuid.uuid4().hex[:6]}"}
    s = sid("hist")
    for i in range(20):
        observe(a, s, f"m{i}", 10_000, model=model)
        usage(a, s, basis=f"m{i}", input_tokens=9_000)
    calibration(a, model["name"], usage_reports=20)
    d = observe(a, s, "m20", 10_000, model=model)
    assert d["input_tokens"] == 9_270 and d["counted_tokens"] == 10_000
    lines = Cli(server.env).run("history", s, "--fleet", server.fleet_a["name"]).stdout
    assert "r1:m20 9270/200000 (counted 10000)" in lines
    assert "r1:m0 10000/200000 (" in lines  # before calibration: the raw count alone
