"""Thresholds, levels, growth trigger and history budget (behaviour.md "Thresholds"). Pure integer arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

from tracker.core.model import (
    FULL_SCALE_BP,
    HISTORY_SAFETY_FACTOR_PCT,
    MIN_SCOPE_CONFIDENCE,
    WINDOW_CEILING,
    ceil_div,
    exact,
    finite_number,
    is_int,
)
from tracker.errors import InvalidInput

SCOPE_THRESHOLDS_BP: dict[str, int] = {
    "current-message": 4500,
    "recent-turns": 6000,
    "full-conversation": 7500,
    "everything": 8000,
}


def _number(field: str, value: Any) -> float | int:
    if is_int(value) and abs(value) > 10**6:  # no meaningful ratio is this large (and math.isfinite overflows)
        raise InvalidInput(field, f"must be a finite number in range, got an integer of {len(str(value))} digits")
    if not finite_number(value):
        raise InvalidInput(field, f"must be a finite number, got {value!r}")
    return value


def scope_to_threshold_bp(scope: str, base_bp: int) -> int:
    """Layer 1 of the one-directional invariant: the mapping itself never exceeds the base."""
    return min(base_bp, SCOPE_THRESHOLDS_BP[scope])


@dataclass(frozen=True)
class Threshold:
    bp: int  # effective C
    rearm_bp: int  # R
    source: str  # explicit | classifier | default


def resolve_threshold(
    base_bp: int,
    rearm_below_bp: int,
    compaction_threshold: Any = None,
    scope: Any = None,
    scope_confidence: Any = None,
) -> Threshold:
    """behaviour.md "Thresholds".2: a per-request threshold may only lower ``base_bp``."""
    # validate everything first, so a bad field is an error whichever source would win
    explicit_bp: int | None = None
    if compaction_threshold is not None:
        t = _number("compaction_threshold", compaction_threshold)
        if not 0 < t <= 1:
            raise InvalidInput("compaction_threshold", f"must be in (0, 1], got {compaction_threshold!r}")
        explicit_bp = math.floor(exact(t) * FULL_SCALE_BP)
        if explicit_bp < 1:
            raise InvalidInput(
                "compaction_threshold", f"is below one basis point (0.0001), got {compaction_threshold!r}"
            )
    classifier_bp: int | None = None
    if scope is not None:
        if not isinstance(scope, str) or scope not in SCOPE_THRESHOLDS_BP:
            raise InvalidInput("scope", f"must be one of {', '.join(SCOPE_THRESHOLDS_BP)}, got {scope!r}")
        if scope_confidence is None:
            raise InvalidInput("scope_confidence", "is required with scope (a number in [0, 1])")
        conf = _number("scope_confidence", scope_confidence)
        if not 0 <= conf <= 1:
            raise InvalidInput("scope_confidence", f"must be in [0, 1], got {scope_confidence!r}")
        if conf >= MIN_SCOPE_CONFIDENCE:
            candidate = scope_to_threshold_bp(scope, base_bp)
            if candidate < base_bp:  # layer 2: a reading is kept only if it really lowers the base
                classifier_bp = candidate
    elif scope_confidence is not None:
        _number("scope_confidence", scope_confidence)

    if explicit_bp is not None:
        c, source = min(base_bp, explicit_bp), "explicit"
    elif classifier_bp is not None:
        c, source = classifier_bp, "classifier"
    else:
        c, source = base_bp, "default"
    if c > base_bp:  # unreachable by construction; the invariant is checked where it is applied
        raise AssertionError("a per-request threshold raised the base")
    return Threshold(bp=c, rearm_bp=rearm_below_bp * c // base_bp, source=source)


@lru_cache(maxsize=64)  # a memo of a pure function (the policy's own threshold): one per policy seen
def default_threshold(base_bp: int, rearm_below_bp: int) -> Threshold:
    """``resolve_threshold(base_bp, rearm_below_bp)`` with no per-request input (the common case)."""
    return resolve_threshold(base_bp, rearm_below_bp)


@dataclass(frozen=True)
class Levels:
    compact: int
    rearm: int
    hard: int


def levels(threshold: Threshold, input_limit: int) -> Levels:
    """behaviour.md "Thresholds".3: token levels, with the 300k ceiling on the compact and rearm levels only."""
    return levels_at(threshold.bp, threshold.rearm_bp, input_limit)


@lru_cache(maxsize=1024)  # a memo of a pure function: few (threshold, limit) pairs recur on the hot path
def levels_at(c: int, r: int, input_limit: int) -> Levels:
    """:func:`levels` of the threshold ``c`` / rearm ``r`` (basis points) on ``input_limit``."""
    L = input_limit
    compact = min(WINDOW_CEILING, ceil_div(c * L, FULL_SCALE_BP))
    rearm = min(ceil_div(r * L, FULL_SCALE_BP), ceil_div(WINDOW_CEILING * r, c))
    return Levels(compact=compact, rearm=rearm, hard=L)


def usage_fraction(used: int, input_limit: int) -> Fraction:
    """Unclamped: on a 1M window, 600k used is 2."""
    return Fraction(used, min(input_limit, WINDOW_CEILING))


def growth_fired(turn_delta: float | None, used: int, input_limit: int, prev: tuple[int, int] | None) -> bool:
    """behaviour.md "Thresholds".4. ``prev`` is (used, input_limit) of the previous measurement at the same revision."""
    if turn_delta is None or prev is None:
        return False
    # f - f_prev >= d, in integers: used/D - pu/pD >= p/q  <=>  q*(used*pD - pu*D) >= p*D*pD
    d = exact(turn_delta)
    D, pD = min(input_limit, WINDOW_CEILING), min(prev[1], WINDOW_CEILING)
    return d.denominator * (used * pD - prev[0] * D) >= d.numerator * D * pD


def history_budget(available: int, overhead: int, threshold_bp: int, base_bp: int) -> int:
    """behaviour.md "Thresholds".5: max(0, floor((available - overhead) * 0.95 * clamp(C / base, 0, 1)))."""
    scale = min(max(Fraction(threshold_bp, base_bp), Fraction(0)), Fraction(1))
    return max(0, math.floor((available - overhead) * Fraction(HISTORY_SAFETY_FACTOR_PCT, 100) * scale))


def check_overhead(value: Any) -> int:
    """The per-request ``overhead_tokens`` input the history budget subtracts: 0 when not given."""
    if value is None:
        return 0
    if not is_int(value) or value < 0:
        raise InvalidInput("overhead_tokens", f"must be an integer >= 0, got {value!r}")
    return value
