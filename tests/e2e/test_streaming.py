"""Very long sessions: the audit commands stream, their memory does not grow with the session.

A 30k-event session and a 5k-event one are written straight through the event
store (``open_store(...).append`` in batches of 500) with events the decision core
itself produced: ``decide_measure`` / ``decide_commit`` / ``decide_reject`` /
``decide_count_failed`` on a simulated agent whose context grows, compacts, and now
and then meets a broken compactor and runs into its limit. Then ``tracker history
--json``, ``tracker replay --json``, ``tracker replay --html`` and the what-if replay
run as subprocesses; each one's peak RSS is measured (``RUSAGE_CHILDREN`` of a tiny
wrapper process, so each figure is that one command's) and must stay under a fixed
bound (250 MB) and within 9 MB of the same command on the 6× shorter session (measured:
about 129 MB for every command on either size; --html 143 MB on the short session and 147-149 MB
on the long one, its capped chart, markers and table filling up; a command that kept 0.5 kB
per event -- far less than one parsed event -- would grow by 12 MB over the 25k more events).

The short session is no shorter than 5k events: below that the store's reads (batches of
``READ_BATCH`` = 2000 events) have not yet reached their steady size, and the short figure
would be 8-13 MB low (measured at 2k and 1k events), hiding a leak of that size.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TRACKER = shutil.which("tracker")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(TRACKER is None, reason="the `tracker` console script is not installed"),
]

LONG, SHORT = 30_000, 5_000
MAX_RSS_MB = 250
# peak RSS of the long session minus that of the short one: the 25k events between them at 0.5 kB
# each would be 12 MB; measured at most 5.6 MB (--html; the other commands under 0.5 MB)
MAX_GROWTH_MB = 9

_WRAPPER = (
    "import resource, subprocess, sys\n"
    "with open(sys.argv[1], 'wb') as out:\n"
    "    rc = subprocess.call(sys.argv[2:], stdout=out)\n"
    "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)


def build_session(url: str, session_id: str, n_events: int, seed: int = 7) -> dict[str, int]:
    """Append ~n_events core-decided events to one session (the bench's realistic long session)."""
    from tests.support.bench import build_session as build
    from tracker.core import SessionProjector
    from tracker.store import open_store

    store = open_store(url, projector=SessionProjector())
    try:
        return build(store, session_id, n_events, seed)
    finally:
        store.close()


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> dict[str, Any]:
    from tracker.store import upgrade

    d = tmp_path_factory.mktemp("streaming")
    url = f"sqlite:///{d / 'tracker.db'}"
    upgrade(url)
    long_counts = build_session(url, "long-session", LONG)
    short_counts = build_session(url, "short-session", SHORT, seed=8)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKER_")}
    env["TRACKER_DATABASE_URL"] = url
    return {"dir": d, "url": url, "env": env, "counts": {"long-session": long_counts, "short-session": short_counts}}


def peak_rss_mb(s: dict[str, Any], args: list[str], out: Path) -> float:
    """Run ``tracker *args`` (stdout to ``out``); return its peak RSS in MB."""
    r = subprocess.run(
        [sys.executable, "-c", _WRAPPER, str(out), TRACKER, *args],
        cwd=s["dir"],
        env=s["env"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    rc, kb = map(int, r.stdout.split())
    assert rc == 0, f"tracker {' '.join(args)} exited {rc}: {r.stderr[-2000:]}"
    return kb / 1024


def test_the_sessions_are_long_and_realistic(sessions):
    c = sessions["counts"]["long-session"]
    assert c["total"] >= LONG
    for kind in (
        "ContextMeasured",
        "CompactionStarted",
        "CompactionCommitted",
        "CompactionRejected",
        "CountFailed",
        "ContextLimitReached",
    ):
        assert c.get(kind, 0) > 10, (kind, c)


COMMANDS = {  # name -> argv for a session id and the output directory
    "history --json": lambda sid, d: ["history", sid, "--json"],
    "replay --json": lambda sid, d: ["replay", sid, "--json"],
    "replay --html": lambda sid, d: ["replay", sid, "--html", str(d / f"{sid}.html"), "--json"],
    "replay --compact-at 7000 --json": lambda sid, d: ["replay", sid, "--compact-at", "7000", "--json"],
}


def _out(d: Path, name: str, sid: str) -> Path:
    return d / f"{sid}.{name.replace(' ', '').replace('--', '-')}.out"


@pytest.mark.timeout(240)
def test_audit_commands_stream_in_bounded_memory(sessions, record_property):
    d = sessions["dir"]
    figures: dict[str, dict[str, float]] = {}
    for name, argv in COMMANDS.items():
        for sid in ("short-session", "long-session"):
            figures.setdefault(name, {})[sid] = round(peak_rss_mb(sessions, argv(sid, d), _out(d, name, sid)), 1)
    record_property("peak_rss_mb", json.dumps(figures))
    print("\npeak RSS (MB):", json.dumps(figures))
    for name, f in figures.items():
        assert f["long-session"] < MAX_RSS_MB, (name, f)
        assert f["long-session"] - f["short-session"] < MAX_GROWTH_MB, f"`tracker {name}` grows with the session: {f}"

    # ... and the outputs are complete
    from tracker.core import SessionProjector
    from tracker.store import open_store

    sid = "long-session"
    c = sessions["counts"][sid]
    n = c["total"]
    store = open_store(sessions["url"], projector=SessionProjector())
    try:
        projection, version = store.load(sid)
    finally:
        store.close()
    assert version == n

    seen = 0
    with _out(d, "history --json", sid).open(encoding="utf-8") as fh:
        for seen, line in enumerate(fh, start=1):  # noqa: B007 - `seen` is the count, read after the loop
            assert json.loads(line)["version"] == seen
    assert seen == n

    last = None
    with _out(d, "replay --json", sid).open(encoding="utf-8") as fh:
        for seen, line in enumerate(fh, start=1):  # noqa: B007 - `seen` is the count, read after the loop
            last = line
    assert seen == n
    last_step = json.loads(last)
    assert last_step["version"] == n and last_step["state"] == projection

    html_counts = json.loads(_out(d, "replay --html", sid).read_text())
    assert html_counts["events"] == n
    assert html_counts["committed"] == c["CompactionCommitted"] and html_counts["rejected"] == c["CompactionRejected"]
    assert html_counts["count_failed"] == c["CountFailed"] and html_counts["context_limit"] == c["ContextLimitReached"]
    page = (d / f"{sid}.html").read_text(encoding="utf-8")
    assert len(page) < 5_000_000, "the report is bounded too (chart points, markers and table rows are capped)"
    assert page.count("<tr class=") == 5000 and f"and {n - 5000} more events" in page
    markers = page.count("<g class='marker ")
    assert 0 < markers <= 1000, markers

    measured = 0
    with _out(d, "replay --compact-at 7000 --json", sid).open(encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            if row["op"] == "measure":
                measured += 1
                assert row["whatif"].get("threshold_bp") == 7000 or "error" in row["whatif"]
    assert measured == c["ContextMeasured"]
