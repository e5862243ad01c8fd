"""Calibration on the real backends (SQLite and PostgreSQL): a calibrated session's log verifies
and replays exactly, old measurements recorded before calibration still fold and verify (across a
downgrade to 0008 and back), and a decision contradicting its own calibration is a difference."""

from __future__ import annotations

import json
import random
from typing import Any

from tests.support.bench import ANTHROPIC_LIKE, CJK_DOCUMENTS, CODING_AGENT, SimProvider, session
from tests.support.cli import Cli, clean_env
from tests.support.db import feed_passed
from tests.support.provider_loop import COUNTING, MODEL, observe_session, train
from tracker.audit.replay import whatif_rows
from tracker.calibrations import ledger_of
from tracker.core.state import SessionProjector
from tracker.queries import verify
from tracker.service import Tracker
from tracker.settings import normalize_database_url
from tracker.store import NewEvent, migrate, open_store

PRE_CALIBRATION = "0008"


def _store(url: str) -> Any:
    return open_store(normalize_database_url(url), projector=SessionProjector())


def _old_measured(event: dict[str, Any]) -> dict[str, Any]:
    """A ContextMeasured as recorded before calibration: version 1, no decided count, limit or calibration."""
    old = {k: v for k, v in event.items() if k not in ("input_tokens", "input_limit", "calibration", "rejected")}
    old["v"] = 1
    return old


def test_a_calibrated_log_verifies_replays_and_old_measurements_still_fold(db_url: str) -> None:
    migrate.upgrade(db_url)
    store = _store(db_url)
    t = Tracker(store, counting=COUNTING)
    rng = random.Random("store")
    train(t, "fS", MODEL, ANTHROPIC_LIKE, CODING_AGENT, rng)
    run = observe_session(t, "fS:s", MODEL, SimProvider(ANTHROPIC_LIKE), session(rng, CODING_AGENT, 8))
    assert run.pairs
    t.report_rejection("fS:s", basis="m3", message="prompt is too long: 171234 tokens > 170000 maximum")
    assert all(not r["changed"] for r in whatif_rows(t.history("fS:s"), t.policy, "fS:s") if r["op"] == "measure")
    # an old session: measurements as recorded before calibration existed
    current = [e for e in t.history("fS:train-0") if e.type in ("SessionStarted", "ContextMeasured")][:3]
    old = [NewEvent(e.type, _old_measured(e.data) if e.type == "ContextMeasured" else e.data) for e in current]
    store.append("old-session", 0, old)
    assert feed_passed(store, "old-session")  # verify reads the decisions through the feed (see below)
    report = verify(store)
    assert (report["ok"], report["differences"], report["broken"]) == (True, [], [])
    # the ledger reads the global feed, which shows an event once every older transaction on the
    # server has ended (another test's may hold it back a moment): wait for the rejection to show
    assert feed_passed(store, "fS:s")
    before = ledger_of(store).summaries()
    assert [(s.usage_reports, s.rejections, s.learned_limit) for s in before] == [(20, 1, 170000)]
    state = t.state("old-session")
    store.close()

    # down to the schema before provider reports (0009's partial index) and back up: same log, same answers
    assert any(r.startswith(PRE_CALIBRATION) for r in migrate.revisions())
    migrate.downgrade(db_url, next(r for r in migrate.revisions() if r.startswith(PRE_CALIBRATION)))
    migrate.upgrade(db_url)
    store = _store(db_url)
    try:
        assert verify(store)["ok"]
        assert ledger_of(store).summaries() == before
        assert Tracker(store).state("old-session") == state
        rows = list(whatif_rows(store.read_stream("old-session"), t.policy, "old-session"))
        assert rows and not any(r["changed"] for r in rows if r["op"] == "measure")
    finally:
        store.close()


def test_verify_reports_a_decision_that_contradicts_its_own_calibration(sqlite_url: str) -> None:
    migrate.upgrade(sqlite_url)
    store = _store(sqlite_url)
    t = Tracker(store, counting=COUNTING)
    rng = random.Random("tamper")
    train(t, "fT", MODEL, ANTHROPIC_LIKE, CODING_AGENT, rng)
    observe_session(t, "fT:s", MODEL, SimProvider(ANTHROPIC_LIKE), session(rng, CODING_AGENT, 2))
    measured = [e for e in t.history("fT:s") if e.type == "ContextMeasured"]
    good = measured[-1].data
    assert good["calibration"] is not None
    tampered = {**good, "input_tokens": good["input_tokens"] - 1000}  # decided below what its factor gives
    started = next(e for e in t.history("fT:s") if e.type == "SessionStarted")
    store.append("fT:forged", 0, [NewEvent("SessionStarted", started.data), NewEvent("ContextMeasured", tampered)])
    high_limit = {**good, "input_limit": good["measurement"]["input_limit"] + 1}
    store.append("fT:forged", 2, [NewEvent("ContextMeasured", high_limit)])
    report = verify(store)
    assert not report["ok"]
    fields = {(d["session_id"], d["version"], d["field"]) for d in report["differences"]}
    assert fields == {("fT:forged", 2, "input_tokens"), ("fT:forged", 3, "input_limit")}
    # the CLI says so too, and the history shows the provider's rejection recorded earlier elsewhere
    t.report_rejection("fT:s", basis="m1", message="prompt is too long: 201234 tokens > 200000 maximum")
    cli = Cli(clean_env(TRACKER_DATABASE_URL=sqlite_url))
    out = cli.run("verify", "--json", ok=False)
    assert json.loads(out.stdout)["ok"] is False
    history = cli.run("history", "fT:s").stdout
    assert "ProviderRejected" in history
    lines = cli.lines("history", "fT:s", "--json")
    assert [x for x in lines if x.get("type") == "ProviderRejected"]
    # replay with and without calibration, side by side
    table = cli.run("replay", "fT:s", "--without-calibration").stdout
    assert "no calibration" in table and "0 decisions would change under this policy" in table
    rows = [r for r in cli.lines("replay", "fT:s", "--without-calibration", "--json") if r["op"] == "measure"]
    assert rows and all(not r["changed"] and r["uncalibrated"]["action"] == "proceed" for r in rows)
    table = cli.run("replay", "fT:s", "--without-calibration", "--calibration-from-log").stdout
    assert "log's calibration" in table and "0 decisions would change with the calibration folded from" in table
    rows = [r for r in cli.lines("replay", "fT:s", "--calibration-from-log", "--json") if r["op"] == "measure"]
    assert rows and all(r["refolded"]["calibration"] == r["whatif"]["calibration"] for r in rows)
    store.close()


def test_an_anchored_session_replays_and_verifies_on_the_store_and_a_tampered_anchor_is_a_difference(
    db_url: str,
) -> None:
    migrate.upgrade(db_url)
    store = _store(db_url)
    try:
        t = Tracker(store, counting=COUNTING)
        sim = SimProvider(ANTHROPIC_LIKE)
        requests = session(random.Random("anchored-store"), CJK_DOCUMENTS, 40)
        run = observe_session(t, "fA:s", MODEL, sim, requests, report=True)
        recorded = [e.data for e in t.history("fA:s") if e.type == "ContextMeasured"]
        assert [m["input_tokens"] for m in recorded] == [d for d, _ in run.pairs]
        assert all(m["anchor"] is not None for m in recorded[1:])
        live_state = t.state("fA:s")
        assert live_state.anchor is not None
        # a fresh process: the projection read back equals the fold, the replay the live decisions
        again = Tracker(_store(db_url))
        try:
            assert again.state("fA:s") == live_state
            rows = [r for r in whatif_rows(again.history("fA:s"), again.policy, "fA:s") if r["op"] == "measure"]
            assert not any(r["changed"] for r in rows)
            assert [r["whatif"].get("anchor") for r in rows] == [m["anchor"] for m in recorded]
            assert [r["whatif"].get("input_tokens") for r in rows[1:]] == [m["input_tokens"] for m in recorded[1:]]
            assert verify(again.store)["ok"]
        finally:
            again.close()
        # `tracker history`: decided against billed per turn, and what each decision was anchored on;
        # `tracker calibration`: how many reported decisions were anchored, and each kind's factor
        cli = Cli(clean_env(TRACKER_DATABASE_URL=db_url))
        history = cli.run("history", "fA:s").stdout
        billed_5 = run.pairs[5][1]
        assert f"anchored on r1:m4: billed {run.pairs[4][1]} + " in history, history
        decided_5 = run.pairs[5][0]
        assert f"usage r1:m5 billed {billed_5:,} (counted " in history
        assert f"decided {decided_5:,} = {decided_5 / billed_5:.3f} × billed, anchored)" in history
        assert feed_passed(store, "fA:s")  # the ledger reads the global feed (see the first test)
        [row] = json.loads(cli.run("calibration", "--json").stdout)
        assert row["usage_reports"] == run.reports and row["anchored"] == run.reports - 1
        assert set(row["contents"]) <= {"cjk", "latin", "other_script"}
        # an anchored decision whose estimate of the new messages is not its own rule's: a difference
        good = recorded[-1]
        forged = {**good, "anchor": {**good["anchor"], "estimated_delta": good["anchor"]["estimated_delta"] - 500}}
        forged["input_tokens"] -= 500
        started = next(e for e in t.history("fA:s") if e.type == "SessionStarted")
        store.append("fA:forged", 0, [NewEvent("SessionStarted", started.data), NewEvent("ContextMeasured", forged)])
        assert feed_passed(store, "fA:forged")  # verify reads the decisions through the feed, too
        report = verify(store)
        assert [(d["session_id"], d["field"]) for d in report["differences"]] == [
            ("fA:forged", "anchor.estimated_delta")
        ]
    finally:
        store.close()
