"""The public calls as typed commands: each rule on a call's input is checked where the command is
built (``tracker.core.commands``). (The HTTP side of a fleet's scope: integration/test_http_scope.py.)"""

from __future__ import annotations

import pytest

from tracker.core.commands import Commit, Observe, ReportUsage, RequestCompaction, Wait
from tracker.errors import InvalidInput, InvalidPolicy, InvalidSessionId, MalformedMeasurement

M = {"basis": "m1", "input_tokens": 1, "input_limit": 10}


@pytest.mark.parametrize(
    "given, field",
    [
        (dict(), "request"),  # neither
        (dict(request={"messages": []}, measurement=M), "request"),  # both
        (dict(request={"messages": []}, basis="b"), "model"),
        (dict(request={"messages": []}, model="m"), "basis"),
        (dict(measurement=M, idempotency_key="a\x1bb"), "idempotency_key"),
        (dict(measurement=M, model=""), "model"),
        (dict(measurement=M, compaction_threshold=1.5), "compaction_threshold"),
        (dict(measurement=M, scope="recent-turns"), "scope_confidence"),
        (dict(measurement=M, policy={"compact_at_bp": 7000}), "policy"),
    ],
)
def test_an_observe_is_refused_where_it_is_built_naming_the_field(given, field):
    with pytest.raises(InvalidInput) as refused:
        Observe("s", **given)
    assert refused.value.field == field
    assert isinstance(refused.value, InvalidPolicy) == (field == "policy")


def test_every_command_checks_its_session_id_and_key():
    for build in (
        lambda sid: Observe(sid, measurement=M),
        lambda sid: RequestCompaction(sid),
        lambda sid: Commit(sid, "a", 1, 10),
        lambda sid: ReportUsage(sid, basis="m1", input_tokens=1),
        lambda sid: Wait(sid, "a"),
    ):
        with pytest.raises(InvalidSessionId):
            build("a b")
        assert build("team:s1").session_id == "team:s1"
    with pytest.raises(InvalidInput) as refused:
        Commit("s", "a", 1, 10, idempotency_key="")
    assert refused.value.field == "idempotency_key"
    with pytest.raises(InvalidInput) as refused:
        Wait("s", "a", timeout=-1)
    assert refused.value.field == "timeout"


def test_a_measurement_is_parsed_once_and_its_bare_basis_kept():
    c = Observe("s", measurement=M, compaction_threshold=0.5, overhead_tokens=3)
    assert c.measured is not None and str(c.measured.basis) == "r1:m1" and c.raw_basis == "m1"
    assert c.per_call() == {
        "compaction_threshold": 0.5,
        "scope": None,
        "scope_confidence": None,
        "overhead_tokens": 3,
    }
    with pytest.raises(MalformedMeasurement):
        Observe("s", measurement={**M, "input_tokens": -1})


def test_a_report_s_inputs_are_its_fields():
    r = ReportUsage("s", basis="r1:m1", input_tokens=5, cache_read_tokens=2, idempotency_key="k")
    assert r.given() == {
        "basis": "r1:m1",
        "input_tokens": 5,
        "model": None,
        "output_tokens": None,
        "cache_read_tokens": 2,
        "cache_write_tokens": None,
    }
