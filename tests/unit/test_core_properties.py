"""Property tests of the decision core (hypothesis).

- the 300k ceiling only ever lowers a level and never binds for limits <= 300k;
- a per-request threshold or classifier reading never raises a level;
- hysteresis: inside [rearm_level, compact_level) pressure keeps what it was;
- over random op sequences (measure / commit / reject / manual / time jumps):
  never more than one open automatic attempt, at most one automatic attempt per
  (session, basis), the state kept by the decisions equals ``fold`` of every prefix
  of the event history, and every event / state round-trips through its data form.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracker.core import (
    ACTIONS,
    SCOPE_THRESHOLDS_BP,
    WINDOW_CEILING,
    Basis,
    Measurement,
    ModelRef,
    Policy,
    SessionState,
    Threshold,
    apply,
    decide_commit,
    decide_manual,
    decide_measure,
    decide_reject,
    fold,
    levels,
    resolve_threshold,
)
from tracker.core.events import event_from_data  # the core's own decoding (the projector's)
from tracker.core.model import ceil_div
from tracker.errors import InvalidInput, TrackerError

FP = "cd" * 32
SID = "prop-session"

# -- strategies -------------------------------------------------------------------------------

policies_base = st.integers(2, 9999).flatmap(lambda c: st.tuples(st.just(c), st.integers(1, c - 1)))
limits_any = st.one_of(
    st.integers(1, 2_000_000), st.sampled_from([8_000, 200_000, 299_999, 300_000, 300_001, 1_000_000, 975_424])
)
explicit_t = st.one_of(
    st.floats(min_value=0.0001, max_value=1.0, allow_nan=False),
    st.sampled_from([0.0001, 0.1, 0.29, 0.4, 0.45, 0.57, 0.8, 0.9, 1.0]),
)
scopes = st.sampled_from(sorted(SCOPE_THRESHOLDS_BP))
confidences = st.one_of(st.floats(0, 1, allow_nan=False), st.sampled_from([0.0, 0.49, 0.5, 0.51, 1.0]))


def unceiled(th: Threshold, L: int) -> tuple[int, int]:
    return ceil_div(th.bp * L, 10_000), ceil_div(th.rearm_bp * L, 10_000)


# -- levels ------------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(base=policies_base, L=limits_any, t=st.one_of(st.none(), explicit_t))
def test_ceiling_only_lowers_and_never_binds_at_or_below_300k(base, L, t):
    c, r = base
    th = resolve_threshold(c, r, compaction_threshold=t)
    lv = levels(th, L)
    compact, rearm = unceiled(th, L)
    assert lv.compact <= compact
    assert lv.rearm <= rearm
    assert lv.hard == L  # the ceiling never caps the hard limit
    assert lv.compact <= WINDOW_CEILING
    assert lv.rearm <= lv.compact <= lv.hard
    if L <= WINDOW_CEILING:
        assert (lv.compact, lv.rearm) == (compact, rearm)


@settings(max_examples=400, deadline=None)
@given(
    base=policies_base,
    L=limits_any,
    t=st.one_of(st.none(), explicit_t),
    scope=st.one_of(st.none(), scopes),
    conf=confidences,
)
def test_request_threshold_never_raises_a_level(base, L, t, scope, conf):
    c, r = base
    default = resolve_threshold(c, r)
    th = resolve_threshold(c, r, compaction_threshold=t, scope=scope, scope_confidence=conf if scope else None)
    assert th.bp <= c and th.rearm_bp <= r
    assert th.rearm_bp < th.bp
    d, x = levels(default, L), levels(th, L)
    assert x.compact <= d.compact
    assert x.rearm <= d.rearm
    assert x.hard == d.hard
    assert th.source in ("explicit", "classifier", "default")
    if t is not None:
        assert th.source == "explicit"
    elif th.source == "classifier":
        assert th.bp < c and conf >= 0.5


@settings(max_examples=300, deadline=None)
@given(C=st.integers(1, 10_000), L=st.integers(1, WINDOW_CEILING), data=st.data())
def test_compact_level_is_exactly_the_occupancy_threshold(C, L, data):
    from tracker.core import occupancy_bp

    lv = levels(Threshold(C, C // 2, "explicit"), L)
    used = data.draw(st.integers(0, 2 * L))
    assert (used >= lv.compact) == (occupancy_bp(used, L) >= C)


# -- hysteresis ---------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.sampled_from([(8000, 6000), (5000, 2000), (9000, 8999), (3000, 1)]),
    L=st.sampled_from([100_000, 175_424, 1_000_000, 37]),
    steps=st.lists(
        st.tuples(
            st.integers(0, 12_000),
            st.sampled_from(["measure", "measure", "measure", "reject", "manual"]),
            st.integers(0, 5),
        ),
        min_size=1,
        max_size=30,
    ),
    per_episode=st.integers(1, 3),
)
def test_hysteresis_in_the_band_keeps_pressure(base, L, steps, per_episode):
    policy = Policy(compact_at_bp=base[0], rearm_below_bp=base[1], max_automatic_per_episode=per_episode)
    lv = levels(resolve_threshold(*base), L)
    state, now = SessionState(SID), 0.0
    for i, (bp, op, through) in enumerate(steps):
        now += 1
        if op == "measure":
            used = L * bp // 10_000
            m = Measurement(Basis(1, f"h{through}"), ModelRef("p", "m"), FP, used, L, "exact_local")
            o = decide_measure(state, policy, m, now=now, new_attempt_id=f"a{i}")
            d = o.decision
            assert d is not None
            if lv.rearm <= used < lv.compact:
                expected = "normal" if d.pressure_before == "normal" else "compact"
                assert d.pressure == expected
            elif used >= lv.hard:
                assert d.pressure == "hard_limit"
            elif used < lv.rearm:
                assert d.pressure == "normal"
            else:
                assert d.pressure == "compact"
        elif op == "reject":
            a = state.open_automatic or state.open_manual
            if a is None:
                continue
            o = decide_reject(
                state, attempt_id=a.attempt_id, fencing_token=a.fencing_token, reject_reason="no", now=now
            )
        else:
            o = decide_manual(state, policy, now=now, new_attempt_id=f"m{i}")
        state = o.state
    assert state.revision == 1  # no commits in this property


# -- random op sequences -------------------------------------------------------------------------

THROUGH = st.sampled_from(["h1", "h2", "h3", "h4"])
LIMITS = st.sampled_from([8_000, 100_000, 300_000, 1_000_000])
DT = st.sampled_from([0, 0.5, 1, 1, 1, 1, 2, 5, 30, 61])
THRESH = st.one_of(
    st.none(),
    st.none(),
    st.tuples(st.just("t"), st.sampled_from([0.3, 0.45, 0.8, 0.95, 1.0])),
    st.tuples(st.just("scope"), scopes, st.sampled_from([0.3, 0.5, 0.9])),
)
MEASURE = st.tuples(
    st.just("measure"),
    THROUGH,
    st.one_of(st.integers(0, 12_000), st.integers(5_500, 10_500)),
    LIMITS,
    THRESH,
    DT,
    st.integers(0, 5),
)
OPS = st.one_of(
    MEASURE,
    MEASURE,
    MEASURE,
    st.tuples(
        st.just("commit"),
        st.sampled_from(["auto", "auto", "manual", "any", "old", "ghost"]),
        st.one_of(st.integers(0, 6_000), st.integers(0, 12_000)),
        st.booleans(),
        DT,
    ),
    st.tuples(st.just("reject"), st.sampled_from(["auto", "auto", "manual", "any", "old", "ghost"]), st.booleans(), DT),
    st.tuples(st.just("manual"), DT),
    st.tuples(st.just("time"), st.sampled_from([10, 59, 60, 120])),
)
POLICIES = st.builds(
    Policy,
    automatic=st.sampled_from([True, True, True, False]),
    compact_at_bp=st.just(8000),
    rearm_below_bp=st.sampled_from([1000, 6000, 7999]),
    turn_delta=st.sampled_from([None, None, 0.1, 0.3, 1.0]),
    max_automatic_per_episode=st.integers(1, 3),
    attempt_lease_s=st.sampled_from([5.0, 60.0, 60.0]),
)


class Runner:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.state = SessionState(SID)
        self.events: list[Any] = []
        self.kept: list[tuple[int, SessionState]] = [(0, self.state)]
        self.now = 100.0
        self.n = 0
        self.seen: list[Any] = []  # every attempt ever opened

    def step(self, op: tuple) -> None:
        kind = op[0]
        dt = op[-1] if kind != "measure" else op[5]
        self.now += dt
        self.n += 1
        try:
            outcome = self._decide(op)
        except TrackerError as exc:  # caller input refused before any event
            assert isinstance(exc, InvalidInput) or type(exc).__name__ == "UnknownAttempt"
            outcome = None
        if outcome is not None:
            self.events.extend(outcome.events)
            self.state = outcome.state
            for e in outcome.events:
                if e.TYPE == "CompactionStarted":
                    self.seen.append(e)
        self.kept.append((len(self.events), self.state))

    def _target(self, which: str):
        s = self.state
        if which == "auto":
            return s.open_automatic
        if which == "manual":
            return s.open_manual
        if which == "any":
            return s.open_automatic or s.open_manual
        if which == "old" and self.seen:
            e = self.seen[self.n % len(self.seen)]
            return type(
                "A", (), {"attempt_id": e.attempt_id, "fencing_token": e.fencing_token, "input_limit": e.input_limit}
            )()
        return type("A", (), {"attempt_id": "ghost", "fencing_token": 1, "input_limit": None})()

    def _decide(self, op: tuple):
        kind = op[0]
        if kind == "measure":
            _, through, bp, L, thresh, _, stale = op
            rev = self.state.revision
            if stale == 0 and rev > 1:
                rev -= 1
            used = L * bp // 10_000
            m = Measurement(Basis(rev, through), ModelRef("p", "m"), FP, used, L, "exact_local")
            kw: dict[str, Any] = {}
            if thresh and thresh[0] == "t":
                kw["compaction_threshold"] = thresh[1]
            elif thresh:
                kw["scope"], kw["scope_confidence"] = thresh[1], thresh[2]
            return decide_measure(self.state, self.policy, m, now=self.now, new_attempt_id=f"a{self.n}", **kw)
        if kind == "manual":
            return decide_manual(self.state, self.policy, now=self.now, new_attempt_id=f"m{self.n}")
        if kind == "time":
            return None
        target = self._target(op[1])
        if target is None:
            return None
        if kind == "commit":
            limit = target.input_limit or 100_000
            token = target.fencing_token if op[3] else target.fencing_token + 7
            return decide_commit(
                self.state,
                attempt_id=target.attempt_id,
                fencing_token=token,
                tokens_after=limit * op[2] // 10_000,
                now=self.now,
            )
        token = target.fencing_token if op[2] else target.fencing_token + 7
        return decide_reject(
            self.state,
            attempt_id=target.attempt_id,
            fencing_token=token,
            reject_reason="execution_failed",
            now=self.now,
        )


def run_ops(policy: Policy, ops: list[tuple]) -> Runner:
    r = Runner(policy)
    for op in ops:
        r.step(op)
    return r


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(policy=POLICIES, ops=st.lists(OPS, min_size=15, max_size=50))
def test_random_sequences_keep_the_invariants(policy, ops):
    r = run_ops(policy, ops)
    events = r.events

    # 1. the state the decisions kept == fold of the events up to that op boundary
    for k, kept in r.kept:
        assert fold(events[:k], SID) == kept

    # 2. every prefix: at most one open automatic attempt, at most one open manual attempt
    s = SessionState(SID)
    for e in events:
        s = apply(s, e)
        assert sum(1 for a in s.open_attempts if a.automatic) <= 1
        assert sum(1 for a in s.open_attempts if not a.automatic) <= 1
    assert s == r.state

    # 3. at most one automatic attempt per (session, basis), ever
    per_basis = Counter(e.basis for e in events if e.TYPE == "CompactionStarted" and e.reason == "automatic")
    assert all(n == 1 for n in per_basis.values()), per_basis

    # 4. every accepted measurement has exactly one action, and its events match it
    for i, e in enumerate(events):
        if e.TYPE != "ContextMeasured":
            continue
        assert e.action in ACTIONS
        nxt = events[i + 1] if i + 1 < len(events) else None
        opened = nxt is not None and nxt.TYPE == "CompactionStarted" and nxt.reason == "automatic"
        assert (e.action == "compact") == opened
        reached = nxt is not None and nxt.TYPE == "ContextLimitReached"
        assert (e.action == "context_limit") == reached
        if e.action in ("wait", "context_limit"):
            assert e.pressure == "hard_limit"
        if not r.policy.automatic:
            assert e.pressure != "compact" and e.action != "compact"

    # 5. commits advance the revision by one, from 1, with no gaps
    revs = [e.new_revision for e in events if e.TYPE == "CompactionCommitted"]
    assert revs == list(range(2, 2 + len(revs)))
    assert r.state.revision == 1 + len(revs)

    # 6. fencing tokens are unique and increasing
    tokens = [e.fencing_token for e in events if e.TYPE == "CompactionStarted"]
    assert tokens == list(range(1, len(tokens) + 1))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(policy=POLICIES, ops=st.lists(OPS, min_size=10, max_size=30))
def test_events_and_states_round_trip_through_data(policy, ops):
    r = run_ops(policy, ops)
    for e in r.events:
        data = json.loads(json.dumps(e.to_data()))
        assert data["v"] == e.SCHEMA
        assert event_from_data(e.TYPE, data) == e
        assert event_from_data(e.TYPE, data).to_data() == data  # the value types give back the stored data
        data["from_a_newer_writer"] = 1  # unknown fields are ignored
        assert event_from_data(e.TYPE, data) == e
    for _, s in r.kept:
        data = json.loads(json.dumps(s.to_data()))
        assert SessionState.from_data(data) == s
        assert SessionState.from_data(data).to_data() == s.to_data()


def test_a_recorded_measurement_decodes_as_measurement_from_data_builds_it():
    from tracker.core.model import Basis, Measurement, ModelRef, recorded_measurement
    from tracker.errors import MalformedMeasurement

    m = Measurement(Basis(3, "msg-1"), ModelRef("openai", "gpt-4.1"), "ab" * 32, 81_234, 111_616, "exact_local")
    data = json.loads(json.dumps(m.to_data()))
    assert recorded_measurement(data) == m == Measurement.from_data(data)
    # any other shape (the first writers' rows, a hand-made one) is checked in full
    bare = {"basis": "r2:x", "input_tokens": 5, "input_limit": 10}
    assert recorded_measurement(bare) == Measurement.from_data(bare)
    assert recorded_measurement(bare).model == ModelRef("unknown", "unknown")
    with pytest.raises(MalformedMeasurement):
        recorded_measurement({**bare, "input_tokens": -1})
