"""The session page's "why nothing was eligible" follows the core's own rule, never a restatement of it.

``tracker.core.decide.eligibility`` is the one rule: ``decide_measure`` opens an automatic attempt
exactly when it says so, and the account (``tracker.audit.story.account``) says which of its
conditions failed by calling it on the core's state of the session at the hard limit. Sessions here
are written by the decision core itself (observe-only, an exhausted basis, the loop breaker's cap),
read back as stored rows (``build_story``, and ``read_story`` on a real SQLite store, with and without
an event after the limit), and each reason's sentence is checked against the function's answer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.support.core_caller import T0, CoreCaller
from tracker.audit import story as story_mod
from tracker.audit.pages import _plural
from tracker.audit.story import Limit, Story, account, build_story, ineligible_because, read_story, why_at_limit
from tracker.bootstrap import build_views
from tracker.core import Basis, Measurement, ModelRef, Policy, SessionProjector, SessionState, fold
from tracker.core import decide as decide_mod
from tracker.core.decide import (
    ELIGIBLE,
    INELIGIBLE,
    Eligibility,
    decide_manual,
    decide_measure,
    decide_reject,
    eligibility,
)
from tracker.core.events import DomainEvent
from tracker.core.state import Attempt
from tracker.errors import ContextLimitError
from tracker.queries import decode
from tracker.store import NewEvent, StoredEvent, open_store, upgrade

L = 100_000  # default levels on this limit: compact 80,000, rearm 60,000, hard 100,000

#: what the account says for each of the core's reasons (a fixed text: the test can fail)
SAID = {
    "observe_only": "the session's policy is observe-only, so no automatic attempt could open",
    "not_under_pressure": "the growth trigger did not fire, so no attempt was due",
    "basis_exhausted": "had already had its attempt and nothing else was eligible",
    "attempt_open": "an automatic attempt was still open, so no other could start",
    "episode_cap": "the loop breaker allowed no more (3 automatic attempts per episode)",
}


def why_line(story: Story) -> str:
    """The account's second line (why nothing was eligible), its first letter as in the middle of a sentence."""
    line = account(story)[1]
    return line[0].lower() + line[1:]


def meas(through: str, used: int, revision: int = 1) -> Measurement:
    return Measurement(
        basis=Basis(revision, through),
        model=ModelRef("test", "model"),
        fingerprint="ab" * 32,
        input_tokens=used,
        input_limit=L,
        quality="exact_local",
    )


class Caller(CoreCaller):
    """Plays the caller of the core and keeps what it recorded, as the store would hand it back."""

    def measure(self, through: str, used: int) -> Any:
        self.now += 1
        self.n += 1
        out = decide_measure(
            self.state, self.policy, meas(through, used, self.state.revision), now=self.now, new_attempt_id=f"a{self.n}"
        )
        return self.record(out)

    def reject(self, attempt: Attempt, reason: str = "summarizer_error") -> Any:
        self.now += 1
        return self.record(
            decide_reject(
                self.state,
                attempt_id=attempt.attempt_id,
                fencing_token=attempt.fencing_token,
                reject_reason=reason,
                now=self.now,
            )
        )

    def manual(self) -> Any:
        self.now += 1
        self.n += 1
        return self.record(decide_manual(self.state, self.policy, now=self.now, new_attempt_id=f"m{self.n}"))


def observe_only() -> Caller:
    c = Caller(Policy(automatic=False, rearm_below_bp=0))
    assert c.measure("m1", 50_000).decision.action == "proceed"
    out = c.measure("m2", 101_000)
    assert isinstance(out.error, ContextLimitError)
    return c


def basis_exhausted() -> Caller:
    c = Caller(Policy())
    out = c.measure("m1", 90_000)
    assert out.decision.action == "compact"
    c.reject(out.decision.attempt)
    out = c.measure("m1", 101_000)  # the same basis again, now over the limit: it had its attempt
    assert isinstance(out.error, ContextLimitError)
    return c


def episode_cap() -> Caller:
    c = Caller(Policy(max_automatic_per_episode=3))
    for i in range(1, 4):
        out = c.measure(f"m{i}", 85_000 + i * 1000)
        assert out.decision.action == "compact"
        c.reject(out.decision.attempt)
    out = c.measure("m9", 101_000)  # a fresh basis, but the episode has had its three attempts
    assert isinstance(out.error, ContextLimitError)
    return c


SESSIONS = {"observe_only": observe_only, "basis_exhausted": basis_exhausted, "episode_cap": episode_cap}


# -- the core's rule ----------------------------------------------------------------------------------


def test_each_reason_is_the_first_condition_that_fails():
    state = SessionState(session_id="s")
    on = Policy()
    assert eligibility(state, on, basis="r1:x", pressure="compact", grew=False) is ELIGIBLE
    assert eligibility(state, on, basis="r1:x", pressure="normal", grew=True) is ELIGIBLE
    cases = {
        "observe_only": (state, Policy(automatic=False, rearm_below_bp=0), "hard_limit"),
        "not_under_pressure": (state, on, "normal"),
        "basis_exhausted": (dataclasses.replace(state, exhausted=frozenset({"r1:x"})), on, "hard_limit"),
        "attempt_open": (
            dataclasses.replace(
                state, open_attempts=(Attempt("a", "automatic", "threshold", "r1:y", 1, 0, 9, 1, L, 1),)
            ),
            on,
            "compact",
        ),
        "episode_cap": (dataclasses.replace(state, episode_automatic=3), on, "compact"),
    }
    assert set(cases) == set(INELIGIBLE)
    for reason, (st, policy, pressure) in cases.items():
        assert eligibility(st, policy, basis="r1:x", pressure=pressure, grew=False) == Eligibility(False, reason)
    # earlier conditions win: observe-only on an exhausted basis is observe-only
    st = dataclasses.replace(state, exhausted=frozenset({"r1:x"}), episode_automatic=5)
    assert (
        eligibility(
            st, Policy(automatic=False, rearm_below_bp=0), basis="r1:x", pressure="hard_limit", grew=False
        ).reason
        == "observe_only"
    )
    assert eligibility(st, on, basis="r1:x", pressure="hard_limit", grew=False).reason == "basis_exhausted"
    # a manual attempt blocks nothing
    manual = Attempt("m", "manual", "manual", "r1:y", 1, 0, 9, 1, L, 1)
    assert eligibility(
        dataclasses.replace(state, open_attempts=(manual,)), on, basis="r1:x", pressure="compact", grew=False
    ).eligible


def test_decide_measure_opens_an_attempt_exactly_when_the_rule_says_so(monkeypatch):
    """``decide_measure`` decides with ``eligibility``: overriding the rule changes the decision."""
    c = Caller(Policy())
    assert c.measure("m1", 10_000).decision.action == "proceed"
    monkeypatch.setattr(decide_mod, "eligibility", lambda *a, **k: ELIGIBLE)
    assert c.measure("m2", 10_000).decision.action == "compact"  # normal pressure, yet "eligible"
    monkeypatch.setattr(decide_mod, "eligibility", lambda *a, **k: Eligibility(False, "episode_cap"))
    c2 = Caller(Policy())
    assert isinstance(c2.measure("m1", 101_000).error, ContextLimitError)


# -- the account follows it -------------------------------------------------------------------------


@pytest.mark.parametrize("reason", sorted(SESSIONS))
def test_the_account_of_a_core_written_session_names_the_rule_s_reason(reason):
    c = SESSIONS[reason]()
    story = build_story("s", c.stored(), table_rows=0)
    assert story.ended_at_limit and story.limit_state is not None
    assert story.limit_state == fold(c.events, "s")  # the core's own fold, at the limit
    why = why_at_limit(story)
    assert why == Eligibility(False, reason)
    said = account(story)
    assert "reached its hard limit" in said[0]
    line = why_line(story)
    assert SAID[reason] in line, line
    assert ineligible_because(why, story.limit_event.basis, story.limit_state.policy) in line
    others = [SAID[r] for r in INELIGIBLE if r != reason]
    assert not any(o in line for o in others), line


@pytest.mark.parametrize("reason", INELIGIBLE)
def test_the_sentence_follows_the_function_for_every_reason(monkeypatch, reason):
    """Whatever the rule answers, the account says that (also for reasons a context-limit decision
    cannot have today): the sentence is chosen by the function's answer, not by the story's own reading."""
    story = build_story("s", basis_exhausted().stored(), table_rows=0)
    monkeypatch.setattr(story_mod, "eligibility", lambda *a, **k: Eligibility(False, reason))
    assert SAID[reason] in why_line(story)
    monkeypatch.setattr(story_mod, "eligibility", lambda *a, **k: ELIGIBLE)
    assert "no attempt was eligible on r1:m1" in why_line(story)


def test_without_the_core_s_state_the_account_does_not_guess():
    story = Story(session_id="s", version=2, limit_event=Limit(2, T0, "r1:x", 101_000, L))
    story.counts["events"] = 2
    assert why_at_limit(story) is None
    assert account(story)[1] == "No attempt was eligible on r1:x."


# -- read through a real store ------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    url = f"sqlite:///{tmp_path / 'why.db'}"
    upgrade(url)
    s = open_store(url, projector=SessionProjector())
    yield s
    s.close()


def _append(store: Any, sid: str, events: list[DomainEvent], version: int = 0) -> int:
    return store.append(sid, version, [NewEvent(e.TYPE, e.to_data()) for e in events]).last_version


@pytest.mark.parametrize("reason", sorted(SESSIONS))
def test_read_story_asks_the_rule_on_the_projection(store, reason):
    c = SESSIONS[reason]()
    _append(store, reason, c.events)
    narrow = read_story(store, reason, views=build_views(store))
    full = build_story(reason, store.read_stream(reason), table_rows=0)
    assert narrow.limit_state == full.limit_state == fold(c.events, reason)
    assert why_at_limit(narrow) == Eligibility(False, reason)
    assert account(narrow) == account(full) and SAID[reason] in why_line(narrow)


def test_one_event_after_the_limit_the_state_is_the_one_at_the_limit(store):
    """A manual attempt opened right after the limit: the account still explains the limit with the
    state the decision saw (the projection has moved on; the log is folded up to the limit)."""
    c = basis_exhausted()
    at_limit = fold(c.events, "late")
    c.manual()
    _append(store, "late", c.events)
    narrow = read_story(store, "late", views=build_views(store))
    full = build_story("late", store.read_stream("late"), table_rows=0)
    assert narrow.ended_at_limit and narrow.version == narrow.limit_event.version + 1
    assert narrow.limit_state == full.limit_state == dataclasses.replace(at_limit, session_id="late")
    assert account(narrow) == account(full) and SAID["basis_exhausted"] in why_line(narrow)


def test_a_window_from_the_middle_is_not_folded():
    c = episode_cap()
    story = build_story("s", c.stored()[3:], table_rows=0)
    assert story.limit_state is None and why_at_limit(story) is None


def test_decoded_rows_are_the_core_s_classes():
    c = basis_exhausted()
    for row, event in zip(c.stored(), c.events, strict=True):
        r = decode(row)
        assert r.event == event and type(r.event) is type(event) and r.type == event.TYPE
    odd = decode(StoredEvent(1, "s", 1, "Tick", {"x": 1}, T0, None))
    assert odd.type == "Tick" and "unknown event type" in odd.event.problem
    broken = decode(StoredEvent(1, "s", 1, "CompactionRejected", {"attempt_id": "a"}, T0, None))
    assert broken.type == "CompactionRejected" and "missing" in broken.event.problem


# -- counts read right ----------------------------------------------------------------------------------


def test_counts_read_right():
    assert _plural(1, "context-limit error") == "1 context-limit error"
    assert _plural(2, "context-limit error") == "2 context-limit errors"
    assert _plural(0, "count failure") == "0 count failures"
    assert _plural(1_000, "event") == "1,000 events"
    c = Caller(Policy())
    c.measure("m1", 10_000)
    said = account(build_story("s", c.stored()[:1], table_rows=0))
    assert said[-1].endswith("across 1 event."), said
