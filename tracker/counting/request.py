"""The canonical shape of one complete LLM request, and its fingerprint.

A count proves which request it counted: every count carries the SHA-256 of the
canonical JSON encoding of the request (sorted keys, no whitespace,
``ensure_ascii=False``, UTF-8). Two spellings of the same request (a string
``content`` versus a single text part, OpenAI ``tool_calls`` versus Anthropic
``tool_use`` parts, a JSON string versus a JSON object for tool arguments) have
the same canonical form and therefore the same fingerprint.

Accepted input (``CanonicalRequest.from_dict``) is an OpenAI-chat / Anthropic-like
dict::

    {
      "system": str | [{"type": "text", "text": ...}, ...] | None,
      "messages": [
        {"role": "system"|"developer"|"user"|"assistant"|"tool",
         "content": str | None | [part, ...],
         "name": str (optional),
         "tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}] (optional, OpenAI),
         "tool_call_id": str (role "tool", OpenAI)},
        ...
      ],
      "tools": [{"name", "description", "input_schema"}                         (Anthropic)
                | {"type": "function", "function": {"name", "description", "parameters"}}  (OpenAI chat)
                | {"type": "function", "name", "description", "parameters"}]     (OpenAI responses)
    }

Content parts: ``{"type": "text", "text"}`` (also ``input_text`` / ``output_text``);
images ``{"type": "image"|"image_url"|"input_image", ...}`` — either a
placeholder carrying only ``width`` / ``height`` / ``detail`` or a real source
(Anthropic ``source`` object, OpenAI ``image_url``); ``{"type": "tool_use", "id",
"name", "input"}``; ``{"type": "tool_result", "tool_use_id", "content",
"is_error"}``. Other top-level keys of the dict (``model``, ``max_tokens``,
``temperature`` …) are not part of what is counted and are ignored.

Anything else is refused with :class:`tracker.errors.InvalidInput` whose
``field`` is the path of the bad value, e.g. ``messages[3].content[1].text``: among
it, JSON values (tool arguments, tool input schemas) nested deeper than
:data:`MAX_NESTING` levels, and text that is not Unicode (a lone surrogate).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tracker.errors import InvalidInput, an_object

ROLES = ("system", "developer", "user", "assistant", "tool")
IMAGE_DETAILS = ("auto", "low", "high")
_TEXT_TYPES = ("text", "input_text", "output_text")
_IMAGE_TYPES = ("image", "image_url", "input_image")
#: how deep a JSON value inside a request (tool arguments, a tool's input schema) may nest
MAX_NESTING = 64


def canonical_json(value: Any) -> str:
    """Sorted keys, no whitespace, non-ASCII kept as is; NaN/Infinity refused."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def fingerprint_of(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()


# -- parts -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextPart:
    text: str

    def to_data(self) -> dict[str, Any]:
        return {"type": "text", "text": self.text}


@dataclass(frozen=True)
class ImagePart:
    """An image, either a size-only placeholder or with its real ``source``.

    ``source`` is ``{"type": "base64", "media_type", "data"}`` or ``{"type": "url", "url"}``.
    """

    width: int | None = None
    height: int | None = None
    detail: str | None = None
    source: Mapping[str, Any] | None = None

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"type": "image"}
        if self.width is not None:
            data["width"] = self.width
        if self.height is not None:
            data["height"] = self.height
        if self.detail is not None:
            data["detail"] = self.detail
        if self.source is not None:
            data["source"] = _thaw(self.source)
        return data


@dataclass(frozen=True)
class ToolCallPart:
    """A call the assistant made.

    ``arguments`` is a JSON value (OpenAI's JSON-string arguments are parsed). When an
    OpenAI arguments string is not valid JSON it is kept verbatim and ``raw`` is true.
    """

    id: str
    name: str
    arguments: Any
    raw: bool = False

    def to_data(self) -> dict[str, Any]:
        data = {"type": "tool_call", "id": self.id, "name": self.name, "arguments": _thaw(self.arguments)}
        if self.raw:
            data["raw"] = True
        return data

    def arguments_text(self) -> str:
        """The arguments as text: canonical JSON, or the raw string when it was not JSON."""
        if self.raw:
            return str(self.arguments)
        return canonical_json(_thaw(self.arguments))


@dataclass(frozen=True)
class ToolResultPart:
    tool_call_id: str
    content: tuple[TextPart | ImagePart, ...]
    is_error: bool = False

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "type": "tool_result",
            "tool_call_id": self.tool_call_id,
            "content": [p.to_data() for p in self.content],
        }
        if self.is_error:
            data["is_error"] = True
        return data


Part = TextPart | ImagePart | ToolCallPart | ToolResultPart


@dataclass(frozen=True)
class Message:
    role: str
    content: tuple[Part, ...]
    name: str | None = None

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"role": self.role, "content": [p.to_data() for p in self.content]}
        if self.name is not None:
            data["name"] = self.name
        return data


@dataclass(frozen=True)
class ToolDef:
    name: str
    description: str
    parameters: Any  # a JSON schema (frozen)

    def to_data(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": _thaw(self.parameters)}


# -- the request -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CanonicalRequest:
    """System prompt, messages and tool definitions: everything that is counted."""

    system: tuple[TextPart, ...] = ()
    messages: tuple[Message, ...] = ()
    tools: tuple[ToolDef, ...] = ()

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any) -> CanonicalRequest:
        if isinstance(data, CanonicalRequest):
            return data
        if not isinstance(data, Mapping):
            raise InvalidInput("request", f"must be an object with 'messages', got {type(data).__name__}")
        system = _parse_system(data.get("system"))
        if "messages" not in data:
            raise InvalidInput("messages", "missing (a list of {role, content} objects)")
        raw_messages = data["messages"]
        if not isinstance(raw_messages, list):
            raise InvalidInput("messages", f"must be a list, got {type(raw_messages).__name__}")
        messages = tuple(_parse_message(m, f"messages[{i}]") for i, m in enumerate(raw_messages))
        raw_tools = data.get("tools")
        if raw_tools is None:
            tools: tuple[ToolDef, ...] = ()
        elif not isinstance(raw_tools, list):
            raise InvalidInput("tools", f"must be a list, got {type(raw_tools).__name__}")
        else:
            tools = tuple(_parse_tool(t, f"tools[{i}]") for i, t in enumerate(raw_tools))
        request = cls(system=system, messages=messages, tools=tools)
        request.canonical_json()  # any value JSON cannot carry is refused here, not later
        try:
            request.fingerprint  # noqa: B018 - encodes as UTF-8: text that is not Unicode is refused here
        except UnicodeEncodeError:
            field = _unencodable({k: data.get(k) for k in ("system", "messages", "tools")}, "") or "request"
            raise InvalidInput(field, "is not valid Unicode text (a lone surrogate)") from None
        return request

    # -- canonical form ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The canonical form. ``from_dict(r.to_dict())`` is ``r`` (same fingerprint)."""
        return {
            "system": [p.to_data() for p in self.system],
            "messages": [m.to_data() for m in self.messages],
            "tools": [t.to_data() for t in self.tools],
        }

    def canonical_json(self) -> str:
        """``canonical_json(self.to_dict())``, built from each message's own canonical JSON (the keys
        sorted: ``messages``, ``system``, ``tools``), which :meth:`history_digests` hashes again."""
        cached = self.__dict__.get("_canonical_json")
        if cached is None:
            try:
                messages = tuple(canonical_json(m.to_data()) for m in self.messages)
                head = canonical_json(
                    {"system": [p.to_data() for p in self.system], "tools": [t.to_data() for t in self.tools]}
                )
            except ValueError as exc:  # NaN / Infinity
                raise InvalidInput("request", f"is not representable as JSON: {exc}") from None
            pieces = ['{"messages":[']
            for i, text in enumerate(messages):
                if i:
                    pieces.append(",")
                pieces.append(text)
            pieces.append("]," + head[1:])
            cached = "".join(pieces)  # one copy of the whole text
            object.__setattr__(self, "_canonical_json", cached)
            object.__setattr__(self, "_parts_json", (head, messages))
        return cached

    @property
    def fingerprint(self) -> str:
        """SHA-256 hex of the canonical JSON encoding (UTF-8)."""
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            cached = hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest()
            object.__setattr__(self, "_fingerprint", cached)
        return cached

    def history_digests(self) -> tuple[str, ...]:
        """The digests of the request's history, message by message: ``d[0]`` of the system prompt
        and the tools, ``d[k + 1] = SHA-256(d[k] + canonical JSON of message k)``. Two requests with
        the same system prompt and tools share ``d[k]`` exactly when their first ``k`` messages are
        the same (what anchoring a decision on an earlier, billed request needs: behaviour.md)."""
        cached = self.__dict__.get("_history_digests")
        if cached is None:
            self.canonical_json()
            head, messages = self.__dict__["_parts_json"]
            d = hashlib.sha256(head.encode("utf-8")).hexdigest()
            out = [d]
            for text in messages:
                d = hashlib.sha256((d + text).encode("utf-8")).hexdigest()
                out.append(d)
            cached = tuple(out)
            object.__setattr__(self, "_history_digests", cached)
        return cached

    # -- views used by counters --------------------------------------------------------------

    def all_messages(self) -> tuple[Message, ...]:
        """The system prompt (as one ``system`` message, if any) followed by the messages."""
        if self.system:
            return (Message("system", tuple(self.system)),) + self.messages
        return self.messages


# -- parsing helpers -------------------------------------------------------------------------


def _parse_system(value: Any) -> tuple[TextPart, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (TextPart(value),) if value else ()
    if isinstance(value, list):
        parts = []
        for i, p in enumerate(value):
            field = f"system[{i}]"
            if isinstance(p, str):
                parts.append(TextPart(p))
                continue
            if not isinstance(p, Mapping) or p.get("type") not in _TEXT_TYPES:
                raise InvalidInput(field, "must be a text part {'type': 'text', 'text': ...}")
            parts.append(TextPart(_str(p.get("text"), field + ".text")))
        return tuple(parts)
    raise InvalidInput("system", f"must be a string, a list of text parts or null, got {type(value).__name__}")


def _parse_message(m: Any, field: str) -> Message:
    if not isinstance(m, Mapping):
        raise InvalidInput(field, f"must be an object with 'role' and 'content', got {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        raise InvalidInput(field + ".role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    name = m.get("name")
    if name is not None:
        name = _str(name, field + ".name", allow_empty=False)
    parts: list[Part] = []
    if "content" not in m and "tool_calls" not in m:
        raise InvalidInput(field + ".content", "missing")
    content = m.get("content")
    if role == "tool" and "tool_call_id" in m:
        # OpenAI tool message: the whole content is the result of one call.
        call_id = _str(m.get("tool_call_id"), field + ".tool_call_id", allow_empty=False)
        inner = _parse_result_content(content, field + ".content")
        parts.append(ToolResultPart(call_id, inner, bool(m.get("is_error", False))))
    else:
        parts.extend(_parse_content(content, field + ".content", role))
    tool_calls = m.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise InvalidInput(field + ".tool_calls", f"only assistant messages make tool calls, role is {role!r}")
        if not isinstance(tool_calls, list):
            raise InvalidInput(field + ".tool_calls", f"must be a list, got {type(tool_calls).__name__}")
        for j, call in enumerate(tool_calls):
            parts.append(_parse_openai_tool_call(call, f"{field}.tool_calls[{j}]"))
    return Message(role, tuple(parts), name)


def _parse_content(content: Any, field: str, role: str) -> list[Part]:
    if content is None:
        return []
    if isinstance(content, str):
        return [TextPart(content)] if content else []
    if not isinstance(content, list):
        raise InvalidInput(field, f"must be a string, a list of parts or null, got {type(content).__name__}")
    parts: list[Part] = []
    for i, p in enumerate(content):
        parts.append(_parse_part(p, f"{field}[{i}]", role))
    return parts


def _parse_part(p: Any, field: str, role: str) -> Part:
    if isinstance(p, str):
        return TextPart(p)
    if not isinstance(p, Mapping):
        raise InvalidInput(field, f"must be a content part object, got {type(p).__name__}")
    kind = p.get("type")
    if kind in _TEXT_TYPES:
        return TextPart(_str(p.get("text"), field + ".text"))
    if kind in _IMAGE_TYPES:
        return _parse_image(p, field)
    if kind in ("tool_use", "tool_call", "function_call"):
        if role != "assistant":
            raise InvalidInput(field + ".type", f"{kind!r} parts belong to assistant messages, role is {role!r}")
        if kind == "tool_use":  # Anthropic: input is a JSON object
            return _tool_call(p.get("id"), p.get("name"), p.get("input", {}), field, "input", parse=False)
        if kind == "tool_call":  # canonical form: arguments already parsed unless raw
            raw = p.get("raw", False)
            if not isinstance(raw, bool):
                raise InvalidInput(field + ".raw", f"must be true or false, got {raw!r}")
            if raw:
                return ToolCallPart(
                    _str(p.get("id"), field + ".id", allow_empty=False),
                    _str(p.get("name"), field + ".name", allow_empty=False),
                    _str(p.get("arguments"), field + ".arguments"),
                    raw=True,
                )
            return _tool_call(p.get("id"), p.get("name"), p.get("arguments", {}), field, "arguments", parse=False)
        # OpenAI responses item: arguments is a JSON string
        return _tool_call(
            p.get("call_id", p.get("id")), p.get("name"), p.get("arguments", "{}"), field, "arguments", parse=True
        )
    if kind in ("tool_result", "function_call_output"):
        call_id = p.get("tool_use_id", p.get("tool_call_id", p.get("call_id")))
        call_id = _str(call_id, field + ".tool_use_id", allow_empty=False)
        inner_key = "content" if "content" in p else "output"
        inner = _parse_result_content(p.get(inner_key), f"{field}.{inner_key}")
        is_error = p.get("is_error", False)
        if not isinstance(is_error, bool):
            raise InvalidInput(field + ".is_error", f"must be true or false, got {is_error!r}")
        return ToolResultPart(call_id, inner, is_error)
    raise InvalidInput(
        field + ".type",
        f"unknown content part type {kind!r} (text, image, image_url, input_image, tool_use, tool_result)",
    )


def _parse_result_content(content: Any, field: str) -> tuple[TextPart | ImagePart, ...]:
    if content is None:
        return ()
    if isinstance(content, str):
        return (TextPart(content),) if content else ()
    if not isinstance(content, list):
        raise InvalidInput(field, f"must be a string, a list of text/image parts or null, got {type(content).__name__}")
    out: list[TextPart | ImagePart] = []
    for i, p in enumerate(content):
        if isinstance(p, Mapping) and p.get("type") not in (*_TEXT_TYPES, *_IMAGE_TYPES):
            raise InvalidInput(f"{field}[{i}].type", "a tool result holds only text and image parts")
        part = _parse_part(p, f"{field}[{i}]", "tool")
        if not isinstance(part, (TextPart, ImagePart)):
            raise InvalidInput(f"{field}[{i}].type", "a tool result holds only text and image parts")
        out.append(part)
    return tuple(out)


def _parse_image(p: Mapping[str, Any], field: str) -> ImagePart:
    width = _opt_dim(p.get("width"), field + ".width")
    height = _opt_dim(p.get("height"), field + ".height")
    detail = p.get("detail")
    source: dict[str, Any] | None = None
    if "source" in p and p["source"] is not None:
        src = p["source"]
        if not isinstance(src, Mapping) or src.get("type") not in ("base64", "url"):
            raise InvalidInput(
                field + ".source", "must be {'type': 'base64', 'media_type', 'data'} or {'type': 'url', 'url'}"
            )
        if src["type"] == "base64":
            source = {
                "type": "base64",
                "media_type": _str(src.get("media_type"), field + ".source.media_type", allow_empty=False),
                "data": _str(src.get("data"), field + ".source.data", allow_empty=False),
            }
        else:
            source = {"type": "url", "url": _str(src.get("url"), field + ".source.url", allow_empty=False)}
    elif "image_url" in p and p["image_url"] is not None:
        iu = p["image_url"]
        if isinstance(iu, Mapping):
            url = _str(iu.get("url"), field + ".image_url.url", allow_empty=False)
            detail = iu.get("detail", detail)
        else:
            url = _str(iu, field + ".image_url", allow_empty=False)
        source = _source_from_url(url)
    if detail is not None and detail not in IMAGE_DETAILS:
        raise InvalidInput(field + ".detail", f"must be one of {', '.join(IMAGE_DETAILS)}, got {detail!r}")
    return ImagePart(width, height, detail, _freeze(source) if source is not None else None)


def _source_from_url(url: str) -> dict[str, Any]:
    if url.startswith("data:") and ";base64," in url:
        head, data = url[5:].split(";base64,", 1)
        return {"type": "base64", "media_type": head or "application/octet-stream", "data": data}
    return {"type": "url", "url": url}


def _parse_openai_tool_call(call: Any, field: str) -> ToolCallPart:
    an_object(field, call)
    fn = call.get("function")
    if not isinstance(fn, Mapping):
        raise InvalidInput(field + ".function", "must be an object with 'name' and 'arguments'")
    return _tool_call(
        call.get("id"), fn.get("name"), fn.get("arguments", "{}"), field, "function.arguments", parse=True
    )


def _tool_call(call_id: Any, name: Any, args: Any, field: str, args_field: str, parse: bool) -> ToolCallPart:
    call_id = _str(call_id, field + ".id", allow_empty=False)
    name = _str(name, field + ".name", allow_empty=False)
    if parse:
        if not isinstance(args, str):
            raise InvalidInput(f"{field}.{args_field}", f"must be a JSON string, got {type(args).__name__}")
        try:
            args = json.loads(args)
        except ValueError:
            return ToolCallPart(call_id, name, args, raw=True)
        except RecursionError:
            raise InvalidInput(f"{field}.{args_field}", f"nests deeper than {MAX_NESTING} levels") from None
    _check_json(args, f"{field}.{args_field}")
    return ToolCallPart(call_id, name, _freeze(args))


def _parse_tool(t: Any, field: str) -> ToolDef:
    an_object(field, t)
    if isinstance(t.get("function"), Mapping):  # OpenAI chat: {"type": "function", "function": {...}}
        fn = t["function"]
        prefix = field + ".function"
        schema_key = "parameters"
    else:
        fn = t
        prefix = field
        schema_key = "input_schema" if "input_schema" in t else "parameters"
    name = _str(fn.get("name"), prefix + ".name", allow_empty=False)
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise InvalidInput(prefix + ".description", f"must be a string, got {type(description).__name__}")
    schema = fn.get(schema_key)
    if schema is None:
        schema = {}
    if not isinstance(schema, Mapping):
        raise InvalidInput(f"{prefix}.{schema_key}", f"must be a JSON schema object, got {type(schema).__name__}")
    _check_json(schema, f"{prefix}.{schema_key}")
    return ToolDef(name, description, _freeze(schema))


def _str(value: Any, field: str, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise InvalidInput(field, f"must be a string, got {'missing' if value is None else type(value).__name__}")
    if not allow_empty and not value:
        raise InvalidInput(field, "must be a non-empty string")
    return value


def _opt_dim(value: Any, field: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidInput(field, f"must be a positive integer, got {value!r}")
    return value


def _check_json(value: Any, field: str, depth: int = 0) -> None:
    if value is None or isinstance(value, (str, bool, int)):
        return
    if depth >= MAX_NESTING and isinstance(value, (Mapping, list, tuple)):
        raise InvalidInput(field, f"nests deeper than {MAX_NESTING} levels")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput(field, f"must be finite, got {value!r}")
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidInput(field, f"object keys must be strings, got {k!r}")
            _check_json(v, f"{field}.{k}", depth + 1)
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(v, f"{field}[{i}]", depth + 1)
        return
    raise InvalidInput(field, f"is not JSON ({type(value).__name__})")


def _unencodable(value: Any, field: str, depth: int = 0) -> str | None:
    """The path of the first string (or key) in ``value`` that UTF-8 cannot encode, if any."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return field or "request"
        return None
    if depth > MAX_NESTING + 8:
        return None
    if isinstance(value, Mapping):
        for k, v in value.items():
            path = f"{field}.{k}" if field else str(k)
            if isinstance(k, str) and _unencodable(k, path) is not None:
                return path
            found = _unencodable(v, path, depth + 1)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _unencodable(v, f"{field}[{i}]", depth + 1)
            if found is not None:
                return found
    return None


class _FrozenDict(dict):
    """A dict that refuses mutation, so requests stay hashable-in-spirit and their fingerprint stable."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("canonical request values are read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(canonical_json(self))


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return _FrozenDict({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value
