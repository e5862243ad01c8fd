"""Calibration bench: where a session compacts before and after 20 provider reports, and what it costs.

For each simulated provider (:mod:`tracker.bench.sim_provider`, a tokenizer unlike any counter
the project ships) and a model counted by the shipped heuristic: the fleet's first sessions
report the billed usage of each turn until there are 20 reports (``MIN_SAMPLES``); then a fresh
session grows turn by turn until its decided count reaches the compact level. Figures:

* ``compaction_point``: the billed tokens of the request that compacts, as a fraction of the
  input limit (the policy asks for 0.80), uncalibrated (the raw heuristic) and calibrated;
* ``decided_over_billed``: min / median / max of decided count / billed over every turn of
  the fresh session up to its compaction;
* ``catch_up_ms_per_1000_reports``: ``ledger_of`` reading and folding a log of provider
  reports interleaved with measurements (Postgres, a scratch database; the partial index);
* ``mixed_fleet``: one heuristic-counted model serving coding sessions and sessions over Chinese
  documents at once (the heuristic over-counts the two by different factors), every turn reported:
  after 140 reports, where a fresh session of each kind compacts (billed / limit) and its
  decided / billed past a fifth of the limit, decided by the calibration alone (no reports of its
  own: per kind of content, else per model) and anchored on its own billed count (reports every
  turn); a resumed session's first decision (its first request already 0.6 of the limit); and the
  same after the provider's billing changes under the model (``SHIFTED``: just after it, anchored;
  a resumed session at the shift and 30 reports after it);
* ``estimate_ms``: one estimate of a full window (paid once per new report, when the next
  decision asks); ``apply_us``: the correction of one count; ``decide_us`` /
  ``decide_calibrated_us``: one pure decision without / with a calibration.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from typing import Any

from tracker.bench.sim_provider import (
    ANTHROPIC_LIKE,
    CJK_DOCUMENTS,
    CODING_AGENT,
    GEMINI_LIKE,
    MULTILINGUAL_ASSISTANT,
    Profile,
    SimProvider,
    Workload,
    session,
)
from tracker.core import Basis, Measurement, ModelRef, Policy, SessionState, decide_measure
from tracker.core.calibration import MIN_SAMPLES, WINDOW, Calibration, CalibrationSample, apply, estimate
from tracker.core.thresholds import levels_at
from tracker.counting.counters import HeuristicCounter
from tracker.counting.registry import ModelRegistry
from tracker.settings import normalize_database_url

#: a Gemini-like model with a 128k window (the shipped Gemini models have 1M: filling 0.80 of it
#: takes minutes of counting and says nothing more)
SIM_MODELS = {
    "gemini-sim-128k": {"provider": "google", "window": 131_072, "counter": "heuristic", "max_output_tokens": 8192}
}
#: the share of the input limit past which decided / billed is claimed within 0.99-1.10
BAND_FROM = 0.2
#: (model, profile, workload)
CASES: tuple[tuple[str, Profile, Workload], ...] = (
    ("claude-sonnet-4-5", ANTHROPIC_LIKE, CODING_AGENT),
    ("gemini-sim-128k", GEMINI_LIKE, MULTILINGUAL_ASSISTANT),
)


def _case(registry: ModelRegistry, model: str, profile: Profile, workload: Workload, seed: str) -> dict[str, Any]:
    spec = registry.get(model)
    counter = HeuristicCounter()
    sim = SimProvider(profile)
    policy = Policy()
    limit = registry.input_limit(spec, policy)
    compact = levels_at(policy.compact_at_bp, policy.rearm_below_bp, limit).compact
    rng = random.Random(seed)
    fresh = session(rng, workload, 200)
    samples: list[CalibrationSample] = []
    while len(samples) < MIN_SAMPLES:  # the fleet's first sessions, each turn reported
        for request in session(rng, workload, rng.randint(4, 12)):
            if len(samples) < MIN_SAMPLES:
                samples.append(CalibrationSample(counter.count(request, spec).input_tokens, sim.billed(request)))
    cal = estimate(samples)
    pairs: list[tuple[int, int]] = []  # (counted, billed) of the fresh session's turns, counted as needed

    def pair(turn: int) -> tuple[int, int]:
        while len(pairs) <= turn:
            r = fresh[len(pairs)]
            pairs.append((counter.count(r, spec).input_tokens, sim.billed(r)))
        return pairs[turn]

    def spread(values: list[float]) -> dict[str, float] | None:
        if not values:
            return None
        return {
            "min": round(min(values), 3),
            "median": round(statistics.median(values), 3),
            "max": round(max(values), 3),
        }

    def run(c: Calibration | None) -> dict[str, Any]:
        ratios: list[tuple[float, float]] = []  # (billed / limit, decided / billed)
        for turn in range(len(fresh)):
            counted, billed = pair(turn)
            decided = apply(counted, c)
            ratios.append((billed / limit, decided / billed))
            if decided >= compact:
                return {
                    "compacts_at_turn": turn,
                    "compaction_point": round(billed / limit, 3),
                    "decided_over_billed": spread([x for _, x in ratios]),
                    f"decided_over_billed_past_{BAND_FROM}": spread([x for f, x in ratios if f >= BAND_FROM]),
                }
        return {"compacts_at_turn": None, "compaction_point": None}

    return {
        "model": model,
        "provider": profile.name,
        "workload": workload.name,
        "input_limit": limit,
        "reports": len(samples),
        "calibration": cal.to_data() if cal is not None else None,
        "before": run(None),
        "after": run(cal),
    }


#: the mixed fleet's two kinds of session
MIXED: dict[str, Workload] = {"code": CODING_AGENT, "zh": CJK_DOCUMENTS}
#: the provider after a new snapshot of the model: its tokenizer bills Latin words, capitals and CJK
#: characters higher (about +10 % on code, +25 % on Chinese)
SHIFTED = dataclasses.replace(
    ANTHROPIC_LIKE, name="anthropic-like-2", word_chars=4, caps_chars=2, cjk_num=2, cjk_den=1, per_message=6
)
MIXED_MODEL = "claude-sonnet-4-5"


def mixed_fleet(t: Any, prefix: str, sim: SimProvider, reports: int, rng: random.Random) -> int:
    """Sessions of both kinds running at once (one turn each in turn), every turn's usage reported;
    ``prefix``: the stored ids' (``fleet:name``). ``t``: a ``Tracker``."""
    live: dict[str, list[Any]] = {}
    done = n = 0
    while done < reports:
        for kind, workload in MIXED.items():
            if kind not in live or not live[kind][1]:
                live[kind] = [f"{prefix}-{kind}-{n}", session(rng, workload, rng.randint(6, 30)), 0]
                n += 1
            sid, requests, i = live[kind]
            request = requests.pop(0)
            action = t.observe(sid, request=request, model=MIXED_MODEL, basis=f"m{i}").decision.action
            assert action == "proceed", action
            t.report_usage(sid, basis=f"m{i}", input_tokens=sim.billed(request))
            live[kind][2] += 1
            done += 1
    return done


def resumed(t: Any, sim: SimProvider, prefix: str, limit: int, share: float = 0.6) -> dict[str, float]:
    """Per kind: decided / billed of a new session whose first request is already ``share`` of the limit."""
    out = {}
    for kind, workload in MIXED.items():
        requests = session(random.Random(f"resumed:{kind}"), workload, 400)
        request = next(r for r in requests if sim.billed(r) >= share * limit)
        d = t.observe(f"{prefix}-{kind}", request=request, model=MIXED_MODEL, basis="m1").decision
        out[kind] = d.input_tokens / sim.billed(request)
    return out


def _mixed_fleet() -> dict[str, Any]:
    from tracker.core.state import SessionProjector
    from tracker.counting.backends import InProcessCounting
    from tracker.service import Tracker
    from tracker.store import MemoryEventStore

    t = Tracker(MemoryEventStore(projector=SessionProjector()), counting=InProcessCounting(ModelRegistry.load()))
    rng = random.Random("bench:mixed")
    sim = SimProvider(ANTHROPIC_LIKE)
    mixed_fleet(t, "fM:train", sim, 140, rng)
    probe = t.observe("fM:probe", request=session(rng, CODING_AGENT, 1)[0], model=MIXED_MODEL, basis="m0")
    input_limit = probe.decision.input_limit

    def run(label: str, provider: SimProvider, report: bool) -> dict[str, Any]:
        out = {}
        for kind, workload in MIXED.items():
            sid = f"fM:{label}-{kind}"
            over = 0
            ratios: list[float] = []
            for i, request in enumerate(session(rng, workload, 400)):
                d = t.observe(sid, request=request, model=MIXED_MODEL, basis=f"m{i}").decision
                billed = provider.billed(request)
                if billed >= BAND_FROM * input_limit:
                    ratios.append(d.input_tokens / billed)
                if d.action == "compact":
                    out[kind] = {
                        "compaction_point": round(billed / input_limit, 3),
                        "decided_over_billed": [round(min(ratios), 3), round(max(ratios), 3)],
                        "let_through_over_the_limit": over,
                    }
                    break
                over += billed >= input_limit
                if report:
                    t.report_usage(sid, basis=f"m{i}", input_tokens=billed)
        return out

    row = t.calibration("fM")[0]
    figures: dict[str, Any] = {
        "factors_bp": {
            "model": row.calibration.factor_bp if row.calibration else None,
            **{k: c.factor_bp if c else None for k, c, _ in row.contents},
        },
        "calibrated_only": run("calibrated", sim, report=False),
        "anchored": run("anchored", sim, report=True),
        "resumed": {k: round(v, 3) for k, v in resumed(t, sim, "fM:resumed", input_limit).items()},
    }
    shifted = SimProvider(SHIFTED)
    at_shift = resumed(t, shifted, "fM:resumed-at-shift", input_limit)
    figures["after_shift_anchored"] = run("after-shift", shifted, report=True)
    mixed_fleet(t, "fM:post-shift", shifted, 30, rng)
    figures["resumed_at_shift"] = {k: round(v, 3) for k, v in at_shift.items()}
    figures["resumed_30_reports_after"] = {
        k: round(v, 3) for k, v in resumed(t, shifted, "fM:resumed-after", input_limit).items()
    }
    return figures


def _catch_up(pg_url: str, reports: int) -> float:
    """ms per 1000 provider reports for ``ledger_of`` over a log of reports and as many measurements."""
    from tracker.bench.procs import create_scratch_db, drop_scratch_db
    from tracker.bench.store import CountingProjector, measured_event
    from tracker.calibrations import ledger_of
    from tracker.core.events import UsageReported
    from tracker.store import NewEvent, open_store, upgrade

    name, url = create_scratch_db(pg_url, "ct_bench")
    try:
        upgrade(normalize_database_url(url))
        store = open_store(normalize_database_url(url), projector=CountingProjector())
        rng = random.Random(5)
        per_session = 50
        for s in range(reports // per_session):
            events = []
            for i in range(per_session):
                counted = rng.randint(2_000, 150_000)
                usage = UsageReported(
                    basis=f"r1:m{i}",
                    model="claude-sonnet-4-5",
                    quality="heuristic_estimate",
                    counted_tokens=counted,
                    input_tokens=counted * 73 // 100 + rng.randint(0, 900),
                    at=float(i),
                )
                events += [measured_event(), NewEvent(type=usage.TYPE, data=usage.to_data())]
            store.append(f"f{s % 4}:bench-{s}", 0, events)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            ledger = ledger_of(store)
            best = min(best, time.perf_counter() - t0)
        assert ledger.folded == reports // per_session * per_session
        store.close()
        return round(best * 1000 * 1000 / ledger.folded, 1)
    finally:
        drop_scratch_db(pg_url, name)


def _costs() -> dict[str, float]:
    rng = random.Random(3)
    window = [
        CalibrationSample(c, c * 73 // 100 + rng.randint(0, 900))
        for c in (rng.randint(2_000, 150_000) for _ in range(WINDOW))
    ]
    t0 = time.perf_counter()
    for _ in range(10):
        cal = estimate(window)
    estimate_ms = (time.perf_counter() - t0) / 10 * 1000
    policy = Policy()
    state = SessionState(session_id="bench")
    model = ModelRef("anthropic", "claude-sonnet-4-5")
    m = Measurement(Basis(1, "m1"), model, "0" * 64, 60_000, 175_424, "heuristic_estimate")
    n = 2000

    def decide(c: Calibration | None) -> float:
        t = time.perf_counter()
        for i in range(n):
            decide_measure(state, policy, m, now=float(i), new_attempt_id="a", calibration=c)
        return time.perf_counter() - t

    plain = min(decide(None) for _ in range(3))
    calibrated = min(decide(cal) for _ in range(3))
    t0 = time.perf_counter()
    for i in range(n * 10):
        apply(60_000 + i, cal)
    apply_us = (time.perf_counter() - t0) / (n * 10) * 1e6
    return {
        "estimate_ms": round(estimate_ms, 2),
        "apply_us": round(apply_us, 2),
        "decide_us": round(plain / n * 1e6, 1),
        "decide_calibrated_us": round(calibrated / n * 1e6, 1),
    }


def run_calibration_bench(pg_url: str, quick: bool = False) -> dict[str, Any]:
    registry = ModelRegistry.load(SIM_MODELS)
    t0 = time.perf_counter()
    cases = {
        profile.name: _case(registry, model, profile, workload, f"bench:{model}") for model, profile, workload in CASES
    }
    return {
        **cases,
        "mixed_fleet": _mixed_fleet(),
        "catch_up_ms_per_1000_reports": _catch_up(pg_url, 1000 if quick else 10_000),
        **_costs(),
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
