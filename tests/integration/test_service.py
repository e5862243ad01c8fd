"""The Tracker service on real stores (SQLite and Postgres): observe → decide → record.

The tests that need nothing but a ``tracker`` (and its ``clock``) are tests/support/service_suite.py's:
they run here on both real stores, and in tests/unit/test_service_memory.py on the in-memory one.
"""

from __future__ import annotations

import pytest

from tests.support.service_suite import *  # noqa: F403 - the shared service suite, run on this module's tracker
from tests.support.service_suite import Clock, log_of, m
from tracker import Policy, Tracker
from tracker.core import SessionProjector
from tracker.errors import (
    CountTimeout,
    QualityMismatch,
)
from tracker.hooks import TrackerHooks as TrackerHooksBase
from tracker.store import open_store, verify_projections
from tracker.store.migrate import upgrade


@pytest.fixture
def tracker(db_url, clock):
    upgrade(db_url)
    store = open_store(db_url, projector=SessionProjector())
    t = Tracker(store, policy=Policy(attempt_lease_s=30), clock=clock)
    yield t
    assert verify_projections(store, SessionProjector()) == []  # after every test: state == fold(log)
    t.close()


def test_quality_refused_is_recorded(db_url):
    upgrade(db_url)
    t = Tracker(open_store(db_url, projector=SessionProjector()), policy=Policy(counter_policy="require_exact"))
    try:
        with pytest.raises(QualityMismatch):
            t.observe("q1", measurement=m("a", 10, quality="heuristic_estimate"))
        assert [e.TYPE for e in log_of(t, "q1")] == ["SessionStarted", "CountFailed"]
    finally:
        t.close()


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


# -- hooks: what the service records, for metrics and traces ------------------------------------------------


def _scenario(t: Tracker, clock: Clock, sid: str) -> list[str]:
    """Every kind of decision and refusal the metrics tell apart; what each call answered (its repr)."""
    out: list = []

    def call(fn, *args, **kwargs):
        try:
            out.append(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - the refusal is the answer compared
            out.append((type(exc).__name__, getattr(exc, "code", None)))

    call(t.observe, sid, measurement=m("a", 100))  # proceed
    call(t.observe, sid, measurement=m("a", 100), idempotency_key="k")  # proceed
    call(t.observe, sid, measurement=m("a", 100), idempotency_key="k")  # a retry: answered, not recorded
    a = t.observe(sid, measurement=m("b", 900)).attempt  # compact (automatic)
    out.append(a)
    call(t.commit, sid, a.attempt_id, a.fencing_token, 1000)  # summary_too_large
    b = t.observe(sid, measurement=m("c", 1000)).attempt  # compact at the hard limit
    out.append(b)
    call(t.observe, sid, measurement=m("d", 1000))  # wait
    call(t.reject, sid, b.attempt_id, b.fencing_token, "execution_failed")  # rejected
    call(t.observe, sid, measurement=m("c", 1000))  # context_limit (basis c exhausted)
    call(t.observe, sid, measurement=m("e", 10, quality="heuristic_estimate"))  # QualityMismatch
    man = t.request_compaction(sid)  # manual
    out.append(man)
    call(t.request_compaction, sid)  # ManualAttemptOpen: refused, nothing recorded
    call(t.commit, sid, man.attempt_id, man.fencing_token + 1, 10)  # NotAttemptHolder
    call(t.commit, sid, man.attempt_id, man.fencing_token, 10)  # committed
    late = t.observe(sid, measurement=m("r2:f", 900)).attempt  # compact (after the commit: r2)
    clock.t += 31
    call(t.wait, sid, late.attempt_id, timeout=0)  # lease_expired, recorded by the wait
    return [repr(x).replace(repr(sid), "<sid>") for x in out]


def _metrics_tracker(db_url: str, hooks: list) -> tuple[Tracker, Clock]:
    clock = Clock()
    ids = iter(range(1_000_000))
    t = Tracker(
        open_store(db_url, projector=SessionProjector()),
        policy=Policy(attempt_lease_s=30, counter_policy="require_exact"),
        clock=clock,
        new_id=lambda: f"att-{next(ids)}",
        hooks=hooks,
    )
    return t, clock


def test_a_library_tracker_with_the_metrics_hook_counts_what_it_records(db_url):
    from prometheus_client import CollectorRegistry

    from tracker.metrics import DecisionMetrics

    upgrade(db_url)
    registry = CollectorRegistry()
    t, clock = _metrics_tracker(db_url, [DecisionMetrics(registry)])
    try:
        _scenario(t, clock, "metrics-1")
    finally:
        t.close()

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    assert value("tracker_decisions_total", action="proceed") == 2  # the retried call is not a second decision
    assert value("tracker_decisions_total", action="compact") == 3
    assert value("tracker_decisions_total", action="wait") == 1
    assert value("tracker_decisions_total", action="context_limit") == 1
    assert value("tracker_count_failures_total", kind="QualityMismatch") == 1
    assert value("tracker_attempts_started_total", reason="automatic") == 3
    assert value("tracker_attempts_started_total", reason="manual") == 1
    assert value("tracker_attempt_outcomes_total", outcome="committed") == 1
    assert value("tracker_attempt_outcomes_total", outcome="rejected") == 1
    assert value("tracker_attempt_outcomes_total", outcome="summary_too_large") == 1
    assert value("tracker_leases_expired_total") == 1
    assert value("tracker_decision_occupancy_bp_count") == 7  # every recorded measurement
    assert value("tracker_decision_occupancy_bp_bucket", le="1000.0") == 2  # the two at 100/1000 = 1000 bp


class Broken(TrackerHooksBase):
    """Every hook raises, and its context managers also try to swallow what they wrap."""

    def __init__(self) -> None:
        self.calls = 0

    def command(self, name, session_id, attempt_id, basis):
        self.calls += 1
        if name == "commit":
            raise RuntimeError("command hook")
        return self.Swallowing(fail_on_exit=name == "observe")

    def after_command(self, name, session_id, result):
        self.calls += 1
        raise RuntimeError("after_command hook")

    def phase(self, name):
        self.calls += 1
        return self.Swallowing(fail_on_enter=name == "decide", fail_on_exit=name == "append")

    def after_record(self, op, session_id, outcome):
        self.calls += 1
        raise RuntimeError("after_record hook")

    class Swallowing:
        def __init__(self, fail_on_enter: bool = False, fail_on_exit: bool = False) -> None:
            self.fail_on_enter, self.fail_on_exit = fail_on_enter, fail_on_exit

        def __enter__(self):
            if self.fail_on_enter:
                raise RuntimeError("enter")

        def __exit__(self, *exc):
            if self.fail_on_exit:
                raise RuntimeError("exit")
            return True  # would swallow a refusal, if a hook could


def test_a_hook_that_raises_never_breaks_or_changes_a_decision(db_url, caplog):
    import logging

    upgrade(db_url)
    broken = Broken()
    (plain, plain_clock), (hooked, hooked_clock) = _metrics_tracker(db_url, []), _metrics_tracker(db_url, [broken])
    try:
        with caplog.at_level(logging.DEBUG, logger="tracker.hooks"):
            expected, got = _scenario(plain, plain_clock, "plain"), _scenario(hooked, hooked_clock, "hooked")
        assert got == expected  # the same answers and the same refusals, raised
        assert [(e.type, e.data) for e in hooked.history("hooked")] == [
            (e.type, e.data) for e in plain.history("plain")
        ]
        assert hooked.state("hooked").to_data() | {"session_id": "plain"} == plain.state("plain").to_data()
    finally:
        plain.close()
        hooked.close()
    assert broken.calls > 40  # every hook was called, on every command
    errors = [r for r in caplog.records if r.name == "tracker.hooks" and r.levelno >= logging.ERROR]
    # logged once per hook and method, with its traceback; every later failure at debug level only
    assert sorted(r.getMessage() for r in errors) == sorted(
        f"hook Broken.{method} raised; ignored (logged once)"
        for method in ("command", "after_command", "phase", "after_record")
    )
    assert all(r.exc_info for r in errors)
    assert sum(r.levelno == logging.DEBUG for r in caplog.records if r.name == "tracker.hooks") > 20


def test_no_hooks_or_no_op_hooks_cost_nothing_per_command(tmp_path):
    from tracker.hooks import NOTHING

    t = Tracker(open_store(f"sqlite:///{tmp_path / 't.db'}", check_schema=False), hooks=[TrackerHooksBase()])
    try:
        assert t.hooks.commands is False  # commands are called directly
        assert t.hooks.phase("decide") is NOTHING  # and each phase is one shared no-op
    finally:
        t.close()
    with pytest.raises(TypeError):
        Tracker(open_store(f"sqlite:///{tmp_path / 't.db'}", check_schema=False), hooks=[object()])  # type: ignore[list-item]


def test_from_settings_attaches_the_metrics_hook_once_per_registry(tmp_path):
    from prometheus_client import REGISTRY

    from tracker.metrics import DecisionMetrics, decision_metrics
    from tracker.settings import Settings

    settings = Settings.of(database_url=f"sqlite:///{tmp_path / 't.db'}")
    with Tracker.from_settings(settings) as t1, Tracker.from_settings(settings) as t2:
        (h1,) = [h for h in t1.hooks.all if isinstance(h, DecisionMetrics)]
        (h2,) = [h for h in t2.hooks.all if isinstance(h, DecisionMetrics)]
        assert h1 is h2 is decision_metrics(REGISTRY)  # two Trackers, one set of counters
        before = REGISTRY.get_sample_value("tracker_decisions_total", {"action": "proceed"}) or 0.0
        t1.observe("lib-1", measurement=m("a", 10))
        t2.observe("lib-2", measurement=m("a", 10))
        assert REGISTRY.get_sample_value("tracker_decisions_total", {"action": "proceed"}) == before + 2
    off = Settings.of(database_url=f"sqlite:///{tmp_path / 't.db'}", metrics=False)
    with Tracker.from_settings(off) as t3:
        assert not any(isinstance(h, DecisionMetrics) for h in t3.hooks.all)
    with Tracker.from_settings(settings, hooks=[]) as t4:
        assert t4.hooks.all == ()
