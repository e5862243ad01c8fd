"""What a type checker sees of the public calls: the keyword arguments declared once
(``ObserveOptions``, ``CompactionOptions``, ``GuardOptions``) are named, typed keyword parameters
of ``Tracker``, both clients, both protocols and the integrations (mypy, on a small typed program).

Not a unit test: mypy checks the programs against the whole package, which takes about a minute of
CPU when its cache is cold (a fresh clone), so it runs with the integration tests."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

api = pytest.importorskip("mypy.api")

# both tests on one worker, so that the module's one mypy run (``checked``) serves them both
pytestmark = pytest.mark.xdist_group("mypy")

ROOT = Path(__file__).resolve().parents[2]

GOOD = """
from tracker.client import AsyncTrackerClient, TrackerClient
from tracker.integrations.compaction import ContextGuard
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


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """mypy's output on the two programs, from one run (the cost is mypy's start and its cache):
    ``{"good": ..., "bad": ...}``, each the lines of its own file."""
    where = tmp_path_factory.mktemp("typing")
    for name, program in (("good", GOOD), ("bad", BAD)):
        (where / f"{name}.py").write_text(textwrap.dedent(program), encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # the project's config and cache, as in CI
        out, err, _ = api.run(
            ["--config-file", str(ROOT / "pyproject.toml"), str(where / "good.py"), str(where / "bad.py")]
        )
    lines = (out + err).splitlines()
    return {name: "\n".join(line for line in lines if f"{name}.py:" in line) for name in ("good", "bad")}


def test_the_declared_keywords_are_named_typed_parameters(checked):
    out = checked["good"]
    assert out, "mypy reported nothing on the good program (not even its reveal_type lines)"
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


def test_a_misspelt_or_mistyped_keyword_is_a_type_error(checked):
    out = checked["bad"]
    assert 'Unexpected keyword argument "measurment"' in out, out
    assert 'Argument "model" to "observe" of "TrackerClient" has incompatible type "int"' in out, out
    assert 'Argument "overhead_tokens" to "request_compaction" of "TrackerClient" has incompatible type "str"' in out
    assert 'Argument "input_tokens" to "report_usage" of "TrackerClient" has incompatible type "str"' in out, out
    assert 'Missing named argument "basis" for "report_usage" of "TrackerClient"' in out, out
    assert 'Argument "keep_last" to "ContextTrackerMiddleware" has incompatible type "str"' in out, out
