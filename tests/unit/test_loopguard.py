"""Loop-guard reclaim plan (behaviour.md "Loop-guard reclaim plan"): worked examples, invariants, bad input."""

from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracker.core.loopguard import LoopGuardEntry, ReclaimPlan, plan_reclaim
from tracker.errors import InvalidInput

O, C, R = "other", "tool_call", "tool_result"


def E(kind: str, tokens: int, preview: int | None = None) -> LoopGuardEntry:
    return LoopGuardEntry(kind, tokens, preview)


def tail(k: int = 4, tokens: int = 10) -> list[LoopGuardEntry]:
    return [E(O, tokens) for _ in range(k)]


# avail=1000 with the default ratios: threshold 800, low 600.
AVAIL = 1000


# -- worked examples ---------------------------------------------------------------------------


def test_fitting_loop_is_untouched_at_exactly_the_threshold():
    entries = [E(O, 100), E(C, 50), E(R, 410, 10), *tail(4)]  # 600
    plan = plan_reclaim(entries, AVAIL, 200)  # total 800 == threshold
    assert plan == ReclaimPlan(False, (), (), 800)


def test_one_token_over_the_threshold_fires():
    entries = [E(O, 100), E(C, 50), E(R, 411, 10), *tail(4)]
    fire, truncate, drop, projected = plan_reclaim(entries, AVAIL, 200)
    assert fire and truncate == (2,) and drop == ()
    assert projected == 801 - 401


def test_truncation_alone_is_enough_and_stops_at_low_water():
    entries = [E(O, 100), E(C, 10), E(R, 300, 20), E(C, 10), E(R, 300, 20), *tail(4)]
    # total = 100 + 100 + 10 + 300 + 10 + 300 + 40 = 860 > 800
    plan = plan_reclaim(entries, AVAIL, 100)
    # index 2 saves 280 -> 580 <= 600: index 4 is left alone.
    assert plan == ReclaimPlan(True, (2,), (), 580)


def test_truncation_then_dropping_oldest_batch_and_truncation_inside_it_removed():
    entries = [
        E(O, 100),
        E(C, 50),
        E(R, 200, 150),  # batch (1, 3)
        E(C, 50),
        E(R, 200, 150),  # batch (3, 5)
        E(C, 50),
        E(R, 50),  # batch (5, 7), not truncatable
        *tail(4, 25),
    ]
    # total = 100 + 100 + 250 + 250 + 100 + 100 = 900
    # stage 1: 2 -> 850, 4 -> 800; stage 2: drop (1,3) at 50 + 150 -> 600 <= 600.
    plan = plan_reclaim(entries, AVAIL, 100)
    assert plan == ReclaimPlan(True, (4,), (1, 2), 600)


def test_dropping_only_when_outputs_are_already_smaller_than_previews():
    entries = [E(O, 100), E(C, 100), E(R, 100, 300), E(C, 100), E(R, 100), E(C, 100), E(R, 100), *tail(4)]
    # total 740 + overhead 100 = 840 > 800; previews buy nothing.
    plan = plan_reclaim(entries, AVAIL, 100)
    assert plan == ReclaimPlan(True, (), (1, 2, 3, 4), 440)


def test_batches_are_calls_then_results_not_maximal_tool_runs():
    entries = [E(O, 100), E(C, 200), E(R, 200), E(C, 200), E(R, 200), *tail(4)]
    plan = plan_reclaim(entries, AVAIL, 100)  # 1040 -> drop (1,3) -> 640 -> drop (3,5) -> 240
    assert plan.drop == (1, 2, 3, 4)
    entries = [E(O, 100), E(C, 300), E(R, 300), E(C, 100), E(R, 100), *tail(4)]
    plan = plan_reclaim(entries, AVAIL, 100)  # 1040 -> drop (1,3) -> 440: second batch kept
    assert plan == ReclaimPlan(True, (), (1, 2), 440)


def test_multi_call_batch_is_dropped_whole():
    entries = [E(O, 100), E(C, 10), E(C, 10), E(C, 500), E(R, 10), E(R, 10), E(R, 10), *tail(4)]
    plan = plan_reclaim(entries, AVAIL, 300)
    assert plan == ReclaimPlan(True, (), (1, 2, 3, 4, 5, 6), 440)


def test_batch_reaching_into_protected_tail_is_never_dropped_or_split():
    # n=7, tail 4 -> window 1..2; batch (1, 4) reaches index 3, inside the tail.
    entries = [E(O, 100), E(C, 400), E(C, 400), E(R, 100), *tail(3)]
    plan = plan_reclaim(entries, AVAIL, 0)
    assert plan == ReclaimPlan(False, (), (), 1030)


def test_nothing_after_a_tail_crossing_batch_is_dropped_but_earlier_ones_are():
    entries = [E(O, 100), E(C, 100), E(R, 100), E(O, 10), E(C, 300), E(R, 300), E(R, 10), E(O, 10), E(O, 10)]
    # n=9, tail 4 -> window 1..4; batch (4, 7) crosses; batch (1, 3) droppable.
    plan = plan_reclaim(entries, AVAIL, 0)
    assert plan == ReclaimPlan(True, (), (1, 2), 740)


def test_truncation_inside_a_tail_crossing_batch_is_allowed_when_in_the_window():
    entries = [E(O, 100), E(C, 10), E(R, 500, 50), E(R, 400), *tail(3)]
    # window 1..2; batch (1, 4) crosses the tail so it is not dropped; index 2 may shrink.
    plan = plan_reclaim(entries, AVAIL, 0)
    assert plan == ReclaimPlan(True, (2,), (), 1040 - 450)


def test_protected_tail_entries_are_never_truncated():
    entries = [E(O, 100), *[E(R, 300, 10) for _ in range(4)]]
    plan = plan_reclaim(entries, AVAIL, 0)
    assert plan == ReclaimPlan(False, (), (), 1300)


def test_entry_zero_is_never_touched_even_if_it_is_a_huge_tool_result():
    entries = [E(R, 5000, 10), E(O, 10), *tail(4)]
    assert plan_reclaim(entries, AVAIL, 0) == ReclaimPlan(False, (), (), 5050)


def test_protected_tail_zero_makes_the_newest_entries_mutable():
    entries = [E(O, 100), E(O, 100), E(C, 300), E(R, 500, 100)]
    assert plan_reclaim(entries, AVAIL, 0, protected_tail=0) == ReclaimPlan(True, (3,), (), 600)
    entries = [E(O, 100), E(O, 100), E(C, 300), E(R, 500)]
    assert plan_reclaim(entries, AVAIL, 0, protected_tail=0) == ReclaimPlan(True, (), (2, 3), 200)


def test_protected_tail_larger_than_the_list_touches_nothing():
    entries = [E(O, 100), E(C, 500), E(R, 500, 1)]
    assert plan_reclaim(entries, AVAIL, 0, protected_tail=10) == ReclaimPlan(False, (), (), 1100)


@pytest.mark.parametrize(
    "entries, overhead, expected",
    [
        ([], 0, ReclaimPlan(False, (), (), 0)),
        ([], 5000, ReclaimPlan(False, (), (), 5000)),
        ([E(O, 900)], 0, ReclaimPlan(False, (), (), 900)),
        ([E(R, 900, 1)], 0, ReclaimPlan(False, (), (), 900)),
        ([E(O, 1), E(R, 900, 1)], 0, ReclaimPlan(False, (), (), 901)),  # index 1 is in the tail
    ],
)
def test_tiny_lists(entries, overhead, expected):
    assert plan_reclaim(entries, AVAIL, overhead) == expected


def test_tiny_list_with_no_tail():
    assert plan_reclaim([E(O, 1), E(R, 900, 1)], AVAIL, 0, protected_tail=0) == ReclaimPlan(True, (1,), (), 2)
    assert plan_reclaim([E(O, 1), E(R, 900)], AVAIL, 0, protected_tail=0) == ReclaimPlan(True, (), (1,), 1)


def test_over_threshold_with_nothing_touchable_does_not_fire():
    entries = [E(O, 300) for _ in range(8)]
    assert plan_reclaim(entries, AVAIL, 0) == ReclaimPlan(False, (), (), 2400)


def test_preview_not_smaller_than_tokens_is_not_truncated_and_preview_on_other_kinds_ignored():
    entries = [E(O, 100), E(C, 400, 1), E(R, 200, 200), E(O, 300, 1), *tail(4)]
    plan = plan_reclaim(entries, AVAIL, 0)
    assert plan == ReclaimPlan(True, (), (1, 2), 440)


def test_preview_equal_to_tokens_saves_nothing_and_is_not_truncated():
    entries = [E(O, 100), E(C, 10), E(R, 300, 300), E(C, 10), E(R, 300, 10), E(R, 0, 0), *tail(4)]
    # total 860: index 2 would save 0, so the first truncation is index 4 (-290).
    assert plan_reclaim(entries, AVAIL, 100) == ReclaimPlan(True, (4,), (), 570)


def test_cannot_reach_low_water_drops_everything_droppable():
    entries = [E(O, 700), E(C, 10), E(R, 100, 20), E(O, 5), E(C, 10), E(R, 10), *tail(4, 100)]
    plan = plan_reclaim(entries, AVAIL, 0)
    assert plan == ReclaimPlan(True, (), (1, 2, 4, 5), 1105)


# -- orphans: batches that start with results --------------------------------------------------


def test_orphan_results_after_a_non_tool_entry_are_their_own_batch():
    entries = [E(O, 100), E(O, 10), E(R, 300), E(R, 300), E(C, 50), E(R, 50), *tail(4)]
    # results (2, 4) have no call: one droppable batch; (4, 6) is the next.
    plan = plan_reclaim(entries, AVAIL, 100)
    assert plan == ReclaimPlan(True, (), (2, 3), 350)


def test_results_answering_a_tool_call_at_entry_zero_are_never_dropped():
    entries = [E(C, 100), E(R, 500), E(O, 10), E(C, 300), E(R, 300), *tail(4)]
    # (0, 2) contains entry 0: kept. (3, 5) droppable.
    plan = plan_reclaim(entries, AVAIL, 0)
    assert plan == ReclaimPlan(True, (), (3, 4), 650)


def test_calls_continuing_a_tool_call_at_entry_zero_are_never_dropped():
    entries = [E(C, 100), E(C, 500), E(R, 500), *tail(4)]
    assert plan_reclaim(entries, AVAIL, 0) == ReclaimPlan(False, (), (), 1140)


def test_results_continuing_entry_zero_may_still_be_truncated():
    entries = [E(C, 100), E(R, 800, 100), *tail(4)]
    assert plan_reclaim(entries, AVAIL, 0) == ReclaimPlan(True, (1,), (), 240)


def test_trailing_calls_without_results_form_a_batch():
    entries = [E(O, 100), E(C, 500), E(O, 10), E(C, 300), *tail(4)]
    plan = plan_reclaim(entries, AVAIL, 100)
    assert plan == ReclaimPlan(True, (), (1,), 550)


# -- thresholds and calibration ----------------------------------------------------------------


def test_calibration_scales_thresholds():
    entries = [E(O, 100), E(C, 100), E(R, 300, 50), *tail(4)]  # 540
    assert plan_reclaim(entries, AVAIL, 0).fire is False
    # cal 2: threshold 400, low 300 -> truncate 2 (-250) -> 290.
    assert plan_reclaim(entries, AVAIL, 0, calibration=2) == ReclaimPlan(True, (2,), (), 290)
    # cal 3: threshold floor(800/3)=266, low 200 -> truncate (290) then drop (1,3) at 150 -> 140.
    assert plan_reclaim(entries, AVAIL, 0, calibration=3) == ReclaimPlan(True, (), (1, 2), 140)
    # cal 0.5: threshold 1600.
    assert plan_reclaim([*entries, E(O, 1000)], AVAIL, 0, calibration=0.5).fire is False


@pytest.mark.parametrize("cal", [0, 0.0, -0.0, -1, -2.5])
def test_calibration_not_positive_means_one(cal):
    entries = [E(O, 100), E(C, 10), E(R, 300, 20), E(C, 10), E(R, 300, 20), *tail(4)]
    assert plan_reclaim(entries, AVAIL, 100, calibration=cal) == plan_reclaim(entries, AVAIL, 100)
    fitting = [E(O, 100), E(C, 50), E(R, 410, 10), *tail(4)]
    assert plan_reclaim(fitting, AVAIL, 200, calibration=cal).fire is False


def test_threshold_uses_exact_decimal_arithmetic():
    # Floats give 100 * 0.57 = 56.99999999999999 -> 56; exactly it is 57.
    assert math.floor(100 * 0.57) == 56
    entries = [E(O, 1), E(R, 56, 0)]
    assert plan_reclaim(entries, 100, 0, threshold_ratio=0.57, low_water_ratio=0.5, protected_tail=0).fire is False
    entries = [E(O, 1), E(R, 57, 0)]
    assert plan_reclaim(entries, 100, 0, threshold_ratio=0.57, low_water_ratio=0.5, protected_tail=0).fire is True


def test_low_water_uses_exact_arithmetic_with_calibration():
    # Floats: 3 * 0.6 / 0.1 = 17.999999999999996 -> 17; exactly low = 18, threshold = 3*0.8/0.1 = 24.
    assert math.floor(3 * 0.6 / 0.1) == 17
    entries = [E(O, 0), E(C, 7), E(R, 1), E(C, 7), E(R, 1), E(O, 10)]
    # total 26 > 24; drop (1, 3) -> 18: exactly low, so stop (a float low of 17 would drop (3, 5) too).
    plan = plan_reclaim(entries, 3, 0, protected_tail=1, calibration=0.1)
    assert plan == ReclaimPlan(True, (), (1, 2), 18)


def test_ratio_types_fraction_and_decimal_and_int_are_accepted():
    entries = [E(O, 100), E(C, 10), E(R, 300, 20), E(C, 10), E(R, 300, 20), *tail(4)]
    expected = plan_reclaim(entries, AVAIL, 100)
    assert plan_reclaim(entries, AVAIL, 100, threshold_ratio=Fraction(4, 5), low_water_ratio=Decimal("0.6")) == expected
    assert plan_reclaim(entries, AVAIL, 100, threshold_ratio=1, low_water_ratio=1).fire is False  # 860 <= 1000


def test_equal_ratios_reclaim_only_to_the_threshold():
    entries = [E(O, 100), E(C, 10), E(R, 300, 20), E(C, 10), E(R, 300, 20), *tail(4)]
    plan = plan_reclaim(entries, AVAIL, 100, low_water_ratio=0.8)
    assert plan == ReclaimPlan(True, (2,), (), 580)


# -- shapes ------------------------------------------------------------------------------------


def test_plan_unpacks_as_a_four_tuple():
    fire, truncate, drop, projected = plan_reclaim([E(O, 1)], AVAIL, 0)
    assert (fire, truncate, drop, projected) == (False, (), (), 1)
    assert tuple(ReclaimPlan(True, (1,), (2, 3), 7)) == (True, (1,), (2, 3), 7)


def test_dict_entries_match_dataclass_entries():
    objs = [E(O, 100), E(C, 50), E(R, 200, 150), E(C, 50), E(R, 200, 150), E(C, 50), E(R, 50), *tail(4, 25)]
    dicts = [
        {
            "kind": e.kind,
            "tokens": e.tokens,
            **({"preview_tokens": e.preview_tokens} if e.preview_tokens is not None else {}),
        }
        for e in objs
    ]
    dicts[1]["preview_tokens"] = None
    assert plan_reclaim(dicts, AVAIL, 100) == plan_reclaim(objs, AVAIL, 100)
    mixed = [dicts[i] if i % 2 else objs[i] for i in range(len(objs))]
    assert plan_reclaim(iter(mixed), AVAIL, 100) == plan_reclaim(objs, AVAIL, 100)


def test_plan_and_entry_are_frozen():
    plan = plan_reclaim([E(O, 1)], AVAIL, 0)
    with pytest.raises(AttributeError):
        plan.fire = True  # type: ignore[misc]
    with pytest.raises(AttributeError):
        E(O, 1).tokens = 2  # type: ignore[misc]


# -- bad input ---------------------------------------------------------------------------------


GOOD = [E(O, 10), E(C, 10), E(R, 10, 1)]


@pytest.mark.parametrize(
    "entries, field",
    [
        ([E(O, 1), {"kind": "tool_result", "tokens": -1}], "entries[1].tokens"),
        ([E(O, 1), E(O, 1), E(O, 1), {"kind": "other", "tokens": 1.5}], "entries[3].tokens"),
        ([{"kind": "other", "tokens": True}], "entries[0].tokens"),
        ([{"kind": "other", "tokens": "3"}], "entries[0].tokens"),
        ([E(O, 1), {"kind": "toolResult", "tokens": 1}], "entries[1].kind"),
        ([{"kind": None, "tokens": 1}], "entries[0].kind"),
        ([E(O, 1), {"kind": "tool_result", "tokens": 5, "preview_tokens": -1}], "entries[1].preview_tokens"),
        ([{"kind": "tool_result", "tokens": 5, "preview_tokens": 2.0}], "entries[0].preview_tokens"),
        ([{"tokens": 5}], "entries[0].kind"),
        ([{"kind": "other"}], "entries[0].tokens"),
        ([E(O, 1), {"kind": "other", "tokens": 1, "previewTokens": 0}], "entries[1]"),
        ([E(O, 1), ("other", 1)], "entries[1]"),
        ([None], "entries[0]"),
        (None, "entries"),
        ("other", "entries"),
        ({"kind": "other", "tokens": 1}, "entries"),
        (5, "entries"),
    ],
)
def test_bad_entries_name_the_field(entries, field):
    with pytest.raises(InvalidInput) as exc:
        plan_reclaim(entries, AVAIL, 0)
    assert exc.value.field == field
    assert str(exc.value).startswith(field + ":")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"available_input_tokens": 0}, "available_input_tokens"),
        ({"available_input_tokens": -5}, "available_input_tokens"),
        ({"available_input_tokens": 1000.0}, "available_input_tokens"),
        ({"available_input_tokens": True}, "available_input_tokens"),
        ({"fixed_overhead_tokens": -1}, "fixed_overhead_tokens"),
        ({"fixed_overhead_tokens": 1.0}, "fixed_overhead_tokens"),
        ({"fixed_overhead_tokens": None}, "fixed_overhead_tokens"),
        ({"threshold_ratio": 0}, "threshold_ratio"),
        ({"threshold_ratio": 1.01}, "threshold_ratio"),
        ({"threshold_ratio": -0.5}, "threshold_ratio"),
        ({"threshold_ratio": float("nan")}, "threshold_ratio"),
        ({"threshold_ratio": float("inf")}, "threshold_ratio"),
        ({"threshold_ratio": "0.8"}, "threshold_ratio"),
        ({"threshold_ratio": True}, "threshold_ratio"),
        ({"low_water_ratio": 0.0}, "low_water_ratio"),
        ({"low_water_ratio": float("nan")}, "low_water_ratio"),
        ({"low_water_ratio": Decimal("NaN")}, "low_water_ratio"),
        ({"low_water_ratio": 1.5}, "low_water_ratio"),
        ({"low_water_ratio": 0.9}, "low_water_ratio"),  # > threshold 0.8
        ({"threshold_ratio": 0.5, "low_water_ratio": 0.6}, "low_water_ratio"),
        ({"protected_tail": -1}, "protected_tail"),
        ({"protected_tail": 2.0}, "protected_tail"),
        ({"protected_tail": None}, "protected_tail"),
        ({"calibration": float("nan")}, "calibration"),
        ({"calibration": float("inf")}, "calibration"),
        ({"calibration": float("-inf")}, "calibration"),
        ({"calibration": None}, "calibration"),
        ({"calibration": "1"}, "calibration"),
    ],
)
def test_bad_parameters_name_the_field(kwargs, field):
    args = {"available_input_tokens": AVAIL, "fixed_overhead_tokens": 0, **kwargs}
    with pytest.raises(InvalidInput) as exc:
        plan_reclaim(GOOD, **args)
    assert exc.value.field == field
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize(
    "args, field",
    [
        (("tool", 1), "kind"),
        (("other", -1), "tokens"),
        (("other", 1.0), "tokens"),
        (("tool_result", 1, -2), "preview_tokens"),
    ],
)
def test_bad_entry_construction_names_the_field(args, field):
    with pytest.raises(InvalidInput) as exc:
        LoopGuardEntry(*args)
    assert exc.value.field == field


def test_bad_input_is_reported_even_when_the_loop_fits():
    with pytest.raises(InvalidInput):
        plan_reclaim([E(O, 1), {"kind": "other", "tokens": -1}], AVAIL, 0)


# -- properties --------------------------------------------------------------------------------


def full_batches(kinds: list[str]) -> list[tuple[int, int]]:
    """Independent restatement: every tool entry belongs to exactly one calls-then-results batch."""
    out, i, n = [], 0, len(kinds)
    while i < n:
        if kinds[i] == O:
            i += 1
            continue
        j = i
        while j < n and kinds[j] == C:
            j += 1
        while j < n and kinds[j] == R:
            j += 1
        out.append((i, j))
        i = j
    return out


@st.composite
def entry_st(draw):
    kind = draw(st.sampled_from([O, C, R, R]))
    tokens = draw(st.integers(0, 400))
    preview = draw(st.none() | st.integers(0, 450) | st.just(tokens))  # equal to tokens: saves nothing
    return LoopGuardEntry(kind, tokens, preview)


percent = st.integers(1, 100)


@st.composite
def cases(draw):
    entries = draw(st.lists(entry_st(), max_size=16))
    a, b = sorted((draw(percent), draw(percent)))
    return {
        "entries": entries,
        "available_input_tokens": draw(st.integers(1, 4000)),
        "fixed_overhead_tokens": draw(st.integers(0, 1500)),
        "threshold_ratio": b / 100,
        "low_water_ratio": a / 100,
        "protected_tail": draw(st.integers(0, 6)),
        "calibration": draw(st.sampled_from([1.0, 1, 0, -1.0, 0.5, 0.9, 1.1, 1.3, 2.0, 0.1])),
    }


def levels(case) -> tuple[int, int]:
    cal = Fraction(repr(float(case["calibration"])))
    if cal <= 0:
        cal = Fraction(1)
    avail = case["available_input_tokens"]
    thr = Fraction(repr(case["threshold_ratio"]))
    low = Fraction(repr(case["low_water_ratio"]))
    return math.floor(avail * thr / cal), math.floor(avail * low / cal)


def effective(entries, i, truncate) -> int:
    e = entries[i]
    return e.preview_tokens if i in truncate else e.tokens


@settings(max_examples=400, deadline=None)
@given(cases())
def test_plan_invariants(case):
    entries = case["entries"]
    n = len(entries)
    plan = plan_reclaim(**case)
    fire, truncate, drop, projected = plan
    threshold, low = levels(case)
    total = case["fixed_overhead_tokens"] + sum(e.tokens for e in entries)
    window = set(range(1, n - case["protected_tail"]))

    # shapes
    assert isinstance(truncate, tuple) and isinstance(drop, tuple)
    assert list(drop) == sorted(set(drop)) and list(truncate) == sorted(set(truncate))
    assert not set(truncate) & set(drop)
    assert fire == bool(truncate or drop)

    # entry 0 and the protected tail are never touched
    assert set(truncate) <= window and set(drop) <= window
    assert 0 not in truncate and 0 not in drop

    # only shrinkable tool results are truncated
    for i in truncate:
        e = entries[i]
        assert e.kind == R and e.preview_tokens is not None and e.preview_tokens < e.tokens

    # a fitting loop is untouched
    if total <= threshold:
        assert plan == ReclaimPlan(False, (), (), total)

    # batches are dropped whole: no call without its results, no result without its calls
    kinds = [e.kind for e in entries]
    for start, end in full_batches(kinds):
        members = set(range(start, end))
        assert members <= set(drop) or not members & set(drop), (start, end, drop)
    for i in drop:
        assert kinds[i] != O

    # projection is exact
    kept = [i for i in range(n) if i not in set(drop)]
    assert projected == case["fixed_overhead_tokens"] + sum(effective(entries, i, set(truncate)) for i in kept)

    if not fire:
        assert projected == total
        return

    # either low water reached, or nothing more could be reclaimed
    if projected > low:
        for i in window - set(drop) - set(truncate):
            e = entries[i]
            assert not (e.kind == R and e.preview_tokens is not None and e.preview_tokens < e.tokens)
        for start, end in full_batches(kinds):
            if start >= 1 and set(range(start, end)) <= window:
                assert set(range(start, end)) <= set(drop)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_plan_is_oldest_first_and_minimal(case):
    entries = case["entries"]
    n = len(entries)
    fire, truncate, drop, projected = plan_reclaim(**case)
    if not fire:
        return
    _, low = levels(case)
    kinds = [e.kind for e in entries]
    hi = max(1, n - case["protected_tail"])
    droppable = []
    for start, end in full_batches(kinds):
        if end > hi:
            break
        if start >= 1:
            droppable.append((start, end))
    dropped = [b for b in droppable if b[0] in drop]
    # dropped batches are a prefix of the droppable ones, oldest first
    assert dropped == droppable[: len(dropped)]
    assert sorted(i for s, e in dropped for i in range(s, e)) == list(drop)
    # the last dropped batch was needed: without it the total was still above low
    if dropped:
        s, e = dropped[-1]
        # (an entry truncated then dropped is counted here at full size: an upper bound, still sound)
        assert projected + sum(effective(entries, i, set(truncate)) for i in range(s, e)) > low


def js_reference(entries, threshold, low, protected_tail, overhead):
    """Direct port of the seed's planLoopGuardReclaim (with exact levels passed in)."""
    total = overhead + sum(e.tokens for e in entries)
    if total <= threshold:
        return ReclaimPlan(False, (), (), total)
    lo, hi = 1, max(1, len(entries) - protected_tail)
    truncate, dropped = [], set()
    i = lo
    while i < hi and total > low:
        e = entries[i]
        if e.kind == R and e.preview_tokens is not None and e.tokens - e.preview_tokens > 0:
            truncate.append(i)
            total -= e.tokens - e.preview_tokens
        i += 1
    if total > low:
        batches, i = [], lo
        while i < hi:
            if entries[i].kind == O:
                i += 1
                continue
            start = i
            while i < len(entries) and entries[i].kind == C:
                i += 1
            while i < len(entries) and entries[i].kind == R:
                i += 1
            if i > hi:
                break
            batches.append((start, i))
        for start, end in batches:
            if total <= low:
                break
            for j in range(start, end):
                e = entries[j]
                total -= e.preview_tokens if j in truncate else e.tokens
                dropped.add(j)
    eff = tuple(j for j in truncate if j not in dropped)
    return ReclaimPlan(bool(eff or dropped), eff, tuple(sorted(dropped)), total)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_matches_seed_reference_when_entry_zero_starts_no_batch(case):
    entries = case["entries"]
    # The one deliberate difference: when entry 1 continues a batch begun by entry 0
    # (call→anything tool, or result→result), that batch contains the untouchable task.
    if len(entries) >= 2:
        a, b = entries[0].kind, entries[1].kind
        if (a == C and b != O) or (a == R and b == R):
            entries = [E(O, entries[0].tokens), *entries[1:]]
            case = {**case, "entries": entries}
    threshold, low = levels(case)
    expected = js_reference(entries, threshold, low, case["protected_tail"], case["fixed_overhead_tokens"])
    assert plan_reclaim(**case) == expected


@settings(max_examples=200, deadline=None)
@given(cases())
def test_dicts_and_dataclasses_agree(case):
    dicts = [{"kind": e.kind, "tokens": e.tokens, "preview_tokens": e.preview_tokens} for e in case["entries"]]
    assert plan_reclaim(**{**case, "entries": dicts}) == plan_reclaim(**case)
