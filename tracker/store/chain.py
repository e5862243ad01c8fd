"""The tamper-evident log's one rule: how an event's hash is chained to the previous event of its stream.

Each stored event carries ``hash = sha256(previous hash || canonical bytes of the event)``, where
the previous hash is that of the event one version earlier in the same session (``GENESIS`` for
version 1), and the canonical bytes are the UTF-8 of the compact, sorted-keys JSON (no ASCII
escaping) of ``[session_id, version, type, data]``::

    ["s1",1,"SessionStarted",{"a":1,"b":[true,null]}]

Numbers are written as a reader gets them back from every backend: PostgreSQL keeps ``data`` as
JSONB, whose numbers are decimals, so a float Python would write in exponent form with a positive
exponent (``1e+16``) comes back as an integer, and ``-0.0`` as ``0.0``; ``canonical_data`` writes
those floats the way they come back (``10000000000000000``, ``0.0``), so one event hashes the same
whether it is hashed at append time or from what any store reads back.

Who computes it: ``ct_append`` on PostgreSQL (migration 0010), from the canonical texts the client
sends (the server parses that same text into the stored row and checks its session and version);
SQLite and the in-memory store here in Python. ``tracker.store.verify.verify_chains`` recomputes
every chain. Changing anything here breaks every stored chain: don't.
"""

from __future__ import annotations

import hashlib
import json
from decimal import Decimal
from typing import Any

__all__ = ["GENESIS", "HASH_BYTES", "canonical", "canonical_data", "canonical_event", "canonical_json", "chain", "link"]

#: the "previous hash" of a stream's first event: 32 zero bytes
GENESIS = bytes(32)
HASH_BYTES = 32


#: the canonical JSON: compact, sorted keys, no ASCII escaping, no NaN (one encoder: ``json.dumps``
#: with options builds one per call). ``tracker.store.validate`` writes every event's data with it.
canonical_json = json.JSONEncoder(separators=(",", ":"), sort_keys=True, ensure_ascii=False, allow_nan=False).encode


def _normal(value: Any) -> Any:
    """``value`` with every float as JSONB gives it back (see the module doc)."""
    if isinstance(value, float):
        if value == 0.0:
            return 0.0
        text = repr(value)
        return int(Decimal(text)) if "e+" in text else value
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normal(v) for v in value]
    return value


def canonical_data(text: str) -> str:
    """The canonical text of an event's data, from its ``canonical_json`` text: the same text unless
    it holds a float JSONB gives back otherwise (then parsed and written again; a string holding
    ``e+`` or ``-0.0`` is parsed too, and comes out the same)."""
    if "e+" in text or "-0.0" in text:
        return canonical_json(_normal(json.loads(text)))
    return text


def canonical_event(session_id: str, version: int, type_: str, data_text: str) -> str:
    """The canonical JSON text of ``[session_id, version, type, data]``, ``data_text`` being ``canonical_data``'s."""
    return f"[{canonical_json(session_id)},{int(version)},{canonical_json(type_)},{data_text}]"


def canonical(session_id: str, version: int, type_: str, data: dict[str, Any]) -> bytes:
    """The canonical bytes of an event (the module doc)."""
    return canonical_event(session_id, version, type_, canonical_data(canonical_json(data))).encode("utf-8")


def link(previous: bytes, canonical_bytes: bytes) -> bytes:
    """``sha256(previous || canonical_bytes)``."""
    return hashlib.sha256(previous + canonical_bytes).digest()


def chain(previous: bytes | None, canonical_texts: list[str]) -> list[bytes | None]:
    """The hashes of consecutive events after one whose hash is ``previous`` (None: unchained, so
    are these)."""
    out: list[bytes | None] = []
    for text in canonical_texts:
        previous = None if previous is None else link(previous, text.encode("utf-8"))
        out.append(previous)
    return out
