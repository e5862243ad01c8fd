"""The TypeScript client's package for the tests that run it with ``node``: skip without Node 20, install, build.

    node = typescript_package(env)   # skips the test without node / npm (or Node < 20); npm ci when needed
    build(env)                       # npm run build: dist/ from src/

``env`` is the environment npm runs in. ``npm ci`` installs the locked dev dependencies (AI SDK, zod,
TypeScript) when ``node_modules`` is missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "clients" / "typescript"


def node_major(node: str) -> int:
    out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    match = re.match(r"v(\d+)\.", out)
    return int(match.group(1)) if match else 0


def typescript_package(env: dict[str, str]) -> tuple[str, str]:
    """``(node, npm)``, with the package's dependencies installed; the test is skipped without them."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip(f"the TypeScript client needs node and npm on PATH (node: {node}, npm: {npm})")
    if node_major(node) < 20:
        pytest.skip(f"the TypeScript client needs Node 20 or newer, found {node_major(node)}")
    if not (PACKAGE / "node_modules").is_dir():
        ci = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=PACKAGE, env=env, capture_output=True, text=True, timeout=600
        )
        assert ci.returncode == 0, f"npm ci failed:\n{ci.stdout[-3000:]}\n{ci.stderr[-3000:]}"
    return node, npm


def build(npm: str, env: dict[str, str]) -> None:
    run = subprocess.run([npm, "run", "build"], cwd=PACKAGE, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"npm run build failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
