"""The Tracker service on real stores (SQLite and Postgres): observe → decide → record."""

from __future__ import annotations

import hashlib

import pytest

from tracker import ContextLimitError, Policy, StaleBasis
from tracker.core import SessionProjector, fold
from tracker.core.events import event_from_data
from tracker.errors import (
    AttemptNotOpen,
    CountTimeout,
    InvalidInput,
    InvalidSessionId,
    MalformedMeasurement,
    ManualAttemptOpen,
    NotAttemptHolder,
    QualityMismatch,
    SummaryTooLarge,
    UnknownAttempt,
    WaitTimeout,
)
from tracker.service import Tracker
from tracker.store import open_store, verify_projections
from tracker.store.migrate import upgrade


class Clock:
    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def m(basis: str, used: int, limit: int = 1000, quality: str = "exact_local") -> dict:
    return {
        "basis": basis,
        "input_tokens": used,
        "input_limit": limit,
        "quality": quality,
        "model": {"provider": "openai", "name": "gpt-4o"},
        "fingerprint": hashlib.sha256(basis.encode()).hexdigest(),
    }


@pytest.fixture
def tracker(db_url):
    upgrade(db_url)
    clock = Clock()
    store = open_store(db_url, projector=SessionProjector())
    t = Tracker(store, policy=Policy(attempt_lease_s=30), clock=clock)
    t.test_clock = clock  # type: ignore[attr-defined]
    yield t
    assert verify_projections(store, SessionProjector()) == []  # after every test: state == fold(log)
    t.close()


def log_of(t: Tracker, sid: str):
    return [event_from_data(e.type, e.data) for e in t.history(sid)]


def test_lifecycle_compact_commit_rearm(tracker):
    t = tracker
    assert t.observe("s1", measurement=m("a", 500)).action == "proceed"
    r = t.observe("s1", measurement=m("b", 820))
    assert r.action == "compact" and r.decision.trigger == "threshold"
    a = r.attempt
    assert a.history_budget == 950  # floor(0.95 * 1000)
    assert t.observe("s1", measurement=m("c", 850)).action == "proceed"  # attempt open: proceed
    st = t.commit("s1", a.attempt_id, a.fencing_token, tokens_after=300)
    assert st.revision == 2
    with pytest.raises(StaleBasis):
        t.observe("s1", measurement=m("r1:d", 300))
    assert log_of(t, "s1")[-1].TYPE == "MeasurementRefused"
    assert t.observe("s1", measurement=m("e", 300)).decision.pressure == "normal"
    assert t.state("s1") == fold(log_of(t, "s1"), "s1")


def test_hard_limit_wait_then_context_limit(tracker):
    t = tracker
    r = t.observe("s2", measurement=m("a", 1000))
    assert r.action == "compact" and r.decision.trigger == "hard_limit"
    w = t.observe("s2", measurement=m("b", 1000))
    assert w.action == "wait" and w.decision.waiting_on.attempt_id == r.attempt.attempt_id
    t.reject("s2", r.attempt.attempt_id, r.attempt.fencing_token, "execution_failed")
    with pytest.raises(ContextLimitError):
        t.observe("s2", measurement=m("a", 1000))  # basis a is exhausted
    assert log_of(t, "s2")[-1].TYPE == "ContextLimitReached"


def test_only_holder_commits(tracker):
    t = tracker
    a = t.observe("s3", measurement=m("a", 900)).attempt
    with pytest.raises(NotAttemptHolder):
        t.commit("s3", a.attempt_id, a.fencing_token + 1, 100)
    with pytest.raises(UnknownAttempt):
        t.commit("s3", "nope", 1, 100)
    with pytest.raises(SummaryTooLarge):
        t.commit("s3", a.attempt_id, a.fencing_token, 1000)
    assert log_of(t, "s3")[-1].reject_reason == "summary_too_large"
    with pytest.raises(AttemptNotOpen):
        t.commit("s3", a.attempt_id, a.fencing_token, 100)


def test_manual_attempts(tracker):
    t = tracker
    t.observe("s4", measurement=m("a", 100))
    manual = t.request_compaction("s4")
    assert manual.reason == "manual"
    with pytest.raises(ManualAttemptOpen):
        t.request_compaction("s4")
    auto = t.observe("s4", measurement=m("b", 900))
    assert auto.action == "compact"  # a manual attempt never blocks an automatic one
    t.reject("s4", manual.attempt_id, manual.fencing_token, "user_cancelled")
    assert "r1:b" not in t.state("s4").exhausted


def test_lease_expiry_and_wait(tracker):
    t = tracker
    a = t.observe("s5", measurement=m("a", 900)).attempt
    with pytest.raises(WaitTimeout):
        t.wait("s5", a.attempt_id, timeout=0.1)
    t.test_clock.t += 31
    assert t.wait("s5", a.attempt_id, timeout=1) == "rejected:lease_expired"
    assert "r1:a" in t.state("s5").exhausted
    assert t.observe("s5", measurement=m("b", 900)).action == "compact"


def test_bad_input_writes_nothing(tracker):
    t = tracker
    with pytest.raises(InvalidSessionId):
        t.observe("bad id!", measurement=m("a", 1))
    with pytest.raises(MalformedMeasurement):
        t.observe("s6", measurement=m("a", -1))
    with pytest.raises(MalformedMeasurement):
        t.observe("s6", measurement=m("a", 1, limit=0))
    with pytest.raises(InvalidInput) as e:
        t.observe("s6", measurement=m("a", 1), compaction_threshold=1.5)
    assert e.value.field == "compaction_threshold"
    with pytest.raises(InvalidInput) as e:
        t.observe("s6", measurement=m("a", 1), scope="galaxy", scope_confidence=0.9)
    assert e.value.field == "scope"
    with pytest.raises(InvalidInput):
        t.commit("s6", "x", 1, tokens_after=-5)
    assert t.store.stream_version("s6") == 0


def test_quality_refused_is_recorded(db_url):
    upgrade(db_url)
    t = Tracker(open_store(db_url, projector=SessionProjector()), policy=Policy(counter_policy="require_exact"))
    try:
        with pytest.raises(QualityMismatch):
            t.observe("q1", measurement=m("a", 10, quality="heuristic_estimate"))
        assert [e.TYPE for e in log_of(t, "q1")] == ["SessionStarted", "CountFailed"]
    finally:
        t.close()


def test_idempotent_observe(tracker):
    t = tracker
    r1 = t.observe("s7", measurement=m("a", 900), idempotency_key="k1")
    r2 = t.observe("s7", measurement=m("a", 900), idempotency_key="k1")
    assert r2.attempt.attempt_id == r1.attempt.attempt_id and r2.action == "compact"
    assert t.store.stream_version("s7") == r1.version


class SlowCounter:
    """A counting backend that fails the way a dead worker does."""

    def measure(self, request, *, model, basis, policy):
        raise CountTimeout(f"no count within {policy.count_timeout_s}s", model=model)


def test_count_failure_recorded_then_raised(db_url):
    upgrade(db_url)
    t = Tracker(open_store(db_url, projector=SessionProjector()), counting=SlowCounter())
    try:
        with pytest.raises(CountTimeout):
            t.observe("c1", request={"messages": []}, model="gpt-4o", basis="m1")
        events = log_of(t, "c1")
        assert events[-1].TYPE == "CountFailed" and events[-1].kind == "CountTimeout"
    finally:
        t.close()


def test_idempotent_commit_reject_and_manual(tracker):
    t = tracker
    a = t.observe("s8", measurement=m("a", 900)).attempt
    s1 = t.commit("s8", a.attempt_id, a.fencing_token, 100, idempotency_key="c1")
    v = t.store.stream_version("s8")
    s2 = t.commit("s8", a.attempt_id, a.fencing_token, 100, idempotency_key="c1")  # a retry, not AttemptNotOpen
    assert s2.revision == s1.revision == 2 and t.store.stream_version("s8") == v
    m1 = t.request_compaction("s8", idempotency_key="man1")
    m2 = t.request_compaction("s8", idempotency_key="man1")  # a retry, not ManualAttemptOpen
    assert m1.attempt_id == m2.attempt_id
    t.reject("s8", m1.attempt_id, m1.fencing_token, "user_cancelled", idempotency_key="r1")
    t.reject("s8", m1.attempt_id, m1.fencing_token, "user_cancelled", idempotency_key="r1")
    assert [e.TYPE for e in log_of(t, "s8")].count("CompactionRejected") == 1


def test_session_id_must_match_whole_string(tracker):
    with pytest.raises(InvalidSessionId):
        tracker.observe("abc\n", measurement=m("a", 1))


def test_local_coordinator_forgets_idle_sessions():
    from tracker.coordination import LocalCoordinator

    c = LocalCoordinator()
    for i in range(100):
        with c.session_lock(f"s{i}"):
            pass
    assert c._locks == {}


def test_a_stale_cached_state_never_refuses_a_valid_call(db_url):
    """Two processes (two Trackers with their own caches): B commits, A then uses the new revision."""
    upgrade(db_url)
    a = Tracker(open_store(db_url, projector=SessionProjector()))
    b = Tracker(open_store(db_url, projector=SessionProjector()))
    try:
        att = a.observe("x1", measurement=m("m1", 850)).attempt
        b.commit("x1", att.attempt_id, att.fencing_token, 300)  # A's cached state still says r1
        assert a.observe("x1", measurement=m("r2:m2", 400)).decision.revision == 2
        assert a.request_compaction("x1", basis="r2:m2").basis == "r2:m2"
    finally:
        a.close()
        b.close()


def test_retried_refusals_get_the_original_refusal(tracker):
    t = tracker
    a = t.observe("x2", measurement=m("a", 900)).attempt
    for _ in range(2):  # the first call and its retry answer the same
        with pytest.raises(SummaryTooLarge):
            t.commit("x2", a.attempt_id, a.fencing_token, 1000, idempotency_key="big")
    b = t.observe("x2", measurement=m("b", 900)).attempt
    t.commit("x2", b.attempt_id, b.fencing_token, 100)
    for _ in range(2):
        with pytest.raises(StaleBasis):
            t.observe("x2", measurement=m("r1:c", 100), idempotency_key="stale")
    c = t.observe("x2", measurement=m("d", 900)).attempt
    t.test_clock.t += 31  # past the lease
    for _ in range(2):
        with pytest.raises(AttemptNotOpen):
            t.commit("x2", c.attempt_id, c.fencing_token, 100, idempotency_key="late")
    types = [e.TYPE for e in log_of(t, "x2")]
    assert types.count("MeasurementRefused") == 1 and types.count("CompactionRejected") == 2


def test_an_idempotency_key_is_bound_to_its_call(tracker):
    t = tracker
    r = t.observe("x3", measurement=m("a", 100), idempotency_key="k")
    with pytest.raises(InvalidInput) as e:
        t.observe("x3", measurement=m("a", 950), idempotency_key="k")  # same key, another measurement
    assert e.value.field == "idempotency_key"
    a = t.observe("x3", measurement=m("b", 900)).attempt
    with pytest.raises(InvalidInput) as e:
        t.commit("x3", a.attempt_id, a.fencing_token, 100, idempotency_key="k")  # an observe's key
    assert e.value.field == "idempotency_key"
    assert t.state("x3").open_automatic is not None and r.action == "proceed"


class FlakyCounter:
    """Counts for real once, then fails: a retry must not count again."""

    def __init__(self) -> None:
        self.calls = 0

    def measure(self, request, *, model, basis, policy):
        from tracker.core import Measurement, ModelRef
        from tracker.counting.request import CanonicalRequest

        self.calls += 1
        if self.calls > 1:
            raise CountTimeout("the counter is slow now", model=model)
        return Measurement(
            basis=basis,
            model=ModelRef("openai", model),
            input_tokens=900,
            input_limit=1000,
            fingerprint=CanonicalRequest.from_dict(request).fingerprint,
            quality="exact_local",
        )


def test_retried_counted_observe_is_answered_without_recounting(db_url):
    upgrade(db_url)
    counter = FlakyCounter()
    t = Tracker(open_store(db_url, projector=SessionProjector()), counting=counter)
    req = {"messages": [{"role": "user", "content": "hello"}]}
    try:
        first = t.observe("x4", request=req, model="gpt-4o", basis="b1", idempotency_key="k")
        again = t.observe("x4", request=req, model="gpt-4o", basis="b1", idempotency_key="k")
        assert first.action == again.action == "compact"
        assert again.attempt.attempt_id == first.attempt.attempt_id and counter.calls == 1
    finally:
        t.close()


def test_count_failure_records_the_basis_at_the_current_revision(db_url):
    upgrade(db_url)
    t = Tracker(open_store(db_url, projector=SessionProjector()), counting=SlowCounter())
    try:
        a = t.observe("x5", measurement=m("a", 900)).attempt
        t.commit("x5", a.attempt_id, a.fencing_token, 100)
        with pytest.raises(CountTimeout):
            t.observe("x5", request={"messages": []}, model="gpt-4o", basis="b2")
        assert log_of(t, "x5")[-1].basis == "r2:b2"
    finally:
        t.close()


def test_control_characters_in_a_basis_are_refused_by_name(tracker):
    with pytest.raises(InvalidInput) as e:
        tracker.observe("x6", measurement=m("a\x00b", 1))
    assert e.value.field == "basis.through"
    assert tracker.store.stream_version("x6") == 0
