"""The TypeScript client's own tests (clients/typescript, ``node --test``), run from the project's pytest.

They start real ``tracker serve`` processes from this tree (SQLite in temp dirs, fleets and keys
made with the CLI) and drive them with ``@context-tracker/client`` and its AI SDK middleware.
``npm ci`` installs the locked dev dependencies first when ``node_modules`` is missing; without
``node`` / ``npm`` (or with a Node older than 20) the test is skipped and says why.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support.node import PACKAGE, ROOT, typescript_package

pytestmark = pytest.mark.slow


def test_the_typescript_client_suite_passes():
    env = {
        **os.environ,
        "PYTHON": sys.executable,  # the servers the suite starts run this interpreter ...
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),  # ... on this tree
    }
    _node, npm = typescript_package(env)
    run = subprocess.run([npm, "test"], cwd=PACKAGE, env=env, capture_output=True, text=True, timeout=900)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"npm test failed:\n{_failures(output)}\n...\n{output[-2000:]}"
    counts = dict(re.findall(r"^# (tests|pass|fail) (\d+)$", run.stdout, flags=re.MULTILINE))
    assert int(counts.get("tests", 0)) > 0 and counts.get("fail") == "0", output[-3000:]
    assert counts["pass"] == counts["tests"], output[-3000:]


def _failures(output: str) -> str:
    """Each failed (sub)test of the TAP output with the lines that explain it (the whole output is long)."""
    lines = output.splitlines()
    picked = [
        "\n".join(lines[i : i + 25])
        for i, line in enumerate(lines)
        if line.lstrip().startswith("not ok") and "# SKIP" not in line
    ]
    return "\n---\n".join(picked)[-8000:] or output[-6000:]
