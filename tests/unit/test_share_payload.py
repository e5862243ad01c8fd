"""A shared compaction's payload (docs/canonical-request.md, section 6): its span in request messages.

Adapters split one history into different items (the AI SDK's tool message of two results is one item
of two request messages, LangChain's two ToolMessages two items); the payload names positions in the
request messages, so a holder in one adapter and an adopter in another agree on the span.
clients/typescript/test/share.test.mjs checks the TypeScript side on the same history.
"""

from __future__ import annotations

import json

from tracker.integrations import DirectoryShare
from tracker.integrations.compaction import Item, Replacement, View, digest, share_payload, shared_span


def tool(call: str) -> dict:
    return {"role": "tool", "tool_call_id": call, "content": f"result {call}"}


USER = Item(({"role": "user", "content": "Go"},))
CALLS = Item(
    (
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": c, "type": "function", "function": {"name": "f", "arguments": "{}"}} for c in ("a", "b")
            ],
        },
    ),
    calls=frozenset({"a", "b"}),
)
TAIL = Item(({"role": "assistant", "content": "Done"},))
# the same history, held two ways: both results in one item, or one item each
ONE_ITEM = View(None, (USER, CALLS, Item((tool("a"), tool("b")), results=frozenset({"a", "b"})), TAIL))
TWO_ITEMS = View(
    None,
    (USER, CALLS, Item((tool("a"),), results=frozenset({"a"})), Item((tool("b"),), results=frozenset({"b"})), TAIL),
)


def test_one_history_held_two_ways_has_one_basis():
    assert ONE_ITEM.basis() == TWO_ITEMS.basis()


def test_a_compaction_made_in_one_shape_is_adopted_in_the_other():
    payload = share_payload(ONE_ITEM, Replacement(0, 3, "S", 2))
    assert (payload["start"], payload["end"]) == (0, 4)  # four request messages, three items
    assert payload["span"] == digest(ONE_ITEM.items[:3])
    assert shared_span(TWO_ITEMS, payload) == (0, 4, "S")
    assert shared_span(ONE_ITEM, share_payload(TWO_ITEMS, Replacement(0, 4, "S", 2))) == (0, 3, "S")
    assert TWO_ITEMS.apply(Replacement(0, 4, "S", 2)).basis() == ONE_ITEM.apply(Replacement(0, 3, "S", 2)).basis()


def test_a_payload_that_does_not_fit_the_history_is_not_adopted():
    payload = share_payload(TWO_ITEMS, Replacement(0, 3, "S", 2))  # ends between the two results
    assert payload["end"] == 3
    assert shared_span(ONE_ITEM, payload) is None  # not a boundary of this history's items
    good = share_payload(ONE_ITEM, Replacement(0, 3, "S", 2))
    for bad in ({"from_revision": 2}, {"span": "0" * 32}, {"end": 99}, {"summary": 7}, {"start": True}):
        assert shared_span(ONE_ITEM, {**good, **bad}) is None, bad
    assert shared_span(ONE_ITEM, None) is None


def test_directory_share_writes_the_layout_the_typescript_share_reads(tmp_path):
    share = DirectoryShare(tmp_path / "nested")
    assert share.get("s-1", "a1") is None
    payload = share_payload(ONE_ITEM, Replacement(0, 3, "héllo ✓", 2))
    share.put("s-1", "a1", payload)
    assert [p.name for p in (tmp_path / "nested").iterdir()] == ["s-1__a1.json"]
    assert json.loads((tmp_path / "nested" / "s-1__a1.json").read_text(encoding="utf-8")) == payload
    assert share.get("s-1", "a1") == payload
