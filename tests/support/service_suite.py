"""The service suite: the tests of ``Tracker`` that need nothing but a ``tracker`` (and its ``clock``).

It runs on every store: tests/integration/test_service.py (SQLite and PostgreSQL) and
tests/unit/test_service_memory.py (``MemoryEventStore``) import it, each with a ``tracker`` fixture
of its own store built on the ``clock`` fixture here (``Policy(attempt_lease_s=30)``), and check after
each test that the projection equals the fold of the log.
"""

from __future__ import annotations

import pytest

from tests.support.measurements import measurement
from tracker import ContextLimitError, StaleBasis
from tracker.core import fold
from tracker.errors import (
    AttemptNotOpen,
    InvalidInput,
    InvalidSessionId,
    MalformedMeasurement,
    ManualAttemptOpen,
    NotAttemptHolder,
    SummaryTooLarge,
    UnknownAttempt,
    WaitTimeout,
)
from tracker.queries import events_of
from tracker.service import Tracker


class Clock:
    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    """The tracker's clock, which a test moves on (``clock.t += 31``: past the 30 s lease)."""
    return Clock()


def m(basis: str, used: int, limit: int = 1000, quality: str = "exact_local") -> dict:
    return measurement(basis, used, limit, quality)


def log_of(t: Tracker, sid: str):
    return list(events_of(t.history(sid)))


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


def test_lease_expiry_and_wait(tracker, clock):
    t = tracker
    a = t.observe("s5", measurement=m("a", 900)).attempt
    with pytest.raises(WaitTimeout):
        t.wait("s5", a.attempt_id, timeout=0.1)
    clock.t += 31
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


def test_idempotent_observe(tracker):
    t = tracker
    r1 = t.observe("s7", measurement=m("a", 900), idempotency_key="k1")
    r2 = t.observe("s7", measurement=m("a", 900), idempotency_key="k1")
    assert r2.attempt.attempt_id == r1.attempt.attempt_id and r2.action == "compact"
    assert t.store.stream_version("s7") == r1.version


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


def test_retried_refusals_get_the_original_refusal(tracker, clock):
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
    clock.t += 31  # past the lease
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


def test_control_characters_in_a_basis_are_refused_by_name(tracker):
    with pytest.raises(InvalidInput) as e:
        tracker.observe("x6", measurement=m("a\x00b", 1))
    assert e.value.field == "basis.through"
    assert tracker.store.stream_version("x6") == 0


__all__ = ["clock", *sorted(name for name in dict(globals()) if name.startswith("test_"))]
