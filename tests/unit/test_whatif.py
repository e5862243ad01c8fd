"""``tracker whatif`` (the README): the CLI as a subprocess and the ``WhatIf`` runner in-process,
plus the example traces in ``examples/``."""

from __future__ import annotations

import json

import pytest

from tests.support.whatif_traces import BAD, EXAMPLES, GOOD, INSERT_AT, j, m, run
from tracker.audit.whatif import WhatIf
from tracker.core import fold

MEASURE_KEYS = {
    "pressure",
    "occupancy_bp",
    "action",
    "trigger",
    "threshold_bp",
    "threshold_source",
    "compact_level",
    "rearm_level",
    "attempt_id",
}


def test_outputs_per_spec():
    w, out = run(GOOD)
    assert len(out) == len(GOOD)
    for line, o in zip(GOOD, out, strict=True):
        if json.loads(line)["op"] == "measure":
            assert set(o) >= MEASURE_KEYS, o
        else:
            assert {"ok", "revision"} <= set(o), o
    assert [o.get("action") for o in out] == [
        "proceed",
        "compact",
        "wait",
        None,
        "proceed",
        "compact",
        None,
        "context_limit",
        None,
        None,
        "proceed",
    ]
    assert out[0] == {
        "pressure": "normal",
        "occupancy_bp": 1000,
        "action": "proceed",
        "trigger": None,
        "threshold_bp": 8000,
        "threshold_source": "default",
        "compact_level": 80,
        "rearm_level": 60,
        "attempt_id": None,
    }
    assert (out[1]["pressure"], out[1]["trigger"], out[1]["attempt_id"], out[1]["history_budget"]) == (
        "compact",
        "threshold",
        "a1",
        95,
    )
    assert out[2]["pressure"] == "hard_limit"
    assert out[3] == {"ok": True, "revision": 2, "attempt_id": "a1"}
    assert out[4]["pressure"] == "normal"
    assert (
        out[5]["threshold_bp"],
        out[5]["threshold_source"],
        out[5]["compact_level"],
        out[5]["rearm_level"],
        out[5]["attempt_id"],
    ) == (5000, "explicit", 50, 38, "a2")
    assert out[6] == {"ok": True, "revision": 2, "attempt_id": "a2"}
    assert out[8] == {"ok": True, "revision": 2, "attempt_id": "a3"}
    assert out[9] == {"ok": True, "revision": 3, "attempt_id": "a3"}
    assert (out[10]["threshold_bp"], out[10]["threshold_source"]) == (4500, "classifier")
    # the runner's state is the fold of the events it produced
    assert w.state == fold(w.events, "whatif")
    assert w.state.revision == 3


def test_bare_basis_is_through_at_the_current_revision_and_old_revisions_are_stale():
    w, out = run(
        [m("b1", 85), j(op="commit", tokens_after=10), m("b2", 10), m("r1:b3", 10), m("r2:b4", 10), m("r9:b4", 10)]
    )
    measured = [str(e.measurement.basis) for e in w.events if e.TYPE == "ContextMeasured"]
    assert measured == ["r1:b1", "r2:b2", "r2:b4"]
    assert out[3]["code"] == "stale_basis" and "r1:b3" in out[3]["error"]
    assert any(e.TYPE == "MeasurementRefused" for e in w.events)  # a stale count is on the record
    assert out[5]["field"] == "basis.revision"


def test_commit_and_reject_act_on_the_automatic_attempt_first():
    w, out = run([j(op="manual"), m("b1", 85), j(op="commit", tokens_after=10)])
    assert out[0]["attempt_id"] == "a1" and out[1]["attempt_id"] == "a2"
    assert out[2] == {"ok": True, "revision": 2, "attempt_id": "a2"}
    types = [e.TYPE for e in w.events]
    assert types[-2:] == ["CompactionCommitted", "CompactionRejected"]  # the manual one is superseded
    w, out = run([j(op="manual"), m("b1", 85), j(op="reject"), j(op="reject")])
    assert out[2]["attempt_id"] == "a2" and out[3]["attempt_id"] == "a1"


def test_summary_too_large_is_reported_not_an_error_line():
    w, out = run([m("b1", 85), j(op="commit", tokens_after=100), m("b1", 90), m("b2", 90)])
    assert out[1]["ok"] is False and out[1]["revision"] == 1 and out[1]["rejected"] == "summary_too_large"
    assert out[2]["action"] == "proceed"  # the basis is exhausted
    assert out[3]["action"] == "compact"


def test_at_drives_leases():
    w, out = run([m("b1", 85, at=10), m("b1", 86, at=70), m("b1", 86, at=70.5), j(op="commit", tokens_after=5, at=71)])
    assert out[0]["action"] == "compact"
    assert out[1]["action"] == "proceed"  # open exactly the lease (60 s): not expired yet
    assert out[2]["action"] == "proceed"  # open longer than the lease: recorded, basis exhausted
    assert [e.reject_reason for e in w.events if e.TYPE == "CompactionRejected"] == ["lease_expired"]
    assert out[3]["field"] == "op" and "no attempt is open" in out[3]["error"]


# -- bad lines -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, field", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
@pytest.mark.parametrize("pos", INSERT_AT)
def test_bad_line_is_an_error_line_and_changes_nothing(bad, field, pos):
    _, baseline = run(GOOD)
    w = WhatIf()
    outs = [w.step_line(line) for line in GOOD[:pos]]
    state, n_events = w.state, len(w.events)
    err = w.step_line(bad)
    assert set(err) >= {"error"} and "action" not in err and "ok" not in err
    if field is None:
        assert "JSON" in err["error"]
    else:
        assert err["field"] == field
        assert field in err["error"]
    assert w.state == state and len(w.events) == n_events  # state unchanged
    outs += [w.step_line(line) for line in GOOD[pos:]]
    assert outs == baseline  # the next good lines' outputs are what they would be without the bad line


def test_wrong_reject_reason_and_missing_tokens_after_are_bad_lines():
    w = WhatIf()
    assert w.step_line(m("b1", 85))["action"] == "compact"
    state = w.state
    assert w.step_line(j(op="commit"))["field"] == "tokens_after"
    assert w.step_line(j(op="commit", tokens_after=-3))["field"] == "tokens_after"
    assert w.step_line(j(op="reject", reject_reason=""))["field"] == "reject_reason"
    assert w.state == state
    assert w.step_line(j(op="commit", tokens_after=3)) == {"ok": True, "revision": 2, "attempt_id": "a1"}


def test_second_manual_is_an_error_line():
    w = WhatIf()
    assert w.step_line(j(op="manual"))["ok"] is True
    state = w.state
    out = w.step_line(j(op="manual"))
    assert out["code"] == "manual_attempt_open"
    assert w.state == state


# -- policy flags ---------------------------------------------------------------------------------


# -- the examples -----------------------------------------------------------------------------------


def test_examples_readme_mentions_each_trace_and_command():
    readme = (EXAMPLES / "README.md").read_text()
    for name in ("coding-session.jsonl", "failed-compaction.jsonl", "big-window.jsonl"):
        assert f"tracker whatif examples/{name}" in readme
    assert "--turn-delta 0.1" in readme


def test_hostile_lines_get_error_lines_and_the_run_goes_on():
    from tracker.audit.whatif import WhatIf

    w = WhatIf()
    lines = [
        '{"op":"measure","basis":"b","input_tokens":10,"input_limit":100,"scope":["a"],"scope_confidence":0.9}',
        '{"op":"measure","basis":"b","input_tokens":10,"input_limit":100,"compaction_threshold":' + "9" * 400 + "}",
        '{"op":"measure","basis":"b","input_tokens":10,"input_limit":100,"at":1e309}',
        "[" * 100_000 + "]" * 100_000,
        '{"op":"commit","tokens_after":5,"reason":"sideways"}',
        '{"op":"measure","basis":"b","input_tokens":10,"input_limit":100}',
    ]
    out = list(w.run(lines))
    assert [("error" in o) for o in out] == [True, True, True, True, True, False]
    assert out[0]["field"] == "scope" and out[1]["field"] == "compaction_threshold" and out[2]["field"] == "at"
    assert out[-1]["action"] == "proceed"


def test_a_line_may_carry_a_calibration_a_learned_limit_and_a_rejection():
    cal = {"factor_bp": 7500, "intercept": 300, "samples": 20, "median": "3/4", "mad": "0"}
    lines = [
        {
            "op": "measure",
            "basis": "b1",
            "counted_tokens": 100_000,
            "input_limit": 175_000,
            "quality": "heuristic_estimate",
            "calibration": cal,
        },
        {
            "op": "measure",
            "basis": "b1",
            "input_tokens": 100_000,
            "input_limit": 175_000,
            "quality": "exact_local",
            "calibration": cal,
        },
        {"op": "measure", "basis": "b1", "input_tokens": 100_000, "counted_tokens": 9, "input_limit": 175_000},
        {"op": "measure", "basis": "b1", "input_tokens": 100_000, "input_limit": 175_000, "learned_limit": 120_000},
        {"op": "rejection", "basis": "b1"},
        {"op": "measure", "basis": "b1", "input_tokens": 1_000, "input_limit": 175_000},
    ]
    out = list(WhatIf().run(json.dumps(x) for x in lines))
    assert out[0]["input_tokens"] == 75_300 and out[0]["calibration"]["factor_bp"] == 7500  # ceil(0.75 c) + 300
    assert "calibration" not in out[1]  # an exact count is not corrected
    assert out[2]["field"] == "counted_tokens"
    assert out[3]["input_limit"] == 120_000 and out[3]["action"] == "compact"  # 100k > 0.80 of 120k
    assert out[4] == {"ok": True, "rejected": "r1:b1"}
    assert out[5]["pressure"] == "hard_limit" and out[5]["rejected"]
    # without calibration: the raw count
    raw = list(WhatIf(calibrated=False).run([json.dumps(lines[0])]))
    assert "calibration" not in raw[0] and raw[0]["occupancy_bp"] == 100_000 * 10_000 // 175_000
