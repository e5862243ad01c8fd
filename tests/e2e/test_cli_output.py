"""What a newcomer reads: `--version`, `info`, help, tables and sentences without rough edges, the demo's
legend and its staged failures. The installed ``tracker`` console script, in subprocesses, with a
private data directory and no inherited ``TRACKER_*``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import Cli, clean_env, run_tracker

TRACKER = shutil.which("tracker")
pytestmark = pytest.mark.skipif(TRACKER is None, reason="the `tracker` console script is not installed")


def run(tmp_path: Path, *args: Any, ok: bool = True, **env: str) -> subprocess.CompletedProcess:
    base = clean_env(XDG_DATA_HOME=str(tmp_path / "data"), HOME=str(tmp_path), COLUMNS="200", **env)
    return Cli(base, tmp_path, script=True, timeout=300).run(*args, ok=True if ok else None)


def test_version(tmp_path):
    from importlib.metadata import version

    assert run(tmp_path, "--version").stdout.strip() == f"context-tracker {version('context-tracker')}"


def test_help_shows_flags_as_flags(tmp_path):
    for cmd in (("history",), ("sessions",), ("replay",), ("whatif",), ("serve",), ()):
        text = run(tmp_path, *cmd, "--help").stdout
        assert "--help" in text and "Show this message and exit." in text, cmd
        assert "<bool>" not in text, (cmd, text)
        assert "<int>" in text or not cmd or cmd == ("whatif",), cmd  # options that take a value keep their type


def test_info_masks_secrets_and_says_where_the_database_is(tmp_path):
    secrets = {
        "TRACKER_OPENAI_API_KEY": "sk-very-secret",
        "TRACKER_REDIS_URL": "redis://user:hunter2@localhost:6379/0",
    }
    info = json.loads(run(tmp_path, "info", "--json", **secrets).stdout)
    db = tmp_path / "data" / "context-tracker" / "tracker.db"
    assert info["database"] == {"url": f"sqlite:///{db}", "file": str(db), "exists": False}
    assert info["settings"]["TRACKER_OPENAI_API_KEY"] == "********"
    assert info["settings"]["TRACKER_REDIS_URL"] == "redis://user:********@localhost:6379/0"
    text = run(tmp_path, "info", **secrets).stdout
    assert "sk-very-secret" not in text and "hunter2" not in text
    assert str(db) in text and "not created yet" in text


def test_history_replay_and_plurals_read_well(tmp_path):
    run(tmp_path, "db", "upgrade")
    run(tmp_path, "observe", "s1", "--basis", "m1", "--input-tokens", 10, "--input-limit", 100)
    from tracker import Tracker
    from tracker.settings import Settings

    env = {"XDG_DATA_HOME": str(tmp_path / "data")}
    with Tracker.from_settings(Settings.load(env)) as t:
        t.request_compaction("s1")  # a manual attempt has no history budget

    history = run(tmp_path, "history", "s1").stdout
    assert "None" not in history, history
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}", history), history  # date and time
    assert "manual attempt" in history

    replay = run(tmp_path, "replay", "s1", "--at", 2).stdout
    assert "{" not in replay, replay  # one rendering, no raw JSON after the table
    assert "state at v2: pressure normal, revision 1" in replay and "0 open attempts" in replay

    assert re.search(r"\b1 session\b", run(tmp_path, "sessions").stdout)
    assert "ok: 1 session," in run(tmp_path, "verify").stdout
    run(tmp_path, "fleet", "create", "agents")
    run(tmp_path, "key", "create", "agents")
    keys = run(tmp_path, "key", "list", "agents").stdout
    assert re.search(r"\b1 key\b", keys) and "1 keys" not in keys
    fleets = run(tmp_path, "fleet", "list").stdout
    assert re.search(r"\b1 fleet\b", fleets) and "1 fleets" not in fleets


def test_the_demo_explains_itself_and_another_folder_sees_its_sessions(tmp_path):
    out = run(tmp_path, "demo", "--workers", 1, "--sessions", 3, "--steps", 34).stdout
    assert "staged to show how failures are handled" in out
    assert "Staged on purpose" in out and "always fails" in out and "CountTimeout" in out
    assert "measured: requests counted and decided" in out  # the legend of the columns
    # into a pipe, no sentence is hard-wrapped: each one ends on the line it starts on
    lines = out.splitlines()
    for start, end in (
        ("Context Tracker demo:", "are staged to show how failures are handled"),
        ("measured: requests counted", "or stopped by ContextLimitError"),
        ("  • ", "instead of letting the provider reject it"),
        ("  • every", "(the count failures column)"),
    ):
        assert any(line.startswith(start) and line.rstrip().endswith(end) for line in lines), (start, out)
    db = tmp_path / "data" / "context-tracker" / "tracker.db"
    assert f"Recorded in the embedded database {db}" in " ".join(out.split())
    other = tmp_path / "elsewhere"
    other.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRACKER_")}
    base.update(XDG_DATA_HOME=str(tmp_path / "data"))
    listed = run_tracker(
        [TRACKER, "sessions", "--json"], cwd=other, env=base, capture_output=True, text=True, timeout=120
    )
    assert listed.returncode == 0, listed.stderr
    assert len(json.loads(listed.stdout)) == 3
