"""OpenAI Agents SDK input items → the tracker's request shape (for :mod:`tracker.integrations.openai_agents`).

Responses-style input items (TypedDicts or the SDK's pydantic items) become :class:`Item` s: a
``function_call`` (any ``*_call`` item with a ``call_id``) is paired with its output, a
``reasoning`` item is bound to the item it precedes, leading system / developer messages are pinned.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from agents.handoffs import Handoff

from tracker.errors import InvalidInput
from tracker.integrations.compaction import SUMMARY_PREFIX, Item, View

_DROPPED_KEYS = frozenset({"id", "status", "type"})  # bookkeeping of an item, not what the model reads


# -- Responses-style input items → the tracker's request shape ---------------------------------


def _as_dict(item: Any) -> dict[str, Any]:
    if isinstance(item, Mapping):
        return dict(item)
    dump = getattr(item, "model_dump", None)
    if callable(dump):  # a pydantic item (the SDK's own types) rather than its TypedDict form
        return dict(dump(exclude_unset=True))
    raise InvalidInput("input", f"an input item must be a mapping, got {type(item).__name__}")


def json_text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)


def _part(p: Any) -> dict[str, Any]:
    if isinstance(p, str):
        return {"type": "text", "text": p}
    p = _as_dict(p)
    kind = p.get("type")
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": str(p.get("text", ""))}
    if kind == "refusal":
        return {"type": "text", "text": str(p.get("refusal", ""))}
    if kind == "input_image" and isinstance(p.get("image_url"), str) and p["image_url"]:
        image: dict[str, Any] = {"type": "input_image", "image_url": p["image_url"]}
        if p.get("detail") in ("low", "high", "auto"):
            image["detail"] = p["detail"]
        return image
    # files, audio, images by file id: counted as their JSON description (conservative)
    return {"type": "text", "text": json_text(p)}


def _content(content: Any) -> Any:
    if content is None or isinstance(content, str):
        return content or ""
    return [_part(p) for p in content]


def input_item(item: Any) -> Item:
    """One SDK input item as the tracker's request message(s), with the tool calls it makes / answers."""
    d = _as_dict(item)
    kind = d.get("type")
    role = d.get("role")
    if kind in (None, "message") and role in ("user", "system", "developer", "assistant"):
        return Item(({"role": role, "content": _content(d.get("content"))},))
    call_id = d.get("call_id")
    if kind == "function_call":
        args = d.get("arguments")
        call = {
            "type": "function_call",
            "call_id": str(call_id),
            "name": str(d.get("name", "")) or "function",
            "arguments": args if isinstance(args, str) else json_text(args),
        }
        return Item(({"role": "assistant", "content": [call]},), calls=frozenset({str(call_id)}))
    if kind == "function_call_output":
        output = d.get("output")
        content = output if isinstance(output, str) else [_part(p) for p in output or []]  # text and images
        return Item(
            ({"role": "tool", "tool_call_id": str(call_id), "content": content},), results=frozenset({str(call_id)})
        )
    if kind == "reasoning":
        texts = [str(s.get("text", "")) for s in (d.get("summary") or []) if isinstance(s, Mapping)]
        texts += [str(c.get("text", "")) for c in (d.get("content") or []) if isinstance(c, Mapping)]
        return Item(({"role": "assistant", "content": [{"type": "text", "text": "\n".join(texts)}]},))
    # hosted and custom tool calls and their outputs (computer, shell, apply_patch, custom, mcp ...),
    # item references, compaction items: their content as JSON text; paired by call_id like function calls
    body = {k: v for k, v in d.items() if k not in _DROPPED_KEYS}
    text = f"{kind}: {json_text(body)}"
    calls: frozenset[str] = frozenset()
    results: frozenset[str] = frozenset()
    if isinstance(kind, str) and isinstance(call_id, str) and call_id:
        if kind.endswith("_output"):
            results = frozenset({call_id})
        elif kind.endswith("_call"):
            calls = frozenset({call_id})
    if kind == "mcp_approval_request" and isinstance(d.get("id"), str):
        calls = frozenset({"approval:" + d["id"]})
    if kind == "mcp_approval_response" and isinstance(d.get("approval_request_id"), str):
        results = frozenset({"approval:" + d["approval_request_id"]})
    speaker = "tool" if results else "assistant" if calls or (kind or "").endswith("_call") else "user"
    if speaker == "tool":
        return Item(({"role": "tool", "tool_call_id": next(iter(results)), "content": text},), results=results)
    return Item(({"role": speaker, "content": text},), calls=calls)


def _is_pinned(d: Mapping[str, Any]) -> bool:
    return d.get("type") in (None, "message") and d.get("role") in ("system", "developer")


def items_of(items: Sequence[Any]) -> tuple[Item, ...]:
    """The items of a whole input: leading system/developer messages pinned; a ``reasoning`` item
    bound to the item after it (the Responses API refuses a call sent without its reasoning)."""
    out: list[Item] = []
    leading = True
    for i, raw in enumerate(items):
        d = _as_dict(raw)
        it = input_item(d)
        leading = leading and _is_pinned(d)
        if leading:
            it = Item(it.messages, it.calls, it.results, pinned=True)
        if i > 0 and _as_dict(items[i - 1]).get("type") == "reasoning":
            it = Item(it.messages, it.calls, it.results | {f"~reasoning:{i - 1}"}, it.pinned)
        if d.get("type") == "reasoning" and i + 1 < len(items):
            it = Item(it.messages, it.calls | {f"~reasoning:{i}"}, it.results, it.pinned)
        out.append(it)
    return tuple(out)


def _tool(t: Any) -> dict[str, Any]:
    if isinstance(t, Handoff):
        return {"name": t.tool_name, "description": t.tool_description or "", "parameters": t.input_json_schema or {}}
    name = str(getattr(t, "name", "") or type(t).__name__)
    schema = getattr(t, "params_json_schema", None)
    if isinstance(schema, Mapping):  # FunctionTool
        return {"name": name, "description": str(getattr(t, "description", "") or ""), "parameters": dict(schema)}
    # hosted tools (web search, file search, computer, shell ...): their configuration as the description
    config = getattr(t, "tool_config", None) or {
        k: v for k, v in getattr(t, "__dict__", {}).items() if not k.startswith("_")
    }
    return {"name": name, "description": json_text(config), "parameters": {}}


def _system(instructions: str | None, output_schema: str | None = None) -> list[dict[str, Any]] | None:
    parts = [{"type": "text", "text": instructions}] if instructions else []
    if output_schema:
        parts.append({"type": "text", "text": output_schema})
    return parts or None


def view_of(
    items: Sequence[Any],
    instructions: str | None = None,
    tools: Sequence[Any] = (),
    *,
    revision: int = 1,
    output_schema: str | None = None,
) -> View:
    """The complete request the SDK is about to send, as a :class:`View`."""
    return View(
        system=_system(instructions, output_schema),
        items=items_of(items),
        tools=tuple(_tool(t) for t in tools),
        revision=revision,
    )


def to_request(items: Sequence[Any], instructions: str | None = None, tools: Sequence[Any] = ()) -> dict[str, Any]:
    """The complete request (tracker shape): input items, instructions and the SDK's tools / handoffs."""
    return view_of(items, instructions, tools).request()


def summary_input_item(text: str) -> dict[str, Any]:
    """The input item a summary becomes (it maps to :func:`~tracker.integrations.compaction.summary_item`)."""
    return {"role": "user", "content": SUMMARY_PREFIX + text}


def transcript(items: Sequence[Any]) -> str:
    lines = []
    for raw in items:
        for d in input_item(raw).messages:
            content = d.get("content")
            text = content if isinstance(content, str) else json_text(content)
            lines.append(f"{d['role']}: {text}")
    return "\n".join(lines)
