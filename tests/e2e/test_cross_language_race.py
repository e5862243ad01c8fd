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

pytestmark = pytest.mark.slow

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
    """One agent process: lines to its stdin, its stdout lines read by a thread."""

    def __init__(self, side: str, cmd: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.side = side
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, want: str) -> None:
        """Read lines until ``want`` (the protocol's lines only come in order: anything else is a failure)."""
        try:
            line = self.lines.get(timeout=TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"{self.side}: no {want!r} within {TIMEOUT_S} s; {self._stderr()}") from None
        assert line == want, f"{self.side}: expected {want!r}, got {line!r}; {self._stderr()}"
        self.seen.append(line)

    def result(self) -> dict[str, Any]:
        """The last line (the JSON report), other protocol lines before it noted; the process exits 0."""
        while True:
            try:
                line = self.lines.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(f"{self.side}: no report within {TIMEOUT_S} s; {self._stderr()}") from None
            assert line is not None, f"{self.side}: exited without a report; {self._stderr()}"
            if line.startswith("{"):
                break
            assert line in ("waiting", "summarizing"), f"{self.side}: unexpected line {line!r}"
            self.seen.append(line)
        assert self.proc.wait(timeout=TIMEOUT_S) == 0, f"{self.side}: {self._stderr()}"
        return json.loads(line)

    def _stderr(self) -> str:
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


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    node, npm = typescript_package(env)
    build(npm, env)
    models = tmp_path_factory.mktemp("race") / "models.json"
    models.write_text(json.dumps(MODELS))
    with api_server(fleets=("race",), TRACKER_MODELS_FILE=str(models), **POLICY) as server:
        yield server, node, env, models


def start_agents(setup: Any, share_dir: Path, session: str) -> dict[str, Agent]:
    server, node, env, models = setup
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
    return {
        "python": Agent(
            "python", [sys.executable, str(ROOT / "tests" / "support" / "race_agent.py"), str(spec)], ROOT, agent_env
        ),
        "typescript": Agent(
            "typescript", [node, str(PACKAGE / "test" / "support" / "race-agent.mjs"), str(spec)], PACKAGE, agent_env
        ),
    }


@pytest.mark.parametrize("order", ["python holds", "typescript holds", "simultaneous"])
def test_one_attempt_per_basis_across_languages_and_the_other_side_adopts(setup, tmp_path, order):
    server = setup[0]
    session = f"xlang-{uuid.uuid4().hex[:10]}"
    basis = view_of(langchain_history(history())).basis()
    tokens = heuristic_request_tokens(
        CanonicalRequest.from_dict(view_of(langchain_history(history()), SystemMessage(SYSTEM)).request())
    )
    assert 3000 <= tokens < 3500, f"the history must be at the hard level (3000), not far over: {tokens}"
    agents = start_agents(setup, tmp_path / "share", session)
    try:
        for agent in agents.values():
            agent.expect("ready")
        if order == "simultaneous":
            for agent in agents.values():
                agent.send("go")
            for agent in agents.values():
                agent.send("summarize")  # read by the summariser of whichever holds the attempt
        else:
            holder = agents[order.split()[0]]
            other = next(a for a in agents.values() if a is not holder)
            holder.send("go")
            holder.expect("summarizing")  # the attempt is open, held by this process
            other.send("go")
            other.expect("waiting")  # the same basis: the tracker tells it to wait on that attempt
            holder.send("summarize")
        reports = {side: agent.result() for side, agent in agents.items()}
    finally:
        for agent in agents.values():
            agent.close()

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
        assert held_by == order.split()[0]
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
    stale = [e.data["basis"] for e in events if e.type == "MeasurementRefused"]
    if order != "simultaneous":  # waited, observed the old basis again (StaleBasis), adopted
        assert "waiting" in agents[adopter].seen
        assert stale == [basis]
    else:
        assert stale in ([], [basis])
    print(f"{order}: held by {held_by}, {adopter} {'waited' if 'waiting' in agents[adopter].seen else 'arrived after'}")
