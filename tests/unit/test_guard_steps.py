"""The compaction guard's steps, driven by hand: no tracker, no counter, no share, no summariser.

``Guard.steps(session, view)`` is a generator of steps (``Observe``, ``Count``, ``Summarize``,
``Publish``, ``Commit``, ``Reject``, ``Wait``, ``FindCommit``, ``Fetch``); each test plays the tracker's
part by sending the core's own values back (or throwing its errors in) and checks what is asked next.
The guard is given a tracker it can never call (``object()``): the steps do no I/O.
"""

from __future__ import annotations

from typing import Any

import pytest

from tracker.core.decide import Result
from tracker.core.events import CompactionCommitted
from tracker.core.outcome import Decision
from tracker.core.state import Attempt, SessionState
from tracker.errors import StaleBasis, WaitTimeout
from tracker.integrations.compaction import (
    Commit,
    Count,
    Fetch,
    FindCommit,
    Guard,
    Item,
    Observe,
    Outcome,
    Publish,
    Reject,
    Replacement,
    Summarize,
    View,
    Wait,
    share_payload,
)

HARD, REARM = 2000, 1500


def view(n: int = 6, revision: int = 1) -> View:
    items = tuple(Item(({"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"},)) for i in range(n))
    return View(system="be brief", items=items, revision=revision)


def attempt(attempt_id: str = "a1", fencing_token: int = 3, history_budget: int = 1200) -> Attempt:
    return Attempt(
        attempt_id=attempt_id,
        reason="automatic",
        trigger="threshold",
        basis="r1:h0",
        fencing_token=fencing_token,
        opened_at=0.0,
        lease_expires_at=60.0,
        tokens_before=1800,
        input_limit=HARD,
        history_budget=history_budget,
    )


def result(action: str, version: int, **extra: Any) -> Result:
    decision = Decision(
        action=action,  # type: ignore[arg-type]
        pressure="normal",
        pressure_before="normal",
        occupancy_bp=0,
        threshold_bp=7000,
        threshold_source="policy",
        compact_level=1400,
        rearm_level=REARM,
        hard_level=HARD,
        growth_fired=False,
        trigger=None,
        basis="r1:h0",
        revision=1,
        **extra,
    )
    return Result(session_id="s", version=version, decision=decision)


def returned(steps: Any, reply: Any) -> Outcome:
    with pytest.raises(StopIteration) as stop:
        steps.send(reply)
    out: Outcome = stop.value.value
    return out


def guard(**options: Any) -> Guard:
    return Guard(object(), model="m", keep_last=2, **options)


def test_a_request_that_proceeds_is_observed_once_and_returned_as_given():
    g, v = guard(), view()
    steps = g.steps("s", v)
    assert next(steps) == Observe(v.request(), "m", v.basis())
    out = returned(steps, result("proceed", 4))
    assert out.view == v and out.replacements == []


def test_compact_counts_summarises_publishes_commits_and_observes_the_compacted_request():
    g, v, a = guard(), view(), attempt()
    steps = g.steps("s", v)
    next(steps)
    # the preferred cut keeps the last two entries: what it keeps is counted first
    assert steps.send(result("compact", 5, attempt=a)) == Count(v.request(v.items[:0] + v.items[4:]))
    ask = steps.send(100)
    # the room: the target (the lower of the budget and the rearm level) less what is kept and the margin
    assert ask == Summarize(v, 0, 4, 1200 - 100 - 24)
    count = steps.send("  The user asked; four turns happened.  ")
    assert isinstance(count, Count) and count.request["messages"][0]["content"].endswith("four turns happened.")
    publish = steps.send(300)
    assert isinstance(publish, Publish) and publish.attempt_id == "a1"
    assert steps.send(None) == Commit("a1", 3, 300)
    again = steps.send(SessionState("s", version=6, revision=2))
    assert isinstance(again, Observe) and again.basis.startswith("r2:h")
    out = returned(steps, result("proceed", 7))
    (rep,) = out.replacements
    assert (rep.start, rep.end, rep.revision, rep.tokens_after, rep.summary) == (
        0,
        4,
        2,
        300,
        "The user asked; four turns happened.",
    )
    assert publish.payload == share_payload(v, rep) and out.view == v.apply(rep)


def test_a_summariser_that_raises_is_rejected_as_summarizer_error_and_the_request_observed_again():
    g, v, a = guard(), view(), attempt()
    steps = g.steps("s", v)
    next(steps)
    steps.send(result("compact", 5, attempt=a))
    assert isinstance(steps.send(100), Summarize)
    assert steps.throw(RuntimeError("model down")) == Reject("a1", 3, "summarizer_error")
    assert steps.send(SessionState("s", version=6)) == Observe(v.request(), "m", v.basis())


def test_a_compacted_request_over_the_budget_is_rejected_as_summary_over_budget():
    g, v, a = guard(), view(), attempt()
    steps = g.steps("s", v)
    next(steps)
    steps.send(result("compact", 5, attempt=a))
    steps.send(100)
    steps.send("a summary")
    assert steps.send(1201) == Reject("a1", 3, "summary_over_budget")


def test_wait_waits_for_the_holders_attempt_and_a_timeout_observes_again():
    g, v = guard(wait_timeout_s=7.0), view()
    steps = g.steps("s", v)
    next(steps)
    assert steps.send(result("wait", 5, waiting_on=attempt("other"))) == Wait("other", 7.0)
    assert steps.throw(WaitTimeout("still open")) == Observe(v.request(), "m", v.basis())


def test_a_stale_basis_adopts_the_commit_found_after_the_last_version_seen():
    g, v = guard(), view()
    first = g.steps("s", v)
    next(first)
    returned(first, result("proceed", 40))  # this guard last saw the session at version 40, revision 1

    steps = g.steps("s", v)
    next(steps)
    assert steps.throw(StaleBasis("older than r2")) == FindCommit(revision=2, from_version=40)
    commit = CompactionCommitted(
        attempt_id="theirs",
        reason="automatic",
        basis=v.basis(),
        new_revision=2,
        tokens_before=1800,
        tokens_after=500,
        duration_ms=10,
    )
    assert steps.send(commit) == Fetch("theirs")
    payload = share_payload(v, Replacement(0, 3, "their summary", 2))
    again = steps.send(payload)
    assert isinstance(again, Observe) and again.basis.startswith("r2:h")
    out = returned(steps, result("proceed", 45))
    (rep,) = out.replacements
    assert rep.adopted and (rep.attempt_id, rep.start, rep.end, rep.tokens_after) == ("theirs", 0, 3, 500)


def test_a_stale_basis_with_nothing_to_adopt_is_raised_and_an_unseen_session_is_read_from_the_start():
    g, v = guard(), view()
    steps = g.steps("never-seen", v)
    next(steps)
    assert steps.throw(StaleBasis("older than r2")) == FindCommit(revision=2, from_version=1)
    with pytest.raises(StaleBasis):
        steps.send(None)


def test_a_version_seen_at_a_later_revision_does_not_bound_the_search():
    g = guard()
    later = g.steps("s", view(revision=3))
    next(later)
    returned(later, result("proceed", 90))
    steps = g.steps("s", view(revision=1))  # an older copy of the history: its commit is before version 90
    next(steps)
    assert steps.throw(StaleBasis("older than r3")) == FindCommit(revision=2, from_version=1)
