"""The ``tracker whatif`` traces the unit and the e2e tests share: a trace that visits every action and
op (``GOOD``), bad lines with the field each must name (``BAD``), where they may be inserted
(``INSERT_AT``), the runner (``run``), line builders (``j``, ``m``) and the example traces (``example``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tracker.audit.whatif import WhatIf
from tracker.core import Policy

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(lines: list[str], policy: Policy | None = None) -> tuple[WhatIf, list[dict[str, Any]]]:
    w = WhatIf(policy=policy or Policy())
    return w, list(w.run(lines))


def j(**op: Any) -> str:
    return json.dumps(op)


def m(basis: str, used: int, limit: int = 100, **kw: Any) -> str:
    return j(op="measure", basis=basis, input_tokens=used, input_limit=limit, **kw)


# A trace that visits every action and op (default policy, limit 100: compact 80, rearm 60, hard 100).
GOOD = [
    m("b1", 10),  # 0 proceed
    m("b2", 85),  # 1 compact a1
    m("b3", 100),  # 2 wait
    j(op="commit", tokens_after=30),  # 3 revision 2
    m("b4", 40),  # 4 normal (rearm)
    m("b5", 70, compaction_threshold=0.5),  # 5 compact a2 (explicit)
    j(op="reject", reject_reason="execution_failed"),  # 6
    m("b5", 100),  # 7 context_limit (exhausted basis)
    j(op="manual"),  # 8 a3
    j(op="commit", tokens_after=20),  # 9 revision 3
    m("b6", 20, scope="current-message", scope_confidence=0.9),  # 10 classifier
]


BAD = [
    (m("x", -5), "input_tokens"),
    (m("x", 1.5), "input_tokens"),
    (m("x", 10, 0), "input_limit"),
    (j(op="measure", basis="x", input_tokens=10), "input_limit"),
    (j(op="measure", input_tokens=10, input_limit=100), "basis"),
    (m("x", 10, compaction_threshold=1.5), "compaction_threshold"),
    (
        '{"op":"measure","basis":"x","input_tokens":10,"input_limit":100,"compaction_threshold":NaN}',
        "compaction_threshold",
    ),
    (m("x", 10, compaction_threshold="high"), "compaction_threshold"),
    (m("x", 10, scope="whole-repo", scope_confidence=0.9), "scope"),
    (m("x", 10, scope="recent-turns", scope_confidence=7), "scope_confidence"),
    (m("x", 10, quality="vibes"), "quality"),
    (m("x", 10, colour="blue"), "colour"),
    (m("x", 10, at="soon"), "at"),
    (m("x", 10, overhead_tokens=-1), "overhead_tokens"),
    ('{"op": "measure", "basis": "x", ', None),  # malformed JSON
    ("not json at all", None),
    (j(op="explode"), "op"),
    (j(nothing="here"), "op"),
    ("[1, 2, 3]", "op"),
    ('"measure"', "op"),
    ("42", "op"),
    (j(op="commit", tokens_after=5), "op"),  # no attempt open at the insertion points
    (j(op="reject"), "op"),
]


INSERT_AT = [0, 1, 4, 8]  # positions in GOOD where no attempt is open


def example(name: str) -> list[str]:
    text = (EXAMPLES / name).read_text()
    lines = [x for x in text.splitlines() if x.strip()]
    for x in lines:
        assert isinstance(json.loads(x), dict)  # comment-free JSON lines
    return lines
