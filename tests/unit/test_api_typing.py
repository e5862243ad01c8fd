"""What a type checker sees of the public calls: the keyword arguments declared once
(``ObserveOptions``, ``CompactionOptions``, ``GuardOptions``) are named, typed keyword parameters
of ``Tracker``, both clients, both protocols and the integrations (mypy, on a small typed program)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

api = pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parents[2]

GOOD = """
from tracker.client import AsyncTrackerClient, TrackerClient
from tracker.integrations._compaction import ContextGuard
from tracker.protocol import AsyncTrackerProtocol, TrackerProtocol
from tracker.service import Tracker


def uses(t: TrackerProtocol) -> None:
    r = t.observe("s", request={"messages": []}, model="m", basis="b1", compaction_threshold=0.7)
    reveal_type(r)
    a = t.request_compaction("s", basis="r1:b", overhead_tokens=3, idempotency_key="k")
    reveal_type(t.commit("s", a.attempt_id, a.fencing_token, tokens_after=10))
    reveal_type(t.report_usage("s", basis="r1:b", input_tokens=10, cache_read_tokens=2))
    t.report_rejection("s", basis="r1:b", message="prompt is too long")


async def uses_async(t: AsyncTrackerProtocol, c: AsyncTrackerClient) -> None:
    reveal_type(await t.observe("s", measurement={"basis": "r1:a"}, scope="tool"))
    reveal_type(await c.observe("s", measurement={"basis": "r1:a"}, idempotency_key="k"))
    reveal_type(await c.request_compaction("s", basis="r1:b"))
    reveal_type(await t.report_rejection("s", basis="r1:b", input_tokens=9, input_limit=8))


def wiring(tracker: Tracker, client: TrackerClient, aclient: AsyncTrackerClient) -> None:
    uses(tracker)
    uses(client)
    reveal_type(client.observe("s", measurement={"basis": "r1:a"}, overhead_tokens=5))
    theirs: AsyncTrackerProtocol = aclient
    ContextGuard(client, model="m", keep_last=2)
"""

BAD = """
from tracker.client import TrackerClient
from tracker.integrations.langchain import ContextTrackerMiddleware


def misuse(c: TrackerClient) -> None:
    c.observe("s", measurment={"basis": "r1:a"})
    c.observe("s", request={}, model=42, basis="b1")
    c.request_compaction("s", overhead_tokens="many")
    c.report_usage("s", basis="r1:a", input_tokens="12")
    c.report_usage("s", input_tokens=12)
    ContextTrackerMiddleware(c, model="m", keep_last="all")
"""


def mypy(program: str, where: Path) -> str:
    path = where / "calls.py"
    path.write_text(textwrap.dedent(program), encoding="utf-8")
    out, err, _ = api.run(["--config-file", str(ROOT / "pyproject.toml"), str(path)])
    return out + err


def test_the_declared_keywords_are_named_typed_parameters(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    out = mypy(GOOD, tmp_path)
    assert "error" not in out, out
    revealed = [line.split("Revealed type is ")[1] for line in out.splitlines() if "Revealed type is" in line]
    assert revealed == [
        '"tracker.core.decide.Result"',
        '"tracker.core.state.SessionState"',
        '"tracker.core.reports.Report"',
        '"tracker.core.decide.Result"',
        '"tracker.core.decide.Result"',
        '"tracker.core.state.Attempt"',
        '"tracker.core.reports.Report"',
        '"tracker.core.decide.Result"',
    ], out


def test_a_misspelt_or_mistyped_keyword_is_a_type_error(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    out = mypy(BAD, tmp_path)
    assert 'Unexpected keyword argument "measurment"' in out, out
    assert 'Argument "model" to "observe" of "TrackerClient" has incompatible type "int"' in out, out
    assert 'Argument "overhead_tokens" to "request_compaction" of "TrackerClient" has incompatible type "str"' in out
    assert 'Argument "input_tokens" to "report_usage" of "TrackerClient" has incompatible type "str"' in out, out
    assert 'Missing named argument "basis" for "report_usage" of "TrackerClient"' in out, out
    assert 'Argument "keep_last" to "ContextTrackerMiddleware" has incompatible type "str"' in out, out
