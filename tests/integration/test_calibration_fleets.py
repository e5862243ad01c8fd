"""The calibration band over many fleets: the claim of tests/unit/test_calibration_loop.py, checked
on 8 simulated fleets (seeds) per model, so that it is not one seed's luck.

No service is needed (the pure path: counter, estimate, apply), but counting eight fleets' growing
sessions takes tens of seconds of CPU, which is why it runs with the slower suites, not in tests/unit.
"""

from __future__ import annotations

import random
import statistics

import pytest

from tests.support.bench import CASES, Profile, SimProvider, Workload, session
from tests.support.provider_loop import BAND_FROM, BAND_MANY, REGISTRY, assert_within_band
from tracker.core.calibration import MIN_SAMPLES, CalibrationSample, apply, estimate
from tracker.core.policy import Policy
from tracker.counting.counters import HeuristicCounter


@pytest.mark.slow
@pytest.mark.parametrize(("model", "profile", "workload"), CASES, ids=[c[0] for c in CASES])
def test_the_band_holds_over_many_fleets(model: str, profile: Profile, workload: Workload) -> None:
    """The same claim as above, over 8 fleets (seeds) each, on the pure path (counter, estimate, apply):
    the Tracker decides with exactly these (the test above), this checks the claim is not one seed's luck."""
    spec = REGISTRY.get(model)
    counter = HeuristicCounter()
    sim = SimProvider(profile)
    limit = REGISTRY.input_limit(spec, Policy())
    worst: list[float] = []
    small: list[float] = []
    for seed in range(8):
        rng = random.Random(f"band:{seed}:{model}")
        samples: list[CalibrationSample] = []
        while len(samples) < MIN_SAMPLES:
            for r in session(rng, workload, rng.randint(4, 12)):
                samples.append(CalibrationSample(counter.count(r, spec).input_tokens, sim.billed(r)))
        cal = estimate(samples[:MIN_SAMPLES])
        pairs = [
            (apply(counter.count(r, spec).input_tokens, cal), sim.billed(r)) for r in session(rng, workload, 36)[1::2]
        ]  # every second turn: the band, at half the counting
        assert_within_band(pairs, limit, BAND_MANY)
        worst += [d / b for d, b in pairs if b >= BAND_FROM * limit]
        small += [d / b for d, b in pairs if b < BAND_FROM * limit]
    print(
        f"\n{model}: 8 fleets, decided/billed past {BAND_FROM} of the limit: {_fmt(worst)} ({len(worst)} requests);"
        f" below: {_fmt(small)} ({len(small)})"
    )


def _fmt(values: list[float]) -> str:
    return f"min {min(values):.3f}  median {statistics.median(values):.3f}  max {max(values):.3f}"
