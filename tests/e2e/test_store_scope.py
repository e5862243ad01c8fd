"""One ``SessionScope`` at every door: the API's caller and the CLI's ``--fleet`` refuse the same ids.

A fleet's sessions are stored as ``"<fleet_id>:<session_id>"`` (``tracker.core.model.SessionScope``),
so a caller in a fleet may name at most 189 characters; the API refuses a longer id with
``invalid_session_id`` (``tests/e2e/test_api_hostile.py``), and so does ``tracker ... --fleet``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.support.cli import run_tracker


def _cli(env: dict[str, str], *args: str) -> tuple[int, Any]:
    proc = run_tracker(
        [sys.executable, "-m", "tracker.cli", *args, "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else proc.stderr


def test_the_cli_fleet_option_refuses_an_id_too_long_for_the_fleet(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKER_")}
    env["TRACKER_DATABASE_URL"] = f"sqlite:///{tmp_path / 'tracker.db'}"
    assert _cli(env, "db", "upgrade")[0] == 0
    code, fleet = _cli(env, "fleet", "create", "acme")
    assert code == 0, fleet
    for command in ("history", "replay"):
        code, out = _cli(env, command, "x" * 190, "--fleet", "acme")
        assert code == 2 and out["code"] == "invalid_session_id", out
        assert "at most 189" in out["message"], out
        # the longest id the fleet may name is valid: merely unknown
        code, out = _cli(env, command, "x" * 189, "--fleet", "acme")
        assert code == 2 and out["code"] == "unknown_session", out
    # without --fleet the ids are the stored ones: 200 characters are valid, 201 are not
    code, out = _cli(env, "history", "x" * 200)
    assert code == 2 and out["code"] == "unknown_session", out
    code, out = _cli(env, "history", "x" * 201)
    assert code == 2 and out["code"] == "invalid_session_id", out
