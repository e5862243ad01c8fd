"""The event store's value types and interface (behaviour.md "Events": the log is the truth).

``EventStore`` is what the rest of the tracker codes against; ``tracker.store.sql``
implements it on SQLite and PostgreSQL (the backends: ``tracker.store.sqlite`` and
``tracker.store.postgres``), ``tracker.store.memory`` in memory. ``SessionViews`` is the read
side's port (``tracker.store.views``). A ``Projector`` supplied by the caller
folds events into the per-session projection (``sessions`` table), which the
store writes in the same transaction as the events it was folded from.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from tracker.errors import ConcurrencyConflict, StoreError, TrackerError

DEFAULT_MAX_EVENT_BYTES = 64 * 1024
MAX_EVENT_TYPE_LEN = 100
MAX_IDEMPOTENCY_KEY_LEN = 200
MAX_EVENTS_PER_APPEND = 1000

#: Listing columns of the projection, filled from ``Projector.columns(state)``.
PROJECTION_COLUMNS = ("pressure", "revision", "occupancy_bp", "open_attempts")


@dataclass(frozen=True)
class NewEvent:
    """An event to append. ``data`` must be a JSON object (dict) of JSON-native values."""

    type: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StoredEvent:
    position: int  # global, unique; increasing in commit order as seen by read_all
    session_id: str
    version: int  # 1, 2, 3 ... within the session, no gaps
    type: str
    data: dict[str, Any]
    recorded_at: datetime  # tz-aware UTC
    idempotency_key: str | None


@dataclass(frozen=True)
class AppendResult:
    session_id: str
    first_version: int
    last_version: int
    positions: tuple[int, ...]
    replayed: bool  # True: idempotent retry; nothing written, the original result returned
    state: dict[str, Any] | None  # projection state after the append (None when no projector)


@runtime_checkable
class Projector(Protocol):
    """Folds a session's events into a JSON-native state dict.

    ``apply`` must be pure and deterministic, must read only the event's ``session_id``,
    ``version``, ``type``, ``data`` and ``idempotency_key`` (on PostgreSQL the state is
    folded before the append's one statement draws ``position`` and ``recorded_at``, so
    those are placeholders there), and the state must survive a JSON
    round trip unchanged (dicts with str keys, lists, str, int, float, bool, None):
    the store persists it as JSON and later appends continue from the stored form.
    A projector may also offer ``apply_many(state, events) -> state`` as a faster
    equivalent of repeated ``apply``; the store uses it when folding long streams.
    """

    def initial(self, session_id: str) -> dict[str, Any]: ...

    def apply(self, state: dict[str, Any], event: StoredEvent) -> dict[str, Any]: ...

    def columns(self, state: dict[str, Any]) -> dict[str, Any]:
        """{"pressure": str, "revision": int, "occupancy_bp": int | None, "open_attempts": int}"""
        ...


def fold_events(proj: Projector, state: dict[str, Any], stored: Sequence[StoredEvent]) -> dict[str, Any]:
    """``stored`` folded into ``state`` (with the projector's ``apply_many`` when it has one)."""
    many = getattr(proj, "apply_many", None)
    if many is not None:
        return many(state, stored)
    for ev in stored:
        state = proj.apply(state, ev)
    return state


def row_columns(proj: Projector, state: dict[str, Any]) -> tuple[Any, Any, Any, int]:
    """(pressure, revision, occupancy_bp, open_attempts): the listing columns of a projection row."""
    cols = proj.columns(state) or {}
    return (cols.get("pressure"), cols.get("revision"), cols.get("occupancy_bp"), int(cols.get("open_attempts") or 0))


def conflict_error(sid: str, expected: int, actual: int, state: dict[str, Any] | None = None) -> TrackerError:
    """``ConcurrencyConflict`` (with the current state when known); ``StoreError`` when the log is at
    ``expected`` but the projection row is not (a row deleted or out of step: ``tracker verify``)."""
    if actual == expected:
        return StoreError(
            f"session {sid}: the projection row is missing or out of step with the log at version {actual}; "
            "run `tracker verify`",
            session_id=sid,
        )
    conflict = ConcurrencyConflict(
        f"expected version {expected}, but the stream is at {actual}",
        session_id=sid,
        expected=expected,
        actual=actual,
    )
    if state is not None:
        conflict.current_state = state
    return conflict


class EventStore(Protocol):
    """What the tracker uses of an event store: the log and the projection, nothing else (ten methods).

    Commands (``tracker.service``) use ``append``, ``find_idempotent``, ``load`` and
    ``read_stream``; the read side (``tracker.queries``) also ``read_all`` and
    ``stream_version``; verification (``tracker.store.verify``) ``log_versions``,
    ``projection_row`` and ``fold_stream``. Implementations: ``tracker.store.sql.SqlEventStore``
    (SQLite, PostgreSQL) and ``tracker.store.memory.MemoryEventStore``. Listings, gauges and the
    session page's narrow reads are ``SessionViews``; fleets are ``tracker.store.fleets``.
    """

    def append(
        self,
        session_id: str,
        expected_version: int,
        events: Sequence[NewEvent],
        *,
        idempotency_key: str | None = None,
        projected: dict[str, Any] | None = None,
    ) -> AppendResult:
        """``projected``: the projection state after these events, when the caller already has
        it (it must equal the projector's fold; ``tracker verify`` checks). Raises
        ``ConcurrencyConflict`` (with ``current_state`` when known) on a stale version."""
        ...

    def find_idempotent(self, session_id: str, idempotency_key: str) -> AppendResult | None:
        """The earlier append made with this key (``replayed=True``), or None (lets a caller skip re-deciding)."""
        ...

    def read_stream(
        self, session_id: str, from_version: int = 1, to_version: int | None = None
    ) -> Iterator[StoredEvent]: ...

    def read_all(
        self,
        after_position: int = 0,
        limit: int = 1000,
        *,
        session_prefix: str | None = None,
        types: Sequence[str] | None = None,
    ) -> list[StoredEvent]:
        """Events after ``after_position`` in commit-safe global order; with ``session_prefix``,
        only those of sessions whose id starts with it (exact, case-sensitive); with ``types``, only
        events of those types (names of ``[A-Za-z][A-Za-z0-9_]*``)."""
        ...

    def stream_version(self, session_id: str) -> int: ...

    def load(self, session_id: str) -> tuple[dict[str, Any] | None, int]:
        """(projection state, version); (None, 0) for an unknown session."""
        ...

    def fold_stream(
        self, session_id: str, to_version: int | None = None, projector: Projector | None = None
    ) -> tuple[dict[str, Any], int]:
        """The session's state folded from the log alone (default: the store's projector), and its version."""
        ...

    def log_versions(self) -> Iterator[tuple[str, int]]:
        """(session_id, last version in the log) of every session the store knows: each stream of
        the log in id order, then each projection row without events, with version 0."""
        ...

    def projection_row(self, session_id: str) -> dict[str, Any] | None:
        """The session's projection row (``version``, ``state`` and the listing columns), or None."""
        ...

    def close(self) -> None: ...


class SessionViews(Protocol):
    """The read side's port: lists, gauges and the narrow reads of one session's page.

    Nothing here decides anything: these reads serve people (the console, ``tracker sessions``,
    the session page, the fleet gauges). Commands and replay never use them; they read the log
    through ``EventStore``. ``tracker.store.views.SqlSessionViews`` implements it on SQLite and PostgreSQL.
    """

    def list_sessions(
        self,
        *,
        pressure: str | None = None,
        active_since: datetime | None = None,
        limit: int = 1000,
        session_prefix: str | None = None,
        after: tuple[datetime, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Projection rows, most recently updated first, then by id. ``session_prefix``: only sessions
        whose id starts with it (exact, case-sensitive); ``after``: the ``(updated_at, session_id)`` of
        the previous page's last row (keyset paging: the rows that come after it in this order)."""
        ...

    def session_summary(self) -> dict[str, Any]:
        """Sessions and open attempts by fleet (``SessionScope.fleet_of`` the session id) and
        pressure, and the oldest open attempt's ``opened_at`` per fleet (the gauges of
        ``tracker.queries.fleet_gauges``)."""
        ...

    def feed_held(self) -> tuple[int, datetime | None]:
        """``(events, oldest recorded_at)`` committed but not yet shown by the global feed (``(0, None)``: none)."""
        ...

    # narrow reads of one session (the session page, ``tracker.audit.story.read_story``)

    def count_by_type(self, session_id: str, to_version: int | None = None) -> dict[str, int]:
        """How many events of each type the session has (up to ``to_version``)."""
        ...

    def read_types(
        self,
        session_id: str,
        types: Sequence[str],
        from_version: int = 1,
        to_version: int | None = None,
        *,
        limit: int | None = None,
    ) -> Iterator[StoredEvent]:
        """The session's events of ``types`` from ``from_version`` to ``to_version`` (inclusive), in
        version order, at most ``limit`` of them."""
        ...

    def last_of_types(
        self, session_id: str, types: Sequence[str], count: int = 1, to_version: int | None = None
    ) -> list[StoredEvent]:
        """The newest ``count`` events of ``types`` (up to ``to_version``), oldest first."""
        ...

    def sample_of_type(
        self, session_id: str, type_: str, points: int, to_version: int | None = None, *, total: int | None = None
    ) -> list[StoredEvent]:
        """About ``points`` events of one type spread evenly by rank, always with the first and the last."""
        ...

    def read_versions(
        self, session_id: str, versions: Sequence[int], types: Sequence[str] | None = None
    ) -> list[StoredEvent]:
        """The session's events at ``versions`` (only of ``types``, if given), in version order."""
        ...

    def find_by_data(
        self, session_id: str, types: Sequence[str], key: str, value: str, limit: int = 100
    ) -> list[StoredEvent]:
        """The session's events of ``types`` whose ``data[key]`` is the string ``value``, in version order
        (at most ``limit``)."""
        ...
