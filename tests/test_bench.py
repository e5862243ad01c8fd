"""`tracker bench` prints one JSON object with figures (speed is reported, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_core_prints_figures():
    out = subprocess.run([sys.executable, "-m", "tracker.cli", "bench", "--json", "--quick", "--only", "core"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    core = result["core"]
    assert core["decisions"] > 0 and core["events"] >= core["decisions"]
    assert core["decisions_per_s"] > 0 and core["fold_events_per_s"] > 0


def test_bench_unknown_section_is_refused():
    out = subprocess.run([sys.executable, "-m", "tracker.cli", "bench", "--json", "--only", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "only" in (out.stdout + out.stderr)
