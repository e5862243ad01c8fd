"""The event store's PostgreSQL fast path: psycopg 3 under SQLAlchemy's pool, fixed statement text.

One ``PgFastPath`` belongs to one ``SqlEventStore`` on PostgreSQL and does the hot work
there: appends, ``read_stream`` pages, ``read_all``, ``load`` and ``stream_version``.
Everything else (idempotency look-ups, listings, verification) goes through SQLAlchemy
Core in ``tracker.store.sql``. The store keeps what is backend-neutral -- validation, the
projection cache, folding -- and hands this class a ``project`` callback for the
projection row (see :meth:`PgFastPath.append`).

Appends take two round trips, each one simple-protocol message (client-side bound,
psycopg ``ClientCursor``)::

    BEGIN; [SELECT version, state FROM sessions …;] SELECT … FROM ct_append_events(…)
    SELECT ct_put_session(…); COMMIT

Both server functions come from migration 0001. A conflict fails the statement
(unique_violation from the insert, CT409 from ``ct_put_session``), which also skips the
COMMIT queued behind it. Append connections stay checked out between calls (autocommit,
explicit transactions) in a small idle stash, so the pool's checkout/reset work is
skipped; hot reads use them too, with prepared (server-side bound) statements.

Faults: a stashed connection idle for more than ``PG_PING_IDLE_S`` is pinged before use;
a disconnect seen on a connection in use invalidates the engine's pool, and a call that hit a
dead connection before sending COMMIT is retried once on a fresh one. If the connection
drops *during* COMMIT nobody can know the outcome: the driver error propagates (the store
maps it to ``StoreUnavailable``), and a retry with the same idempotency key is safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import psycopg
from sqlalchemy.engine import Engine

from tracker.store.base import StoredEvent
from tracker.store.errors import is_unavailable, map_db_errors

__all__ = ["PG_IDLE_APPEND_CONNECTIONS", "PG_PING_IDLE_S", "Appended", "PgFastPath"]


#: A pooled PostgreSQL connection idle for longer than this is pinged before use. (A ping
#: on every checkout, i.e. ``pool_pre_ping``, costs one round trip per append: ~25%.)
PG_PING_IDLE_S = 1.0
#: idle append connections kept by a store (beyond this they go back to the pool)
PG_IDLE_APPEND_CONNECTIONS = 8

CONFLICT_SQLSTATE = "CT409"  # raised by ct_put_session: the projection is not at the expected version
UNIQUE_VIOLATION = "23505"  # ct_append_events: that version or idempotency key is taken
CONFLICT_SQLSTATES = (CONFLICT_SQLSTATE, UNIQUE_VIOLATION)
MAX_VERSION = 2**31 - 1

# -- statements (fixed text: no SQL compilation per call) -------------------------------------------

# Appends: client-side bound so that several statements travel in one round trip.
_PRE_READ = "SELECT version, state::text FROM sessions WHERE session_id = %s::text"
_APPEND = (
    "SELECT out_position, out_version, out_recorded_at "
    "FROM ct_append_events(%s::text, %s::integer, %s::text, %s::text, %s::text)"
)
_BEGIN_APPEND = "BEGIN; " + _APPEND
_BEGIN_PRE_READ_APPEND = "BEGIN; " + _PRE_READ + "; " + _APPEND
_PUT_SESSION = "SELECT ct_put_session(%s::text, %s::integer, %s::integer, %s::text, %s::text, %s::integer, %s::integer, %s::integer)"
_PUT_SESSION_COMMIT = _PUT_SESSION + "; COMMIT"
# Hot reads (server-side bound, prepared by psycopg after a few uses).
_EVENT_COLS = "position, session_id, version, type, data, recorded_at, idempotency_key"
_READ_STREAM = (
    f"SELECT {_EVENT_COLS} FROM events WHERE session_id = %s AND version > %s AND version <= %s "
    "ORDER BY version LIMIT %s"
)
# The watermark and the rows come from the same statement, hence the same snapshot
# (the commit-order argument is in tracker.store.sql's docstring).
_READ_ALL = (
    f"SELECT {_EVENT_COLS} FROM events WHERE position > %s "
    "AND txid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint ORDER BY position LIMIT %s"
)
# The same with a session-id prefix filter (``starts_with``: exact, case-sensitive, no LIKE wildcards).
_READ_ALL_PREFIX = (
    f"SELECT {_EVENT_COLS} FROM events WHERE position > %s AND starts_with(session_id, %s) "
    "AND txid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint ORDER BY position LIMIT %s"
)
_LOAD = "SELECT version, state::text FROM sessions WHERE session_id = %s"
_STREAM_VERSION = "SELECT coalesce(max(version), 0) FROM events WHERE session_id = %s"

#: ``project(pre_read_row, positions, recorded_at)``: the projection row's
#: ``(state_json, pressure, revision, occupancy_bp, open_attempts)`` after the append
#: (all None without a projector). ``pre_read_row`` is ``(version, state_json)`` read in
#: the append's transaction when ``append(pre_read=True)``, else None.
ProjectFn = Callable[[tuple[Any, ...] | None, tuple[int, ...], datetime], tuple[Any, ...]]


@dataclass(frozen=True)
class Appended:
    """What an append wrote: the events' positions (in version order) and their timestamp."""

    positions: tuple[int, ...]
    recorded_at: datetime


class _Conflict(Exception):
    """Internal: the stream is not at the expected version."""


class _RetryableDisconnect(Exception):
    """Internal: an append failed on a dead pooled connection before COMMIT was sent."""


def _event(row: tuple[Any, ...]) -> StoredEvent:
    return StoredEvent(row[0], row[1], row[2], row[3], row[4], row[5].astimezone(UTC), row[6])


class PgFastPath:
    """The psycopg hot path of one store's engine, with its stash of idle append connections."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._idle: list[tuple[Any, float]] = []
        self._idle_lock = threading.Lock()

    def after_fork(self) -> None:
        """In a forked child: forget (never touch) the parent's connections."""
        self._idle = []
        self._idle_lock = threading.Lock()

    def close(self) -> None:
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for raw, _ in idle:
            self._release(raw)

    # -- connections ----------------------------------------------------------------------------------

    def _take(self) -> tuple[Any, bool]:
        """(connection, fresh): an idle append connection, pinged if it sat idle, or a new checkout."""
        while True:
            with self._idle_lock:
                if not self._idle:
                    break
                raw, since = self._idle.pop()
            if time.monotonic() - since <= PG_PING_IDLE_S:
                return raw, False
            try:
                alive = self._engine.dialect.do_ping(raw.driver_connection)
            except Exception:  # noqa: BLE001 - any failure means "reconnect"
                alive = False
            if alive:
                return raw, True
            self._discard(raw)
            self.reset_pool()
        raw = cast(Any, self._engine.raw_connection())  # the checkout pings a connection that sat idle in the pool
        try:
            raw.driver_connection.autocommit = True
        except BaseException:
            self._discard(raw)
            raise
        return raw, True

    def _put(self, raw: Any) -> None:
        with self._idle_lock:
            if len(self._idle) < PG_IDLE_APPEND_CONNECTIONS:
                self._idle.append((raw, time.monotonic()))
                return
        self._release(raw)

    @classmethod
    def _release(cls, raw: Any) -> None:
        try:
            raw.driver_connection.autocommit = False
            raw.close()
        except Exception:  # noqa: BLE001 - a broken connection
            cls._discard(raw)

    @staticmethod
    def _discard(raw: Any) -> None:
        try:
            raw.invalidate()
            raw.close()
        except Exception:  # noqa: BLE001
            pass

    def reset_pool(self) -> None:
        """After a disconnect: make every pooled connection reconnect before its next use.

        This is what SQLAlchemy itself does when a Core connection sees a disconnect: the
        pool's invalidation time moves to now, so every connection made before it is
        recycled at its next checkout, and the pool stays the same object. That method,
        ``Pool._invalidate``, is private, and SQLAlchemy 2 has no public equivalent:
        ``Engine.dispose()`` replaces the pool instead, leaving the connections checked out
        right now (other threads' calls, this stash) to be returned to the abandoned pool
        and closed only when it is garbage collected. So we keep the private call, and
        fall back to ``dispose()`` should a future SQLAlchemy drop it.
        """
        invalidate = getattr(self._engine.pool, "_invalidate", None)
        try:
            if invalidate is not None:
                invalidate(None)
                return
        except Exception:  # noqa: BLE001
            pass
        self._engine.dispose()

    @staticmethod
    def _cursor(raw: Any, client_side: bool) -> Any:
        """A cursor cached on the pooled connection (ClientCursor: several statements per round trip)."""
        conn = raw.driver_connection
        slot = "ct_ccursor" if client_side else "ct_cursor"
        cur = raw.info.get(slot)
        if cur is None or cur.closed or cur.connection is not conn:
            cur = raw.info[slot] = psycopg.ClientCursor(conn) if client_side else psycopg.Cursor(conn)
        return cur

    def _query(self, what: str, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """One autocommit statement; typed errors; once more if a stashed connection turned out dead."""
        with map_db_errors(what):
            for attempt in (1, 2):
                raw, fresh = self._take()
                try:
                    cur = self._cursor(raw, client_side=False)
                    cur.execute(sql, params)
                    rows = cur.fetchall()
                except BaseException as exc:
                    self._discard(raw)
                    if is_unavailable(exc):
                        self.reset_pool()
                        if attempt == 1 and not fresh:
                            continue
                    raise
                self._put(raw)
                return rows
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    # -- reads ----------------------------------------------------------------------------------------

    def read_stream_page(self, session_id: str, after: int, to_version: int | None, limit: int) -> list[StoredEvent]:
        """Up to ``limit`` events of the session with ``after < version <= to_version``, in version order."""
        upto = MAX_VERSION if to_version is None else to_version
        return [_event(r) for r in self._query("read_stream", _READ_STREAM, (session_id, after, upto, limit))]

    def read_all(self, after_position: int, limit: int, session_prefix: str | None) -> list[StoredEvent]:
        if session_prefix is None:
            rows = self._query("read_all", _READ_ALL, (after_position, limit))
        else:
            rows = self._query("read_all", _READ_ALL_PREFIX, (after_position, session_prefix, limit))
        return [_event(r) for r in rows]

    def stream_version(self, session_id: str) -> int:
        return int(self._query("stream_version", _STREAM_VERSION, (session_id,))[0][0])

    def projection_state(self, session_id: str) -> tuple[int, str | None] | None:
        """(version, state JSON) of the session's projection row, or None."""
        rows = self._query("load", _LOAD, (session_id,))
        return (rows[0][0], rows[0][1]) if rows else None

    # -- append ---------------------------------------------------------------------------------------

    def append(
        self,
        session_id: str,
        expected: int,
        types_json: str,
        data_json: str,
        key: str | None,
        *,
        pre_read: bool,
        project: ProjectFn,
        before_commit: Callable[[str, tuple[int, ...]], None] | None = None,
    ) -> Appended | None:
        """Append the events (``types_json``/``data_json``: JSON arrays) and write the projection row.

        Returns None when the stream is not at ``expected`` (or the key is taken): nothing was
        written, and the store decides between replay and ``ConcurrencyConflict``. Driver
        errors propagate; the store maps them.
        """
        try:
            return self._append_once(session_id, expected, types_json, data_json, key, pre_read, project, before_commit)
        except _RetryableDisconnect:
            # The stashed connection was dead (e.g. the server restarted since its last use)
            # and nothing was committed: once more on a fresh connection.
            return self._append_once(
                session_id, expected, types_json, data_json, key, pre_read, project, before_commit, retry=False
            )

    def _append_once(
        self,
        sid: str,
        expected: int,
        types_json: str,
        data_json: str,
        key: str | None,
        pre_read: bool,
        project: ProjectFn,
        before_commit: Callable[[str, tuple[int, ...]], None] | None,
        retry: bool = True,
    ) -> Appended | None:
        raw, fresh = self._take()
        conflict = committing = False
        try:
            cur = self._cursor(raw, client_side=True)
            try:
                if pre_read:
                    cur.execute(_BEGIN_PRE_READ_APPEND, (sid, sid, expected, types_json, data_json, key), prepare=False)
                    cur.nextset()  # -> the pre-read
                    row = cur.fetchone()
                    cur.nextset()  # -> the append
                    if (row[0] if row else 0) != expected:  # e.g. expected_version ahead of the stream
                        raise _Conflict()
                else:
                    cur.execute(_BEGIN_APPEND, (sid, expected, types_json, data_json, key), prepare=False)
                    cur.nextset()
                    row = None
                rows = cur.fetchall()
                rows.sort(key=lambda r: r[1])
                positions = tuple(r[0] for r in rows)
                recorded_at = rows[0][2].astimezone(UTC)
                put = (sid, expected, expected + len(rows), *project(row, positions, recorded_at))
                if before_commit is None:
                    committing = True
                    cur.execute(_PUT_SESSION_COMMIT, put, prepare=False)
                else:
                    cur.execute(_PUT_SESSION, put)
                    before_commit(sid, positions)
                    committing = True
                    cur.execute("COMMIT")
            except (psycopg.Error, _Conflict) as exc:
                if isinstance(exc, psycopg.Error) and exc.sqlstate not in CONFLICT_SQLSTATES:
                    raise
                conflict = True
                cur.execute("ROLLBACK")
        except BaseException as exc:
            # Broken, or mid-transaction (e.g. the projector raised): never reuse it. Closing
            # it makes the server roll back whatever this append had written.
            self._discard(raw)
            if is_unavailable(exc):
                self.reset_pool()
                if retry and not fresh and not committing:
                    raise _RetryableDisconnect() from exc
            raise
        self._put(raw)
        return None if conflict else Appended(positions, recorded_at)
