"""``MemoryEventStore``: the ``EventStore`` port in plain Python, for tests and embedding without a database.

The same semantics as ``tracker.store.sql.SqlEventStore`` (``tests/integration/test_store_contract.py`` runs
one suite against all of them): per-session versions without gaps; an optimistic version check
raising ``ConcurrencyConflict`` (with ``current_state``); idempotency keys (a retry returns the
original result, ``replayed=True``, and writes nothing, even with a stale version); the
projection folded by the ``Projector`` and kept as JSON (so it survives a round trip exactly as
it does in a database); ``read_all`` in global position order, with ``session_prefix``; the same
input checks (``tracker.store.validate``). One lock serialises appends, so position order is
commit order and a ``read_all`` page is a prefix of the log, as on SQLite.

Nothing is durable: the log lives as long as the object.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tracker.errors import InvalidInput
from tracker.store import validate
from tracker.store.base import DEFAULT_MAX_EVENT_BYTES, AppendResult, Projector, StoredEvent, conflict_error
from tracker.store.chain import GENESIS, chain
from tracker.store.common import CheckedAppend, LogStore

__all__ = ["MemoryEventStore"]


@dataclass(frozen=True)
class _Event:
    """A logged event, its data kept as JSON text (every read gets a fresh copy)."""

    position: int
    session_id: str
    version: int
    type: str
    data_json: str
    recorded_at: datetime
    idempotency_key: str | None
    batch_size: int | None
    hash: bytes | None = None  # tracker.store.chain

    def stored(self) -> StoredEvent:
        return StoredEvent(
            self.position,
            self.session_id,
            self.version,
            self.type,
            json.loads(self.data_json),
            self.recorded_at,
            self.idempotency_key,
        )


@dataclass
class _Row:
    """A session's projection row (the columns of the ``sessions`` table)."""

    version: int
    state_json: str | None
    pressure: Any
    revision: Any
    occupancy_bp: Any
    open_attempts: int
    created_at: datetime
    updated_at: datetime


class MemoryEventStore(LogStore):
    """``EventStore`` in memory. Thread-safe (one lock); one instance is one database."""

    def __init__(self, *, projector: Projector | None = None, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES):
        if not validate.is_int(max_event_bytes) or max_event_bytes <= 0:
            raise InvalidInput("max_event_bytes", "must be a positive integer")
        self.projector = projector
        self.max_event_bytes = max_event_bytes
        #: the tests' seam, as on ``SqlEventStore``: ``hook(session_id, positions)`` before an
        #: append is published (an exception from it leaves nothing written)
        self.before_commit: Callable[[str, tuple[int, ...]], None] | None = None
        self._lock = threading.RLock()
        self._log: list[_Event] = []  # in position order
        self._streams: dict[str, list[_Event]] = {}  # in version order
        self._keys: dict[tuple[str, str], int] = {}  # (session, idempotency key) -> first version
        self._rows: dict[str, _Row] = {}

    def close(self) -> None:
        """Nothing to release (the log goes with the object)."""

    # -- append ----------------------------------------------------------------------------------

    def _append(self, append: CheckedAppend) -> AppendResult:
        sid, expected, key, types = append.session_id, append.expected, append.key, append.types
        with self._lock:
            if key is not None and (sid, key) in self._keys:
                return self._replay(sid, self._keys[(sid, key)])
            stream = self._streams.get(sid, [])
            actual = len(stream)
            if actual != expected:
                row = self._rows.get(sid)
                current = None
                if row is not None and row.version == actual and row.state_json is not None:
                    current = json.loads(row.state_json)
                raise conflict_error(sid, expected, actual, current)
            recorded_at = datetime.now(UTC)
            first_position = (self._log[-1].position if self._log else 0) + 1
            hashes = chain(stream[-1].hash if stream else GENESIS, append.canonical_texts())
            new = [
                _Event(
                    first_position + i,
                    sid,
                    expected + 1 + i,
                    types[i],
                    append.texts[i],
                    recorded_at,
                    key if i == 0 else None,
                    len(types) if i == 0 else None,
                    hashes[i],
                )
                for i in range(len(types))
            ]
            positions = tuple(e.position for e in new)
            state = state_json = None
            cols: tuple[Any, ...] = (None, None, None, 0)
            proj = self.projector
            if proj is not None:
                state, state_json, cols = append.projection(
                    proj, lambda: self._state_at(proj, sid, expected), positions, recorded_at
                )
            if self.before_commit is not None:
                self.before_commit(sid, positions)
            # publish: nothing above wrote anything
            self._log.extend(new)
            self._streams.setdefault(sid, []).extend(new)
            if key is not None:
                self._keys[(sid, key)] = expected + 1
            old = self._rows.get(sid)
            pressure, revision, occupancy, open_attempts = cols
            self._rows[sid] = _Row(
                expected + len(new),
                state_json,
                pressure,
                revision,
                occupancy,
                open_attempts,
                created_at=old.created_at if old is not None else recorded_at,
                updated_at=recorded_at,
            )
        return AppendResult(sid, expected + 1, expected + len(new), positions, False, state)

    def _state_at(self, proj: Projector, sid: str, version: int) -> dict[str, Any]:
        """The session's state at ``version`` (its row's, when it is at that version; else folded)."""
        row = self._rows.get(sid)
        if row is not None and row.version == version and row.state_json is not None:
            return json.loads(row.state_json)
        return self.fold_stream(sid, version, proj)[0] if version else proj.initial(sid)

    def find_idempotent(self, session_id: str, idempotency_key: str) -> AppendResult | None:
        with self._lock:
            first = self._keys.get((session_id, idempotency_key))
            return None if first is None else self._replay(session_id, first)

    def _replay(self, sid: str, first: int) -> AppendResult:
        stream = self._streams[sid]
        n = stream[first - 1].batch_size or 1
        last = first + n - 1
        positions = tuple(e.position for e in stream[first - 1 : last])
        state = None
        if self.projector is not None:
            state = self._state_at(self.projector, sid, last)
        return AppendResult(sid, first, last, positions, True, state)

    # -- reads -----------------------------------------------------------------------------------

    def read_stream(
        self, session_id: str, from_version: int = 1, to_version: int | None = None
    ) -> Iterator[StoredEvent]:
        """The session's events from ``from_version`` to ``to_version`` (inclusive), in version order."""
        validate.check_read_stream(session_id, from_version, to_version)
        with self._lock:
            stream = self._streams.get(session_id, [])
            upto = len(stream) if to_version is None else max(0, min(len(stream), to_version))
            picked = stream[from_version - 1 : upto]
        return (e.stored() for e in picked)

    def _read_all(
        self, after_position: int, limit: int, session_prefix: str | None, kinds: tuple[str, ...] | None
    ) -> list[StoredEvent]:
        """Position order is commit order here (one lock serialises appends)."""
        out: list[StoredEvent] = []
        with self._lock:
            start = bisect.bisect_right(self._log, after_position, key=lambda e: e.position)
            for e in self._log[start:]:
                if kinds is not None and e.type not in kinds:
                    continue
                if session_prefix is None or e.session_id.startswith(session_prefix):
                    out.append(e.stored())
                    if len(out) >= limit:
                        break
        return out

    def _stream_version(self, session_id: str) -> int:
        with self._lock:
            return len(self._streams.get(session_id, ()))

    def load(self, session_id: str) -> tuple[dict[str, Any] | None, int]:
        validate.check_session_id(session_id)
        with self._lock:
            row = self._rows.get(session_id)
            if row is None:
                return None, 0
            if row.state_json is None:
                if self.projector is None:
                    return None, row.version
                return self.fold_stream(session_id, row.version)[0], row.version
            return json.loads(row.state_json), row.version

    # -- verification reads ----------------------------------------------------------------------

    def log_versions(self) -> Iterator[tuple[str, int]]:
        """(session_id, last version) of every stream in id order, then every projection row
        without events (none, here: rows are written with their events), with 0."""
        with self._lock:
            logged = sorted((sid, len(stream)) for sid, stream in self._streams.items())
            orphans = sorted(sid for sid in self._rows if sid not in self._streams)
        yield from logged
        yield from ((sid, 0) for sid in orphans)

    def chain_links(self, session_id: str) -> Iterator[tuple[int, str, dict[str, Any], bytes | None]]:
        """(version, type, data, hash) of each of the session's events, in version order."""
        validate.check_session_id(session_id)
        with self._lock:
            stream = list(self._streams.get(session_id, ()))
        return ((e.version, e.type, json.loads(e.data_json), e.hash) for e in stream)

    def projection_row(self, session_id: str) -> dict[str, Any] | None:
        """The session's projection row (the columns of the ``sessions`` table), or None."""
        validate.check_session_id(session_id)
        with self._lock:
            row = self._rows.get(session_id)
            if row is None:
                return None
            return {
                "session_id": session_id,
                "version": row.version,
                "state": None if row.state_json is None else json.loads(row.state_json),
                "pressure": row.pressure,
                "revision": row.revision,
                "occupancy_bp": row.occupancy_bp,
                "open_attempts": row.open_attempts,
                "created_at": row.created_at,
                "updated_at": row.updated_at,
            }
