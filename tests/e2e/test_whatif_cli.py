"""``tracker whatif`` as a user runs it: the CLI in a subprocess (flags, stdin, tables, bad input) and the
example traces in ``examples/`` (the in-process ``WhatIf`` runner is tested in tests/unit/test_whatif.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import Cli
from tests.support.whatif_traces import BAD, EXAMPLES, GOOD, INSERT_AT, example, j, m, run
from tracker.core import Policy

ROOT = Path(__file__).resolve().parents[2]


def test_cli_matches_the_runner_and_reads_stdin(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(GOOD) + "\n\n")  # blank lines are skipped
    _, expected = run(GOOD)
    assert cli_lines(str(trace)) == expected
    assert cli_lines(stdin="\n".join(GOOD)) == expected


@pytest.mark.skipif(shutil.which("tracker") is None, reason="console script not installed")
def test_console_script(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(GOOD))
    p = subprocess.run(["tracker", "whatif", str(trace)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert [json.loads(x) for x in p.stdout.splitlines()] == run(GOOD)[1]


def test_cli_bad_lines_interleaved(tmp_path):
    lines = list(GOOD)
    for i, (bad, _) in reversed(list(enumerate(BAD[:12]))):
        lines.insert(INSERT_AT[i % 3], bad)
    trace = tmp_path / "bad.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    out = cli_lines(str(trace))
    assert len(out) == len(lines)
    errors = [o for o in out if "error" in o]
    assert len(errors) == 12
    assert [o for o in out if "error" not in o] == run(GOOD)[1]


def test_flag_compact_at_and_rearm_below(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join([m("b1", 49), m("b2", 50), j(op="commit", tokens_after=35), m("b3", 36), m("b4", 34)]))
    out = cli_lines(str(trace), "--compact-at", "5000", "--rearm-below", "3500")
    assert (out[0]["action"], out[0]["compact_level"], out[0]["rearm_level"], out[0]["threshold_bp"]) == (
        "proceed",
        50,
        35,
        5000,
    )
    assert out[1]["action"] == "compact"
    assert out[3]["pressure"] == "compact"  # 36 >= rearm level 35: hysteresis
    assert out[4]["pressure"] == "normal"
    default = cli_lines(str(trace))
    assert default[1]["action"] == "proceed"


def test_flag_observe_only():
    out = cli_lines(str(EXAMPLES / "failed-compaction.jsonl"), "--observe-only")
    measures = [o for o in out if "action" in o]
    assert "compact" not in {o["action"] for o in measures}
    assert "compact" not in {o["pressure"] for o in measures}
    assert [o["action"] for o in measures if o["pressure"] == "hard_limit"] == ["context_limit", "context_limit"]
    # reject with nothing open is an error line; the manual attempt still works
    assert out[5]["field"] == "op"
    assert out[9]["ok"] is True and out[10] == {"ok": True, "revision": 2, "attempt_id": "a1"}


def test_flag_max_automatic_per_episode(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join([m("b1", 85), j(op="reject"), m("b2", 86)]))
    assert cli_lines(str(trace))[2]["action"] == "compact"
    assert cli_lines(str(trace), "--max-automatic-per-episode", "1")[2]["action"] == "proceed"


def test_flag_turn_delta(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join([m("b1", 10), m("b2", 40)]))
    assert cli_lines(str(trace))[1]["action"] == "proceed"
    out = cli_lines(str(trace), "--turn-delta", "0.3")
    assert (out[1]["action"], out[1]["trigger"], out[1]["pressure"]) == ("compact", "growth", "normal")


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--compact-at", "5000", "--rearm-below", "7000"], "rearm_below_bp"),
        (["--compact-at", "5000"], "rearm_below_bp"),
        (["--compact-at", "10000"], "compact_at_bp"),
        (["--turn-delta", "1.5"], "turn_delta"),
        (["--turn-delta", "0"], "turn_delta"),
        (["--max-automatic-per-episode", "0"], "max_automatic_per_episode"),
    ],
)
def test_invalid_flag_combinations_exit_non_zero_naming_the_field(flags, field):
    p = cli(str(EXAMPLES / "coding-session.jsonl"), *flags)
    assert p.returncode != 0
    assert field in p.stderr + p.stdout
    assert p.stdout.strip() == ""  # no output lines at all


def test_missing_trace_file_exits_non_zero(tmp_path):
    p = cli(str(tmp_path / "nope.jsonl"))
    assert p.returncode != 0


def test_table_renders():
    p = cli(str(EXAMPLES / "failed-compaction.jsonl"), "--table")
    assert p.returncode == 0, p.stderr
    text = p.stdout
    for word in ("what-if", "measure", "compact", "wait", "context_limit", "hard_limit", "manual", "revision 2"):
        assert word in text, word
    p = cli(str(EXAMPLES / "coding-session.jsonl"), "--table")
    assert p.returncode == 0 and "older than" in p.stdout and "(classifier)" in p.stdout


def test_example_coding_session():
    lines = example("coding-session.jsonl")
    out = cli_lines(str(EXAMPLES / "coding-session.jsonl"))
    assert out == run(lines)[1]
    assert all("error" not in o for i, o in enumerate(out) if i != 8)
    assert {json.loads(x).get("input_limit") for x in lines} - {None} == {175_424}
    acts = [o.get("action") for o in out]
    # climbs with tool output, compacts at 80 %
    assert acts[:7] == ["proceed"] * 5 + ["compact", "proceed"]
    assert out[4]["occupancy_bp"] < 8000 <= out[5]["occupancy_bp"]
    assert (out[5]["trigger"], out[5]["threshold_source"], out[5]["attempt_id"]) == ("threshold", "default", "a1")
    assert (out[6]["pressure"], out[6]["attempt_id"]) == ("compact", None)
    # commits; a late count of the old history is stale
    assert out[7] == {"ok": True, "revision": 2, "attempt_id": "a1"}
    assert out[8]["code"] == "stale_basis"
    # rearms and climbs again
    assert out[9]["pressure"] == "normal" and out[9]["occupancy_bp"] < 6000
    assert [o["pressure"] for o in out[10:12]] == ["normal", "normal"]
    # per-request threshold
    assert (out[12]["action"], out[12]["threshold_source"], out[12]["threshold_bp"], out[12]["attempt_id"]) == (
        "compact",
        "explicit",
        6000,
        "a2",
    )
    assert out[12]["occupancy_bp"] < 8000
    assert out[13] == {"ok": True, "revision": 3, "attempt_id": "a2"}
    # a low-confidence classifier reading is ignored, a confident one lowers the level
    assert out[15]["threshold_source"] == "default"
    assert (out[16]["action"], out[16]["threshold_source"], out[16]["threshold_bp"]) == ("proceed", "classifier", 4500)
    assert (out[17]["action"], out[17]["threshold_source"], out[17]["attempt_id"]) == ("compact", "classifier", "a3")
    assert out[18] == {"ok": True, "revision": 4, "attempt_id": "a3"}
    assert out[19]["pressure"] == "normal"
    assert "context_limit" not in acts and "wait" not in acts


def test_example_failed_compaction():
    lines = example("failed-compaction.jsonl")
    out = cli_lines(str(EXAMPLES / "failed-compaction.jsonl"))
    assert out == run(lines)[1]
    assert all("error" not in o for o in out)
    acts = [o.get("action") for o in out]
    assert acts == [
        "proceed",
        "proceed",
        "proceed",
        "compact",
        "wait",
        None,
        "proceed",
        "proceed",
        "context_limit",
        None,
        None,
        "proceed",
    ]
    assert out[4]["pressure"] == "hard_limit"
    assert out[5] == {"ok": True, "revision": 1, "attempt_id": "a1"}  # the rejection
    assert [o["pressure"] for o in out[6:8]] == ["compact", "compact"]  # exhausted basis: no new attempt
    assert out[8]["pressure"] == "hard_limit"
    assert json.loads(lines[8])["basis"] == json.loads(lines[3])["basis"]  # the same, exhausted, basis
    assert out[9] == {"ok": True, "revision": 1, "attempt_id": "a2"}  # manual
    assert out[10] == {"ok": True, "revision": 2, "attempt_id": "a2"}
    assert out[11]["pressure"] == "normal"
    w, _ = run(lines)
    assert [e.TYPE for e in w.events].count("ContextLimitReached") == 1
    assert [e.reject_reason for e in w.events if e.TYPE == "CompactionRejected"] == ["summariser_timeout"]


def test_example_big_window():
    lines = example("big-window.jsonl")
    out = cli_lines(str(EXAMPLES / "big-window.jsonl"), "--turn-delta", "0.1")
    assert out == run(lines, Policy(turn_delta=0.1))[1]
    assert all("error" not in o for o in out)
    measures = [o for o in out if "action" in o]
    assert {(o["compact_level"], o["rearm_level"]) for o in measures} == {(300_000, 225_000)}  # the ceiling
    # the growth trigger fires at normal pressure
    assert (out[2]["action"], out[2]["trigger"], out[2]["pressure"], out[2]["attempt_id"]) == (
        "compact",
        "growth",
        "normal",
        "a1",
    )
    assert out[3] == {"ok": True, "revision": 2, "attempt_id": "a1"}
    # steady growth below 0.1 of 300k per turn never fires; 299,999 proceeds, 300,000 compacts
    assert [o["action"] for o in out[4:14]] == ["proceed"] * 10
    assert json.loads(lines[13])["input_tokens"] == 299_999
    assert json.loads(lines[14])["input_tokens"] == 300_000
    assert (out[14]["action"], out[14]["trigger"], out[14]["pressure"], out[14]["attempt_id"]) == (
        "compact",
        "threshold",
        "compact",
        "a2",
    )
    assert out[14]["occupancy_bp"] < 8000
    assert out[15] == {"ok": True, "revision": 3, "attempt_id": "a2"}
    assert out[16]["pressure"] == "normal"
    # without the growth trigger only the ceiling compaction remains
    plain = cli_lines(str(EXAMPLES / "big-window.jsonl"))
    assert [o.get("action") for o in plain].count("compact") == 1
    assert plain[2]["action"] == "proceed"
    assert (plain[14]["action"], plain[14]["attempt_id"]) == ("compact", "a1")


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1"}
    return Cli(env, ROOT, timeout=60).run("whatif", *args, ok=None, input=stdin)


def cli_lines(*args: str, stdin: str | None = None) -> list[dict[str, Any]]:
    p = cli(*args, stdin=stdin)
    assert p.returncode == 0, p.stderr
    return [json.loads(line) for line in p.stdout.splitlines()]
