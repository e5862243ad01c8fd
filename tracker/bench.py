"""``tracker bench``: one JSON object, one section per layer, every figure from this run."""

from __future__ import annotations

import os
import random
import time
from typing import Any, Callable

from tracker.core import Basis, Measurement, ModelRef, Policy, SessionState, decide_commit, decide_measure, fold
from tracker.core.events import DomainEvent


def generated_trace(n: int, seed: int = 7) -> list[tuple[str, int]]:
    """A session that climbs with tool output, compacts, and climbs again."""
    rng = random.Random(seed)
    ops: list[tuple[str, int]] = []
    used = 20_000
    for _ in range(n):
        used += rng.randint(500, 6000)
        ops.append(("measure", used))
        if used > 150_000:
            used = rng.randint(20_000, 60_000)
            ops.append(("commit", used))
    return ops


def _drive(ops: list[tuple[str, int]], policy: Policy) -> tuple[int, list[DomainEvent], SessionState]:
    state = SessionState(session_id="bench")
    events: list[DomainEvent] = []
    decisions = 0
    fp = "0" * 64
    model = ModelRef("openai", "gpt-4o")
    for i, (kind, tokens) in enumerate(ops):
        now = float(i)
        if kind == "measure":
            m = Measurement(Basis(state.revision, f"m{i}"), model, fp, tokens, 175_000, "exact_local")
            out = decide_measure(state, policy, m, now=now, new_attempt_id=f"a{i}")
            decisions += 1
        else:
            a = state.open_automatic
            if a is None:
                continue
            out = decide_commit(state, attempt_id=a.attempt_id, fencing_token=a.fencing_token, tokens_after=tokens, now=now)
        state = out.state
        events.extend(out.events)
    return decisions, events, state


def bench_core(quick: bool) -> dict[str, Any]:
    n = 20_000 if quick else 200_000
    ops = generated_trace(n)
    policy = Policy(turn_delta=0.2)
    t0 = time.perf_counter()
    decisions, events, final = _drive(ops, policy)
    t1 = time.perf_counter()
    folded = fold(events, "bench")
    t2 = time.perf_counter()
    if folded != final:  # the bench doubles as a sanity check of fold == live state
        raise AssertionError("fold of the benchmark's events differs from the live state")
    return {
        "decisions": decisions,
        "decisions_per_s": round(decisions / (t1 - t0)),
        "events": len(events),
        "fold_events_per_s": round(len(events) / (t2 - t1)),
    }


def _pg() -> str:
    return os.environ.get("TRACKER_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/test")


def _redis() -> str:
    return os.environ.get("TRACKER_BENCH_REDIS", "redis://127.0.0.1:6379/0")


def bench_store(quick: bool, result: dict[str, Any]) -> dict[str, Any]:
    from tracker.store.bench import run_store_bench

    return run_store_bench(_pg(), quick)


def bench_counting(quick: bool, result: dict[str, Any]) -> dict[str, Any]:
    from tracker.counting.bench import run_counting_bench

    return run_counting_bench(quick, os.environ.get("TRACKER_BENCH_BROKER", "redis://127.0.0.1:6379/0"))


def bench_service(quick: bool, result: dict[str, Any]) -> dict[str, Any]:
    from tracker.service_bench import run_service_bench

    raw = result.get("store", {}).get("raw_insert_per_s")  # the baseline measured in this same run
    return run_service_bench(_pg(), _redis(), quick, raw_insert_per_s=raw)


def bench_http(quick: bool, result: dict[str, Any]) -> dict[str, Any]:
    from tracker.api_bench import run_http_bench

    return run_http_bench(_pg(), _redis(), quick)


SECTIONS: dict[str, Callable[[bool, dict[str, Any]], dict[str, Any]]] = {
    "core": lambda quick, result: bench_core(quick),
    "store": bench_store,
    "counting": bench_counting,
    "service": bench_service,
    "http": bench_http,
}


def run_bench(quick: bool = False, only: set[str] | None = None, progress: Any = None) -> dict[str, Any]:
    """Run the sections in order (service uses the store's raw baseline from the same run).

    Servers: TRACKER_BENCH_PG (default the local ``test`` database; a scratch database is
    created and dropped), TRACKER_BENCH_REDIS, TRACKER_BENCH_BROKER.
    """
    unknown = (only or set()) - set(SECTIONS)
    if unknown:
        from tracker.errors import InvalidInput

        raise InvalidInput("only", f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    result: dict[str, Any] = {"quick": quick, "cpus": os.cpu_count()}
    for name, fn in SECTIONS.items():
        if only and name not in only:
            continue
        if progress is not None:
            progress.print(f"[dim]bench: {name}…[/]")
        try:
            result[name] = fn(quick, result)
        except Exception as exc:  # a section that cannot run says why, the others still report
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return result
