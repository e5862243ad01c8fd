"""Core bench: pure decisions per second and fold speed, no I/O at all."""

from __future__ import annotations

import random
import time
from typing import Any

from tracker.bench.stats import throughput
from tracker.core import Basis, Measurement, ModelRef, Policy, SessionState, decide_commit, decide_measure, fold
from tracker.core.events import DomainEvent
from tracker.errors import IntegrityError


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
            out = decide_commit(
                state, attempt_id=a.attempt_id, fencing_token=a.fencing_token, tokens_after=tokens, now=now
            )
        state = out.state
        events.extend(out.events)
    return decisions, events, state


def run_core_bench(quick: bool = False) -> dict[str, Any]:
    """``decide_*`` over a generated trace, then ``fold`` of the events it produced."""
    ops = generated_trace(20_000 if quick else 200_000)
    t0 = time.perf_counter()
    decisions, events, final = _drive(ops, Policy(turn_delta=0.2))
    t1 = time.perf_counter()
    folded = fold(events, "bench")
    t2 = time.perf_counter()
    if folded != final:  # the bench doubles as a check that fold == the live state
        raise IntegrityError("fold of the benchmark's events differs from the live state")
    return {
        "decisions": decisions,
        "decisions_per_s": round(throughput(decisions, t1 - t0)),
        "events": len(events),
        "fold_events_per_s": round(throughput(len(events), t2 - t1)),
    }
