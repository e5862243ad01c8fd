"""The one CLI runner of the tests: ``tracker …`` in a subprocess, with one environment and folder.

    cli = Cli(env)                        # python -m tracker.cli (this tree, through PYTHONPATH)
    cli = Cli(env, script=True)           # the installed `tracker` console script, as a user runs it
    cli.run("fleet", "list")              # asserts exit 0 (ok=False: asserts failure; ok=None: no check)
    cli.json("fleet", "list", "--json")   # stdout parsed
    cli.lines("history", s, "--json")     # stdout, one JSON value a line

``clean_env()`` is this process's environment without any ``TRACKER_*`` (so a developer's own
settings never leak into a test), plus what is given.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TRACKER = shutil.which("tracker")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKER_")}
    env.update(extra)
    return env


class Cli:
    """Runs ``tracker …`` with one environment and working directory (text, or bytes with ``text=False``)."""

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
        *,
        script: bool = False,
        text: bool = True,
        timeout: float = 180,
    ) -> None:
        if script and TRACKER is None:
            raise RuntimeError("the `tracker` console script is not installed")
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.text = text
        self.timeout = timeout
        self.argv: list[str] = [TRACKER] if script and TRACKER else [sys.executable, "-m", "tracker.cli"]

    def run(
        self, *args: Any, ok: bool | None = True, input: str | bytes | None = None, timeout: float | None = None
    ) -> subprocess.CompletedProcess:
        argv = [*self.argv, *map(str, args)]
        out = subprocess.run(
            argv,
            cwd=self.cwd,
            env=self.env,
            input=input,
            capture_output=True,
            text=self.text,
            timeout=timeout or self.timeout,
        )
        shown = " ".join(map(str, args))
        if ok is True:
            assert out.returncode == 0, f"{shown} exited {out.returncode}:\n{out.stderr}\n{out.stdout[-2000:]}"
        elif ok is False:
            assert out.returncode != 0, f"{shown} should have failed:\n{out.stdout[-2000:]}"
        return out

    def json(self, *args: Any, **kw: Any) -> Any:
        return json.loads(self.run(*args, **kw).stdout)

    def lines(self, *args: Any, **kw: Any) -> list[Any]:
        return [json.loads(line) for line in self.run(*args, **kw).stdout.splitlines() if line.strip()]
