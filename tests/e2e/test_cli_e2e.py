"""End to end: the installed ``tracker`` console script, as a user runs it, in subprocesses.

Each test has its own working directory and an environment with no inherited
``TRACKER_*`` variables. The audit flow (``db upgrade`` → ``demo`` → ``sessions``
→ ``history`` → ``replay`` (+ ``--at``, + what-if flags) → ``export`` / ``--since``
→ ``verify`` → a tampered projection makes ``verify`` fail) runs twice:

* on the embedded default (SQLite file, in-process counting and coordination);
* distributed: a fresh Postgres database, Redis coordination, and a real Celery
  worker started with ``tracker worker -Q <unique queue>`` that does the counting.

Bad input is checked last: unknown sessions, a bad ``--pressure``, and databases
that were never upgraded (a missing SQLite file, an empty one, an empty Postgres
database) all exit non-zero with a message that says what to do.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import Cli as HarnessCli
from tests.support.cli import clean_env
from tests.support.db import settled, transaction_open_elsewhere
from tests.support.procs import stop_process_group

ROOT = Path(__file__).resolve().parents[2]
TRACKER = shutil.which("tracker")
DEMO_MODELS = ROOT / "tracker" / "demo" / "models.json"
# The demo's broken-compactor session (the 2nd) reaches its input limit at step 32.
DEMO_STEPS = 34

pytestmark = pytest.mark.skipif(TRACKER is None, reason="the `tracker` console script is not installed")


def base_env(**extra: str) -> dict[str, str]:
    return clean_env(PYTHONDONTWRITEBYTECODE="1", **extra)


def Cli(cwd: Path, env: dict[str, str]) -> HarnessCli:  # noqa: N802 - was a class of this module
    """Runs the installed ``tracker ...`` with one environment and working directory."""
    return HarnessCli(env, cwd, script=True)


# -- the audit flow, shared by both deployments --------------------------------------------------


def check_demo_summary(result: dict[str, Any], n_sessions: int, distributed: bool) -> None:
    rows = result["sessions"]
    assert len(rows) == n_sessions
    assert result["distributed"] == {"redis": distributed, "broker": distributed}
    broken = [r for r in rows if r["outcome"] == "ContextLimitError"]
    assert len(broken) == 1, [(r["session_id"], r["outcome"]) for r in rows]
    b = broken[0]
    assert b["context_limit_errors"] == 1 and b["pressure"] == "hard_limit"
    assert b["compactions_committed"] == 0 and b["compactions_rejected"] >= 1  # its compactor always fails
    assert sum(r["compactions_committed"] for r in rows) >= 1
    assert sum(r["count_failures"] for r in rows) >= 1  # the slow counter's CountTimeout, recorded
    for r in rows:
        if r["outcome"] == "finished":  # every step was either measured or a recorded count failure
            assert r["measurements"] + r["count_failures"] == DEMO_STEPS, r


def audit_flow(cli: Cli, *, workers: int, sessions: int, distributed: bool) -> dict[str, Any]:
    up = cli.json("db", "upgrade", "--json")
    assert up["ok"] is True and up["revision"]

    demo = cli.json("demo", "--workers", workers, "--sessions", sessions, "--steps", DEMO_STEPS, "--json")
    n = workers * sessions
    check_demo_summary(demo, n, distributed)
    by_id = {r["session_id"]: r for r in demo["sessions"]}
    sid = next(r["session_id"] for r in demo["sessions"] if r["outcome"] == "ContextLimitError")

    # sessions: the projection rows agree with the summary
    listed = {r["session_id"]: r for r in cli.json("sessions", "--json")}
    assert set(by_id) <= set(listed)
    for s, r in by_id.items():
        assert listed[s]["version"] == r["events"]
        assert listed[s]["pressure"] == r["pressure"] and listed[s]["revision"] == r["revision"]
    assert [r["session_id"] for r in cli.json("sessions", "--pressure", "hard_limit", "--json")] == [sid]

    # history: versions 1..n with no gaps, the story of a failing session
    hist = cli.lines("history", sid, "--json")
    assert [e["version"] for e in hist] == list(range(1, by_id[sid]["events"] + 1))
    assert all(e["session_id"] == sid for e in hist)
    types = [e["type"] for e in hist]
    assert types[0] == "SessionStarted" and types[-1] == "ContextLimitReached"
    assert types.count("CompactionRejected") == by_id[sid]["compactions_rejected"]
    assert types.count("ContextMeasured") == by_id[sid]["measurements"]
    assert [e["position"] for e in hist] == sorted(e["position"] for e in hist)
    tail = cli.lines("history", sid, "--from-version", 10, "--json")
    assert tail == hist[9:]
    assert "ContextLimitReached" in cli.run("history", sid).stdout  # the table view

    # replay: the state after every event; the last one is the stored projection
    steps = cli.lines("replay", sid, "--json")
    assert [s["version"] for s in steps] == list(range(1, len(hist) + 1))
    assert [s["type"] for s in steps] == types
    final = steps[-1]["state"]
    assert final == listed[sid]["state"]
    assert final["pressure"] == "hard_limit" and final["revision"] == 1
    at = len(hist) // 2
    partial = cli.lines("replay", sid, "--at", at, "--json")
    assert partial == steps[:at]
    assert "replay of" in cli.run("replay", sid, "--at", at).stdout

    # what-if on the recorded measurements: lower thresholds
    rows = cli.lines("replay", sid, "--compact-at", 7000, "--rearm-below", 5000, "--json")
    measured = [e for e in hist if e["type"] == "ContextMeasured"]
    measure_rows = [r for r in rows if r["op"] == "measure"]
    assert [r["version"] for r in measure_rows] == [e["version"] for e in measured]
    for r, e in zip(measure_rows, measured, strict=True):
        assert r["recorded_action"] == e["data"]["action"]
        assert r["whatif"]["compact_level"] < e["data"]["compact_level"]
        assert r["whatif"]["threshold_bp"] == 7000
    assert any(r["changed"] for r in measure_rows)  # it would have compacted earlier
    assert "decisions would change" in cli.run("replay", sid, "--compact-at", 7000, "--rearm-below", 5000).stdout

    # export: every event once, global order, resumable (on PostgreSQL the feed shows an event once every
    # transaction older than it has ended on the whole server -- another test's too -- hence the wait)
    expected = sum(r["events"] for r in demo["sessions"]) + sum(
        r["version"] for s, r in listed.items() if s not in by_id
    )
    everything = settled(lambda: cli.lines("export", "--json"), lambda events: len(events) >= expected)
    assert len(everything) == expected
    positions = [e["position"] for e in everything]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    assert len({(e["session_id"], e["version"]) for e in everything}) == len(everything)
    assert [e for e in everything if e["session_id"] == sid] == hist
    half = len(everything) // 2
    first = cli.lines("export", "--limit", half)
    rest = cli.lines("export", "--since", first[-1]["position"])
    assert first + rest == everything
    assert cli.lines("export", "--since", everything[-1]["position"]) == []

    # verify: every projection equals the fold of its log
    v = cli.json("verify", "--json")
    assert v == {
        "ok": True,
        "sessions": len(listed),
        "differences": [],
        "chains": len(listed),
        "events": v["events"],
        "broken": [],
    }
    assert v["events"] >= len(listed)
    assert "every projection equals the fold" in cli.run("verify").stdout
    return {"sid": sid, "final": final, "events": len(hist)}


def check_tampering_is_caught(cli: Cli, sid: str, tamper) -> None:
    """A projection row that is not the fold of its log makes `tracker verify` exit 1, naming it."""
    tamper()
    out = cli.run("verify", "--json", ok=False)
    assert out.returncode == 1
    report = json.loads(out.stdout)
    assert report["ok"] is False
    assert {(d["session_id"], d["field"]) for d in report["differences"]} >= {(sid, "state")}
    human = cli.run("verify", ok=False)
    assert human.returncode == 1 and sid in human.stderr


# -- embedded default -------------------------------------------------------------------------------


def test_embedded_default_audit_flow(tmp_path):
    db = tmp_path / "t.db"
    cli = Cli(tmp_path, base_env(TRACKER_DATABASE_URL=f"sqlite:///{db}"))
    out = audit_flow(cli, workers=2, sessions=2, distributed=False)
    sid = out["sid"]

    # the HTML report of the failing session (its content is checked in a browser by test_replay_html.py)
    report = cli.json("replay", sid, "--html", tmp_path / "r.html", "--json")
    assert report["context_limit"] == 1 and report["committed"] == 0 and report["rejected"] >= 1
    assert report["events"] == out["events"]
    html = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert '<svg id="timeline"' in html and sid in html

    def tamper() -> None:
        with sqlite3.connect(db) as conn:
            (state,) = conn.execute("SELECT state FROM sessions WHERE session_id = ?", (sid,)).fetchone()
            state = json.loads(state)
            state["pressure"] = "normal"
            conn.execute("UPDATE sessions SET state = ? WHERE session_id = ?", (json.dumps(state), sid))

    check_tampering_is_caught(cli, sid, tamper)


def test_db_upgrade_creates_the_embedded_default_in_a_fresh_directory(tmp_path):
    """No TRACKER_DATABASE_URL: the default is the user's data directory ($XDG_DATA_HOME/context-tracker),
    which does not exist yet; every folder then sees the same database."""
    work, other = tmp_path / "work", tmp_path / "other"
    work.mkdir()
    other.mkdir()
    env = base_env(XDG_DATA_HOME=str(tmp_path / "data"), HOME=str(tmp_path))
    cli = Cli(work, env)
    assert cli.json("db", "upgrade", "--json")["ok"] is True
    assert (tmp_path / "data" / "context-tracker" / "tracker.db").is_file()
    assert not (work / ".tracker").exists()
    assert cli.json("sessions", "--json") == []
    cli.run("observe", "s1", "--basis", "m1", "--input-tokens", 10, "--input-limit", 100)
    elsewhere = Cli(other, env)
    assert [s["session_id"] for s in elsewhere.json("sessions", "--json")] == ["s1"]
    assert elsewhere.json("verify", "--json") == {
        "ok": True,
        "sessions": 1,
        "differences": [],
        "chains": 1,
        "events": 2,
        "broken": [],
    }


# -- distributed: Postgres + Redis + a real Celery worker ------------------------------------------


class Worker:
    """``tracker worker`` in its own process group; stopped (group and pool children) on exit."""

    def __init__(self, cwd: Path, env: dict[str, str], queue: str) -> None:
        self.log_path = cwd / "worker.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [TRACKER, "worker", "-c", "2", "-Q", queue, "--loglevel", "info"],
            cwd=cwd,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"tracker worker exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            if " ready." in self.output():
                return
            time.sleep(0.1)
        raise AssertionError(f"tracker worker not ready after {timeout}s:\n{self.output()[-3000:]}")

    def stop(self) -> None:
        stop_process_group(self.proc, grace_s=15)
        self.log.close()


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.celery
def test_distributed_audit_flow(tmp_path, pg_url, redis_url):
    queue = f"ct-e2e-{uuid.uuid4().hex[:10]}"
    broker = "redis://127.0.0.1:6379/3"
    env = base_env(
        TRACKER_DATABASE_URL=pg_url,
        TRACKER_REDIS_URL=redis_url,
        TRACKER_BROKER_URL=broker,
        TRACKER_COUNT_QUEUE=queue,
        TRACKER_MODELS_FILE=str(DEMO_MODELS),
    )
    worker = Worker(tmp_path, env, queue)
    try:
        worker.wait_ready()
        cli = Cli(tmp_path, env)
        out = audit_flow(cli, workers=2, sessions=1, distributed=True)
        log = worker.output()
        assert log.count("Task workers.tasks.count[") >= DEMO_STEPS, "the worker did the counting"
        assert "succeeded" in log
    finally:
        worker.stop()
    assert worker.proc.poll() is not None

    import psycopg

    sid = out["sid"]

    def tamper() -> None:
        with psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True) as conn:
            (kind,) = conn.execute(
                "SELECT data_type FROM information_schema.columns "
                "WHERE table_name = 'sessions' AND column_name = 'state'"
            ).fetchone()
            cur = conn.execute(
                f"UPDATE sessions SET state = jsonb_set(state::jsonb, '{{pressure}}', '\"normal\"')::{kind} "
                "WHERE session_id = %s",
                (sid,),
            )
            assert cur.rowcount == 1

    check_tampering_is_caught(Cli(tmp_path, env), sid, tamper)


@pytest.mark.postgres
@pytest.mark.feed
def test_export_says_what_a_transaction_open_elsewhere_on_the_server_holds_back(tmp_path, pg_url):
    """A transaction left open in another database of the same server holds the feed back: the
    export writes what the feed shows and says on stderr how many committed events it could not
    write yet; once that transaction ends, the same command writes them all and says nothing."""
    cli = Cli(tmp_path, base_env(TRACKER_DATABASE_URL=pg_url))
    cli.run("db", "upgrade")
    cli.run("observe", "s1", "--basis", "m1", "--input-tokens", "1000", "--input-limit", "100000")
    first = settled(lambda: cli.lines("export"), lambda events: len(events) == 2)
    assert [e["type"] for e in first] == ["SessionStarted", "ContextMeasured"]
    with transaction_open_elsewhere(pg_url) as end:
        cli.run("observe", "s1", "--basis", "m2", "--input-tokens", "2000", "--input-limit", "100000")
        held = cli.run("export")
        assert [json.loads(line) for line in held.stdout.splitlines()] == first
        assert held.stderr.startswith("note: 1 committed event (of any session) not exported yet (the oldest")
        assert "a transaction open on the database server since before them holds the feed back" in held.stderr
        end()
        everything = settled(lambda: cli.run("export"), lambda out: len(out.stdout.splitlines()) == 3)
        assert [json.loads(line)["version"] for line in everything.stdout.splitlines()] == [1, 2, 3]
        assert "note:" not in everything.stderr


# -- bad input --------------------------------------------------------------------------------------


def test_unknown_session_and_bad_options(tmp_path):
    cli = Cli(tmp_path, base_env(TRACKER_DATABASE_URL=f"sqlite:///{tmp_path / 't.db'}"))
    cli.run("db", "upgrade")

    for cmd in (("history", "nope"), ("replay", "nope", "--html", tmp_path / "nope.html")):
        out = cli.run(*cmd, ok=False)
        assert out.returncode == 2 and "no session nope" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    for cmd in (("history", "nope"), ("replay", "nope"), ("replay", "nope", "--compact-at", 7000)):
        j = cli.run(*cmd, "--json", ok=False)
        assert j.returncode == 2
        assert json.loads(j.stdout) == {
            "code": "unknown_session",
            "error": "UnknownSession",
            "message": "no session nope",
            "session_id": "nope",
        }
    assert not (tmp_path / "nope.html").exists()

    bad_id = cli.run("history", "bad id!", "--json", ok=False)
    assert json.loads(bad_id.stdout)["code"] == "invalid_session_id"

    p = cli.run("sessions", "--pressure", "bogus", ok=False)
    assert "pressure" in p.stderr and "bogus" in p.stderr and "Traceback" not in p.stderr
    pj = json.loads(cli.run("sessions", "--pressure", "bogus", "--json", ok=False).stdout)
    assert pj["code"] == "invalid_input" and pj["field"] == "pressure"
    # user text is not read as terminal markup
    m = cli.run("sessions", "--pressure", "[/bold]", ok=False)
    assert m.returncode == 2 and "[/bold]" in m.stderr and "Traceback" not in m.stderr

    assert cli.run("export", "--since", -1, ok=False).returncode == 2
    assert json.loads(cli.run("sessions", "--since", "yesterday", "--json", ok=False).stdout)["field"] == "since"


DATA_COMMANDS = (("sessions",), ("history", "s1"), ("replay", "s1"), ("verify",), ("export",))


def _check_refuses_unupgraded(cli: Cli, commands: tuple[tuple[str, ...], ...] = DATA_COMMANDS) -> None:
    for i, cmd in enumerate(commands):
        if i % 2 == 0:
            out = cli.run(*cmd, ok=False)
            assert out.returncode == 2, (cmd, out.stderr)
            assert "run `tracker db upgrade`" in out.stderr, (cmd, out.stderr)  # on one line, copyable
            assert "Traceback" not in out.stderr
        else:
            j = json.loads(cli.run(*cmd, "--json", ok=False).stdout)
            assert j["code"] == "schema_out_of_date" and "run `tracker db upgrade`" in j["message"], (cmd, j)


def test_unupgraded_sqlite_is_refused_with_the_fix(tmp_path):
    missing = tmp_path / "missing.db"
    _check_refuses_unupgraded(
        Cli(tmp_path, base_env(TRACKER_DATABASE_URL=f"sqlite:///{missing}")), DATA_COMMANDS + DATA_COMMANDS[:1]
    )  # every command; text and --json alternate
    assert not missing.exists(), "looking at a database must not create it"

    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    cli = Cli(tmp_path, base_env(TRACKER_DATABASE_URL=f"sqlite:///{empty}"))
    _check_refuses_unupgraded(cli, (("history", "s1"), ("verify",)))
    cli.run("db", "upgrade")
    assert cli.json("sessions", "--json") == []


@pytest.mark.postgres
def test_unupgraded_postgres_is_refused_with_the_fix(tmp_path, pg_url):
    cli = Cli(tmp_path, base_env(TRACKER_DATABASE_URL=pg_url))
    _check_refuses_unupgraded(cli, (("sessions",), ("replay", "s1")))
    cli.run("db", "upgrade")
    assert cli.json("verify", "--json")["ok"] is True


# A fresh interpreter running the CLI, that says on its last stderr line which of ``WATCHED`` it loaded.
_LOADED = (
    "import atexit, json, sys\n"
    "watched = set(sys.argv[1].split(','))\n"
    "atexit.register(lambda: print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & watched)), file=sys.stderr))\n"
    "sys.argv = ['tracker', *sys.argv[2:]]\n"
    "from tracker.cli import main\n"
    "main()\n"
)


def test_a_command_on_the_embedded_default_loads_no_client_it_does_not_use(tmp_path):
    """On SQLite without Redis or a provider's counting API, a command imports neither redis-py, httpx nor
    psycopg (each is a tenth of a second of every command's start, ``tracker serve``'s too)."""
    import sys

    from tracker.store import upgrade

    url = f"sqlite:///{tmp_path / 't.db'}"
    upgrade(url)
    watched = "redis,httpx,psycopg,sqlalchemy"
    env = base_env(TRACKER_DATABASE_URL=url)
    for argv in (  # the write path (service, coordination, counting) and the read side
        ["observe", "s1", "--basis", "m1", "--input-tokens", "150000", "--input-limit", "175000", "--json"],
        ["history", "s1", "--json"],
    ):
        out = subprocess.run(
            [sys.executable, "-c", _LOADED, watched, *argv], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, (argv, out.stderr[-2000:])
        # sqlalchemy: the probe sees what the command loaded (it opened the database)
        assert json.loads(out.stderr.splitlines()[-1]) == ["sqlalchemy"], (argv, out.stderr[-2000:])
