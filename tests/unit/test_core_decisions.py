"""behaviour.md "Pressure" (pressure), §6 (decisions) and §3 (policy validation) against the pure decision core.

Every decision is a pure function ``(state, input, now, new_attempt_id) -> Outcome``; the
``Session`` helper below plays the caller: it records ``outcome.events``, keeps
``outcome.state`` and checks after every step that the kept state equals ``fold(events)``.
"""

from __future__ import annotations

import math

import pytest

from tracker.core import (
    Basis,
    Measurement,
    ModelRef,
    Policy,
    SessionState,
    decide_commit,
    decide_count_failed,
    decide_manual,
    decide_measure,
    decide_reject,
    fold,
)
from tracker.core.decide import Outcome
from tracker.errors import (
    AttemptNotOpen,
    ContextLimitError,
    CountTimeout,
    InvalidInput,
    InvalidPolicy,
    MalformedMeasurement,
    ManualAttemptOpen,
    NotAttemptHolder,
    QualityMismatch,
    StaleBasis,
    SummaryTooLarge,
    UnknownAttempt,
)

FP = "ab" * 32
L = 100_000  # default levels on this limit: compact 80,000, rearm 60,000, hard 100,000


def meas(through: str, used: int, limit: int = L, revision: int = 1, quality: str = "exact_local") -> Measurement:
    return Measurement(
        basis=Basis(revision, through),
        model=ModelRef("test", "model"),
        fingerprint=FP,
        input_tokens=used,
        input_limit=limit,
        quality=quality,
    )


class Session:
    """A caller of the core: records every outcome's events and checks state == fold(events)."""

    def __init__(self, policy: Policy | None = None, session_id: str = "s1", now: float = 1000.0) -> None:
        self.policy = policy or Policy()
        self.sid = session_id
        self.state = SessionState(session_id=session_id)
        self.events: list = []
        self.now = now
        self.seq = 0

    def _record(self, outcome: Outcome) -> Outcome:
        self.events.extend(outcome.events)
        self.state = outcome.state
        assert self.state == fold(self.events, self.sid)
        assert self.state.version == len(self.events)
        return outcome

    def types(self, outcome: Outcome) -> list[str]:
        return [e.TYPE for e in outcome.events]

    def measure(
        self,
        through: str,
        used: int,
        limit: int = L,
        *,
        revision: int | None = None,
        dt: float = 1.0,
        quality: str = "exact_local",
        **kw,
    ) -> Outcome:
        self.now += dt
        self.seq += 1
        m = meas(through, used, limit, self.state.revision if revision is None else revision, quality)
        return self._record(
            decide_measure(self.state, self.policy, m, now=self.now, new_attempt_id=f"a{self.seq}", **kw)
        )

    def manual(self, dt: float = 1.0, **kw) -> Outcome:
        self.now += dt
        self.seq += 1
        return self._record(decide_manual(self.state, self.policy, now=self.now, new_attempt_id=f"m{self.seq}", **kw))

    def commit(self, attempt, tokens_after: int, *, token: int | None = None, dt: float = 1.0) -> Outcome:
        self.now += dt
        return self._record(
            decide_commit(
                self.state,
                attempt_id=attempt.attempt_id,
                fencing_token=attempt.fencing_token if token is None else token,
                tokens_after=tokens_after,
                now=self.now,
            )
        )

    def reject(
        self, attempt, reason: str = "execution_failed", *, token: int | None = None, dt: float = 1.0
    ) -> Outcome:
        self.now += dt
        return self._record(
            decide_reject(
                self.state,
                attempt_id=attempt.attempt_id,
                fencing_token=attempt.fencing_token if token is None else token,
                reject_reason=reason,
                now=self.now,
            )
        )


def action(o: Outcome) -> str:
    assert o.decision is not None
    return o.decision.action


def pressure(o: Outcome) -> str:
    assert o.decision is not None
    return o.decision.pressure


# ============================================================================================
# §5 pressure
# ============================================================================================


def test_first_measurement_starts_the_session_with_normal_before():
    s = Session()
    o = s.measure("m1", 10_000)
    assert s.types(o) == ["SessionStarted", "ContextMeasured"]
    assert o.events[0].policy == Policy() and o.events[0].to_data()["policy"] == Policy().to_data()
    d = o.decision
    assert (d.pressure_before, d.pressure, d.action, d.trigger) == ("normal", "normal", "proceed", None)
    assert (d.occupancy_bp, d.threshold_bp, d.threshold_source) == (1000, 8000, "default")
    assert (d.compact_level, d.rearm_level, d.hard_level) == (80_000, 60_000, 100_000)
    assert o.error is None
    o = s.measure("m2", 20_000)
    assert s.types(o) == ["ContextMeasured"]  # started once


def test_rule1_hard_limit_first():
    s = Session()
    o = s.measure("m1", 100_000)  # used == hard_level
    assert pressure(o) == "hard_limit"
    assert action(o) == "compact"
    assert o.decision.trigger == "hard_limit"
    o = s.measure("m1", 250_000)
    assert pressure(o) == "hard_limit"


def test_rule1_hard_limit_in_observe_only_yields_context_limit():
    s = Session(Policy(automatic=False))
    o = s.measure("m1", 99_999)
    assert (pressure(o), action(o)) == ("normal", "proceed")  # rule 2: never compact in observe-only
    o = s.measure("m2", 100_000)
    assert (pressure(o), action(o)) == ("hard_limit", "context_limit")
    assert s.types(o) == ["ContextMeasured", "ContextLimitReached"]
    assert isinstance(o.error, ContextLimitError)
    assert not s.state.open_attempts


def test_rule2_observe_only_is_never_compact():
    s = Session(Policy(automatic=False))
    for i, used in enumerate([50_000, 80_000, 95_000, 70_000, 99_999, 30_000]):
        o = s.measure(f"m{i}", used)
        assert (pressure(o), action(o)) == ("normal", "proceed")
    assert s.state.attempts_opened == 0


def test_rule3_hysteresis_from_compact():
    s = Session()
    o = s.measure("m1", 80_000)
    assert (pressure(o), action(o)) == ("compact", "compact")
    a = o.decision.attempt
    s.reject(a)
    for i, used in enumerate([79_999, 70_000, 60_000]):  # rearm_level <= used < compact_level
        o = s.measure(f"n{i}", used)
        assert o.decision.pressure_before == "compact"
        assert pressure(o) == "compact"
    o = s.measure("n9", 59_999)  # below rearm: normal, episode over
    assert pressure(o) == "normal"
    o = s.measure("n10", 70_000)  # back in the band from normal: stays normal
    assert pressure(o) == "normal"
    assert action(o) == "proceed"


def test_rule3_hysteresis_from_hard_limit():
    s = Session(Policy(max_automatic_per_episode=1))
    o = s.measure("m1", 120_000)
    assert pressure(o) == "hard_limit"
    s.reject(o.decision.attempt)
    o = s.measure("m2", 61_000)
    assert (o.decision.pressure_before, pressure(o)) == ("hard_limit", "compact")


def test_rule4_compact_level_boundary():
    s = Session()
    o = s.measure("m1", 79_999)
    assert pressure(o) == "normal"
    o = s.measure("m2", 80_000)
    assert pressure(o) == "compact"
    assert o.decision.occupancy_bp == 8000


def test_hysteresis_observe_only_never_holds_compact():
    # previous pressure hard_limit, observe-only: rule 2 comes before rule 3
    s = Session(Policy(automatic=False))
    s.measure("m1", 100_000)
    o = s.measure("m2", 90_000)
    assert (o.decision.pressure_before, pressure(o)) == ("hard_limit", "normal")


def test_levels_follow_the_request_threshold():
    s = Session()
    o = s.measure("m1", 45_000, compaction_threshold=0.45)
    d = o.decision
    assert (d.threshold_bp, d.threshold_source, d.compact_level, d.rearm_level) == (4500, "explicit", 45_000, 33_750)
    assert (pressure(o), action(o)) == ("compact", "compact")
    o = s.measure("m2", 44_000, scope="current-message", scope_confidence=0.8)
    assert (o.decision.threshold_source, o.decision.threshold_bp) == ("classifier", 4500)
    o = s.measure("m3", 44_000, scope="current-message", scope_confidence=0.49)
    assert (o.decision.threshold_source, o.decision.threshold_bp) == ("default", 8000)


def test_ceiling_fires_at_300k_on_a_1m_limit():
    s = Session()
    o = s.measure("m1", 299_999, 1_000_000, compaction_threshold=0.4)
    assert (pressure(o), action(o)) == ("normal", "proceed")
    o = s.measure("m2", 300_000, 1_000_000, compaction_threshold=0.4)
    assert (pressure(o), action(o), o.decision.trigger) == ("compact", "compact", "threshold")
    assert o.decision.occupancy_bp == 3000
    # default threshold on the same model also fires at 300,000 (not at 800,000)
    s = Session()
    assert action(s.measure("m1", 300_000, 1_000_000)) == "compact"


# ============================================================================================
# §6 decision table
# ============================================================================================


def test_compact_opens_an_attempt_with_budget_and_lease():
    s = Session()
    o = s.measure("m1", 85_000, overhead_tokens=10_000)
    assert s.types(o) == ["SessionStarted", "ContextMeasured", "CompactionStarted"]
    started = o.events[-1]
    assert started.reason == "automatic"
    assert started.trigger == "threshold"
    assert started.basis == "r1:m1"
    assert started.fencing_token == 1
    assert started.lease_expires_at == s.now + 60
    assert started.tokens_before == 85_000
    assert started.input_limit == L
    assert started.history_budget == math.floor(0.95 * (L - 10_000)) == 85_500
    a = o.decision.attempt
    assert a is not None and a.attempt_id == "a1" and a.automatic
    assert s.state.open_automatic == a
    assert o.events[1].action == "compact" and o.events[1].trigger == "threshold"


def test_history_budget_scales_with_a_lowered_threshold():
    s = Session()
    o = s.measure("m1", 50_000, compaction_threshold=0.4)
    assert o.decision.attempt.history_budget == 47_500  # floor(0.95 * 100,000 * 4000/8000)


def test_wait_when_hard_limit_and_automatic_open():
    s = Session()
    o = s.measure("m1", 85_000)
    a = o.decision.attempt
    o = s.measure("m2", 105_000)
    assert (pressure(o), action(o)) == ("hard_limit", "wait")
    assert o.decision.waiting_on == a
    assert o.error is None
    assert s.types(o) == ["ContextMeasured"]


def test_context_limit_when_hard_limit_and_basis_exhausted():
    s = Session()
    o = s.measure("m1", 85_000)
    s.reject(o.decision.attempt)
    o = s.measure("m1", 100_000)  # same basis (history unchanged), bigger current prompt
    assert (pressure(o), action(o)) == ("hard_limit", "context_limit")
    assert s.types(o) == ["ContextMeasured", "ContextLimitReached"]
    reached = o.events[-1]
    assert (reached.basis, reached.input_tokens, reached.input_limit) == ("r1:m1", 100_000, L)
    assert isinstance(o.error, ContextLimitError)
    assert o.error.details["basis"] == "r1:m1"


def test_proceed_with_compact_pressure_and_attempt_open():
    s = Session()
    s.measure("m1", 85_000)
    o = s.measure("m2", 90_000)
    assert (pressure(o), action(o)) == ("compact", "proceed")
    assert s.state.attempts_opened == 1


def test_proceed_with_compact_pressure_and_basis_exhausted():
    s = Session()
    o = s.measure("m1", 85_000)
    s.reject(o.decision.attempt)
    o = s.measure("m1", 90_000)
    assert (pressure(o), action(o)) == ("compact", "proceed")


def test_each_measurement_yields_exactly_one_action():
    s = Session()
    for i, used in enumerate([10_000, 85_000, 90_000, 120_000, 30_000]):
        o = s.measure(f"m{i}", used)
        measured = [e for e in o.events if e.TYPE == "ContextMeasured"]
        assert len(measured) == 1 and measured[0].action == action(o)


# -- eligibility, one condition at a time ------------------------------------------------------


def test_eligibility_requires_automatic_mode():
    s = Session(Policy(automatic=False, turn_delta=0.1))
    s.measure("m1", 10_000)
    o = s.measure("m2", 90_000)  # growth would fire, pressure capped at normal
    assert o.decision.growth_fired is True
    assert action(o) == "proceed"


def test_eligibility_requires_pressure_or_growth():
    s = Session()
    o = s.measure("m1", 79_999)
    assert action(o) == "proceed"


def test_growth_trigger_opens_an_attempt_at_normal_pressure():
    s = Session(Policy(turn_delta=0.3))
    o = s.measure("m1", 10_000)
    assert o.decision.growth_fired is False  # first measurement of a revision never fires
    o = s.measure("m2", 39_999)
    assert (o.decision.growth_fired, action(o)) == (False, "proceed")
    o = s.measure("m3", 69_999)  # +30,000 = +0.3 of 100k
    assert (pressure(o), o.decision.growth_fired, action(o), o.decision.trigger) == (
        "normal",
        True,
        "compact",
        "growth",
    )
    assert o.events[-1].trigger == "growth"


def test_growth_on_a_million_limit_uses_the_ceiling():
    s = Session(Policy(turn_delta=0.1))
    s.measure("m1", 100_000, 1_000_000)
    o = s.measure("m2", 120_000, 1_000_000)
    assert (o.decision.growth_fired, action(o)) == (False, "proceed")
    o = s.measure("m3", 150_000, 1_000_000)  # +30,000 over min(L, 300k)
    assert (o.decision.growth_fired, action(o), o.decision.trigger) == (True, "compact", "growth")


def test_growth_is_compared_with_the_previous_measurement_of_the_same_revision_only():
    s = Session(Policy(turn_delta=0.3))
    s.measure("m1", 10_000)
    o = s.measure("m2", 50_000)
    assert action(o) == "compact"  # growth +0.4
    s.commit(o.decision.attempt, 5_000)
    o = s.measure("n1", 60_000)  # r2: first measurement of the revision, +0.55 vs 5k -> no growth
    assert o.decision.revision == 2
    assert (o.decision.growth_fired, action(o)) == (False, "proceed")
    o = s.measure("n2", 95_000)
    assert o.decision.growth_fired is True


def test_pressure_trigger_wins_over_growth_for_the_trigger_name():
    s = Session(Policy(turn_delta=0.1))
    s.measure("m1", 10_000)
    o = s.measure("m2", 85_000)
    assert o.decision.growth_fired and o.decision.trigger == "threshold"


def test_eligibility_requires_basis_not_exhausted_but_a_new_basis_works():
    s = Session()
    o = s.measure("m1", 85_000)
    s.reject(o.decision.attempt)
    assert "r1:m1" in s.state.exhausted
    for used in (85_000, 82_000, 95_000):  # same basis never re-triggers while pressure stays >= rearm
        assert action(s.measure("m1", used)) == "proceed"
    o = s.measure("m2", 86_000)  # a new basis does
    assert (action(o), o.decision.trigger) == ("compact", "threshold")


def test_eligibility_requires_no_open_automatic():
    s = Session()
    o1 = s.measure("m1", 85_000)
    o2 = s.measure("m2", 90_000)
    assert action(o1) == "compact" and action(o2) == "proceed"
    assert len(s.state.open_attempts) == 1


def test_loop_breaker_max_automatic_per_episode():
    s = Session(Policy(max_automatic_per_episode=2))
    o = s.measure("m1", 85_000)
    s.reject(o.decision.attempt)
    o = s.measure("m2", 86_000)
    assert action(o) == "compact"
    s.reject(o.decision.attempt)
    assert s.state.episode_automatic == 2
    o = s.measure("m3", 87_000)  # a fresh basis, but the episode has used its two attempts
    assert (pressure(o), action(o)) == ("compact", "proceed")
    o = s.measure("m4", 100_000)  # and at the hard limit that means context_limit
    assert action(o) == "context_limit"
    o = s.measure("m5", 50_000)  # rearm: episode over
    assert pressure(o) == "normal" and s.state.episode_automatic == 0
    o = s.measure("m6", 81_000)
    assert action(o) == "compact"


def test_loop_breaker_counts_commits_that_do_not_leave_the_episode():
    # commits whose summary stays above the rearm level keep the episode going
    s = Session(Policy(max_automatic_per_episode=2))
    o = s.measure("m1", 90_000)
    s.commit(o.decision.attempt, 70_000)
    o = s.measure("n1", 81_000)
    assert (o.decision.revision, pressure(o), action(o)) == (2, "compact", "compact")
    s.commit(o.decision.attempt, 75_000)
    o = s.measure("p1", 82_000)
    assert (o.decision.revision, pressure(o), action(o)) == (3, "compact", "proceed")


def test_episode_count_resets_on_any_normal_measurement():
    s = Session(Policy(max_automatic_per_episode=1, turn_delta=0.2))
    s.measure("m1", 10_000)
    o = s.measure("m2", 40_000)  # growth at normal pressure
    assert action(o) == "compact"
    s.reject(o.decision.attempt)
    o = s.measure("m3", 45_000)
    assert s.state.episode_automatic == 0
    o = s.measure("m4", 81_000)  # a new episode: eligible again
    assert action(o) == "compact"


# -- exhaustion, commit, stale -----------------------------------------------------------------


def test_commit_advances_revision_and_old_measurements_are_stale():
    s = Session()
    o = s.measure("m1", 85_000)
    a = o.decision.attempt
    o = s.commit(a, 30_000)
    assert s.types(o) == ["CompactionCommitted"]
    c = o.events[0]
    assert (c.attempt_id, c.reason, c.basis, c.new_revision, c.tokens_before, c.tokens_after) == (
        "a1",
        "automatic",
        "r1:m1",
        2,
        85_000,
        30_000,
    )
    assert c.duration_ms == 1000
    assert s.state.revision == 2 and not s.state.open_attempts
    assert o.attempt == a and o.error is None
    before = s.state
    o = s.measure("m1", 90_000, revision=1)
    assert s.types(o) == ["MeasurementRefused"]
    assert (o.events[0].kind, o.events[0].basis, o.events[0].current_revision) == ("stale_basis", "r1:m1", 2)
    assert isinstance(o.error, StaleBasis)
    assert o.decision is None
    # refusal recorded, nothing else changed
    assert s.state.version == before.version + 1
    assert (s.state.pressure, s.state.revision, s.state.last, s.state.exhausted) == (
        before.pressure,
        before.revision,
        before.last,
        before.exhausted,
    )
    o = s.measure("m2", 40_000)  # at the new revision
    assert (o.decision.basis, pressure(o)) == ("r2:m2", "normal")


def test_basis_ahead_of_the_session_is_invalid_input_and_records_nothing():
    s = Session()
    s.measure("m1", 10)
    with pytest.raises(InvalidInput) as exc:
        s.measure("m2", 10, revision=2)
    assert exc.value.field == "basis.revision"
    assert len(s.events) == 2


def test_rearm_after_commit():
    s = Session()
    o = s.measure("m1", 85_000)
    s.commit(o.decision.attempt, 20_000)
    o = s.measure("n1", 25_000)
    assert (o.decision.pressure_before, pressure(o), action(o)) == ("compact", "normal", "proceed")
    o = s.measure("n2", 79_000)
    assert (pressure(o), action(o)) == ("normal", "proceed")
    o = s.measure("n3", 80_000)
    assert (pressure(o), action(o)) == ("compact", "compact")
    assert o.decision.attempt.fencing_token == 2


def test_commit_still_above_rearm_keeps_compact_pressure_and_can_compact_again():
    s = Session()
    o = s.measure("m1", 85_000)
    s.commit(o.decision.attempt, 70_000)
    o = s.measure("n1", 70_000)
    assert (o.decision.pressure_before, pressure(o), action(o)) == ("compact", "compact", "compact")


def test_commit_supersedes_other_open_attempts():
    s = Session()
    m = s.manual().attempt
    a = s.measure("m1", 85_000).decision.attempt
    o = s.commit(a, 20_000)
    assert s.types(o) == ["CompactionCommitted", "CompactionRejected"]
    assert (o.events[1].attempt_id, o.events[1].reject_reason) == (m.attempt_id, "superseded")
    assert not s.state.open_attempts
    o = s.commit(m, 10_000)
    assert isinstance(o.error, AttemptNotOpen)


def test_manual_commit_supersedes_the_automatic_attempt():
    s = Session()
    a = s.measure("m1", 85_000).decision.attempt
    m = s.manual().attempt
    o = s.commit(m, 20_000)
    assert s.types(o) == ["CompactionCommitted", "CompactionRejected"]
    assert o.events[1].attempt_id == a.attempt_id and o.events[1].reject_reason == "superseded"
    assert s.state.revision == 2 and not s.state.open_attempts
    assert s.state.exhausted == frozenset()


def test_summary_too_large_is_recorded_as_a_rejection():
    s = Session()
    a = s.measure("m1", 85_000).decision.attempt
    o = s.commit(a, L)  # tokens_after == input_limit
    assert s.types(o) == ["CompactionRejected"]
    assert o.events[0].reject_reason == "summary_too_large"
    assert isinstance(o.error, SummaryTooLarge)
    assert s.state.revision == 1 and not s.state.open_attempts
    assert "r1:m1" in s.state.exhausted  # a rejection exhausts the basis
    assert action(s.measure("m1", 86_000)) == "proceed"


def test_summary_just_below_the_limit_commits():
    s = Session()
    a = s.measure("m1", 85_000).decision.attempt
    o = s.commit(a, L - 1)
    assert o.error is None and s.state.revision == 2


def test_reject_records_reason_and_exhausts_basis():
    s = Session()
    a = s.measure("m1", 85_000).decision.attempt
    o = s.reject(a, "model_refused")
    assert s.types(o) == ["CompactionRejected"]
    r = o.events[0]
    assert (r.attempt_id, r.reason, r.basis, r.reject_reason, r.duration_ms) == (
        "a1",
        "automatic",
        "r1:m1",
        "model_refused",
        1000,
    )
    assert s.state.outcome_of("a1") == "rejected:model_refused"
    assert s.state.revision == 1


# -- holders ------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["commit", "reject"])
def test_wrong_fencing_token_is_not_the_holder(op):
    s = Session()
    a = s.measure("m1", 85_000).decision.attempt
    o = s.commit(a, 10, token=a.fencing_token + 1) if op == "commit" else s.reject(a, token=99)
    assert isinstance(o.error, NotAttemptHolder)
    assert o.events == ()
    assert s.state.open_automatic == a


@pytest.mark.parametrize("op", ["commit", "reject"])
def test_unknown_attempt(op):
    s = Session()
    s.measure("m1", 85_000)
    ghost = type("A", (), {"attempt_id": "nope", "fencing_token": 1})()
    o = s.commit(ghost, 10) if op == "commit" else s.reject(ghost)
    assert isinstance(o.error, UnknownAttempt)
    assert o.events == ()


@pytest.mark.parametrize("first", ["commit", "reject"])
@pytest.mark.parametrize("second", ["commit", "reject"])
def test_already_ended_attempt_is_not_open(first, second):
    s = Session()
    a = s.measure("m1", 85_000).decision.attempt
    s.commit(a, 10) if first == "commit" else s.reject(a)
    o = s.commit(a, 10) if second == "commit" else s.reject(a)
    assert isinstance(o.error, AttemptNotOpen)
    assert o.error.details["outcome"] == ("committed" if first == "commit" else "rejected:execution_failed")
    assert o.events == ()


def test_commit_or_reject_on_an_unstarted_session():
    st = SessionState("s1")
    with pytest.raises(UnknownAttempt):
        decide_commit(st, attempt_id="a1", fencing_token=1, tokens_after=1, now=0)
    with pytest.raises(UnknownAttempt):
        decide_reject(st, attempt_id="a1", fencing_token=1, reject_reason="x", now=0)


@pytest.mark.parametrize("tokens_after", [-1, 1.5, "10", None, True])
def test_commit_bad_tokens_after_raises_before_anything(tokens_after):
    s = Session()
    a = s.measure("m1", 85_000).decision.attempt
    with pytest.raises(InvalidInput) as exc:
        decide_commit(s.state, attempt_id=a.attempt_id, fencing_token=a.fencing_token, tokens_after=tokens_after, now=0)
    assert exc.value.field == "tokens_after"


@pytest.mark.parametrize("reason", ["", "   ", None, 3, "x" * 201])
def test_reject_bad_reason_raises(reason):
    s = Session()
    a = s.measure("m1", 85_000).decision.attempt
    with pytest.raises(InvalidInput) as exc:
        decide_reject(s.state, attempt_id=a.attempt_id, fencing_token=a.fencing_token, reject_reason=reason, now=0)
    assert exc.value.field == "reject_reason"


@pytest.mark.parametrize(
    "attempt_id, token, field",
    [("", 1, "attempt_id"), (None, 1, "attempt_id"), ("a1", "1", "fencing_token"), ("a1", None, "fencing_token")],
)
def test_commit_bad_holder_fields_raise(attempt_id, token, field):
    s = Session()
    s.measure("m1", 85_000)
    with pytest.raises(InvalidInput) as exc:
        decide_commit(s.state, attempt_id=attempt_id, fencing_token=token, tokens_after=1, now=s.now)
    assert exc.value.field == field


# -- manual attempts -------------------------------------------------------------------------------


def test_manual_opens_regardless_of_pressure():
    s = Session()
    o = s.manual()
    assert s.types(o) == ["SessionStarted", "CompactionStarted"]
    st = o.events[-1]
    assert (st.reason, st.trigger, st.basis, st.fencing_token) == ("manual", "manual", "r1:manual", 1)
    assert st.tokens_before is None and st.history_budget is None
    assert s.state.open_manual == o.attempt
    s2 = Session()
    s2.measure("m1", 10_000, overhead_tokens=5)
    o = s2.manual(overhead_tokens=10_000)
    st = o.events[-1]
    assert (st.basis, st.tokens_before, st.input_limit, st.history_budget) == ("r1:m1", 10_000, L, 85_500)


def test_manual_with_an_explicit_basis():
    s = Session()
    s.measure("m1", 10_000)
    o = s.manual(basis=Basis(1, "m7"))
    assert o.events[-1].basis == "r1:m7"
    s2 = Session()
    s2.measure("m1", 10_000)
    with pytest.raises(InvalidInput) as exc:
        s2.manual(basis=Basis(3, "m7"))
    assert exc.value.field == "basis.revision"
    # a new session is at revision 1 too: a manual attempt on r5 would put a basis in the log
    # that the session never had (and its commit would then claim r5 -> r2)
    s3 = Session()
    with pytest.raises(InvalidInput) as exc:
        s3.manual(basis=Basis(5, "x"))
    assert exc.value.field == "basis.revision"
    assert s3.events == []
    assert s3.manual(basis=Basis(1, "x")).events[-1].basis == "r1:x"


def test_only_one_manual_open():
    s = Session()
    m = s.manual().attempt
    o = s.manual()
    assert isinstance(o.error, ManualAttemptOpen)
    assert o.events == () and o.attempt is None
    s.reject(m, "changed_my_mind")
    assert s.manual().error is None


def test_manual_never_blocks_automatic():
    s = Session()
    s.manual()
    o = s.measure("m1", 85_000)
    assert action(o) == "compact"
    assert len(s.state.open_attempts) == 2
    # and at the hard limit a manual attempt alone does not make callers wait
    s2 = Session()
    s2.manual()
    o = s2.measure("m1", 120_000)
    assert (action(o), o.decision.trigger) == ("compact", "hard_limit")


def test_manual_opens_while_automatic_open():
    s = Session()
    s.measure("m1", 85_000)
    o = s.manual()
    assert o.error is None and len(s.state.open_attempts) == 2


def test_manual_never_exhausts_a_basis():
    s = Session()
    s.measure("m1", 10_000)
    m = s.manual().attempt
    assert m.basis == "r1:m1"
    s.reject(m)
    assert s.state.exhausted == frozenset()
    o = s.measure("m1", 85_000)
    assert action(o) == "compact"


def test_manual_does_not_count_in_the_episode():
    s = Session(Policy(max_automatic_per_episode=1))
    s.measure("m1", 85_000)
    s.manual()
    assert s.state.episode_automatic == 1


# -- lease ----------------------------------------------------------------------------------------


def test_lease_expiry_is_recorded_by_the_next_measurement_and_exhausts_the_basis():
    s = Session()
    a = s.measure("m1", 85_000).decision.attempt
    o = s.measure("m1", 86_000, dt=60)  # now == lease_expires_at: open exactly the lease, not longer
    assert s.types(o) == ["ContextMeasured"]  # not yet
    o = s.measure("m1", 86_000, dt=0.001)  # open longer than the lease
    assert s.types(o) == ["CompactionRejected", "ContextMeasured"]
    r = o.events[0]
    assert (r.attempt_id, r.reject_reason, r.basis, r.duration_ms) == (a.attempt_id, "lease_expired", "r1:m1", 60_001)
    assert action(o) == "proceed"  # the basis is exhausted now
    assert "r1:m1" in s.state.exhausted
    o = s.measure("m2", 87_000)
    assert (action(o), o.decision.attempt.fencing_token) == ("compact", 2)


def test_lease_expiry_then_hard_limit_same_basis_is_context_limit():
    s = Session()
    s.measure("m1", 85_000)
    o = s.measure("m1", 100_000, dt=61)
    assert s.types(o) == ["CompactionRejected", "ContextMeasured", "ContextLimitReached"]
    assert isinstance(o.error, ContextLimitError)


def test_commit_after_lease_expiry_records_expiry_and_is_not_open():
    s = Session()
    a = s.measure("m1", 85_000).decision.attempt
    o = s.commit(a, 10_000, dt=120)
    assert s.types(o) == ["CompactionRejected"]
    assert o.events[0].reject_reason == "lease_expired"
    assert isinstance(o.error, AttemptNotOpen)
    assert s.state.revision == 1


def test_manual_lease_expires_and_does_not_exhaust():
    s = Session()
    s.measure("m1", 10_000)
    s.manual()
    o = s.manual(dt=61)
    assert s.types(o) == ["CompactionRejected", "CompactionStarted"]
    assert o.events[0].reject_reason == "lease_expired"
    assert s.state.exhausted == frozenset()


def test_attempt_lease_policy_is_used():
    s = Session(Policy(attempt_lease_s=5))
    o = s.measure("m1", 85_000)
    assert o.events[-1].lease_expires_at == s.now + 5
    o = s.measure("m2", 86_000, dt=5.001)
    assert [e.TYPE for e in o.events] == ["CompactionRejected", "ContextMeasured", "CompactionStarted"]


# -- refusals before any event ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(input_tokens=-1), "input_tokens"),
        (dict(input_tokens=1.0), "input_tokens"),
        (dict(input_limit=0), "input_limit"),
        (dict(input_limit=-100), "input_limit"),
        (dict(quality="guess"), "quality"),
        (dict(fingerprint="xyz"), "fingerprint"),
        (dict(fingerprint="AB" * 32), "fingerprint"),
    ],
)
def test_malformed_measurement_cannot_be_built(kw, field):
    base = dict(
        basis=Basis(1, "m1"),
        model=ModelRef("p", "m"),
        fingerprint=FP,
        input_tokens=1,
        input_limit=10,
        quality="exact_local",
    )
    with pytest.raises(MalformedMeasurement) as exc:
        Measurement(**{**base, **kw})
    assert exc.value.field == field


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(compaction_threshold=1.5), "compaction_threshold"),
        (dict(compaction_threshold=float("nan")), "compaction_threshold"),
        (dict(compaction_threshold="0.5"), "compaction_threshold"),
        (dict(scope="galaxy", scope_confidence=0.9), "scope"),
        (dict(scope="recent-turns"), "scope_confidence"),
        (dict(overhead_tokens=-1), "overhead_tokens"),
    ],
)
def test_bad_request_inputs_raise_before_any_event(kw, field):
    s = Session()
    s.measure("m1", 85_000)
    before = (s.state, len(s.events))
    with pytest.raises(InvalidInput) as exc:
        decide_measure(s.state, s.policy, meas("m2", 10_000), now=s.now + 100, new_attempt_id="x", **kw)
    assert exc.value.field == field
    assert (s.state, len(s.events)) == before
    # also on a brand-new session: not even SessionStarted
    with pytest.raises(InvalidInput):
        decide_measure(SessionState("new"), Policy(), meas("m1", 1), now=0, new_attempt_id="x", **kw)


def test_quality_not_allowed_by_policy_is_recorded_as_count_failed():
    s = Session(Policy(counter_policy="require_exact", safety_margin=0))
    s.measure("m1", 50_000)
    before = s.state
    o = s.measure("m2", 99_000, quality="heuristic_estimate")
    assert s.types(o) == ["CountFailed"]
    cf = o.events[0]
    assert (cf.kind, cf.model, cf.basis) == ("QualityMismatch", "model", "r1:m2")
    assert isinstance(o.error, QualityMismatch)
    assert o.decision is None
    assert (s.state.pressure, s.state.last, s.state.open_attempts) == (before.pressure, before.last, ())
    assert action(s.measure("m3", 99_000, quality="exact_provider")) == "compact"


def test_heuristic_quality_is_allowed_by_allow_conservative():
    s = Session()
    assert action(s.measure("m1", 85_000, quality="heuristic_estimate")) == "compact"


def test_count_failed_is_recorded_and_decides_nothing():
    s = Session()
    s.measure("m1", 50_000)
    o = s._record(
        decide_count_failed(
            s.state,
            s.policy,
            CountTimeout("no count within 2.0s"),
            model="gpt",
            duration_ms=2001,
            now=s.now + 3,
            basis=Basis(1, "m2"),
        )
    )
    assert s.types(o) == ["CountFailed"]
    assert (o.events[0].kind, o.events[0].duration_ms, o.events[0].basis) == ("CountTimeout", 2001, "r1:m2")
    assert isinstance(o.error, CountTimeout)
    assert s.state.pressure == "normal" and s.state.last.basis == "r1:m1"


def test_session_policy_is_pinned_at_start():
    s = Session(Policy(compact_at_bp=5000, rearm_below_bp=3000))
    s.measure("m1", 10_000)
    s.policy = Policy()  # a different default later does not change a started session
    o = s.measure("m2", 50_000)
    assert (o.decision.threshold_bp, action(o)) == (5000, "compact")


def test_decisions_are_pure():
    s = Session()
    s.measure("m1", 50_000)
    st = s.state
    m = meas("m2", 85_000)
    o1 = decide_measure(st, Policy(), m, now=5000.0, new_attempt_id="x")
    o2 = decide_measure(st, Policy(), m, now=5000.0, new_attempt_id="x")
    assert o1 == o2
    assert s.state is st and st.open_attempts == ()


# ============================================================================================
# §3 policy validation
# ============================================================================================


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(automatic="yes"), "automatic"),
        (dict(automatic=1), "automatic"),
        (dict(compact_at_bp=0), "compact_at_bp"),
        (dict(compact_at_bp=10_000), "compact_at_bp"),
        (dict(compact_at_bp=-5), "compact_at_bp"),
        (dict(compact_at_bp=8000.0), "compact_at_bp"),
        (dict(compact_at_bp=True), "compact_at_bp"),
        (dict(rearm_below_bp=8000), "rearm_below_bp"),  # rearm >= compact
        (dict(rearm_below_bp=9000), "rearm_below_bp"),
        (dict(compact_at_bp=5000), "rearm_below_bp"),  # default rearm 6000 now >= compact
        (dict(rearm_below_bp=0), "rearm_below_bp"),
        (dict(rearm_below_bp=-1), "rearm_below_bp"),
        (dict(rearm_below_bp=10_000), "rearm_below_bp"),
        (dict(rearm_below_bp="6000"), "rearm_below_bp"),
        (dict(counter_policy="anything_goes"), "counter_policy"),
        (dict(reserved_output=-1), "reserved_output"),
        (dict(reserved_output=1.5), "reserved_output"),
        (dict(safety_margin=0), "safety_margin"),  # allow_conservative needs > 0
        (dict(safety_margin=-1, counter_policy="require_exact"), "safety_margin"),
        (dict(safety_margin=0.5), "safety_margin"),
        (dict(count_timeout_s=0), "count_timeout_s"),
        (dict(count_timeout_s=-1.0), "count_timeout_s"),
        (dict(count_timeout_s=float("nan")), "count_timeout_s"),
        (dict(count_timeout_s=float("inf")), "count_timeout_s"),
        (dict(count_timeout_s="2"), "count_timeout_s"),
        (dict(count_timeout_s=True), "count_timeout_s"),
        (dict(turn_delta=0), "turn_delta"),
        (dict(turn_delta=0.0), "turn_delta"),
        (dict(turn_delta=1.5), "turn_delta"),
        (dict(turn_delta=-0.1), "turn_delta"),
        (dict(turn_delta=float("nan")), "turn_delta"),
        (dict(turn_delta="0.1"), "turn_delta"),
        (dict(turn_delta=True), "turn_delta"),
        (dict(max_automatic_per_episode=0), "max_automatic_per_episode"),
        (dict(max_automatic_per_episode=2.0), "max_automatic_per_episode"),
        (dict(attempt_lease_s=0), "attempt_lease_s"),
        (dict(attempt_lease_s=float("nan")), "attempt_lease_s"),
    ],
)
def test_invalid_policy_names_the_field(kw, field):
    with pytest.raises(InvalidPolicy) as exc:
        Policy(**kw)
    assert exc.value.field == field
    assert field in str(exc.value)
    assert isinstance(exc.value, InvalidInput)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(compact_at_bp=9999, rearm_below_bp=9998),
        dict(compact_at_bp=2, rearm_below_bp=1),
        dict(automatic=False, compact_at_bp=5000, rearm_below_bp=7000),  # ordering only binds when automatic
        dict(counter_policy="require_exact", safety_margin=0),
        dict(turn_delta=1),
        dict(turn_delta=0.1),
        dict(turn_delta=None),
        dict(count_timeout_s=0.001),
        dict(max_automatic_per_episode=1),
        dict(reserved_output=0),
    ],
)
def test_valid_policies(kw):
    p = Policy(**kw)
    assert Policy.from_data(p.to_data()) == p


def test_policy_from_data_rejects_unknown_fields():
    with pytest.raises(InvalidPolicy) as exc:
        Policy.from_data({"compact_at_bp": 7000, "bogus": 1})
    assert exc.value.field == "bogus"
    assert Policy.from_data(None) == Policy()


def test_policy_replace_validates():
    with pytest.raises(InvalidPolicy) as exc:
        Policy().replace(compact_at_bp=5000, rearm_below_bp=7000)
    assert exc.value.field == "rearm_below_bp"
    assert Policy().replace(compact_at_bp=5000, rearm_below_bp=4000).compact_at_bp == 5000


def test_policy_from_env():
    """The policy section of the settings tree: every field from TRACKER_<FIELD>, errors name the variable."""
    from tracker.errors import InvalidSetting
    from tracker.settings import Settings

    def from_env(env):
        return Settings.load(env).policy

    p = from_env(
        {
            "TRACKER_COMPACT_AT_BP": "7000",
            "TRACKER_AUTOMATIC": "true",
            "TRACKER_TURN_DELTA": "0.25",
            "TRACKER_COUNT_TIMEOUT_S": "1.5",
            "TRACKER_SAFETY_MARGIN": "",
        }
    )
    assert (p.compact_at_bp, p.automatic, p.turn_delta, p.count_timeout_s, p.safety_margin) == (
        7000,
        True,
        0.25,
        1.5,
        8192,
    )
    assert from_env({"TRACKER_TURN_DELTA": "off"}).turn_delta is None
    with pytest.raises(InvalidSetting) as exc:
        from_env({"TRACKER_COMPACT_AT_BP": "eighty"})
    assert exc.value.field == "TRACKER_COMPACT_AT_BP"
    with pytest.raises(InvalidSetting) as exc:
        from_env({"TRACKER_AUTOMATIC": "maybe"})
    assert exc.value.field == "TRACKER_AUTOMATIC"
    with pytest.raises(InvalidSetting) as exc:
        from_env({"TRACKER_COMPACT_AT_BP": "5000"})
    assert exc.value.field == "TRACKER_REARM_BELOW_BP"
