"""Decisions anchored on the session's own billed count (behaviour.md "Anchoring"), through the
``Tracker`` against the simulated provider (its tokenizer differs from every shipped counter).

The fleet mixes coding sessions and sessions over Chinese documents under one heuristic-counted
model: the heuristic over-counts the two kinds by different factors, so one factor per model cannot
fit both. Each session reports the usage of every turn (as an integration does); a request that
extends the last billed one is decided on ``billed + estimate(new messages)``. Run with ``-s`` to
see the figures.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.support.bench import (
    ANTHROPIC_LIKE,
    CJK_DOCUMENTS,
    CODING_AGENT,
    MIXED,
    SHIFTED,
    SimProvider,
    mixed_fleet,
    resumed,
    session,
)
from tests.support.provider_loop import MODEL, Run, observe_session, tracker
from tracker.audit.replay import whatif_rows
from tracker.core import events as ev
from tracker.core.anchor import Anchor, AnchorPoint, RequestShape, anchor_decision, delta_factor
from tracker.core.model import Basis, Measurement, ModelRef
from tracker.core.policy import Policy
from tracker.core.state import SessionState, fold
from tracker.errors import InvalidInput
from tracker.queries import verify
from tracker.service import Tracker

KINDS = MIXED


def _fleet(t: Tracker, prefix: str, sim: SimProvider, reports: int, rng: random.Random) -> int:
    return mixed_fleet(t, f"fM:{prefix}", sim, reports, rng)


def _resumed(t: Tracker, sim: SimProvider, label: str) -> dict[str, float]:
    return resumed(t, sim, f"fM:resumed-{label}", 175_424)


def _fresh(t: Tracker, sim: SimProvider, label: str, rng: random.Random, *, report: bool) -> dict[str, Run]:
    runs = {}
    for kind, workload in KINDS.items():
        runs[kind] = observe_session(t, f"fM:{label}-{kind}", MODEL, sim, session(rng, workload, 400), report=report)
    return runs


def _check(runs: dict[str, Run], label: str) -> dict[str, float]:
    points = {}
    for kind, run in runs.items():
        assert run.compacted_at is not None
        limit = run.input_limit
        # nothing over the limit was let through: every request before the compact is under it
        assert all(billed < limit for _, billed in run.pairs[:-1])
        past = [d / b for d, b in run.pairs if b >= 0.2 * limit]
        points[kind] = run.compacted_at[1] / limit
        print(
            f"  {label} {kind}: compacts at turn {run.compacted_at[0]}, {points[kind]:.3f} of the billed limit;"
            f" decided/billed past a fifth {min(past):.3f}-{max(past):.3f}"
        )
    return points


@pytest.mark.slow
def test_a_mixed_fleet_compacts_each_kind_at_076_084_of_the_billed_limit_and_follows_a_billing_shift() -> None:
    t = tracker()
    rng = random.Random("mixed-fleet")
    sim = SimProvider(ANTHROPIC_LIKE)
    _fleet(t, "train", sim, 140, rng)
    [row] = [r for r in t.calibration("fM") if r.model == MODEL]
    kinds = {kind: cal for kind, cal, _ in row.contents}
    assert kinds["latin"] is not None and kinds["cjk"] is not None
    # the heuristic over-counts the two kinds by different factors
    assert kinds["cjk"].factor_bp < kinds["latin"].factor_bp - 150
    print(
        f"\nfleet of code and Chinese-document sessions, {row.usage_reports} reports ({row.anchored} anchored):"
        f" model factor {row.calibration.factor_bp if row.calibration else None},"
        f" per kind {[(k, c.factor_bp if c else None) for k, c in kinds.items()]}"
    )

    # no reports of its own: decided by the calibration (per kind of content, per model)
    _check(_fresh(t, sim, "calibrated", rng, report=False), "calibrated only")
    # every turn reported: anchored on the session's own billed count
    points = _check(_fresh(t, sim, "anchored", rng, report=True), "anchored")
    assert all(0.76 <= p <= 0.84 for p in points.values()), points
    anchored = [e.data for e in t.history("fM:anchored-zh") if e.type == "ContextMeasured"]
    assert anchored[0]["anchor"] is None and all(m["anchor"] is not None for m in anchored[1:])
    assert all(m["calibration"] is None for m in anchored[1:])

    # a resumed session: its first request is already large, with no billed count of its own yet
    resumed = _resumed(t, sim, "before")
    print(f"  resumed sessions, first request at 0.6 of the limit: decided/billed {resumed}")
    assert all(0.95 <= r <= 1.10 for r in resumed.values()), resumed

    # the provider's billing changes under the model (a new snapshot)
    shifted = SimProvider(SHIFTED)
    stale = _resumed(t, shifted, "at-shift")
    points = _check(_fresh(t, shifted, "after-shift", rng, report=True), "just after the shift, anchored")
    assert all(0.76 <= p <= 0.84 for p in points.values()), points
    _fleet(t, "post-shift", shifted, 30, rng)
    converged = _resumed(t, shifted, "after-30")
    print(f"  resumed: at the shift {stale}; 30 reports after it {converged}")
    assert min(stale.values()) < 0.95  # the calibration before the shift under-counts the new billing
    assert all(0.95 <= r <= 1.10 for r in converged.values()), converged
    [row] = [r for r in t.calibration("fM") if r.model == MODEL]
    assert row.anchored > 0
    assert verify(t.store)["ok"]


def test_replay_of_an_anchored_session_equals_the_live_decisions() -> None:
    t = tracker()
    sim = SimProvider(ANTHROPIC_LIKE)
    rng = random.Random("replay-anchored")
    requests = session(rng, CJK_DOCUMENTS, 200)
    run = observe_session(t, "fR:s", MODEL, sim, requests, report=True)
    assert run.compacted_at is not None
    attempt = t.state("fR:s").open_automatic
    assert attempt is not None
    t.commit("fR:s", attempt.attempt_id, attempt.fencing_token, tokens_after=5_000)
    assert t.state("fR:s").anchor is None  # a compaction clears the anchor
    # the next revision: its first request is not anchored, the one after its report is
    again = session(rng, CJK_DOCUMENTS, 3)
    after = observe_session(t, "fR:s", MODEL, sim, again, report=True)
    recorded = [e.data for e in t.history("fR:s") if e.type == "ContextMeasured"]
    assert sum(m["anchor"] is not None for m in recorded) >= len(recorded) - 3
    assert recorded[len(run.pairs)]["anchor"] is None and recorded[-1]["anchor"] is not None
    assert [d for d, _ in run.pairs + after.pairs] == [m["input_tokens"] for m in recorded]

    rows = [r for r in whatif_rows(t.history("fR:s"), t.policy, "fR:s", uncalibrated=True) if r["op"] == "measure"]
    assert not any(r["changed"] for r in rows)
    assert [
        r["whatif"].get("input_tokens", m["measurement"]["input_tokens"]) for r, m in zip(rows, recorded, strict=True)
    ] == [m["input_tokens"] for m in recorded]
    assert [r["whatif"].get("anchor") for r in rows] == [m["anchor"] for m in recorded]
    # without calibration (TRACKER_CALIBRATION=off) nothing is anchored: the raw heuristic decides
    assert all("anchor" not in r["uncalibrated"] for r in rows)
    assert any(r["changed_uncalibrated"] for r in rows)
    assert verify(t.store)["ok"]


def test_a_bad_report_is_refused_typed_and_writes_nothing_and_an_implausible_one_anchors_nothing() -> None:
    t = tracker()
    sim = SimProvider(ANTHROPIC_LIKE)
    requests = session(random.Random("bad-reports"), CODING_AGENT, 12)
    observe_session(t, "fB:s", MODEL, sim, requests[:6], report=True)
    anchor = t.state("fB:s").anchor
    assert anchor is not None and anchor.basis == "r1:m5"
    before = len(list(t.history("fB:s")))
    for bad, field in (
        ({"input_tokens": -1}, "input_tokens"),
        ({"input_tokens": 10**9}, "input_tokens"),
        ({"input_tokens": "many"}, "input_tokens"),
        ({"input_tokens": 1000, "cache_read_tokens": 1.5}, "cache_read_tokens"),
        ({"input_tokens": 1000, "model": "gpt-4o"}, "model"),
    ):
        with pytest.raises(InvalidInput) as err:
            t.report_usage("fB:s", basis="m5", **bad)
        assert err.value.field == field
    with pytest.raises(InvalidInput) as err:
        t.report_usage("fB:s", basis="m99", input_tokens=1000)
    assert err.value.field == "basis"
    assert len(list(t.history("fB:s"))) == before and t.state("fB:s").anchor == anchor
    # a recorded report the estimator would ignore (20x the count) does not anchor the session either
    d = t.observe("fB:s", request=requests[6], model=MODEL, basis="m6").decision
    t.report_usage("fB:s", basis="m6", input_tokens=d.counted_tokens * 20)
    assert t.state("fB:s").anchor == anchor


# -- the pure rule -------------------------------------------------------------------------------

H = "a" * 64
H2 = "b" * 64


def _measure(state: SessionState, tokens: int, shape: RequestShape | None, *, model: str = MODEL) -> Any:
    from tracker.core.decide import decide_measure

    m = Measurement(
        Basis(state.revision, f"m{state.version}"),
        ModelRef("anthropic", model),
        H,
        tokens,
        100_000,
        "heuristic_estimate",
    )
    return decide_measure(state, Policy(), m, now=1.0, new_attempt_id="a1", shape=shape)


def _anchored_state() -> SessionState:
    s = fold([ev.SessionStarted(policy=Policy())], "s")
    s = _measure(s, 40_000, RequestShape(10, H)).state
    usage = ev.UsageReported(
        basis="r1:m1",
        model=MODEL,
        quality="heuristic_estimate",
        counted_tokens=40_000,
        input_tokens=28_000,
        messages=10,
        chain=H,
    )
    return fold([usage], "s", s)


def test_a_request_extending_the_billed_one_is_decided_on_billed_plus_the_new_messages() -> None:
    s = _anchored_state()
    assert s.anchor == AnchorPoint("r1:m1", MODEL, "heuristic_estimate", 10, H, 40_000, 28_000)
    out = _measure(s, 44_000, RequestShape(12, H2, 10, H))
    e = out.events[-1]
    factor = delta_factor(28_000, 40_000)
    assert factor == 7210  # 0.7 x 1.03, rounded up to a basis point
    assert e.anchor == Anchor("r1:m1", 28_000, 40_000, factor, -(-4_000 * factor // 10_000))
    assert e.input_tokens == 28_000 + 2_884 and e.calibration is None
    # not a prefix, another position, fewer tokens, another model: not anchored
    for shape, tokens, model in (
        (RequestShape(12, H2, 10, H2), 44_000, MODEL),
        (RequestShape(12, H2, 9, H), 44_000, MODEL),
        (RequestShape(12, H2, 10, H), 39_000, MODEL),
        (RequestShape(12, H2), 44_000, MODEL),
        (None, 44_000, MODEL),
        (RequestShape(12, H2, 10, H), 44_000, "claude-opus-4-1"),
    ):
        assert _measure(s, tokens, shape, model=model).events[-1].anchor is None
    # a measurement of another model clears the anchor
    assert _measure(s, 44_000, RequestShape(12, H2, 10, H), model="claude-opus-4-1").state.anchor is None


def test_a_shape_is_checked_and_the_rule_is_exact() -> None:
    for data, field in (
        ({"messages": -1, "chain": H}, "shape.messages"),
        ({"messages": 3, "chain": "x"}, "shape.chain"),
        ({"messages": 3, "chain": H, "at": 4, "at_chain": H}, "shape.at"),
        ({"messages": 3, "chain": H, "at": 2}, "shape.at"),
        ({"messages": 3, "chain": H, "content": "klingon"}, "shape.content"),
        ("no", "shape"),
    ):
        with pytest.raises(InvalidInput) as err:
            RequestShape.from_data(data)
        assert err.value.field == field
    shape = RequestShape(3, H, 2, H2, "cjk")
    assert RequestShape.from_data(shape.to_data()) == shape
    point = AnchorPoint("r2:m1", MODEL, "heuristic_estimate", 2, H2, 10_000, 7_000)
    kw = dict(model=MODEL, quality="heuristic_estimate", counted=10_000)
    assert anchor_decision(point, shape, basis_revision=1, **kw) is None  # another revision
    same = anchor_decision(point, shape, basis_revision=2, **kw)
    assert same is not None and same.decided == 7_000  # the billed request itself: its billed count


def test_history_digests_name_a_prefix_and_the_kind_of_content_is_read_from_the_characters() -> None:
    from tracker.counting.backends import shape_of
    from tracker.counting.counters import content_kind
    from tracker.counting.request import CanonicalRequest, canonical_json

    def req(*texts: str, system: str = "be brief") -> CanonicalRequest:
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]
        return CanonicalRequest.from_dict({"system": system, "messages": messages})

    short, longer = req("a", "b"), req("a", "b", "c", "d")
    assert longer.history_digests()[:3] == short.history_digests()
    assert req("a", "x", "c").history_digests()[1] == short.history_digests()[1]
    assert req("a", "x", "c").history_digests()[2] != short.history_digests()[2]
    assert req("a", "b", system="other").history_digests()[0] != short.history_digests()[0]
    # the canonical JSON built from the messages' own is the whole request's, as before
    assert longer.canonical_json() == canonical_json(longer.to_dict())
    assert CanonicalRequest().canonical_json() == canonical_json(CanonicalRequest().to_dict())
    shape = shape_of(longer, 2)
    assert (shape.messages, shape.at, shape.at_chain) == (4, 2, short.history_digests()[2])
    assert shape_of(short, 3).at is None  # a shorter request cannot extend a 3-message anchor
    assert content_kind(req("def f(x):\n    return x + 1")) == "latin"
    assert content_kind(req("请总结这份文件的要点，并列出三个问题。", "好的。")) == "cjk"
    assert content_kind(req("Пожалуйста, кратко изложите этот документ.")) == "other_script"


def test_the_ledger_corrects_each_kind_of_content_by_its_own_samples_once_it_has_20() -> None:
    from tracker.core.calibration import MIN_SAMPLES
    from tracker.core.ledger import CalibrationLedger

    def usage(counted: int, billed: int, content: str, anchored: bool = False) -> ev.UsageReported:
        return ev.UsageReported(
            basis="r1:m1", model=MODEL, quality="heuristic_estimate", counted_tokens=counted,
            input_tokens=billed, content=content, anchored=anchored,
        )  # fmt: skip

    ledger = CalibrationLedger()
    for i in range(MIN_SAMPLES):
        ledger.fold("f", usage(20_000 + 997 * i, (20_000 + 997 * i) * 76 // 100, "latin", anchored=i > 0), f"s{i}")
    for i in range(MIN_SAMPLES - 1):
        ledger.fold("f", usage(20_000 + 991 * i, (20_000 + 991 * i) * 70 // 100, "cjk"), f"c{i}")
    model = ledger.calibration("f", MODEL, "heuristic_estimate")
    latin = ledger.calibration("f", MODEL, "heuristic_estimate", "latin")
    assert model is not None and latin is not None and latin != model
    # cjk has 19 samples of its own: the model's calibration
    assert ledger.calibration("f", MODEL, "heuristic_estimate", "cjk") == model
    ledger.fold("f", usage(60_000, 42_000, "cjk"), "c-last")
    cjk = ledger.calibration("f", MODEL, "heuristic_estimate", "cjk")
    assert cjk is not None and cjk.factor < latin.factor
    assert ledger.calibration("f", MODEL, "exact_local", "cjk") is None  # exact counts are never corrected
    [row] = ledger.summaries("f")
    assert row.anchored == MIN_SAMPLES - 1 and [k for k, _, _ in row.contents] == ["cjk", "latin"]
    assert row.to_data()["contents"]["cjk"]["samples"] == MIN_SAMPLES


def test_cached_tokens_count_as_billed_input_of_the_anchor() -> None:
    t = tracker()
    sim = SimProvider(ANTHROPIC_LIKE)
    requests = session(random.Random("cached"), CODING_AGENT, 8)
    for i, request in enumerate(requests[:6]):
        t.observe("fC:s", request=request, model=MODEL, basis=f"m{i}")
    billed = sim.billed(requests[5])
    # Anthropic's usage: uncached input, cache read and cache write, added up
    t.report_usage("fC:s", basis="m5", input_tokens=300, cache_read_tokens=billed - 1_300, cache_write_tokens=1_000)
    anchor = t.state("fC:s").anchor
    assert anchor is not None and anchor.billed == billed
    d = t.observe("fC:s", request=requests[6], model=MODEL, basis="m6").decision
    assert 0.99 <= d.input_tokens / sim.billed(requests[6]) <= 1.05


def test_a_report_recorded_by_another_process_anchors_this_ones_next_decision() -> None:
    from tracker.core.state import SessionProjector
    from tracker.store import MemoryEventStore

    store = MemoryEventStore(projector=SessionProjector())
    here, there = tracker(store), tracker(store)  # two processes on one log: each has its own cache
    sim = SimProvider(ANTHROPIC_LIKE)
    requests = session(random.Random("two-processes"), CJK_DOCUMENTS, 8)
    for i, request in enumerate(requests[:6]):
        here.observe("fP:s", request=request, model=MODEL, basis=f"m{i}")
    there.report_usage("fP:s", basis="m5", input_tokens=sim.billed(requests[5]))
    d = here.observe("fP:s", request=requests[6], model=MODEL, basis="m6").decision
    recorded = [e.data for e in here.history("fP:s") if e.type == "ContextMeasured"][-1]
    assert recorded["anchor"] is not None and recorded["anchor"]["basis"] == "r1:m5"
    assert 0.99 <= d.input_tokens / sim.billed(requests[6]) <= 1.05
