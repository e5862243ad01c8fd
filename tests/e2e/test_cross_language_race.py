"""Single flight across languages: a LangChain agent (Python) and an AI SDK agent (TypeScript) race.

Both are real processes (tests/support/race_agent.py, clients/typescript/test/support/race-agent.mjs)
on one session of a real ``tracker serve`` (PostgreSQL, Redis), holding the same conversation each
in its own framework's messages (LangChain one ``ToolMessage`` per result, the AI SDK one tool
message per step with both results), over the input limit: at the hard limit an open attempt makes
every other caller of the session wait (under it they would proceed, docs/behaviour.md). The adapters must
give it one basis (docs/canonical-request.md), so the tracker opens exactly one automatic attempt for
it; the other process waits (or, arriving after the commit, gets ``StaleBasis``) and adopts the
holder's compaction from their shared directory (a ``DirectoryShare`` each, one file layout): both
model calls receive the same compacted history.

The processes are driven on stdin and report on stdout (see race_agent.py): the ordered cases hold
the holder's summariser until the other process is waiting, so "the other waits and adopts" is shown
both ways round; the simultaneous case releases both at once.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import SystemMessage

from tests.support.api import api_server
from tests.support.node import PACKAGE, ROOT, build, typescript_package
from tests.support.race_agent import langchain_history
from tracker.client import TrackerClient
from tracker.counting.counters import heuristic_request_tokens
from tracker.counting.request import CanonicalRequest
from tracker.integrations.langchain import view_of

pytestmark = [pytest.mark.serial, pytest.mark.slow]

MODEL = "race-agent"
# input limit (and hard level) = window 5000 - reserved output 1000 - safety margin 1000 = 3000; history budget 2850
MODELS = {"models": {MODEL: {"provider": "test", "window": 5000, "max_output_tokens": 1000, "counter": "heuristic"}}}
POLICY = {"TRACKER_RESERVED_OUTPUT": "1000", "TRACKER_SAFETY_MARGIN": "1000", "TRACKER_COUNT_TIMEOUT_S": "10"}
SYSTEM = "You are a weather agent. Read the reports you are asked for, then answer briefly."
CITIES = ["Paris", "Oslo", "Rome", "Lima", "Kyiv", "Cairo", "Quito", "Hanoi", "Dakar", "Perth"]
TIMEOUT_S = 120


def report(city: str) -> str:
    return "\n".join(
        f"{city} at {h:02d}:00: {10 + h % 7} C, wind {5 + h} km/h, humidity {60 + h} %." for h in range(10)
    )


def history() -> list[dict[str, Any]]:
    """The conversation, framework-neutral: five steps of two tool calls each, both results after each step."""
    turns: list[dict[str, Any]] = [{"role": "user", "text": "Read the weather reports of ten cities, two at a time."}]
    for step in range(5):
        pair = CITIES[2 * step : 2 * step + 2]
        calls = [{"id": f"call_{city.lower()}", "name": "weather", "args": {"city": city}} for city in pair]
        turns.append({"role": "assistant", "text": f"Step {step + 1}: {pair[0]} and {pair[1]}.", "calls": calls})
        turns.append({"role": "tool", "results": [{**c, "text": report(c["args"]["city"])} for c in calls]})
    return turns


class Agent:
    """One agent process: lines to its stdin; its stdout lines, read by a thread, go to the race's one queue."""

    def __init__(self, side: str, cmd: list[str], cwd: Path, env: dict[str, str], lines: queue.Queue) -> None:
        self.side = side
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(lines,), daemon=True).start()

    def _read(self, lines: queue.Queue) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            lines.put((self.side, line.rstrip("\n")))
        lines.put((self.side, None))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        assert self.proc.stderr is not None
        return f"exit {self.proc.returncode}, stderr:\n{self.proc.stderr.read()[-3000:]}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


class Race:
    """The two agents and the lines they print, in the order they printed them."""

    def __init__(self) -> None:
        self.lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self.agents: dict[str, Agent] = {}
        self.reports: dict[str, dict[str, Any]] = {}

    def start(self, side: str, cmd: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.agents[side] = Agent(side, cmd, cwd, env, self.lines)

    def next(self) -> tuple[str, str]:
        """The next line of either agent: a protocol line, or ``report`` when one printed its JSON report
        (kept in ``reports``; the process must then exit 0)."""
        while True:
            try:
                side, line = self.lines.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(f"no line from the agents within {TIMEOUT_S} s; {self._stderr()}") from None
            agent = self.agents[side]
            if line is None and side in self.reports:
                continue  # the end of its output, after its report
            assert line is not None, f"{side} exited before its report; {agent.stderr()}"
            if not line.startswith("{"):
                agent.seen.append(line)
                return side, line
            self.reports[side] = json.loads(line)
            assert agent.proc.wait(timeout=TIMEOUT_S) == 0, f"{side}: {agent.stderr()}"
            return side, "report"

    def expect(self, side: str, want: str) -> None:
        got = self.next()
        assert got == (side, want), f"expected {want!r} from {side}, got {got[1]!r} from {got[0]}; {self._stderr()}"

    def report(self, side: str) -> dict[str, Any]:
        """That agent's report (reading on until it has printed it)."""
        while side not in self.reports:
            got = self.next()
            assert got[1] in ("waiting", "summarizing", "report"), f"unexpected {got}; {self._stderr()}"
        return self.reports[side]

    def _stderr(self) -> str:
        return "; ".join(f"{side}: {agent.stderr()}" for side, agent in self.agents.items())

    def close(self) -> None:
        for agent in self.agents.values():
            agent.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    node, npm = typescript_package(env)
    build(npm, env)
    models = tmp_path_factory.mktemp("race") / "models.json"
    models.write_text(json.dumps(MODELS))
    with api_server(fleets=("race",), TRACKER_MODELS_FILE=str(models), **POLICY) as server:
        yield server, node, env, models


def start_agents(setup: Any, share_dir: Path, session: str) -> Race:
    server, node, env, _models = setup
    spec = share_dir.parent / f"{session}.json"
    spec.write_text(
        json.dumps(
            {
                "url": server.url,
                "token": server.token_a,
                "session": session,
                "model": MODEL,
                "share_dir": str(share_dir),
                "system": SYSTEM,
                "history": history(),
            }
        )
    )
    agent_env = {k: v for k, v in env.items() if not k.startswith("TRACKER_")}
    race = Race()
    race.start(
        "python", [sys.executable, str(ROOT / "tests" / "support" / "race_agent.py"), str(spec)], ROOT, agent_env
    )
    race.start(
        "typescript", [node, str(PACKAGE / "test" / "support" / "race-agent.mjs"), str(spec)], PACKAGE, agent_env
    )
    return race


ORDERS = ["python holds", "typescript holds", "simultaneous", "typescript after the commit"]


@pytest.mark.parametrize("order", ORDERS)
def test_one_attempt_per_basis_across_languages_and_the_other_side_adopts(setup, tmp_path, order):
    """``python holds`` / ``typescript holds``: that side observes first and holds the attempt; the other
    observes while it is open (and waits). ``simultaneous``: both observe at once, whichever the tracker
    gives the attempt holds it until the other waits. ``typescript after the commit``: Python compacts
    alone, then TypeScript observes the old basis (StaleBasis) and adopts without waiting."""
    server = setup[0]
    session = f"xlang-{uuid.uuid4().hex[:10]}"
    basis = view_of(langchain_history(history())).basis()
    tokens = heuristic_request_tokens(
        CanonicalRequest.from_dict(view_of(langchain_history(history()), SystemMessage(SYSTEM)).request())
    )
    assert 3000 <= tokens < 3500, f"the history must be at the hard level (3000), not far over: {tokens}"
    race = start_agents(setup, tmp_path / "share", session)
    agents = race.agents
    try:
        for _ in agents:
            assert race.next()[1] == "ready"
        if order == "typescript after the commit":
            agents["python"].send("go")
            race.expect("python", "summarizing")
            agents["python"].send("summarize")
            race.report("python")  # committed, and its model called with the compacted history
            agents["typescript"].send("go")
        else:
            if order == "simultaneous":
                for agent in agents.values():
                    agent.send("go")
                # one side holds the attempt, the other waits on it; two processes print those lines,
                # so either may arrive first
                said = dict(race.next()[::-1] for _ in agents)
                assert sorted(said) == ["summarizing", "waiting"], said
                holder = said["summarizing"]
                assert said["waiting"] != holder, said
            else:
                holder = order.split()[0]
                agents[holder].send("go")
                race.expect(holder, "summarizing")  # the attempt is open, held by this process
                other = next(side for side in agents if side != holder)
                agents[other].send("go")
                race.expect(other, "waiting")  # the same basis at the hard limit: wait on that attempt
            agents[holder].send("summarize")
        reports = {side: race.report(side) for side in agents}
    finally:
        race.close()

    with TrackerClient(server.url, server.token_a) as client:
        events = list(client.history(session))
    started = [e.data for e in events if e.type == "CompactionStarted"]
    committed = [e.data for e in events if e.type == "CompactionCommitted"]
    assert [(s["reason"], s["trigger"], s["basis"]) for s in started] == [("automatic", "hard_limit", basis)], (
        "one attempt"
    )
    assert [(c["basis"], c["new_revision"]) for c in committed] == [(basis, 2)], "one compaction: none doubled"
    assert not [e for e in events if e.type in ("CompactionRejected", "ContextLimitReached", "CountFailed")]

    holders = [side for side, r in reports.items() if r["summarizer_calls"] == 1]
    assert len(holders) == 1 and sum(r["summarizer_calls"] for r in reports.values()) == 1, reports
    (held_by,) = holders
    if order != "simultaneous":
        assert held_by == order.split()[0] if "holds" in order else held_by == "python"
    adopter = next(side for side in reports if side != held_by)
    summary = reports[held_by]["summaries"]
    assert len(summary) == 1 and summary[0].startswith(
        f"Written by the {'Python' if held_by == 'python' else 'TypeScript'}"
    )
    # the other side adopted that compaction: its one model call got the same compacted history
    assert reports[adopter]["summaries"] == summary
    assert reports["python"]["history_canonical"] == reports["typescript"]["history_canonical"]
    assert reports["python"]["history_digest"] == reports["typescript"]["history_digest"]
    assert [r["prompts"] for r in reports.values()] == [1, 1]

    # every observation was on the one basis or on the compacted history's (the same in both languages)
    compacted = f"r2:h{reports['python']['history_digest']}"
    measured = [e.data["measurement"]["basis"] for e in events if e.type == "ContextMeasured"]
    assert set(measured) == {basis, compacted} and measured[0] == basis, measured
    # the other side observed the old basis after the commit (StaleBasis: after waiting, or arriving late)
    assert [e.data["basis"] for e in events if e.type == "MeasurementRefused"] == [basis]
    assert ("waiting" in agents[adopter].seen) == (order != "typescript after the commit")
    print(f"{order}: held by {held_by}, {adopter} {'waited' if 'waiting' in agents[adopter].seen else 'arrived after'}")
