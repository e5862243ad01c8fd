"""Observe never reads the log: the calibration book is loaded once and kept current in the background.

The store is the real in-memory one, wrapped to count its ``read_all`` calls (the only way the book
reads the log) by the thread that made them. Another ``Tracker`` on the same store stands for
another process: its usage reports reach this process's decisions through the background refresh
alone, and replay of the decisions made with them re-decides every one of them the same.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from tests.support.db import settled
from tracker.audit.replay import replay_states, whatif_rows
from tracker.calibrations import CalibrationBook
from tracker.core import Policy, SessionProjector
from tracker.service import Tracker
from tracker.store import MemoryEventStore

MODEL = "anthropic/claude-sonnet-4-5"
LIMIT = 100_000


class CountingStore:
    """The real store, counting ``read_all`` calls by the thread that made them."""

    def __init__(self, store: MemoryEventStore) -> None:
        self._store = store
        self.reads: Counter[int] = Counter()

    def read_all(self, *args: Any, **kwargs: Any) -> Any:
        self.reads[threading.get_ident()] += 1
        return self._store.read_all(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _measurement(basis: str, used: int) -> dict:
    return {"basis": basis, "model": MODEL, "input_tokens": used, "input_limit": LIMIT, "quality": "heuristic_estimate"}


def _tracker(store: Any, refresh_s: float) -> Tracker:
    return Tracker(store, policy=Policy(), calibrations=CalibrationBook(store, refresh_s=refresh_s))


def _report(t: Tracker, sid: str, n: int) -> None:
    for i in range(n):
        used = 10_000 + 100 * i
        t.observe(sid, measurement=_measurement(f"m{i}", used))
        t.report_usage(sid, basis=f"m{i}", input_tokens=int(used * 0.75))


def test_observes_read_nothing_while_the_background_refresh_brings_other_processes_reports() -> None:
    shared = MemoryEventStore(projector=SessionProjector())
    store = CountingStore(shared)
    mine = _tracker(store, refresh_s=0.05)
    other = _tracker(shared, refresh_s=3600.0)  # another process, writing to the same log
    me = threading.get_ident()
    mine.calibrations.start()  # the one load (servers start the book before their first request)
    assert store.reads[me] == 1
    try:
        first = mine.observe("s", measurement=_measurement("x0", 50_000)).decision
        assert first.calibration is None and first.input_tokens == 50_000
        _report(other, "o", 20)  # 20 reports this process did not record: only the log has them
        turns = iter(range(1, 10_000))
        calibrated = settled(
            lambda: mine.observe("s", measurement=_measurement(f"x{next(turns)}", 50_000)).decision,
            lambda d: d.calibration is not None,
        )
        assert calibrated.calibration is not None and calibrated.calibration["samples"] == 20
        assert calibrated.input_tokens < calibrated.counted_tokens == 50_000
    finally:
        mine.close()
        other.close()
    # every observe above, uncalibrated and calibrated, read nothing on its own thread; the
    # background refresh did all the reading
    assert store.reads[me] == 1
    background = sum(n for thread, n in store.reads.items() if thread != me)
    assert background >= 1
    # and replay re-decides each of those decisions the same, from what each recorded
    stored = list(shared.read_stream("s"))
    rows = [r for r in whatif_rows(stored, Policy(), "s") if r["op"] == "measure"]
    assert len(rows) >= 2 and not any(r["changed"] for r in rows)
    recorded = [e.data for e in stored if e.type == "ContextMeasured"]
    # the count decided on (shown when it is not the line's own) and the occupancy, each the recorded one
    decided = [
        r["whatif"].get("input_tokens", d["measurement"]["input_tokens"]) for r, d in zip(rows, recorded, strict=True)
    ]
    assert decided == [d["input_tokens"] for d in recorded]
    assert [r["whatif"]["occupancy_bp"] for r in rows] == [d["occupancy_bp"] for d in recorded]
    assert any(d["calibration"] is not None for d in recorded) and recorded[0]["calibration"] is None
    *_, last = replay_states(stored, "s")
    assert last.state == mine.state("s")


def test_the_first_decision_loads_a_book_nothing_started_and_later_ones_read_nothing() -> None:
    store = CountingStore(MemoryEventStore(projector=SessionProjector()))
    t = _tracker(store, refresh_s=3600.0)
    me = threading.get_ident()
    try:
        t.observe("s", measurement=_measurement("m0", 10_000))
        assert store.reads[me] == 1  # the load, once per process
        for i in range(1, 50):
            t.observe("s", measurement=_measurement(f"m{i}", 10_000 + i))
        t.report_usage("s", basis="m49", input_tokens=7_000)  # this process's own report: folded at once
        t.observe("s", measurement=_measurement("m50", 11_000))
        assert store.reads[me] == 1
    finally:
        t.close()


def test_close_stops_the_background_refresh_and_a_closed_book_reads_no_more() -> None:
    store = CountingStore(MemoryEventStore(projector=SessionProjector()))
    book = CalibrationBook(store, refresh_s=0.05)
    book.start()
    thread = book._thread
    assert thread is not None and thread.is_alive()
    book.close()
    assert not thread.is_alive()
    reads = sum(store.reads.values())
    assert book.for_decision("s", "claude-sonnet-4-5", "heuristic_estimate") == (None, None)
    assert sum(store.reads.values()) == reads
