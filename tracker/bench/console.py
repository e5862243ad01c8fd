"""Console page times on long sessions: ``python -m tracker.bench.console [--pg URL] [--sizes 10000,100000]``.

Writes sessions of each size straight through the event store with events the decision core
produced (a context that grows, compacts, meets a broken compactor now and then, runs into its
limit, and has a count fail every 97 steps), then times, through the real ASGI app (signed in
with an operator key), the session page, the session page with an event-type filter, an
attempt page, the overview, and the static file of ``tracker replay --html``. Prints one JSON
object: median milliseconds of ``repeat`` loads per page and size. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

BATCH = 500  # events per append while building


def build_session(store: Any, session_id: str, n_events: int, seed: int = 7) -> dict[str, int]:
    """Append ~n_events core-decided events to one session of ``store`` (a realistic long session:
    growth, compactions, stretches of a failing compactor, count timeouts, context limits); returns
    counts by type and ``total``. The streaming tests and the console bench build their sessions with it."""
    from tracker.core import (
        Measurement,
        Policy,
        SessionState,
        decide_commit,
        decide_count_failed,
        decide_measure,
        decide_reject,
    )
    from tracker.errors import CountTimeout
    from tracker.store import NewEvent

    rng = random.Random(seed)
    policy = Policy()
    state = SessionState(session_id=session_id)
    limit, tokens, step, version, now = 100_000, 20_000, 0, 0, 1_800_000_000.0
    pending: list[Any] = []
    counts: dict[str, int] = {}

    def emit(outcome: Any) -> Any:
        nonlocal state
        for e in outcome.events:
            pending.append(NewEvent(e.TYPE, e.to_data()))
            counts[e.TYPE] = counts.get(e.TYPE, 0) + 1
        state = outcome.state
        return outcome

    while version + len(pending) < n_events:
        step += 1
        now += 0.5
        broken = step % 400 >= 370  # now and then the compactor fails for a while
        if step % 97 == 0:
            emit(
                decide_count_failed(
                    state,
                    policy,
                    CountTimeout("no count within 2s", model="gpt-4o"),
                    model="gpt-4o",
                    duration_ms=2000,
                    now=now,
                )
            )
        else:
            tokens = min(limit + 4000, tokens + rng.randint(300, 2500))
            m = Measurement.from_data(
                {
                    "basis": f"r{state.revision}:m{step}",
                    "input_tokens": tokens,
                    "input_limit": limit,
                    "quality": "exact_local",
                    "model": {"provider": "openai", "name": "gpt-4o"},
                    "fingerprint": f"{step:064x}",
                },
                state.revision,
            )
            d = emit(decide_measure(state, policy, m, now=now, new_attempt_id=f"{session_id}-a{step}")).decision
            if d.action == "compact":
                now += 1.5
                a = d.attempt
                if broken:
                    emit(
                        decide_reject(
                            state,
                            attempt_id=a.attempt_id,
                            fencing_token=a.fencing_token,
                            reject_reason="summarizer_error",
                            now=now,
                        )
                    )
                else:
                    tokens = rng.randint(15_000, 35_000)
                    emit(
                        decide_commit(
                            state,
                            attempt_id=a.attempt_id,
                            fencing_token=a.fencing_token,
                            tokens_after=tokens,
                            now=now,
                        )
                    )
            elif d.action == "context_limit":
                tokens = rng.randint(20_000, 30_000)  # the agent dropped its history and started over
        if len(pending) >= BATCH:
            store.append(session_id, version, pending)
            version += len(pending)
            pending = []
    if pending:
        store.append(session_id, version, pending)
        version += len(pending)
    counts["total"] = version
    return counts


def _median_ms(call: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1000, 1)


def _get(client: Any, path: str) -> None:
    resp = client.get(path)
    assert resp.status_code == 200, (path, resp.status_code)


def _pages(client: Any, store: Any, sid: str, n: int, aid: str, repeat: int, views: Any) -> dict[str, float]:
    from tracker.audit.report import render_store_html
    from tracker.http.console import _STORIES

    page = f"/console/sessions/{sid}"
    whatif = "?wi=1&compact_at_bp=7000&rearm_below_bp=6000&max_automatic_per_episode=3&attempt_lease_s=60&automatic=on"

    def first_view() -> None:
        _STORIES.clear()
        _get(client, page)

    return {
        "session page, first view": _median_ms(first_view, repeat),
        "session page, again (unchanged session)": _median_ms(lambda: _get(client, page), repeat),
        "session page, rejected only": _median_ms(lambda: _get(client, page + "?type=CompactionRejected"), repeat),
        "session page, events from the middle": _median_ms(lambda: _get(client, page + f"?from={n // 2}"), repeat),
        "attempt page": _median_ms(lambda: _get(client, f"{page}/attempts/{aid}"), repeat),
        "what-if (compact at 7000)": _median_ms(lambda: _get(client, page + whatif), 1),
        "static file (replay --html)": _median_ms(
            lambda: render_store_html(store, sid, io.StringIO(), views=views), repeat
        ),
    }


def run(url: str | None = None, sizes: tuple[int, ...] = (10_000, 100_000), repeat: int = 3) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    from tracker import queries
    from tracker.bootstrap import build_storage
    from tracker.core import SessionProjector
    from tracker.core.events import CompactionStarted
    from tracker.http.app import create_app
    from tracker.settings import Settings
    from tracker.store import upgrade

    tmp = tempfile.TemporaryDirectory(prefix="tracker-bench-console-")
    if url is None:
        url = f"sqlite:///{Path(tmp.name) / 'bench.db'}"
    upgrade(url)
    db = build_storage(Settings.of(database_url=url).store, projector=SessionProjector())
    store = db.store
    out: dict[str, Any] = {"database": url.split(":", 1)[0], "repeat": repeat, "pages_ms": {}}
    try:
        for n in sizes:
            t0 = time.perf_counter()
            build_session(store, f"bench-{n}", n)
            out.setdefault("build_s", {})[str(n)] = round(time.perf_counter() - t0, 1)
        _, token = db.fleets.create_operator_key()
        app = create_app(settings=Settings.of(database_url=url))
        with TestClient(app) as client:
            r = client.post("/console/signin", content=f"key={token}", follow_redirects=False)
            assert r.status_code == 303, r.text
            for n in sizes:
                sid = f"bench-{n}"
                aid = next(
                    r.event.attempt_id
                    for r in queries.decode_all(queries.read_history(store, sid, max(1, n - 2000)))
                    if isinstance(r.event, CompactionStarted)
                )

                out["pages_ms"][str(n)] = _pages(client, store, sid, n, aid, repeat, db.views)
            out["pages_ms"]["overview"] = _median_ms(lambda: _get(client, "/console/"), repeat)
    finally:
        store.close()
        tmp.cleanup()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg", help="a Postgres SQLAlchemy URL of an empty, scratch database (default: SQLite)")
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    print(json.dumps(run(args.pg, sizes, args.repeat), indent=2))


if __name__ == "__main__":
    main()
