"""Provider calibration: a robust, bounded, conservative correction of estimated counts.

Every provider response carries the input tokens it billed. For a model whose counter is
not exact (quality ``heuristic_estimate``) the pairs *(counted, billed)* of one model in one
fleet give a correction factor; the core then decides on ``apply(counted, calibration)``
instead of the raw estimate. Pure: no I/O, clock, randomness or globals, and exact
arithmetic throughout, so a replay of the same samples gives the same factor.

Samples
    :class:`CalibrationSample` ``(counted, billed)``: ``counted`` is what the tracker's
    counter said for the request (> 0), ``billed`` what the provider billed for the same
    request: input + cache-read + cache-write tokens (``CalibrationSample.from_usage``).
    Construction refuses what is not a count (a bool, a float, a negative number, a
    number past ``JSON_SAFE_INT``) with :class:`~tracker.errors.InvalidInput` naming the
    field. An *absurd* pair is a faithful record and is accepted, but the estimator
    **ignores** it (``sample.usable`` is false), so it can neither move the factor nor
    push honest samples out of the window:

    * ``billed / counted`` outside ``[PLAUSIBLE_MIN, PLAUSIBLE_MAX]`` = ``[1/4, 4]``: no
      counter the project ships is off by 4x on a whole request; such a pair is a report
      about another request, a provider fault or a hostile report;
    * ``counted < MIN_COUNTED`` (1024): the constant overhead a provider adds (a tool-use
      preamble, message framing) dominates a tiny request and says nothing about the
      ratio near the limit, where decisions matter.

The estimate (:func:`estimate`)
    Over the last ``window`` (64) usable samples, once there are ``min_samples`` (20): a
    provider bills a request about ``slope x counted + intercept``, where the intercept is
    what it adds to every request whatever its size (a tool-use preamble, framing) beyond
    what the counter counts for it. A proportional factor alone would fit large requests
    and under-count small ones by the share of that constant (on the simulated providers,
    the first turns of a session at 0.86-0.93 x billed). So:

    * **the fit**: Siegel's repeated median, exact: for each sample the median slope
      ``(billed_j - billed_i) / (counted_j - counted_i)`` to the samples of another size,
      the slope ``a`` = the median of those, the intercept ``b`` = the median of
      ``billed - a x counted``. When no two samples differ in size, or ``a`` or ``b`` is
      not positive, the proportional fit instead: ``a`` = the median ratio, ``b = 0`` (a
      counter that over-counts the constant part then over-counts small requests: the
      conservative side);
    * **the margin**: the residual ratios ``q = billed / (a x counted + b)``, their median
      ``q_m`` and median absolute deviation ``MAD_q``, and ``k = q_m + max(MAD_MULTIPLIER x
      MAD_q, MIN_MARGIN x q_m)``;
    * **the result**: ``factor = clamp(ceil_grid(k x a), FACTOR_MIN, FACTOR_MAX)`` and
      ``intercept = min(ceil(k x b), INTERCEPT_MAX)``; ``apply(counted)`` =
      ``ceil(counted x factor) + intercept`` (0 for an empty request).

    ``MAD_MULTIPLIER = 3`` (about two standard deviations of a normal spread) and a margin
    of at least ``MIN_MARGIN`` = 3 %: the decided count sits above most of the samples'
    billed counts, so it over-counts a few percent rather than under-count. The floor is
    there because the ratio of a request depends on its mix of content (prose, code, tool
    output, other scripts) and 20 reports understate the tails of that mix. ``ceil_grid``
    rounds *up* to a multiple of 1/10000 (one basis point; the factor is stored and shown
    as ``factor_bp``); the bounds are ``[FACTOR_MIN, FACTOR_MAX] = [1/2, 5/4]`` and
    ``[0, INTERCEPT_MAX] = [0, 2048]`` tokens. The median of an even count is the mean of
    the two middle values (exact). ``Calibration.median`` / ``mad`` are the plain ratios'
    median and MAD (what ``tracker calibration`` shows), whatever the fit.

    Robust: the repeated median, the median and the MAD each need half of the window to be
    moved arbitrarily, so a
    minority of hostile but plausible reports shifts the factor only within about the
    honest ratios' range; however many there are, the factor stays within the bounds,
    and absurd reports are ignored outright. What no single factor can do: a model whose
    requests differ in ratio by more than the 0.99-1.10 band (sessions entirely in a
    script the counter over-counts differently, beside English code sessions) gets a
    factor that over-counts the lower-ratio requests by more than 10 %, since the margin
    leans to over-counting. That is why the ledger (:mod:`tracker.core.ledger`) keeps an estimate
    per kind of content as well, and why a session that reports its usage is anchored on its
    own billed count (:mod:`tracker.core.anchor`).

A billing shift (a new snapshot of the model, its tokenizer changed under it)
    The window of 64 and its medians would take more than 32 reports to follow a change of the
    provider's billing. So the estimate first looks for one: the *reference* is the estimate of
    the window's oldest ``min_samples`` samples; when the newest of at least ``SHIFT_RUN`` (10) samples, from
    at least ``SHIFT_SOURCES`` (2) sessions, lie beyond it on one side (4 in 5 of them) -- each billed above
    the count the reference decides (it under-counts them), or each decided more than
    ``SHIFT_OVER`` (12 %) over billed -- the provider's billing changed: the estimate uses only
    the samples since the shift (the longest run of the newest samples, starting with one beyond
    the reference, of which at least ``SHIFT_SHARE`` (4/5) are beyond it on that side), and none (the raw counts, which over-count) until there are ``min_samples`` of
    them. One session's run of reports is never a shift (its content is not the fleet's), and
    samples without a session (``source``) never make one. So a shift is followed within
    ``min_samples`` + a few reports; an anchored session follows it at once (``tracker.core.anchor``).

Drift of exact counters (:func:`drift`)
    For an exact counter the billed count should equal the count: ``drift`` is the median
    of ``billed / counted`` over the recent usable samples, and :func:`drifted` says
    whether it is more than ``DRIFT_THRESHOLD`` (2 %) away from 1 (a wrong encoding, a
    provider-side tokenizer change).

Incremental form (:class:`CalibrationState`)
    ``state.fold(sample)`` keeps the last ``window`` usable samples (an O(window) = O(1)
    step per event, whatever the history length); ``state.calibration`` equals
    ``estimate(all samples folded, same parameters)`` (a hypothesis property in
    tests/unit/test_calibration.py proves it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property
from typing import Any

from tracker.core.model import JSON_SAFE_INT, QUALITY_HEURISTIC, ceil_div, is_int
from tracker.errors import InvalidInput, an_object

__all__ = [
    "CALIBRATED_QUALITIES",
    "DRIFT_MIN_SAMPLES",
    "DRIFT_THRESHOLD",
    "FACTOR_GRID",
    "FACTOR_MAX",
    "FACTOR_MIN",
    "INTERCEPT_MAX",
    "MAD_MULTIPLIER",
    "MIN_MARGIN",
    "MIN_COUNTED",
    "MIN_SAMPLES",
    "PLAUSIBLE_MAX",
    "PLAUSIBLE_MIN",
    "SHIFT_OVER",
    "SHIFT_RUN",
    "SHIFT_SOURCES",
    "WINDOW",
    "Calibration",
    "CalibrationSample",
    "CalibrationState",
    "apply",
    "calibrates",
    "drift",
    "drifted",
    "estimate",
]

#: qualities whose counts are corrected; exact counts are only watched for drift
CALIBRATED_QUALITIES: frozenset[str] = frozenset({QUALITY_HEURISTIC})
#: usable samples needed before a calibration is used
MIN_SAMPLES = 20
#: how many of the most recent usable samples the estimate looks at
WINDOW = 64
#: a ratio billed/counted outside [PLAUSIBLE_MIN, PLAUSIBLE_MAX] is ignored
PLAUSIBLE_MIN = Fraction(1, 4)
PLAUSIBLE_MAX = Fraction(4)
#: a sample of fewer counted tokens is ignored (constant provider overhead dominates it)
MIN_COUNTED = 1024
#: the factor never leaves [FACTOR_MIN, FACTOR_MAX]
FACTOR_MIN = Fraction(1, 2)
FACTOR_MAX = Fraction(5, 4)
#: the factor is rounded up to a multiple of 1 / FACTOR_GRID (one basis point)
FACTOR_GRID = 10_000
#: the fitted constant per request (the intercept, in tokens) never leaves [0, INTERCEPT_MAX]
INTERCEPT_MAX = 2 * MIN_COUNTED
#: factor = median + max(MAD_MULTIPLIER x MAD, MIN_MARGIN x median) (before rounding and bounds)
MAD_MULTIPLIER = 3
MIN_MARGIN = Fraction(3, 100)
#: a billing shift: the newest SHIFT_RUN samples, from at least SHIFT_SOURCES sessions, all beyond the
#: reference on one side (under-counted, or over-counted by more than SHIFT_OVER)
SHIFT_RUN = 10
SHIFT_SOURCES = 2
SHIFT_OVER = 4 * MIN_MARGIN
#: the share of the samples since a shift that must be beyond the reference
SHIFT_SHARE = Fraction(4, 5)
#: an exact counter whose median billed/counted is further than this from 1 has drifted
DRIFT_THRESHOLD = Fraction(2, 100)
#: usable samples needed before drift is judged
DRIFT_MIN_SAMPLES = 5


def _count(field_name: str, value: Any, *, positive: bool) -> int:
    if not is_int(value):
        shown = "missing" if value is None else type(value).__name__
        raise InvalidInput(field_name, f"must be an integer token count, got {shown}")
    low = 1 if positive else 0
    if not low <= value <= JSON_SAFE_INT:
        raise InvalidInput(field_name, f"must be an integer in [{low}, {JSON_SAFE_INT}], got {value}")
    return value


@dataclass(frozen=True)
class CalibrationSample:
    """One provider report: what was counted for a request and what the provider billed for it."""

    counted: int
    billed: int
    #: the session that reported it ("" when unknown): a billing shift is seen by several sessions
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _count("counted", self.counted, positive=True)
        _count("billed", self.billed, positive=False)

    @classmethod
    def from_usage(
        cls, counted: int, input_tokens: int, cache_read_tokens: int = 0, cache_write_tokens: int = 0
    ) -> CalibrationSample:
        """``billed`` = input + cache read + cache write tokens (each a count, named on error)."""
        total = (
            _count("usage.input_tokens", input_tokens, positive=False)
            + _count("usage.cache_read_tokens", cache_read_tokens, positive=False)
            + _count("usage.cache_write_tokens", cache_write_tokens, positive=False)
        )
        if total > JSON_SAFE_INT:
            raise InvalidInput("usage", f"input + cache tokens add up past {JSON_SAFE_INT}: {total}")
        return cls(counted, total)

    @property
    def ratio(self) -> Fraction:
        """``billed / counted``, exact."""
        return Fraction(self.billed, self.counted)

    @property
    def usable(self) -> bool:
        """Whether the estimator uses this sample (see the module docstring: absurd pairs are ignored)."""
        if self.counted < MIN_COUNTED:
            return False
        # ratio within [1/4, 4], in integers: counted <= 4 billed and billed <= 4 counted
        lo, hi = PLAUSIBLE_MIN, PLAUSIBLE_MAX
        return (
            self.counted * lo.numerator <= self.billed * lo.denominator
            and self.billed * hi.denominator <= self.counted * hi.numerator
        )

    def to_data(self) -> dict[str, int]:
        return {"counted": self.counted, "billed": self.billed}


@dataclass(frozen=True)
class Calibration:
    """A correction factor and what it rests on. ``factor`` is a multiple of 1/10000 within the bounds."""

    factor: Fraction
    samples: int  # usable samples it was estimated from (<= window)
    median: Fraction  # median billed/counted of those samples
    mad: Fraction  # their median absolute deviation
    bounded: bool = False  # true when the bounds cut the estimate
    intercept: int = 0  # tokens the provider adds to every request beyond factor x counted (>= 0)

    def __post_init__(self) -> None:
        if not isinstance(self.factor, Fraction) or not FACTOR_MIN <= self.factor <= FACTOR_MAX:
            raise InvalidInput("factor", f"must be a fraction in [{FACTOR_MIN}, {FACTOR_MAX}], got {self.factor!r}")
        if (self.factor * FACTOR_GRID).denominator != 1:
            raise InvalidInput("factor", f"must be a multiple of 1/{FACTOR_GRID}, got {self.factor}")
        if not is_int(self.samples) or self.samples <= 0:
            raise InvalidInput("samples", f"must be a positive integer, got {self.samples!r}")
        if not is_int(self.intercept) or not 0 <= self.intercept <= INTERCEPT_MAX:
            raise InvalidInput("intercept", f"must be an integer in [0, {INTERCEPT_MAX}], got {self.intercept!r}")

    @property
    def factor_bp(self) -> int:
        """The factor in basis points (7231 means 0.7231)."""
        return int(self.factor * FACTOR_GRID)

    def to_data(self) -> dict[str, Any]:
        """JSON-safe: the factor in basis points, the median and MAD as exact ``"p/q"`` strings."""
        return {
            "factor_bp": self.factor_bp,
            "samples": self.samples,
            "median": str(self.median),
            "mad": str(self.mad),
            "bounded": self.bounded,
            "intercept": self.intercept,
        }

    @classmethod
    def from_data(cls, data: Any) -> Calibration:
        """The inverse of ``to_data`` (a recorded decision's calibration, for replay and what-if)."""
        an_object("calibration", data)
        bp = data.get("factor_bp")
        if not isinstance(bp, int) or isinstance(bp, bool):
            raise InvalidInput("calibration.factor_bp", f"must be an integer, got {bp!r}")
        try:
            median = Fraction(str(data.get("median", Fraction(bp, FACTOR_GRID))))
            mad = Fraction(str(data.get("mad", 0)))
        except (ValueError, ZeroDivisionError) as exc:
            raise InvalidInput("calibration.median", f"must be a fraction 'p/q': {exc}") from None
        return cls(
            factor=Fraction(bp, FACTOR_GRID),
            samples=data.get("samples"),
            median=median,
            mad=mad,
            bounded=bool(data.get("bounded", False)),
            intercept=data.get("intercept", 0),  # absent in decisions recorded before the affine fit
        )


def calibrates(quality: str) -> bool:
    """Whether counts of this quality are corrected (only estimates are; exact counts are watched for drift)."""
    return quality in CALIBRATED_QUALITIES


def _median(sorted_values: Sequence[Fraction]) -> Fraction:
    n = len(sorted_values)
    mid = n // 2
    if n % 2:
        return sorted_values[mid]
    return (sorted_values[mid - 1] + sorted_values[mid]) / 2


def _recent_usable(samples: Iterable[CalibrationSample], window: int) -> list[CalibrationSample]:
    usable = [s for s in samples if s.usable]
    return usable[-window:]


def _check_params(min_samples: Any, window: Any) -> None:
    if not is_int(min_samples) or min_samples < 1:
        raise InvalidInput("min_samples", f"must be an integer >= 1, got {min_samples!r}")
    if not is_int(window) or window < min_samples:
        raise InvalidInput("window", f"must be an integer >= min_samples ({min_samples}), got {window!r}")


def _median_of(values: Iterable[Any], exact: Any = Fraction) -> Fraction:
    """The exact median of unsorted numbers, sorted by their float values (cheap comparisons).

    ``values``: fractions, or ``(p, q)`` pairs with ``q > 0`` read as ``p / q`` (``exact`` builds
    the fraction of one, only for the middle ones). Rounding keeps order (``x < y`` gives
    ``float(x) <= float(y)``; Python's ``int / int`` is correctly rounded), so only a run of equal
    floats can be out of exact order, and the run around a middle position is sorted exactly:
    the result is the same as sorting the fractions themselves."""
    pairs = exact is not Fraction
    keyed = sorted(values, key=(lambda pq: pq[0] / pq[1]) if pairs else float)
    floats = [p / q for p, q in keyed] if pairs else [float(v) for v in keyed]

    def at(i: int) -> Fraction:
        lo = hi = i
        while lo > 0 and floats[lo - 1] == floats[i]:
            lo -= 1
        while hi < len(floats) and floats[hi] == floats[i]:
            hi += 1
        if hi - lo == 1:
            return exact(keyed[i])
        return sorted(exact(v) for v in keyed[lo:hi])[i - lo]

    mid = len(keyed) // 2
    return at(mid) if len(keyed) % 2 else (at(mid - 1) + at(mid)) / 2


def _quotient(pq: tuple[int, int]) -> Fraction:
    return Fraction(*pq)


def _ratio_fit(recent: Sequence[CalibrationSample]) -> tuple[Fraction, Fraction]:
    """The proportional fit: slope = the median ratio, no intercept."""
    return _median_of(s.ratio for s in recent), Fraction(0)


def _affine_fit(recent: Sequence[CalibrationSample]) -> tuple[Fraction, Fraction]:
    """``billed ~ slope x counted + intercept`` by Siegel's repeated median (50 % breakdown point).

    The slope: for each sample, the median slope to every sample of another size; then the
    median of those. The intercept: the median of ``billed - slope x counted``. Falls back to the
    proportional fit when no two samples differ in size, or when the slope or the intercept is
    not positive (a counter over-counting the constant part: then the proportional fit over-counts
    small requests, which is the conservative side)."""
    per_sample = []
    for s in recent:
        # (billed_t - billed_s) / (counted_t - counted_s), the denominator made positive
        slopes = [
            (t.billed - s.billed, t.counted - s.counted)
            if t.counted > s.counted
            else (s.billed - t.billed, s.counted - t.counted)
            for t in recent
            if t.counted != s.counted
        ]
        if slopes:
            per_sample.append(_median_of(slopes, _quotient))
    if not per_sample:
        return _ratio_fit(recent)
    slope = _median_of(per_sample)
    if slope <= 0:
        return _ratio_fit(recent)
    intercept = _median_of(s.billed - slope * s.counted for s in recent)
    if intercept <= 0:
        return _ratio_fit(recent)
    return slope, intercept


def _beyond(s: CalibrationSample, reference: Calibration) -> int:
    """+1: the reference under-counts the sample; -1: it over-counts it by more than SHIFT_OVER; else 0."""
    decided = apply(s.counted, reference)
    if s.billed > decided:
        return 1
    over = 1 + SHIFT_OVER
    if decided * over.denominator > s.billed * over.numerator:
        return -1
    return 0


def since_shift(recent: Sequence[CalibrationSample], min_samples: int) -> Sequence[CalibrationSample]:
    """The samples since a billing shift (the module docstring), or ``recent`` when there was none."""
    if len(recent) < min_samples + SHIFT_RUN:
        return recent
    if len({s.source for s in recent[-SHIFT_RUN:] if s.source}) < SHIFT_SOURCES:
        return recent
    reference = _fit(recent[:min_samples], min_samples)
    if reference is None:
        return recent
    side = _beyond(recent[-1], reference)
    if side == 0:
        return recent
    # the longest run of the newest samples at least SHIFT_SHARE of which are beyond on that side
    # (a sample near the old fit now and then does not hide a shift), starting with one beyond
    start, beyond = None, 0
    for i in range(len(recent) - 1, min_samples - 1, -1):
        hit = _beyond(recent[i], reference) == side
        beyond += hit
        if hit and beyond * SHIFT_SHARE.denominator >= (len(recent) - i) * SHIFT_SHARE.numerator:
            start = i
    if start is None or len(recent) - start < SHIFT_RUN:
        return recent
    return recent[start:]


def _estimate_recent(recent: Sequence[CalibrationSample], min_samples: int) -> Calibration | None:
    return _fit(since_shift(recent, min_samples), min_samples)


def _fit(recent: Sequence[CalibrationSample], min_samples: int) -> Calibration | None:
    if len(recent) < min_samples:
        return None
    ratios = [s.ratio for s in recent]
    med = _median_of(ratios)
    mad = _median_of(abs(r - med) for r in ratios)
    slope, intercept = _affine_fit(recent)
    # the residual ratios billed / fitted, and a margin over them as over the ratios before
    residuals = [s.billed / (slope * s.counted + intercept) for s in recent]
    q = _median_of(residuals)
    q_mad = _median_of(abs(r - q) for r in residuals)
    k = q + max(MAD_MULTIPLIER * q_mad, MIN_MARGIN * q)
    raw = k * slope
    gridded = Fraction(ceil_div(raw.numerator * FACTOR_GRID, raw.denominator), FACTOR_GRID)
    factor = min(FACTOR_MAX, max(FACTOR_MIN, gridded))
    b = k * intercept
    raw_intercept = ceil_div(b.numerator, b.denominator)
    fixed = min(INTERCEPT_MAX, raw_intercept)
    return Calibration(
        factor=factor,
        samples=len(recent),
        median=med,
        mad=mad,
        bounded=factor != gridded or fixed != raw_intercept,
        intercept=fixed,
    )


def estimate(
    samples: Iterable[CalibrationSample], *, min_samples: int = MIN_SAMPLES, window: int = WINDOW
) -> Calibration | None:
    """The calibration of the last ``window`` usable samples, or None with fewer than ``min_samples`` of them."""
    _check_params(min_samples, window)
    return _estimate_recent(_recent_usable(samples, window), min_samples)


def apply(counted: int, calibration: Calibration | None) -> int:
    """The count the core decides on: ``ceil(counted x factor) + intercept`` (0 for an empty request,
    capped at ``JSON_SAFE_INT``); ``counted`` itself without a calibration."""
    _count("input_tokens", counted, positive=False)
    if calibration is None or counted == 0:
        return counted
    f = calibration.factor
    return min(JSON_SAFE_INT, ceil_div(counted * f.numerator, f.denominator) + calibration.intercept)


def drift(
    samples: Iterable[CalibrationSample], *, min_samples: int = DRIFT_MIN_SAMPLES, window: int = WINDOW
) -> Fraction | None:
    """Median ``billed / counted`` of the last ``window`` usable samples (None with fewer than ``min_samples``)."""
    _check_params(min_samples, window)
    recent = _recent_usable(samples, window)
    if len(recent) < min_samples:
        return None
    return _median(sorted(s.ratio for s in recent))


def quantile(samples: Sequence[CalibrationSample], q: Fraction) -> Fraction | None:
    """The ``q`` quantile (nearest rank, rounded up) of the samples' ``billed / counted`` (None without samples)."""
    if not samples:
        return None
    ratios = sorted(s.ratio for s in samples)
    rank = ceil_div(q.numerator * len(ratios), q.denominator)
    return ratios[min(len(ratios), max(1, rank)) - 1]


def drifted(ratio: Fraction | None) -> bool:
    """Whether an exact counter's drift ratio is more than ``DRIFT_THRESHOLD`` (2 %) away from 1."""
    return ratio is not None and abs(ratio - 1) > DRIFT_THRESHOLD


@dataclass(frozen=True)
class CalibrationState:
    """The incremental form, one per (fleet, model): fold samples in event order, read ``calibration``.

    ``CalibrationState().fold(s1).fold(s2)...calibration == estimate([s1, s2, ...])`` for the
    same ``min_samples`` / ``window``. Each fold keeps at most ``window`` samples.
    """

    min_samples: int = MIN_SAMPLES
    window: int = WINDOW
    recent: tuple[CalibrationSample, ...] = ()
    seen: int = 0  # samples folded in, usable or not
    ignored: int = 0  # of them, the ones the estimator ignores

    def __post_init__(self) -> None:
        _check_params(self.min_samples, self.window)
        if len(self.recent) > self.window or not all(s.usable for s in self.recent):
            raise InvalidInput("recent", f"must hold at most {self.window} usable samples")

    @cached_property
    def since_shift(self) -> Sequence[CalibrationSample]:
        """The samples the estimate uses: ``recent``, or those since a billing shift in it."""
        return since_shift(self.recent, self.min_samples)

    @property
    def shifted(self) -> bool:
        """Whether the window holds a billing shift (the estimate uses only the samples since)."""
        return len(self.since_shift) < len(self.recent)

    @cached_property
    def calibration(self) -> Calibration | None:
        """The estimate of ``recent`` (computed once, when first asked: a catch-up folding many
        reports pays for one estimate, not one per report)."""
        return _fit(self.since_shift, self.min_samples)

    def fold(self, sample: CalibrationSample) -> CalibrationState:
        if not isinstance(sample, CalibrationSample):
            raise InvalidInput("sample", f"must be a CalibrationSample, got {type(sample).__name__}")
        if not sample.usable:
            return CalibrationState(self.min_samples, self.window, self.recent, self.seen + 1, self.ignored + 1)
        recent = (*self.recent, sample)[-self.window :]
        return CalibrationState(self.min_samples, self.window, recent, self.seen + 1, self.ignored)
