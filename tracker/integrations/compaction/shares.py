"""Sharing a compaction with the other holders of the same history, and the payload they exchange.

A holder publishes its compaction to a :class:`SummaryShare` before committing it; a holder whose
basis went stale finds the commit in the tracker's history and takes the summary from the share.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tracker.integrations.compaction.view import Item, Replacement, View, digest


class SummaryShare(Protocol):
    """Where a holder publishes its compaction (before committing) so others can adopt it."""

    def put(self, session_id: str, attempt_id: str, payload: dict[str, Any]) -> None: ...

    def get(self, session_id: str, attempt_id: str) -> dict[str, Any] | None: ...


class MemoryShare:
    """Within one process (threads, or one agent whose state update was lost)."""

    def __init__(self) -> None:
        self._data: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def put(self, session_id: str, attempt_id: str, payload: dict[str, Any]) -> None:
        with self._lock:
            self._data[(session_id, attempt_id)] = dict(payload)

    def get(self, session_id: str, attempt_id: str) -> dict[str, Any] | None:
        with self._lock:
            found = self._data.get((session_id, attempt_id))
            return dict(found) if found is not None else None


class RedisShare:
    """Across processes and machines: one Redis key per attempt, expiring after ``ttl_s``."""

    def __init__(self, url: str, *, prefix: str = "context-tracker:compaction:", ttl_s: float = 7 * 24 * 3600) -> None:
        import redis

        self._redis = redis.Redis.from_url(url)
        self._prefix = prefix
        self._ttl_ms = int(ttl_s * 1000)

    def _key(self, session_id: str, attempt_id: str) -> str:
        return f"{self._prefix}{session_id}:{attempt_id}"

    def put(self, session_id: str, attempt_id: str, payload: dict[str, Any]) -> None:
        self._redis.set(self._key(session_id, attempt_id), json.dumps(payload), px=self._ttl_ms)

    def get(self, session_id: str, attempt_id: str) -> dict[str, Any] | None:
        raw = self._redis.get(self._key(session_id, attempt_id))
        return json.loads(raw) if raw else None


class DirectoryShare:
    """Across processes of one machine: one JSON file per attempt under ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._dir = Path(path)
        self._dir.mkdir(parents=True, exist_ok=True)

    def _file(self, session_id: str, attempt_id: str) -> Path:
        return self._dir / f"{session_id}__{attempt_id}.json"  # both are [A-Za-z0-9._:-]

    def put(self, session_id: str, attempt_id: str, payload: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self._dir, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f)
        os.replace(tmp, self._file(session_id, attempt_id))

    def get(self, session_id: str, attempt_id: str) -> dict[str, Any] | None:
        try:
            return json.loads(self._file(session_id, attempt_id).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None


#: the share of a guard given none: the holders in this process (two agents on one session)
PROCESS_SHARE = MemoryShare()


def _offsets(items: Sequence[Item]) -> list[int]:
    """Where each item starts in the history's request messages (and, last, their count)."""
    out = [0]
    for it in items:
        out.append(out[-1] + len(it.messages))
    return out


def share_payload(view: View, rep: Replacement) -> dict[str, Any]:
    """What a holder publishes of its compaction: language-neutral (docs/canonical-request.md, section 6).

    ``start`` / ``end`` are positions in the history's *request messages*, not framework messages:
    adapters of different frameworks split the same history into different items (an AI SDK tool
    message holding two results is one item of two request messages, LangChain's two ToolMessages
    are two items), and the request messages are what the basis is the digest of.
    """
    offsets = _offsets(view.items)
    return {
        "from_revision": view.revision,
        "start": offsets[rep.start],
        "end": offsets[rep.end],
        "span": digest(view.items[rep.start : rep.end]),
        "summary": rep.summary,
    }


def shared_span(view: View, payload: Any) -> tuple[int, int, str] | None:
    """The items ``[start, end)`` a shared compaction replaces in ``view`` and its summary, or None when it
    does not apply:
    made from another revision, its positions not on this history's item boundaries, or its span's digest
    not this history's (a different history under the same session)."""
    if not isinstance(payload, Mapping) or payload.get("from_revision") != view.revision:
        return None
    start, end, summary = payload.get("start"), payload.get("end"), payload.get("summary")
    offsets = _offsets(view.items)
    if not (type(start) is int and type(end) is int and 0 <= start < end and start in offsets and end in offsets):
        return None
    first, stop = offsets.index(start), offsets.index(end)
    if not isinstance(summary, str) or digest(view.items[first:stop]) != payload.get("span"):
        return None
    return first, stop, summary
