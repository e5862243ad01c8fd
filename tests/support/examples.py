"""The agent examples (``examples/*_agent.py``) as the framework tests use them: loaded as modules,
given a tracker on a SQLite file with the example's models, run as real processes, and the one
check every framework's compaction test makes of a run.

Each example runs the same scripted task (reading files with a tool, 13 steps by default) on the
same small model (``example-agent-small``), so these numbers are the same for all of them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tracker import Tracker
from tracker.settings import Settings
from tracker.store.migrate import upgrade

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
#: example-agent-small's input limit: an 11,000-token window less the default 8,192 reserved
INPUT_LIMIT = 2808
#: one scripted step (a tool call and a file) adds about 255-262 tokens: a generous bound
STEP_GROWTH = 400
#: the compaction events, in the order a run records them
COMPACTION_EVENTS = ("CompactionStarted", "CompactionCommitted", "CompactionRejected")


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (registered in ``sys.modules``: pydantic resolves an
    example's annotations through it)."""
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@contextmanager
def example_tracker(directory: Path, models: dict[str, Any]) -> Iterator[Tracker]:
    """A ``Tracker`` on a new SQLite file in ``directory`` that knows the example's ``models``."""
    models_file = directory / "models.json"
    models_file.write_text(json.dumps(models))
    url = f"sqlite:///{directory / 'tracker.db'}"
    upgrade(url)
    with Tracker.from_settings(Settings.of(database_url=url, models_file=str(models_file))) as t:
        yield t


def events(tracker: Tracker, session: str, *types: str) -> list[Any]:
    """The session's recorded events (of ``types``, when given), in order."""
    return [e for e in tracker.history(session) if not types or e.type in types]


def assert_compacted_once(tracker: Tracker, session: str, report: dict[str, Any], framework: str) -> tuple[int, int]:
    """A 13-step run compacted once through the tracker, and the model then got exactly the
    committed, shorter request: ``(tokens_before, tokens_after)`` of the commit."""
    assert report["answer"].startswith("I read 13 files")
    assert [e.type for e in events(tracker, session, *COMPACTION_EVENTS)] == [
        "CompactionStarted",
        "CompactionCommitted",
    ]
    (committed,) = events(tracker, session, "CompactionCommitted")
    before, after = committed.data["tokens_before"], committed.data["tokens_after"]
    print(f"{framework}: tokens_before={before} tokens_after={after} model requests={report['model_requests']}")
    assert after < before / 2

    # What the model received: the compacted request is exactly what was committed, and the one
    # before it was the last uncompacted one (one step short of tokens_before, which was never sent).
    sent = report["model_requests"]
    k = sent.index(after)
    assert k > 0 and before - STEP_GROWTH < sent[k - 1] < before
    assert sent[k - 1] - sent[k] == pytest.approx(before - after, abs=STEP_GROWTH)
    assert max(sent) < INPUT_LIMIT
    return before, after


def run_example_processes(
    example: Path, *, database_url: str, redis_url: str, session: str, steps: int = 13, processes: int = 2
) -> list[dict[str, Any]]:
    """``processes`` real processes run one of ``examples/`` on one session (its ``--share-redis``), all
    starting at the same wall-clock moment; each must exit 0, and its last line (``--json``) is its report."""
    cmd = [
        sys.executable,
        str(example),
        *("--database-url", database_url, "--redis-url", redis_url, "--share-redis", "--no-upgrade"),
        *("--session", session, "--steps", str(steps), "--summary-delay", "1.0", "--json"),
        *("--start-at", str(time.time() + 8)),  # time for every interpreter to import and connect first
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKER_")}
    procs = [
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=example.parents[1]
        )
        for _ in range(processes)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    print(f"{processes} processes:", [(r["summarizer_calls"], r["model_requests"]) for r in reports])
    return reports
