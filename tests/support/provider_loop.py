"""A fleet's sessions through a ``Tracker`` against the simulated provider, turn by turn.

``observe_session`` observes each request of a session until a compact (reporting the billed
usage of each one let through, if asked); ``train`` runs a fleet's first sessions until it has
reported ``MIN_SAMPLES`` usages. Used by tests/unit/test_calibration_loop.py and
tests/integration/test_calibration_store.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tests.support.bench import BAND_FROM, SIM_MODELS, Profile, SimProvider, Workload, session
from tracker.core.calibration import MIN_SAMPLES
from tracker.core.state import SessionProjector
from tracker.counting.backends import InProcessCounting
from tracker.counting.registry import ModelRegistry
from tracker.counting.request import CanonicalRequest
from tracker.service import Tracker
from tracker.store import MemoryEventStore

MODEL = "claude-sonnet-4-5"

#: the shipped models, and the bench's Gemini-like model with a 128k window
REGISTRY = ModelRegistry.load(SIM_MODELS)
COUNTING = InProcessCounting(REGISTRY)


def tracker(store: MemoryEventStore | None = None) -> Tracker:
    return Tracker(store or MemoryEventStore(projector=SessionProjector()), counting=COUNTING)


@dataclass
class Run:
    """One session observed turn by turn: every decision's (decided, billed) and where it compacted."""

    pairs: list[tuple[int, int]]  # (decided count, billed) of every decision
    compacted_at: tuple[int, int] | None  # (turn, billed tokens) of the first compact
    input_limit: int
    reports: int


def observe_session(
    t: Tracker,
    sid: str,
    model: str,
    provider: SimProvider,
    requests: list[CanonicalRequest],
    *,
    report: bool | int = False,
) -> Run:
    """Observe each request in turn until a compact; ``report``: report the billed usage of each
    request let through (``True``), or of at most that many."""
    pairs: list[tuple[int, int]] = []
    limit = 0
    reports = 0
    for i, request in enumerate(requests):
        d = t.observe(sid, request=request, model=model, basis=f"m{i}").decision
        billed = provider.billed(request)
        pairs.append((d.input_tokens, billed))
        limit = d.input_limit
        if d.action == "compact":
            return Run(pairs, (i, billed), limit, reports)
        assert d.action == "proceed", d
        if report is True or reports < report:
            t.report_usage(sid, basis=f"m{i}", input_tokens=billed)
            reports += 1
    return Run(pairs, None, limit, reports)


def train(t: Tracker, fleet: str, model: str, provider: Profile, workload: Workload, rng: random.Random) -> int:
    """The fleet's first sessions, each reporting the usage of its turns, until ``MIN_SAMPLES`` reports."""
    sim = SimProvider(provider)
    reports = 0
    n = 0
    while reports < MIN_SAMPLES:
        requests = session(rng, workload, rng.randint(4, 12))
        reports += observe_session(t, f"{fleet}:train-{n}", model, sim, requests, report=MIN_SAMPLES - reports).reports
        n += 1
    return reports


#: decided / billed, for requests of at least ``BAND_FROM`` x the input limit, and for smaller ones.
#: Why smaller requests are outside 0.99-1.10: a session's first turns carry one or two kinds of
#: content (a system prompt, one German or Chinese exchange) whose ratio the fleet's calibration
#: does not fit, and the fitted constant per request weighs more on them; they are a few percent
#: of the limit, far from any decision (compaction is decided at 0.80 of it).
BAND = (0.99, 1.10)

BAND_SMALL = (0.94, 1.25)


#: over many fleets the multilingual workload (five scripts, in varying shares per session) leans
#: a little further over: its sessions' ratios spread more than one factor fits (never under 0.99)
BAND_MANY = (0.99, 1.12)


def assert_within_band(pairs: list[tuple[int, int]], limit: int, band: tuple[float, float] = BAND) -> None:
    for decided, billed in pairs:
        lo, hi = band if billed >= BAND_FROM * limit else BAND_SMALL
        assert lo <= decided / billed <= hi, (decided, billed, round(decided / billed, 3))
