"""behaviour.md "Words", "Thresholds" numbers: occupancy, input limits, thresholds, levels, growth trigger, history budget.

Every number and worked example in behaviour.md "Policy"/§4 appears here as a unit test.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from tracker.core import (
    FULL_SCALE_BP,
    HISTORY_SAFETY_FACTOR,
    MIN_SCOPE_CONFIDENCE,
    SCOPE_THRESHOLDS_BP,
    WINDOW_CEILING,
    Policy,
    Threshold,
    growth_fired,
    history_budget,
    levels,
    occupancy_bp,
    resolve_input_limit,
    resolve_threshold,
    usage_fraction,
)
from tracker.errors import ContextLimitUnknown, InvalidInput, MalformedMeasurement


def default_threshold(policy: Policy = Policy()) -> Threshold:
    return resolve_threshold(policy.compact_at_bp, policy.rearm_below_bp)


def threshold_at(t: float, base: int = 8000, rearm: int = 6000) -> Threshold:
    return resolve_threshold(base, rearm, compaction_threshold=t)


# -- fixed constants (behaviour.md "Policy") ---------------------------------------------------------------


def test_fixed_constants():
    assert FULL_SCALE_BP == 10_000
    assert WINDOW_CEILING == 300_000
    assert HISTORY_SAFETY_FACTOR == 0.95
    assert MIN_SCOPE_CONFIDENCE == 0.5


def test_policy_defaults():
    p = Policy()
    assert p.automatic is True
    assert (p.compact_at_bp, p.rearm_below_bp) == (8000, 6000)
    assert p.counter_policy == "allow_conservative"
    assert (p.reserved_output, p.safety_margin) == (16384, 8192)
    assert p.count_timeout_s == 2.0
    assert p.turn_delta is None
    assert p.max_automatic_per_episode == 3
    assert p.attempt_lease_s == 60


# -- occupancy (behaviour.md "Words") -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "used, limit, expected",
    [
        (0, 100, 0),
        (80, 100, 8000),
        (1, 3, 3333),  # floor, not round
        (2, 3, 6666),
        (79_999, 100_000, 7999),
        (80_000, 100_000, 8000),
        (100, 100, 10_000),
        (101, 100, 10_000),  # capped at full scale
        (600_000, 1_000_000, 6000),
        (10**30, 7, 10_000),  # integer arithmetic only: no float overflow / rounding
        (10**20 - 1, 10**20, 9999),
    ],
)
def test_occupancy_formula(used, limit, expected):
    assert occupancy_bp(used, limit) == expected


def test_occupancy_limit_zero_is_an_error():
    with pytest.raises(MalformedMeasurement) as exc:
        occupancy_bp(10, 0)
    assert exc.value.field == "input_limit"


@pytest.mark.parametrize(
    "used, limit, field",
    [
        (-1, 100, "input_tokens"),
        (1.5, 100, "input_tokens"),
        (True, 100, "input_tokens"),
        (1, -5, "input_limit"),
        (1, 10.0, "input_limit"),
    ],
)
def test_occupancy_rejects_non_integers_and_negatives(used, limit, field):
    with pytest.raises(MalformedMeasurement) as exc:
        occupancy_bp(used, limit)
    assert exc.value.field == field


# -- input limit (behaviour.md "Policy") ---------------------------------------------------------------------


def limit(window, max_output=None, max_input=None, reserved=16384, margin=8192):
    return resolve_input_limit(
        window=window,
        max_output_tokens=max_output,
        max_input_tokens=max_input,
        reserved_output=reserved,
        safety_margin=margin,
        model="m",
    )


def test_input_limit_window_minus_reserved_minus_margin():
    assert limit(200_000) == 200_000 - 16384 - 8192 == 175_424


def test_input_limit_max_output_smaller_than_reserved_wins():
    # raw = window - min(reserved_output, max_output_tokens)
    assert limit(200_000, max_output=4096) == 200_000 - 4096 - 8192
    assert limit(200_000, max_output=64_000) == 200_000 - 16384 - 8192


def test_input_limit_smaller_max_input_tokens_wins():
    assert limit(200_000, max_input=150_000) == 150_000 - 8192
    # a larger max_input_tokens changes nothing
    assert limit(200_000, max_input=190_000) == 200_000 - 16384 - 8192
    assert limit(128_000, max_output=16_384, max_input=111_616) == 111_616 - 8192


def test_input_limit_million_window():
    assert limit(1_000_000) == 1_000_000 - 16384 - 8192


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(window=16384),  # reserved_output == window
        dict(window=10_000),  # reserved_output > window
        dict(window=20_000, max_output=20_000, reserved=30_000),  # reserved >= window even if max_output smaller
        dict(window=20_000, max_input=0),  # raw == 0
        dict(window=30_000, margin=30_000 - 16384),  # safety_margin == raw
        dict(window=30_000, margin=50_000),  # safety_margin > raw
        dict(window=100_000, max_input=8192),  # max_input wins, then margin >= raw
        dict(window=None),  # unknown model / no window
        dict(window=0),
    ],
)
def test_input_limit_unknown_fails_closed(kwargs):
    with pytest.raises(ContextLimitUnknown):
        limit(**kwargs)


def test_input_limit_edge_just_fits():
    # safety_margin one below raw leaves exactly one token
    assert limit(30_000, margin=30_000 - 16384 - 1) == 1


# -- explicit threshold (behaviour.md "Thresholds".2) -------------------------------------------------------------


@pytest.mark.parametrize(
    "t, bp",
    [
        (0.45, 4500),  # exactly 4500, not 4499 from binary float error
        (0.8, 8000),
        (0.4, 4000),
        (0.29, 2900),
        (0.57, 5700),  # float 0.57*10000 = 5699.999..., the user wrote 0.57: T = 5700
        (0.7, 7000),
        (0.12345, 1234),  # floor
        (0.99999, 8000),  # floor(9999.9) = 9999, then min(base, T)
        (1, 8000),
        (1.0, 8000),
    ],
)
def test_explicit_threshold_is_floor_t_times_10000_capped_at_base(t, bp):
    th = threshold_at(t)
    assert th.source == "explicit"
    assert th.bp == bp


def test_explicit_threshold_uncapped_values_with_a_high_base():
    assert threshold_at(0.99999, base=9999, rearm=1).bp == 9999
    assert threshold_at(0.12345, base=9999, rearm=1).bp == 1234
    assert threshold_at(0.9, base=9000).bp == 9000


@pytest.mark.parametrize(
    "t",
    [
        0,
        0.0,
        -0.1,
        1.0000001,
        1.5,
        2,
        float("nan"),
        float("inf"),
        float("-inf"),
        "0.5",
        "abc",
        True,
        False,
        [0.5],
        {"t": 0.5},
    ],
)
def test_explicit_threshold_invalid_names_the_field(t):
    with pytest.raises(InvalidInput) as exc:
        threshold_at(t)
    assert exc.value.field == "compaction_threshold"
    assert "compaction_threshold" in str(exc.value)


def test_explicit_threshold_below_one_basis_point_is_refused():
    # floor(t * 10000) == 0 would make every request compact and divide by zero in the rearm ceiling
    with pytest.raises(InvalidInput) as exc:
        threshold_at(0.00001)
    assert exc.value.field == "compaction_threshold"
    assert threshold_at(0.0001).bp == 1


def test_explicit_threshold_rearm_scales():
    # R = floor(rearm * C / base)
    th = threshold_at(0.45)
    assert th.rearm_bp == 6000 * 4500 // 8000 == 3375
    th = threshold_at(0.4)
    assert th.rearm_bp == 3000
    th = resolve_threshold(8000, 6001, compaction_threshold=0.33)
    assert th.rearm_bp == math.floor(6001 * 3300 / 8000) == 2475


def test_default_threshold():
    th = default_threshold()
    assert th == Threshold(bp=8000, rearm_bp=6000, source="default")
    th = resolve_threshold(5000, 2000)
    assert th == Threshold(bp=5000, rearm_bp=2000, source="default")


# -- classifier (behaviour.md "Thresholds".2) ------------------------------------------------------------------------


def test_scope_table():
    assert SCOPE_THRESHOLDS_BP == {
        "current-message": 4500,
        "recent-turns": 6000,
        "full-conversation": 7500,
        "everything": 8000,
    }


@pytest.mark.parametrize(
    "scope, bp, source",
    [
        ("current-message", 4500, "classifier"),
        ("recent-turns", 6000, "classifier"),
        ("full-conversation", 7500, "classifier"),
        ("everything", 8000, "default"),  # 8000 is not below the base 8000: discarded
    ],
)
def test_classifier_mapping(scope, bp, source):
    th = resolve_threshold(8000, 6000, scope=scope, scope_confidence=0.9)
    assert (th.bp, th.source) == (bp, source)
    assert th.rearm_bp == 6000 * bp // 8000


def test_classifier_confidence_boundary():
    ignored = resolve_threshold(8000, 6000, scope="current-message", scope_confidence=0.49)
    assert ignored == Threshold(8000, 6000, "default")
    used = resolve_threshold(8000, 6000, scope="current-message", scope_confidence=0.5)
    assert used == Threshold(4500, 3375, "classifier")
    assert resolve_threshold(8000, 6000, scope="current-message", scope_confidence=1).source == "classifier"
    assert resolve_threshold(8000, 6000, scope="current-message", scope_confidence=0).source == "default"


def test_classifier_reading_kept_only_if_it_lowers_the_base():
    # compact_at 5000: a full-conversation reading (7500) would raise it -> discarded, source default
    th = resolve_threshold(5000, 3000, scope="full-conversation", scope_confidence=0.95)
    assert th == Threshold(5000, 3000, "default")
    th = resolve_threshold(5000, 3000, scope="recent-turns", scope_confidence=0.95)
    assert th == Threshold(5000, 3000, "default")
    th = resolve_threshold(5000, 3000, scope="current-message", scope_confidence=0.95)
    assert th == Threshold(4500, 2700, "classifier")
    # equal to the base is not lower
    th = resolve_threshold(4500, 3000, scope="current-message", scope_confidence=0.95)
    assert th.source == "default"


def test_explicit_wins_over_classifier():
    th = resolve_threshold(8000, 6000, compaction_threshold=0.7, scope="current-message", scope_confidence=0.99)
    assert (th.bp, th.source) == (7000, "explicit")
    # even when the explicit value does not lower the base
    th = resolve_threshold(8000, 6000, compaction_threshold=0.95, scope="current-message", scope_confidence=0.99)
    assert (th.bp, th.source) == (8000, "explicit")


def test_bad_classifier_is_an_error_even_when_explicit_wins():
    with pytest.raises(InvalidInput) as exc:
        resolve_threshold(8000, 6000, compaction_threshold=0.7, scope="whole-universe", scope_confidence=0.9)
    assert exc.value.field == "scope"


@pytest.mark.parametrize(
    "scope, conf, field",
    [
        ("whole-universe", 0.9, "scope"),
        ("", 0.9, "scope"),
        (3, 0.9, "scope"),
        ("recent-turns", None, "scope_confidence"),
        ("recent-turns", 1.5, "scope_confidence"),
        ("recent-turns", -0.1, "scope_confidence"),
        ("recent-turns", float("nan"), "scope_confidence"),
        ("recent-turns", "high", "scope_confidence"),
        ("recent-turns", True, "scope_confidence"),
    ],
)
def test_classifier_invalid_names_the_field(scope, conf, field):
    with pytest.raises(InvalidInput) as exc:
        resolve_threshold(8000, 6000, scope=scope, scope_confidence=conf)
    assert exc.value.field == field


# -- levels (behaviour.md "Thresholds".3) -------------------------------------------------------------------------------


def test_levels_spec_examples():
    # 1M window at 0.4 fires at 300,000 (the ceiling), not 299,999
    lv = levels(threshold_at(0.4), 1_000_000)
    assert lv.compact == 300_000
    assert lv.hard == 1_000_000
    # 256k at 0.9 (a base of 9000 is needed: a request can never raise the default 8000)
    lv = levels(resolve_threshold(9000, 6000), 256_000)
    assert lv.compact == 230_400
    assert levels(threshold_at(0.9, base=9000), 256_000).compact == 230_400
    # 200k at 0.4
    assert levels(threshold_at(0.4), 200_000).compact == 80_000
    # 300k at 1.0 (C = full scale)
    assert levels(Threshold(10_000, 6000, "explicit"), 300_000).compact == 300_000
    # 8k at 0.4
    assert levels(threshold_at(0.4), 8_000).compact == 3_200


def test_levels_rearm_and_ceiling():
    # default 8000/6000 on a 1M limit: compact capped at 300k, rearm at 300k * 6000/8000
    lv = levels(default_threshold(), 1_000_000)
    assert (lv.compact, lv.rearm, lv.hard) == (300_000, 225_000, 1_000_000)
    # 0.4 on 1M: R = 3000, rearm = min(300,000, ceil(300,000*3000/4000)) = 225,000
    lv = levels(threshold_at(0.4), 1_000_000)
    assert lv.rearm == 225_000
    # 200k default: no ceiling effect
    lv = levels(default_threshold(), 200_000)
    assert (lv.compact, lv.rearm, lv.hard) == (160_000, 120_000, 200_000)


def test_levels_round_up():
    # 175,424 * 0.8 = 140,339.2 -> 140,340 ; * 0.6 = 105,254.4 -> 105,255
    lv = levels(default_threshold(), 175_424)
    assert (lv.compact, lv.rearm) == (140_340, 105_255)
    lv = levels(default_threshold(), 7)
    assert (lv.compact, lv.rearm, lv.hard) == (6, 5, 7)


def test_level_firing_boundary_1m_at_0_4():
    lv = levels(threshold_at(0.4), 1_000_000)
    assert not lv.compact <= 299_999
    assert lv.compact <= 300_000


@pytest.mark.parametrize("L", [1, 3, 7, 100, 8_000, 99_999, 175_424, 200_000, 256_000, 299_999, 300_000])
@pytest.mark.parametrize("C", [1, 1234, 4000, 4500, 6000, 7999, 8000, 9999, 10_000])
def test_used_at_compact_level_iff_occupancy_at_threshold(L, C):
    # no ceiling effect at or below 300k: used >= compact_level <=> occupancy >= C
    lv = levels(Threshold(C, C * 3 // 4, "explicit"), L)
    for used in {max(0, lv.compact - 2), max(0, lv.compact - 1), lv.compact, lv.compact + 1, L}:
        assert (used >= lv.compact) == (occupancy_bp(used, L) >= C)


def test_ceiling_never_caps_the_hard_limit():
    lv = levels(default_threshold(), 2_000_000)
    assert lv.hard == 2_000_000
    assert lv.compact == 300_000


# -- growth trigger (behaviour.md "Thresholds".4) --------------------------------------------------------------------------


def test_growth_million_window_d_0_1():
    assert growth_fired(0.1, 130_000, 1_000_000, (100_000, 1_000_000))  # 1/3 -> 13/30 = exactly +0.1
    assert not growth_fired(0.1, 120_000, 1_000_000, (100_000, 1_000_000))
    assert not growth_fired(0.1, 129_999, 1_000_000, (100_000, 1_000_000))


def test_growth_200k_window_d_0_3_needs_60k():
    assert growth_fired(0.3, 160_000, 200_000, (100_000, 200_000))
    assert not growth_fired(0.3, 159_999, 200_000, (100_000, 200_000))
    assert growth_fired(0.3, 60_000, 200_000, (0, 200_000))


def test_growth_first_measurement_and_off():
    assert not growth_fired(0.1, 300_000, 1_000_000, None)  # first measurement of a revision
    assert not growth_fired(None, 300_000, 1_000_000, (0, 1_000_000))  # off by default


def test_growth_never_fires_on_shrinking():
    assert not growth_fired(0.1, 50_000, 200_000, (150_000, 200_000))


def test_usage_fraction_exact_and_unclamped():
    assert usage_fraction(600_000, 1_000_000) == 2
    assert usage_fraction(100_000, 1_000_000) == Fraction(1, 3)
    assert usage_fraction(50_000, 200_000) == Fraction(1, 4)
    assert usage_fraction(250_000, 200_000) == Fraction(5, 4)


def test_growth_across_the_ceiling_uses_unclamped_fraction():
    # 1M limit: 300k -> 330k is +0.1 of the 300k denominator even though f > 1 afterwards
    assert growth_fired(0.1, 330_000, 1_000_000, (300_000, 1_000_000))
    assert growth_fired(1, 600_000, 1_000_000, (300_000, 1_000_000))


# -- history budget (behaviour.md "Thresholds".5) -----------------------------------------------------------------------------


@pytest.mark.parametrize("available, overhead", [(100_000, 0), (175_424, 12_345), (1_000_000, 3), (7, 0), (1001, 1)])
def test_history_budget_default_threshold(available, overhead):
    assert history_budget(available, overhead, 8000, 8000) == math.floor(Fraction(95, 100) * (available - overhead))


def test_history_budget_examples():
    assert history_budget(100_000, 0, 8000, 8000) == 95_000
    assert history_budget(100_000, 20_000, 8000, 8000) == 76_000
    # a 0.4 threshold on the 0.8 base halves it
    assert history_budget(100_000, 0, 4000, 8000) == 47_500
    assert history_budget(100_000, 20_000, 4000, 8000) == 38_000
    # 4500 / 8000 scale, floored once at the end
    assert history_budget(100_001, 0, 4500, 8000) == math.floor(Fraction(100_001 * 95 * 4500, 100 * 8000))


def test_history_budget_never_negative_and_scale_clamped():
    assert history_budget(10_000, 20_000, 8000, 8000) == 0
    assert history_budget(10_000, 10_000, 8000, 8000) == 0
    assert history_budget(100_000, 0, 12_000, 8000) == 95_000  # clamp(C/base, 0, 1)
