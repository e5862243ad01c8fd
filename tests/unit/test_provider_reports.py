"""The provider's own numbers in the pure core: usage reports, rejections, calibrated decisions.

Each test plays the caller of the core (record ``outcome.events``, keep ``outcome.state``) and
checks the kept state against ``fold(events)``, as tests/unit/test_core_decisions.py does.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from tests.support.core_caller import CoreCaller
from tracker.core import (
    Basis,
    Calibration,
    CalibrationLedger,
    Measurement,
    ModelRef,
    Policy,
    SessionState,
    decide_commit,
    decide_measure,
    decide_rejection,
    decide_usage,
    fold,
)
from tracker.core import events as ev
from tracker.core.outcome import Decision, Outcome
from tracker.core.recorded import recorded_outcome
from tracker.core.reports import Report, learned_limit
from tracker.core.state import RECENT_BASES_KEPT
from tracker.errors import ContextLimitError, InvalidInput

FP = "cd" * 32
L = 100_000
HEURISTIC = "heuristic_estimate"
FACTOR = Calibration(factor=Fraction(7500, 10_000), samples=20, median=Fraction(72, 100), mad=Fraction(1, 100))


def meas(through: str, used: int, quality: str = HEURISTIC, limit: int = L, revision: int = 1) -> Measurement:
    return Measurement(Basis(revision, through), ModelRef("anthropic", "m1"), FP, used, limit, quality)


class Caller(CoreCaller):
    def take(self, out: Outcome) -> Outcome:
        self.record(out)
        assert fold(self.events, "s") == self.state
        if out.error is not None:
            raise out.error
        return out

    def measure(self, m: Measurement, **kw: object) -> Decision:
        self.n += 1
        out = self.take(decide_measure(self.state, Policy(), m, now=float(self.n), new_attempt_id=f"a{self.n}", **kw))
        assert out.decision is not None
        return out.decision

    def usage(self, **kw: object) -> Outcome:
        return self.take(decide_usage(self.state, now=1.0, **kw))

    def rejection(self, **kw: object) -> Outcome:
        return self.take(decide_rejection(self.state, now=1.0, **kw))


# -- calibrated decisions --------------------------------------------------------------------------


def test_an_estimate_is_decided_on_its_calibrated_count_and_the_event_records_both():
    c = Caller()
    d = c.measure(meas("m1", 100_000), calibration=FACTOR)
    assert (d.counted_tokens, d.input_tokens, d.input_limit) == (100_000, 75_000, L)
    assert d.action == "proceed" and d.occupancy_bp == 7_500  # raw, it would have been the hard limit
    assert d.calibration == FACTOR.to_data()
    measured = c.events[-1]
    assert isinstance(measured, ev.ContextMeasured)
    assert measured.measurement.input_tokens == 100_000 and measured.input_tokens == 75_000
    assert measured.calibration == FACTOR == Calibration.from_data(measured.to_data()["calibration"])
    assert c.state.last is not None and c.state.last.input_tokens == 75_000


def test_an_exact_count_is_never_corrected():
    d = Caller().measure(meas("m1", 90_000, quality="exact_local"), calibration=FACTOR)
    assert (d.input_tokens, d.calibration, d.action) == (90_000, None, "compact")


def test_the_calibrated_count_is_rounded_up():
    odd = Calibration(factor=Fraction(7501, 10_000), samples=20, median=Fraction(3, 4), mad=Fraction(0))
    assert Caller().measure(meas("m1", 3), calibration=odd).input_tokens == 3  # ceil(2.2503)


def test_a_learned_limit_lowers_the_limit_and_a_higher_one_is_ignored():
    c = Caller()
    assert c.measure(meas("m1", 70_000, quality="exact_local"), learned_limit=80_000).action == "compact"
    assert c.measure(meas("m2", 10_000, quality="exact_local"), learned_limit=500_000).input_limit == L


def test_an_old_measurement_event_folds_as_uncalibrated():
    old = {
        "v": 1,
        "measurement": meas("m1", 50_000).to_data(),
        "occupancy_bp": 5000,
        "pressure_before": "normal",
        "pressure": "normal",
        "threshold_bp": 8000,
        "threshold_source": "default",
        "compact_level": 80_000,
        "rearm_level": 60_000,
        "hard_level": 100_000,
        "growth_fired": False,
        "action": "proceed",
        "at": 1.0,
    }
    e = ev.event_from_data("ContextMeasured", old)
    assert isinstance(e, ev.ContextMeasured) and (e.decided_tokens, e.decided_limit) == (50_000, L)
    # upcast_v1_v2: decided on the raw count against the measured limit, uncalibrated, not rejected
    assert (e.input_tokens, e.input_limit, e.calibration, e.rejected) == (50_000, L, None, False)
    # upcast_v2_v3: no request shape known, not anchored
    assert (e.shape, e.anchor) == (None, None)
    assert e.to_data()["v"] == 3 and ev.ContextMeasured.from_data(e.to_data()) == e
    state = fold([e], "s")
    assert state.last is not None and state.last.input_tokens == 50_000
    assert state.measured_basis("r1:m1") is not None
    d = Decision.from_event(e)
    assert (d.input_tokens, d.counted_tokens, d.calibration) == (50_000, 50_000, None)


def test_an_old_projection_without_the_new_fields_loads():
    data = SessionState(session_id="s").to_data()
    del data["measured"], data["rejected"]
    assert SessionState.from_data(data) == SessionState(session_id="s")


# -- usage reports ---------------------------------------------------------------------------------


def test_a_usage_report_records_the_measurement_it_refers_to():
    c = Caller()
    c.measure(meas("m1", 40_000))
    out = c.usage(basis="m1", input_tokens=30_000, cache_read_tokens=1_000, output_tokens=500, model="anthropic/m1")
    (e,) = out.events
    assert isinstance(e, ev.UsageReported)
    assert (e.basis, e.model, e.quality, e.counted_tokens, e.billed_tokens) == (
        "r1:m1",
        "m1",
        HEURISTIC,
        40_000,
        31_000,
    )
    assert out.state.version == 3  # SessionStarted, ContextMeasured, UsageReported: state otherwise unchanged


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"basis": "never"}, "basis"),
        ({"basis": "r2:m1"}, "basis"),
        ({"basis": ""}, "basis"),
        ({"input_tokens": -1}, "input_tokens"),
        ({"input_tokens": 1.5}, "input_tokens"),
        ({"input_tokens": True}, "input_tokens"),
        ({"input_tokens": None}, "input_tokens"),
        ({"input_tokens": "10"}, "input_tokens"),
        ({"input_tokens": 4 * L + 1}, "input_tokens"),
        ({"input_tokens": 2**60}, "input_tokens"),
        ({"input_tokens": 3 * L, "cache_read_tokens": 2 * L}, "input_tokens"),
        ({"output_tokens": -5}, "output_tokens"),
        ({"cache_read_tokens": 0.5}, "cache_read_tokens"),
        ({"cache_write_tokens": -1}, "cache_write_tokens"),
        ({"model": "other-model"}, "model"),
        ({"model": "bad\x00model"}, "model"),
    ],
)
def test_bad_usage_names_the_field_and_records_nothing(kw, field):
    c = Caller()
    c.measure(meas("m1", 40_000))
    before = (c.state, len(c.events))
    args = {"basis": "m1", "input_tokens": 30_000, **kw}
    with pytest.raises(InvalidInput) as info:
        c.usage(**args)
    assert info.value.field == field
    assert (c.state, len(c.events)) == before


def test_usage_refers_to_the_last_few_bases_only():
    c = Caller()
    for i in range(RECENT_BASES_KEPT + 1):
        c.measure(meas(f"m{i}", 1_000 + i))
    assert [m.basis for m in c.state.measured] == [f"r1:m{i}" for i in range(1, RECENT_BASES_KEPT + 1)]
    with pytest.raises(InvalidInput, match="last 8 measured"):
        c.usage(basis="m0", input_tokens=900)
    c.measure(meas("m3", 5_000))  # measured again: its newest count, and it moves to the end
    assert c.state.measured[-1].basis == "r1:m3" and c.state.measured[-1].counted_tokens == 5_000
    assert len(c.state.measured) == RECENT_BASES_KEPT


def test_a_retried_usage_report_is_answered_from_its_events():
    c = Caller()
    c.measure(meas("m1", 40_000))
    before = c.state
    out = c.usage(basis="m1", input_tokens=30_000)
    again = recorded_outcome(before, list(out.events), op="usage")
    assert again.events == out.events and again.state == out.state
    with pytest.raises(InvalidInput, match="idempotency_key"):
        recorded_outcome(before, list(out.events), op="observe")
    report = Report("s", 3, out.events[0])  # type: ignore[arg-type]
    assert Report.from_data(report.to_data()) == report


# -- rejections ------------------------------------------------------------------------------------


def test_a_rejection_reads_the_message_and_the_basis_is_then_at_the_hard_limit():
    c = Caller()
    assert c.measure(meas("m1", 70_000, quality="exact_local")).action == "proceed"
    out = c.rejection(basis="m1", message="Error code: 400 - prompt is too long: 95123 tokens > 90000 maximum")
    (e,) = out.events
    assert isinstance(e, ev.ProviderRejected)
    assert (e.provider, e.form, e.input_tokens, e.input_limit) == (
        "anthropic",
        "anthropic.prompt_too_long",
        95_123,
        90_000,
    )
    assert e.learned_limit == 90_000 and e.counted_tokens == 70_000
    assert c.state.rejected == {"r1:m1"}
    d = c.measure(meas("m1", 70_000, quality="exact_local"))
    assert d.rejected and d.pressure == "hard_limit" and d.action == "compact" and d.trigger == "hard_limit"
    # the attempt fails: the basis is exhausted, and the same request is still not let through
    attempt = d.attempt
    assert attempt is not None
    from tracker.core import decide_reject

    c.take(
        decide_reject(
            c.state, attempt_id=attempt.attempt_id, fencing_token=attempt.fencing_token, reject_reason="failed", now=5.0
        )
    )
    with pytest.raises(ContextLimitError):
        c.measure(meas("m1", 70_000, quality="exact_local"))


def test_a_commit_clears_the_rejection_with_the_revision():
    c = Caller()
    c.measure(meas("m1", 70_000, quality="exact_local"))
    c.rejection(basis="m1", input_tokens=95_000, input_limit=90_000)
    d = c.measure(meas("m1", 70_000, quality="exact_local"))
    assert d.attempt is not None
    c.take(
        decide_commit(
            c.state,
            attempt_id=d.attempt.attempt_id,
            fencing_token=d.attempt.fencing_token,
            tokens_after=20_000,
            now=9.0,
        )
    )
    assert c.state.rejected == frozenset() and c.state.revision == 2
    assert c.measure(meas("m1", 20_000, quality="exact_local", revision=2)).action == "proceed"


def test_an_unrecognised_message_is_still_recorded_without_numbers():
    c = Caller()
    c.measure(meas("m1", 70_000))
    (e,) = c.rejection(basis="m1", message="upstream said no\x1b[31m").events
    assert isinstance(e, ev.ProviderRejected)
    assert (e.form, e.input_tokens, e.input_limit, e.learned_limit) == (None, None, None, None)
    assert e.message == "upstream said no [31m"  # control characters never reach a terminal


def test_given_numbers_win_over_the_message_and_absurd_ones_are_refused():
    c = Caller()
    c.measure(meas("m1", 70_000))
    (e,) = c.rejection(
        basis="m1", message="prompt is too long: 95000 tokens > 90000 maximum", input_limit=85_000
    ).events
    assert isinstance(e, ev.ProviderRejected) and (e.input_tokens, e.input_limit) == (95_000, 85_000)
    for kw, field in (
        ({"input_limit": 0}, "input_limit"),
        ({"input_tokens": 10 * L}, "input_tokens"),
        ({"message": 42}, "message"),
    ):
        with pytest.raises(InvalidInput) as info:
            c.rejection(basis="m1", **kw)
        assert info.value.field == field


def test_learned_limits_are_floored_and_only_lower():
    assert learned_limit(100_000, 95_000, 90_000) == 90_000
    assert learned_limit(100_000, 120_000, None) is None  # a count above our limit teaches nothing new
    assert learned_limit(100_000, 60_000, None) == 59_999  # refused below our limit: the limit is lower
    assert learned_limit(100_000, None, 150_000) is None
    assert learned_limit(100_000, None, 1) == 25_000  # one report cannot refuse everything


# -- the ledger --------------------------------------------------------------------------------------


def _usage(counted: int, billed: int, quality: str = HEURISTIC, model: str = "m1") -> ev.UsageReported:
    return ev.UsageReported(basis="r1:x", model=model, quality=quality, counted_tokens=counted, input_tokens=billed)


def test_the_ledger_keeps_fleets_models_and_counter_kinds_apart():
    ledger = CalibrationLedger()
    for i in range(25):
        ledger.fold("fA", _usage(10_000 + i, 7_000 + i))
        ledger.fold("fB", _usage(10_000 + i, 39_000))  # hostile but plausible: 3.9x
        ledger.fold("fA", _usage(10_000, 10_500, quality="exact_local"))
    a = ledger.calibration("fA", "m1", HEURISTIC)
    b = ledger.calibration("fB", "m1", HEURISTIC)
    assert a is not None and Fraction(7, 10) < a.factor < Fraction(3, 4)
    assert b is not None and b.factor == Fraction(5, 4) and b.bounded  # bounded, and only fleet B's
    assert ledger.calibration("fA", "m1", "exact_local") is None  # exact counts are never corrected
    assert ledger.calibration("fA", "other", HEURISTIC) is None
    rows = {(r.fleet, r.kind): r for r in ledger.summaries()}
    assert rows[("fA", "exact")].drift == Fraction(21, 20) and rows[("fA", "exact")].drifted
    assert rows[("fA", "estimate")].usage_reports == 25 and rows[("fA", "estimate")].samples == 25
    assert [r.fleet for r in ledger.summaries("fB")] == ["fB"]


def test_absurd_reports_are_ignored_and_rejections_teach_limits():
    ledger = CalibrationLedger()
    ledger.fold("", _usage(10_000, 1))  # 1/10000 of the count: not a report about this request
    ledger.fold("", _usage(500, 400))  # a tiny request: overhead dominates
    rej = ev.ProviderRejected(
        basis="r1:x",
        model="m1",
        quality=HEURISTIC,
        counted_tokens=100_000,
        measured_limit=L,
        input_tokens=95_000,
        input_limit=90_000,
        learned_limit=90_000,
    )
    ledger.fold("", rej)
    ledger.fold("", ev.ProviderRejected(**{**rej.__dict__, "learned_limit": 92_000}))
    (row,) = ledger.summaries()
    assert (row.usage_reports, row.rejections, row.ignored, row.samples) == (2, 2, 2, 2)
    assert ledger.learned_limit("", "m1") == 90_000 and row.learned_limit == 90_000
