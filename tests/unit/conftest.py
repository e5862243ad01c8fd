"""The unit tier runs without any service and without subprocesses: a test here that starts one fails."""

from __future__ import annotations

import subprocess

import pytest


class _NoSubprocess(subprocess.Popen):
    def __init__(self, *args, **kwargs):
        raise AssertionError(f"tests/unit starts no subprocess (move the test to tests/e2e): {args[:1]}")


@pytest.fixture(autouse=True)
def _no_subprocesses(monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", _NoSubprocess)
