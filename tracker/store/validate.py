"""Every input check of the event store and its read side, in one place (behaviour.md "Events").

Each check raises a typed error naming the field (``InvalidInput``, ``InvalidSessionId``,
``PayloadTooLarge``) before anything is read or written, so every implementation of the ports
(``tracker.store.sql``, ``tracker.store.memory``, ``tracker.store.views``) refuses the same
input the same way. Integers are checked with ``tracker.core.model.is_int`` (a bool is no integer).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from tracker.core.model import check_session_id, is_int
from tracker.errors import InvalidInput, PayloadTooLarge
from tracker.store.base import (
    MAX_EVENT_TYPE_LEN,
    MAX_EVENTS_PER_APPEND,
    MAX_IDEMPOTENCY_KEY_LEN,
    NewEvent,
)
from tracker.store.chain import canonical_json

__all__ = [
    "check_append",
    "check_count",
    "check_data_key",
    "check_from_version",
    "check_key",
    "check_limit",
    "check_list_sessions",
    "check_prefix",
    "check_read_all",
    "check_read_stream",
    "check_session_id",
    "check_to_version",
    "check_types",
    "dumps",
    "dumps_data",
    "is_int",
]

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
_SESSION_PREFIX = re.compile(r"[A-Za-z0-9._:-]{1,200}")
_DATA_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def dumps(value: Any) -> str:
    """The compact JSON text the store keeps (no NaN, no ASCII escaping)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


#: an event's data as the store sends it: the canonical JSON of ``tracker.store.chain`` (``dumps`` with
#: sorted keys), so the chain needs no second encoding
dumps_data = canonical_json


def check_key(idempotency_key: Any) -> str | None:
    if idempotency_key is not None:
        if not isinstance(idempotency_key, str) or not 1 <= len(idempotency_key) <= MAX_IDEMPOTENCY_KEY_LEN:
            raise InvalidInput("idempotency_key", f"must be a string of 1-{MAX_IDEMPOTENCY_KEY_LEN} characters")
        if _CONTROL.search(idempotency_key):
            raise InvalidInput("idempotency_key", "must not contain control characters")
    return idempotency_key


def check_append(
    session_id: Any,
    expected_version: Any,
    events: Any,
    idempotency_key: Any,
    max_event_bytes: int,
    parse: bool = True,
) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """An append's input: (types, JSON texts (sorted keys), and -- with ``parse`` -- the data as a reader will get it back)."""
    check_session_id(session_id)
    if not is_int(expected_version) or expected_version < 0:
        raise InvalidInput("expected_version", f"must be an integer >= 0, got {expected_version!r}")
    check_key(idempotency_key)
    if type(events) not in (list, tuple) and (
        isinstance(events, (str, bytes, dict, NewEvent)) or not isinstance(events, Sequence)
    ):
        raise InvalidInput("events", "must be a list of NewEvent")
    if not events:
        raise InvalidInput("events", "must not be empty")
    if len(events) > MAX_EVENTS_PER_APPEND:
        raise InvalidInput("events", f"at most {MAX_EVENTS_PER_APPEND} events per append, got {len(events)}")
    types: list[str] = []
    texts: list[str] = []
    datas: list[dict[str, Any]] = []
    for i, ev in enumerate(events):
        etype = getattr(ev, "type", None)
        data = getattr(ev, "data", None)
        if not isinstance(etype, str) or not 1 <= len(etype) <= MAX_EVENT_TYPE_LEN:
            raise InvalidInput(
                f"events[{i}].type", f"must be a non-empty string of at most {MAX_EVENT_TYPE_LEN} characters"
            )
        if _CONTROL.search(etype):
            raise InvalidInput(f"events[{i}].type", "must not contain control characters")
        if not isinstance(data, dict):
            raise InvalidInput(f"events[{i}].data", f"must be a JSON object (dict), got {type(data).__name__}")
        try:
            text = dumps_data(data)
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidInput(f"events[{i}].data", f"not JSON-serialisable: {exc}") from None
        size = len(text.encode("utf-8"))
        if size > max_event_bytes:
            raise PayloadTooLarge(
                f"events[{i}].data",
                f"{size} bytes of JSON exceeds the limit of {max_event_bytes} bytes",
                size=size,
                limit=max_event_bytes,
            )
        if "\\u0000" in text and _JSON_NUL.search(text):
            raise InvalidInput(f"events[{i}].data", "strings must not contain NUL (\\u0000)")
        types.append(etype)
        texts.append(text)
        if parse:
            datas.append(json.loads(text))  # what a reader will get back
    return types, texts, datas


def check_from_version(from_version: Any) -> int:
    if not is_int(from_version) or from_version < 1:
        raise InvalidInput("from_version", "must be an integer >= 1")
    return int(from_version)


def check_to_version(to_version: Any, name: str = "to_version") -> int | None:
    if to_version is not None and not is_int(to_version):
        raise InvalidInput(name, "must be an integer or None")
    return to_version


def check_read_stream(session_id: Any, from_version: Any, to_version: Any) -> None:
    check_session_id(session_id)
    check_from_version(from_version)
    check_to_version(to_version)


def check_prefix(session_prefix: Any) -> str | None:
    if session_prefix is not None and (
        not isinstance(session_prefix, str) or not _SESSION_PREFIX.fullmatch(session_prefix)
    ):
        raise InvalidInput("session_prefix", "must be 1-200 characters of [A-Za-z0-9._:-] or None")
    return session_prefix


def check_limit(limit: Any) -> int:
    if not is_int(limit) or limit < 1:
        raise InvalidInput("limit", "must be an integer >= 1")
    return int(limit)


def check_read_all(after_position: Any, limit: Any, session_prefix: Any, types: Any = None) -> tuple[str, ...] | None:
    """The checks of ``read_all``; returns ``types`` as a sorted tuple of event type names (or None)."""
    if not is_int(after_position) or after_position < 0:
        raise InvalidInput("after_position", "must be an integer >= 0")
    check_limit(limit)
    check_prefix(session_prefix)
    if types is None:
        return None
    kinds = check_types(types)
    for t in kinds:
        if not _TYPE_NAME.fullmatch(t):
            raise InvalidInput("types", f"each must be an event type name ([A-Za-z][A-Za-z0-9_]*), got {t[:40]!r}")
    return tuple(sorted(kinds))


#: an event type name a ``read_all`` filter may name (so a filter can be written into SQL as a literal)
_TYPE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,99}")


def check_list_sessions(limit: Any, active_since: Any, session_prefix: Any, after: Any) -> None:
    check_limit(limit)
    if active_since is not None and not isinstance(active_since, datetime):
        raise InvalidInput("active_since", "must be a datetime")
    check_prefix(session_prefix)
    if after is not None and not (
        isinstance(after, tuple) and len(after) == 2 and isinstance(after[0], datetime) and isinstance(after[1], str)
    ):
        raise InvalidInput("after", "must be an (updated_at datetime, session_id) pair or None")


def check_types(types: Any) -> list[str]:
    """A non-empty list of event types, without repeats (in the order given)."""
    if isinstance(types, str) or not isinstance(types, Sequence) or not types:
        raise InvalidInput("types", "must be a non-empty list of event types")
    kinds = list(dict.fromkeys(types))
    for t in kinds:
        if not isinstance(t, str) or not 1 <= len(t) <= MAX_EVENT_TYPE_LEN:
            raise InvalidInput("types", f"each must be a string of 1-{MAX_EVENT_TYPE_LEN} characters")
    return kinds


def check_count(name: str, value: Any, lo: int, hi: int | None = None, *, optional: bool = False) -> None:
    """An integer from ``lo`` (to ``hi``); None too with ``optional``."""
    if optional and value is None:
        return
    if not is_int(value) or value < lo or (hi is not None and value > hi):
        if hi is not None:
            raise InvalidInput(name, f"must be an integer from {lo} to {hi}")
        raise InvalidInput(name, f"must be an integer >= {lo}" + (" or None" if optional else ""))


def check_data_key(key: Any, value: Any) -> None:
    if not isinstance(key, str) or not _DATA_KEY.fullmatch(key):
        raise InvalidInput("key", "must be a JSON field name of [A-Za-z0-9_]")
    if not isinstance(value, str) or len(value) > 1000:
        raise InvalidInput("value", "must be a string of at most 1000 characters")
