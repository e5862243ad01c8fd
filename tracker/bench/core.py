"""Core bench: pure decisions per second and fold speed, no I/O at all (three rounds: medians and spread;
per wall-clock second, and per second of this process's CPU, which other load on a shared machine moves least)."""

from __future__ import annotations

import random
import time
from typing import Any

from tracker.bench.stats import over_rounds, throughput
from tracker.core import (
    Basis,
    Measurement,
    ModelRef,
    Policy,
    SessionState,
    apply,
    decide_commit,
    decide_measure,
    fold,
)
from tracker.core.events import ContextMeasured, DomainEvent
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


def _round(ops: list[tuple[str, int]], recorded: list[DomainEvent]) -> dict[str, Any]:
    """One round's figures; ``recorded``: this round's events (the last round's are kept, no more)."""
    recorded.clear()
    w0, c0 = time.perf_counter(), time.process_time()
    decisions, events, final = _drive(ops, Policy(turn_delta=0.2))
    w1, c1 = time.perf_counter(), time.process_time()
    folded = fold(events, "bench")
    w2, c2 = time.perf_counter(), time.process_time()
    if folded != final:  # the bench doubles as a check that fold == the live state
        raise IntegrityError("fold of the benchmark's events differs from the live state")
    recorded[:] = events
    return {
        "decisions": decisions,
        "decisions_per_s": round(throughput(decisions, w1 - w0)),
        "events": len(events),
        "fold_events_per_s": round(throughput(len(events), w2 - w1)),
        # the same over this process's CPU time: what another process on a shared machine moves least
        "decisions_per_cpu_s": round(throughput(decisions, max(c1 - c0, 1e-9))),
        "fold_events_per_cpu_s": round(throughput(len(events), max(c2 - c1, 1e-9))),
    }


def replayed(events: list[DomainEvent], policy: Policy) -> int:
    """Re-decide every recorded measurement on the state folded from the events before it (as
    replay does) and check it decides what was recorded; the number re-decided."""
    state = SessionState(session_id="bench")
    n = 0
    for e in events:
        if isinstance(e, ContextMeasured):
            again = decide_measure(state, policy, e.measurement, now=e.at, new_attempt_id="replay").events
            if not again or again[0] != e:
                raise IntegrityError(f"replay re-decided the measurement at {e.at} differently: {again[:1]} != {e}")
            n += 1
        state = apply(state, e)
    return n


def run_core_bench(quick: bool = False, rounds: int = 3) -> dict[str, Any]:
    """``decide_*`` over a generated trace, then ``fold`` of the events it produced, in ``rounds``
    rounds: each figure is the rounds' median, with its ``spread`` (``stats.over_rounds``). Then,
    untimed, replay: every recorded measurement re-decided the same (``replayed_equal``)."""
    ops = generated_trace(20_000 if quick else 200_000)
    events: list[DomainEvent] = []
    figures = over_rounds([_round(ops, events) for _ in range(rounds)], ndigits=0)
    figures["replayed_equal"] = replayed(events, Policy(turn_delta=0.2))
    return figures
