"""The bench's one definition of each figure: percentile, latency summary, throughput.

* **percentile** — linear interpolation between the closest ranks (the "type 7" estimator,
  numpy's and Excel's default): for sorted values ``x[0..n-1]`` and ``p`` in [0, 100], the
  rank is ``h = (n - 1) * p / 100`` and the result ``x[⌊h⌋] + (h - ⌊h⌋) * (x[⌊h⌋+1] - x[⌊h⌋])``.
  p0 is the minimum, p100 the maximum, p50 the usual median; one value is every percentile.
* **latency** — measured in seconds with ``time.perf_counter`` around each call, reported in
  milliseconds rounded to 3 decimals.
* **throughput** — completed operations divided by the wall-clock seconds of the window they
  ran in (not by the sum of their latencies), rounded to 1 decimal.
* **rounds** — a section measures its figures in several rounds and reports, per figure, the
  median across the rounds and the spread ``[min, max]`` (:func:`over_rounds`).

Every section reports through these functions, so ``ms_p99`` or ``*_per_s`` mean the same
thing whichever layer printed them.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any


def percentile(values: Iterable[float], p: float) -> float:
    """The ``p``-th percentile (0 ≤ p ≤ 100) of ``values`` by linear interpolation (see module doc)."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {p!r}")
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    h = (len(ordered) - 1) * p / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo])


def throughput(count: float, elapsed_s: float) -> float:
    """Operations per second over a window of ``elapsed_s`` wall-clock seconds."""
    if elapsed_s <= 0:
        raise ValueError(f"elapsed time must be positive, got {elapsed_s!r}")
    return round(count / elapsed_s, 1)


def ms(seconds: float) -> float:
    """Seconds as milliseconds, rounded the way every latency figure is."""
    return round(seconds * 1000, 3)


def latency_ms(latencies_s: Iterable[float], *percentiles: float) -> dict[str, float | None]:
    """``{"ms_p50": …, "ms_p99": …}`` (the percentiles asked for, default 50 and 99) of latencies in seconds.

    With no latencies (nothing completed) every figure is ``None``, so the JSON stays valid.
    """
    values = sorted(latencies_s)
    return {f"ms_p{p:g}": (ms(percentile(values, p)) if values else None) for p in (percentiles or (50, 99))}


def summary(latencies_s: list[float], elapsed_s: float) -> dict[str, Any]:
    """``{"per_s", "ms_p50", "ms_p99"}`` of calls made one after another within ``elapsed_s``."""
    return {"per_s": throughput(len(latencies_s), elapsed_s), **latency_ms(latencies_s)}


def timed_calls(call: Callable[[], Any], seconds: float, max_calls: int = 100_000) -> tuple[list[float], float]:
    """Call ``call`` back to back for about ``seconds``; return (latency of each call in s, elapsed s)."""
    latencies: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds and len(latencies) < max_calls:
        t0 = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - t0)
    return latencies, time.perf_counter() - started


def concurrent_rate(call: Callable[[], Any], threads: int, seconds: float) -> float:
    """Throughput of ``threads`` threads each calling ``call`` back to back for about ``seconds``."""
    done = [0] * threads
    stop = time.perf_counter() + seconds

    def work(i: int) -> None:
        while time.perf_counter() < stop:
            call()
            done[i] += 1

    started = time.perf_counter()
    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return throughput(sum(done), time.perf_counter() - started)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` rounded to 3 decimals, ``None`` when either side is missing or ``b`` is 0."""
    if a is None or not b:
        return None
    return round(a / b, 3)


def median(values: Iterable[float]) -> float:
    """The middle value (the mean of the two middle ones for an even count): ``percentile(values, 50)``."""
    return percentile(values, 50)


def over_rounds(rounds: list[dict[str, Any]], ndigits: int = 3) -> dict[str, Any]:
    """One figure per key from the same figures measured in several rounds: the median of each
    numeric figure, and under ``"spread"`` its ``[min, max]`` across the rounds (a noisy round on a
    shared machine moves the spread, not the figure). Keys whose values are not all numbers
    (None in some round, text) are taken from the first round."""
    out: dict[str, Any] = {}
    spread: dict[str, list[float]] = {}
    for key in rounds[0]:
        values = [r.get(key) for r in rounds]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            nums = [float(v) for v in values]  # type: ignore[arg-type]
            mid = round(median(nums), ndigits)
            out[key] = round(mid) if all(isinstance(v, int) for v in values) else mid
            spread[key] = [round(min(nums), ndigits), round(max(nums), ndigits)]
        else:
            out[key] = values[0]
    out["spread"] = spread
    out["rounds"] = len(rounds)
    return out
