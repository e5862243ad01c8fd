"""The one CLI runner of the tests: ``tracker …`` in its own process, with one environment and folder.

    cli = Cli(env)                        # python -m tracker.cli (this tree, through PYTHONPATH)
    cli = Cli(env, script=True)           # the installed `tracker` console script, as a user runs it
    cli.run("fleet", "list")              # asserts exit 0 (ok=False: asserts failure; ok=None: no check)
    cli.json("fleet", "list", "--json")   # stdout parsed
    cli.lines("history", s, "--json")     # stdout, one JSON value a line

``clean_env()`` is this process's environment without any ``TRACKER_*`` (so a developer's own
settings never leak into a test), plus what is given.

Each command is a process of its own, forked from a zygote that has the imports done
(``tests.support.zygote``; ``run_tracker`` is the ``subprocess.run`` for modules that build
their own argv); ``TRACKER_TEST_NO_ZYGOTE=1`` starts a fresh interpreter for every command.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support.zygote import Zygote, console_script

TRACKER = shutil.which("tracker")


def run_tracker(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    input: str | bytes | None = None,
    text: bool = True,
    timeout: float = 180,
    check: bool = False,
    capture_output: bool = True,
) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, ...)`` for a ``tracker`` command: ``argv`` is
    ``[sys.executable, "-m", "tracker.cli", ...]`` or ``[TRACKER, ...]``. Forked from the test
    process's zygote (``tests.support.zygote``: the same process, without the second of imports)
    unless ``TRACKER_TEST_NO_ZYGOTE=1`` or the environment changes the interpreter's own settings."""
    env = dict(os.environ if env is None else env)
    argv = [str(a) for a in argv]
    script = console_script() if argv and TRACKER is not None and argv[0] == TRACKER else None
    module = argv[:3] == [sys.executable, "-m", "tracker.cli"]
    assert capture_output, "run_tracker always captures the output"
    out: subprocess.CompletedProcess | None = None
    if (script is not None or module) and os.environ.get("TRACKER_TEST_NO_ZYGOTE") != "1":
        zygote = Zygote.shared()
        if zygote.serves(env):
            out = zygote.run(argv, env=env, cwd=cwd, input=input, timeout=timeout, text=text, script=script)
    if out is None:
        out = subprocess.run(argv, cwd=cwd, env=env, input=input, capture_output=True, text=text, timeout=timeout)
    if check:
        out.check_returncode()
    return out


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
        out = run_tracker(
            argv, env=self.env, cwd=self.cwd, input=input, text=self.text, timeout=timeout or self.timeout
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
