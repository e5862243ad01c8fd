"""The basis digest as a cross-language contract: docs/vectors/basis.json against the Python implementation.

Each vector is a request with what Python computes for it: its canonical JSON, fingerprint,
the digest of its history (``tracker.integrations.compaction.digest`` over one item per
message), the basis ``View.basis()`` writes at the vector's revision and the heuristic count;
or, for bad input, the ``InvalidInput`` code and field. ``numbers`` pairs JSON number texts with
the canonical JSON Python writes for them. ``conversations`` holds one conversation as two
frameworks hold it (LangChain messages, an AI SDK prompt) with the history's canonical form and
the basis both adapters must compute for it. The TypeScript client checks the same file
(clients/typescript/test/canonical.test.mjs); docs/canonical-request.md is the prose.

After a deliberate change of the canonical form, rewrite the expected values with
``python3 tests/unit/test_basis_vectors.py --write`` (and say so: every other implementation breaks).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from tracker.counting.counters import heuristic_request_tokens
from tracker.counting.request import CanonicalRequest, canonical_json
from tracker.errors import InvalidInput
from tracker.integrations.compaction import Item, View, digest
from tracker.integrations.langchain import view_of

VECTORS = Path(__file__).resolve().parents[2] / "docs" / "vectors" / "basis.json"


def load() -> dict[str, Any]:
    return json.loads(VECTORS.read_text(encoding="utf-8"))


def expected(vector: dict[str, Any]) -> dict[str, Any]:
    """What the Python implementation computes for a vector's request."""
    request = vector["request"]
    try:
        canonical = CanonicalRequest.from_dict(request)
    except InvalidInput as exc:
        return {"error": {"code": exc.code, "field": exc.field}}
    items = tuple(Item((m,)) for m in request["messages"])
    view = View(
        system=request.get("system"), items=items, tools=tuple(request.get("tools") or ()), revision=vector["revision"]
    )
    return {
        "canonical": canonical.canonical_json(),
        "fingerprint": canonical.fingerprint,
        "history_digest": digest(items),
        "basis": view.basis(),
        "heuristic_tokens": heuristic_request_tokens(canonical),
    }


def langchain_messages(spec: list[dict[str, Any]]) -> list[Any]:
    """LangChain messages from the vectors' plain form: ``{"type": "human" | "ai" | "tool" | "system", ...}``."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    kinds = {"human": HumanMessage, "ai": AIMessage, "tool": ToolMessage, "system": SystemMessage}
    return [kinds[m["type"]](**{k: v for k, v in m.items() if k != "type"}) for m in spec]


def conversation_expected(conversation: dict[str, Any]) -> dict[str, Any]:
    """What the LangChain adapter computes for a conversation's history."""
    from langchain_core.messages import SystemMessage

    lc = conversation["langchain"]
    system = SystemMessage(lc["system"]) if "system" in lc else None
    view = view_of(langchain_messages(lc["messages"]), system)
    history = CanonicalRequest.from_dict({"messages": view.request()["messages"]})
    return {
        "history_canonical": history.canonical_json(),
        "history_digest": digest(view.items),
        "basis": view.basis(),
    }


def number_canonical(text: str) -> str:
    return canonical_json(json.loads(text))


VECTOR_CASES = load()["vectors"]
NUMBER_CASES = load()["numbers"]
CONVERSATIONS = load()["conversations"]


@pytest.mark.parametrize("vector", VECTOR_CASES, ids=[v["name"] for v in VECTOR_CASES])
def test_the_python_implementation_computes_each_vector(vector):
    want = expected(vector)
    got = {k: vector.get(k) for k in want}
    assert got == want


@pytest.mark.parametrize("case", NUMBER_CASES, ids=[c["json"] for c in NUMBER_CASES])
def test_numbers_are_written_as_python_writes_them(case):
    assert number_canonical(case["json"]) == case["canonical"]


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=[c["name"] for c in CONVERSATIONS])
def test_the_langchain_adapter_computes_each_conversation(conversation):
    want = conversation_expected(conversation)
    assert {k: conversation.get(k) for k in want} == want


def test_the_conversations_cover_tool_batches_and_revisions():
    """A step with several tool results (one LangChain message each, one AI SDK message for all) and a
    compacted history (revision above 1) are among the conversations both adapters are checked on."""
    steps = [
        m
        for c in CONVERSATIONS
        for m in c["ai_sdk"]["prompt"]
        if m["role"] == "tool" and sum(p["type"] == "tool-result" for p in m["content"]) > 1
    ]
    assert steps
    assert {c["basis"].split(":")[0] for c in CONVERSATIONS} >= {"r1", "r2"}


def test_the_vectors_cover_the_contract():
    """Every shape, both kinds of outcome, revisions above 1, and the equalities the doc promises."""
    by_name = {v["name"]: v for v in VECTOR_CASES}
    assert len(by_name) == len(VECTOR_CASES), "vector names are unique"
    ok = [v for v in VECTOR_CASES if "error" not in v]
    errors = [v for v in VECTOR_CASES if "error" in v]
    assert len(ok) >= 10 and len(errors) >= 10
    assert {v["revision"] for v in ok} > {1}
    a, b = by_name["one user message"], by_name["string content equals one text part"]
    assert a["canonical"] == b["canonical"] and a["basis"] == b["basis"]
    fixed = by_name["canonical form as input"]
    assert canonical_json(json.loads(fixed["canonical"])) == fixed["canonical"]
    again = CanonicalRequest.from_dict(json.loads(fixed["canonical"]))
    assert again.fingerprint == fixed["fingerprint"], "the canonical form is a fixed point"
    for v in ok:
        assert v["basis"] == f"r{v['revision']}:h{v['history_digest']}"
        assert len(v["history_digest"]) == 32 and len(v["fingerprint"]) == 64


def _floats(value: Any) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        return [f for v in value.values() for f in _floats(v)]
    if isinstance(value, list):
        return [f for v in value for f in _floats(v)]
    return []


def test_the_vectors_are_portable():
    """A JSON reader without an int/float distinction (JavaScript) reads the same values: no
    integral float outside JSON strings, no integer beyond 2**53 - 1 (see docs/canonical-request.md)."""
    for v in VECTOR_CASES:
        for f in _floats(v["request"]):
            assert not (math.isfinite(f) and f.is_integer() and abs(f) < 1e21), (v["name"], f)

        def ints(value: Any) -> list[int]:
            if isinstance(value, bool):
                return []
            if isinstance(value, int):
                return [value]
            if isinstance(value, dict):
                return [i for x in value.values() for i in ints(x)]
            if isinstance(value, list):
                return [i for x in value for i in ints(x)]
            return []

        assert all(abs(i) <= 2**53 - 1 for i in ints(v["request"])), v["name"]


def write() -> None:
    data = load()
    for v in data["vectors"]:
        for key in ("canonical", "fingerprint", "history_digest", "basis", "heuristic_tokens", "error"):
            v.pop(key, None)
        v.update(expected(v))
    for case in data["numbers"]:
        case["canonical"] = number_canonical(case["json"])
    for conversation in data["conversations"]:
        conversation.update(conversation_expected(conversation))
    text = json.dumps(data, ensure_ascii=False, indent=1)
    # a lone surrogate (one vector is about refusing it) is written as its \\u escape
    VECTORS.write_bytes(text.encode("utf-8", "backslashreplace") + b"\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        print(__doc__)
