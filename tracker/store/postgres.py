"""The event store's PostgreSQL fast path: psycopg 3 under SQLAlchemy's pool, fixed statement text.

One ``PgFastPath`` belongs to one ``SqlEventStore`` on PostgreSQL and does the hot work
there: appends, ``read_stream`` pages, ``read_all``, ``load`` and ``stream_version``.
Everything else (idempotency look-ups and verification in ``tracker.store.sql``, the read
side's views in ``tracker.store.views``) goes through SQLAlchemy Core. The store keeps what is backend-neutral -- validation, the
projection cache, folding -- and hands this class the events and the projection row
(see :meth:`PgFastPath.append`).

An append is one round trip: one prepared (server-side bound) statement in autocommit,
``SELECT … FROM ct_append(…)`` (migration 0003; since 0008 it releases its lock on every
exit; since 0010 it takes the events' canonical texts and chains their hashes, ``tracker.store.chain``), which does the projection row's compare-and-set, draws the positions under the append
lock and inserts the events. The
projection state is folded by the store *before* the call (projectors read only an event's
type, data and version). When the session is not at the expected version the function
writes nothing and *returns* the current version and state (``Stale``) -- no error, so a
lost race leaves nothing in the server log -- and a used idempotency key returns the
version it was first used at (``Replayed``). Connections stay checked out between calls
(autocommit) in a small idle stash, so the pool's checkout/reset work is skipped; hot reads
use them too, prepared as well.

Faults: before a stashed connection is used, its socket is polled (no round trip): a
connection the server closed (restart, termination) has an error message or EOF waiting
there, and is pinged and replaced; one idle for more than ``PG_PING_IDLE_S`` is pinged
anyway. A disconnect seen on a connection in use invalidates the engine's pool. An append
that failed on a dead connection taken from the stash is run once more on a fresh
connection only when that is safe: nothing was sent, or the call carries an idempotency key
(``ct_append`` checks the key first, so a second run of a call that did commit returns
``Replayed``). The rule is about the statement, not a COMMIT: it runs in autocommit (the
tests' ``before_commit`` seam wraps it in BEGIN … COMMIT, under the same rule), so once it
was sent without a key nobody can know whether it committed, and it is not run again: the
driver error propagates (the store maps it to ``StoreUnavailable``), and a retry with the
same idempotency key is safe. A failure on a freshly made connection is not retried either.
Reads are run once more whenever the stashed connection turned out dead.

Commit order: see the comment above ``_READ_ALL`` (the proof that ``read_all`` never skips).

Partitions (migration 0011: ``events`` is partitioned by month of ``recorded_at``): the first
successful append of each process in each calendar month (UTC) also calls
``ct_events_ensure_partitions`` for that month and ``PARTITION_MONTHS_AHEAD`` more, under a
``lock_timeout`` of ``PARTITION_LOCK_TIMEOUT``: a month's partition exists long before its first
event (the DEFAULT partition takes an event should it not). A failure there is logged and tried
again after ``PARTITION_RETRY_S``; the append it follows has committed either way.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy.engine import Engine

from tracker.errors import StoreError
from tracker.store.base import StoredEvent
from tracker.store.errors import is_unavailable, map_db_errors

__all__ = ["PG_IDLE_APPEND_CONNECTIONS", "PG_PING_IDLE_S", "Appended", "PgFastPath", "Replayed", "Stale"]


#: A pooled PostgreSQL connection idle for longer than this is pinged before use. (A ping
#: on every checkout, i.e. ``pool_pre_ping``, costs one round trip per append: ~25%.)
PG_PING_IDLE_S = 1.0
#: idle append connections kept by a store (beyond this they go back to the pool)
PG_IDLE_APPEND_CONNECTIONS = 8

MAX_VERSION = 2**31 - 1

#: months of ``events`` partitions kept ahead of the current one (see the module doc)
PARTITION_MONTHS_AHEAD = 3
#: how long the partition upkeep waits for a lock (e.g. behind an operator's DETACH) before giving up
PARTITION_LOCK_TIMEOUT = "2s"
#: seconds before a failed partition upkeep is tried again
PARTITION_RETRY_S = 60.0

log = logging.getLogger(__name__)

# -- statements (fixed text: no SQL compilation per call) -------------------------------------------

_APPEND = (
    "SELECT out_status, out_version, out_state, out_positions, out_recorded_at FROM ct_append("
    "%s::text, %s::integer, %s::text, %s::text, %s::text, %s::text, %s::integer, %s::integer, %s::integer)"
)
# Hot reads (server-side bound, prepared by psycopg after a few uses).
_EVENT_COLS = "position, session_id, version, type, data, recorded_at, idempotency_key"
_READ_STREAM = (
    f"SELECT {_EVENT_COLS} FROM events WHERE session_id = %s AND version > %s AND version <= %s "
    "ORDER BY version LIMIT %s"
)
# Commit-order tailing: why a reader paging through ``read_all(after_position)`` never skips
# an event that commits later with a lower position.
#
# Positions come from the identity sequence (CACHE 1), but transactions commit in any order,
# so position order alone is not safe: a tailer could read position 11 (committed) while 10
# is still in flight, resume after 11 and never see 10. We use a transaction-id watermark,
# made sound by a tiny critical section:
#
# 1. Every append goes through ``ct_append`` (``_APPEND`` above), one statement in its own
#    transaction. Under a session-level advisory lock ``L`` (``APPEND_LOCK_KEY``) it only
#    (a) assigns the transaction its id (``pg_current_xact_id()``) and (b) draws the events'
#    positions (``nextval``), then releases ``L`` and inserts the rows, recording the
#    transaction id in ``events.txid``. ``L`` is held for microseconds and never across the
#    insert or the commit, so appends still commit in parallel. (Since migration 0008 the
#    locked section is a PL/pgSQL block whose handler, ``WHEN OTHERS OR query_canceled``,
#    releases ``L`` and re-raises: an error or a cancel inside it aborts the append -- it
#    wrote nothing, so it never commits and (2) holds vacuously for it -- and leaves no lock
#    on the server connection, which a transaction pooler would hand to the next client.
#    The block writes nothing: the xid it assigns is the top-level transaction's.)
# 2. Hence, for any two appending transactions A and B: ``xid(A) < xid(B)`` iff every
#    position of A is below every position of B (xids and sequence values both grow with
#    time, and each transaction takes both inside one ``L`` section).
# 3. ``read_all`` is the one statement below, returning the rows with
#    ``txid < pg_snapshot_xmin(pg_current_snapshot())`` (``xmin`` of that very statement's
#    snapshot), ordered by position: the watermark and the rows come from the same
#    statement, hence the same snapshot. Every transaction with an xid below ``xmin`` has
#    ended, and its committed rows are visible in the snapshot; every transaction that can
#    still commit (running now, or not yet started) has an xid ``>= xmin`` and so, by (2),
#    only positions above every position returned. The result is therefore a prefix of the
#    final log in position order: the next call, after the last position seen, cannot miss
#    anything. Committed rows with ``txid >= xmin`` are simply returned by a later call.
#
# Without step 1 the watermark alone is not enough: B (higher xid) can draw a lower position
# than A (lower xid); once A commits, the watermark passes A's rows while B, holding the
# lower position, is still running. Trade-off: an event becomes visible to ``read_all`` only
# once every transaction that got an xid before it (anywhere in the PostgreSQL cluster, not
# only appends) has ended, so a long-running writing transaction delays tailing (never
# safety). ``read_stream`` and ``load`` are not affected. The prefix filters below
# (``_READ_ALL_PREFIX``, ``_READ_ALL_FLEET``) are part of the same statement and keep the
# same watermark, so their results are prefixes of the filtered log.
#: the feed's watermark (3 above), the one text every feed statement and ``SqlSessionViews.feed_held`` use
FEED_WATERMARK = "txid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint"
_READ_ALL = f"SELECT {_EVENT_COLS} FROM events WHERE position > %s AND {FEED_WATERMARK} ORDER BY position LIMIT %s"
# The same with a session-id prefix filter (``starts_with``: exact, case-sensitive, no LIKE wildcards).
_READ_ALL_PREFIX = (
    f"SELECT {_EVENT_COLS} FROM events WHERE position > %s AND starts_with(session_id, %s) "
    f"AND {FEED_WATERMARK} ORDER BY position LIMIT %s"
)
# A fleet's feed (prefix "<fleet>:"): the (fleet, position) index reads exactly the page. Written
# as a closed range on fleet ordered by (fleet, position) so that only that index gives the
# order: with ``fleet = %s`` the prepared statement's generic plan (which cannot know that a
# fleet is idle) walks the position index and filters every later event of every fleet.
_READ_ALL_FLEET = (
    f"SELECT {_EVENT_COLS} FROM events WHERE fleet >= %(f)s AND fleet <= %(f)s AND position > %(p)s "
    f"AND {FEED_WATERMARK} ORDER BY fleet, position LIMIT %(n)s"
)


# Events of some types (the provider reports calibration folds): the types are written into the
# text as literals (names checked to be [A-Za-z][A-Za-z0-9_]*, sorted), so that a partial index on
# exactly that list (``ix_events_provider_reports``, migration 0009) can serve the read.
def _read_all_types(types: tuple[str, ...], prefixed: bool) -> str:
    listed = ", ".join(f"'{t}'" for t in types)
    prefix = "AND starts_with(session_id, %s) " if prefixed else ""
    return (
        f"SELECT {_EVENT_COLS} FROM events WHERE type IN ({listed}) AND position > %s {prefix}"
        f"AND {FEED_WATERMARK} ORDER BY position LIMIT %s"
    )


_ENSURE_PARTITIONS = (
    "SELECT ct_events_ensure_partitions(now(), now() + make_interval(months => %s)) "
    "FROM (SELECT set_config('lock_timeout', %s, true)) AS t"
)
_LOAD = "SELECT version, state::text FROM sessions WHERE session_id = %s"
_STREAM_VERSION = "SELECT coalesce(max(version), 0) FROM events WHERE session_id = %s"
_KEYED_VERSION = "SELECT version FROM events WHERE session_id = %s AND idempotency_key = %s"


@dataclass(frozen=True)
class Appended:
    """What an append wrote: the events' positions (in version order) and their timestamp."""

    positions: tuple[int, ...]
    recorded_at: datetime


@dataclass(frozen=True)
class Stale:
    """Nothing was written: the session is at ``version`` (0: no projection row), whose state
    JSON is ``state_json`` (None without a projector)."""

    version: int
    state_json: str | None


@dataclass(frozen=True)
class Replayed:
    """Nothing was written: the idempotency key was first used by the append starting at ``first_version``."""

    first_version: int


class _RetryableDisconnect(Exception):
    """Internal: an append failed on a dead connection, and running it again is safe."""


def _has_pending_input(raw: Any) -> bool:
    """Whether an idle connection's socket has something to read: nothing is expected between
    autocommit statements, so it is the server's goodbye (an error message, or EOF)."""
    import psycopg  # loaded with the connection's driver already; not with this module (SQLite never needs it)

    try:
        ready, _, _ = select.select([raw.driver_connection.pgconn.socket], [], [], 0)
    except (OSError, ValueError, psycopg.Error):
        return True  # closed: let the ping decide
    return bool(ready)


def _event(row: tuple[Any, ...]) -> StoredEvent:
    return StoredEvent(row[0], row[1], row[2], row[3], row[4], row[5].astimezone(UTC), row[6])


class PgFastPath:
    """The psycopg hot path of one store's engine, with its stash of idle append connections."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._idle: list[tuple[Any, float]] = []
        self._idle_lock = threading.Lock()
        #: (year, month) whose partitions this process has made sure of; when to try again after a failure
        self._partitions_month: tuple[int, int] | None = None
        self._partitions_retry_at = 0.0

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
            if time.monotonic() - since <= PG_PING_IDLE_S and not _has_pending_input(raw):
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
        import psycopg  # loaded with the connection's driver already

        conn = raw.driver_connection
        slot = "ct_ccursor" if client_side else "ct_cursor"
        cur = raw.info.get(slot)
        if cur is None or cur.closed or cur.connection is not conn:
            cur = raw.info[slot] = psycopg.ClientCursor(conn) if client_side else psycopg.Cursor(conn)
        return cur

    def _query(self, what: str, sql: str, params: tuple[Any, ...] | dict[str, Any]) -> list[tuple[Any, ...]]:
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

    def read_all(
        self, after_position: int, limit: int, session_prefix: str | None, types: tuple[str, ...] | None
    ) -> list[StoredEvent]:
        if types is not None:
            sql = _read_all_types(types, session_prefix is not None)
            args = (after_position, session_prefix, limit) if session_prefix is not None else (after_position, limit)
            return [_event(r) for r in self._query("read_all", sql, args)]
        if session_prefix is None:
            rows = self._query("read_all", _READ_ALL, (after_position, limit))
        elif session_prefix.endswith(":") and session_prefix.count(":") == 1:  # exactly one fleet
            params = {"f": session_prefix[:-1], "p": after_position, "n": limit}
            rows = self._query("read_all", _READ_ALL_FLEET, params)
        else:
            rows = self._query("read_all", _READ_ALL_PREFIX, (after_position, session_prefix, limit))
        return [_event(r) for r in rows]

    def stream_version(self, session_id: str) -> int:
        return int(self._query("stream_version", _STREAM_VERSION, (session_id,))[0][0])

    def projection_state(self, session_id: str) -> tuple[int, str | None] | None:
        """(version, state JSON) of the session's projection row, or None."""
        rows = self._query("load", _LOAD, (session_id,))
        return (rows[0][0], rows[0][1]) if rows else None

    def keyed_version(self, session_id: str, idempotency_key: str) -> int | None:
        """The first version of the session's append recorded under ``idempotency_key``, or None."""
        rows = self._query("append", _KEYED_VERSION, (session_id, idempotency_key))
        return int(rows[0][0]) if rows else None

    # -- append ---------------------------------------------------------------------------------------

    def append(
        self,
        session_id: str,
        expected: int,
        events_text: str,
        key: str | None,
        put: tuple[Any, ...],
        *,
        before_commit: Callable[[str, tuple[int, ...]], None] | None = None,
    ) -> Appended | Stale | Replayed:
        """One ``ct_append`` call: the events (``events_text``: their canonical texts,
        ``tracker.store.chain``, one a line; the server stores and chains them) and the
        projection row ``put`` = ``(state_json, pressure, revision, occupancy_bp, open_attempts)``
        (all None without a projector).

        Returns ``Appended``; ``Stale`` (nothing written) when the session is not at ``expected``,
        with its current version and state; ``Replayed`` when the idempotency key was used
        before. Driver errors propagate; the store maps them.
        """
        try:
            out = self._append_once(session_id, expected, events_text, key, put, before_commit)
        except _RetryableDisconnect:
            # Either nothing was sent (a dead stashed connection), or the call carries an
            # idempotency key, so that running it again returns the first run's outcome.
            out = self._append_once(session_id, expected, events_text, key, put, before_commit, retry=False)
        if isinstance(out, Appended):
            self._keep_partitions_ahead(out.recorded_at)
        return out

    def _keep_partitions_ahead(self, recorded_at: datetime) -> None:
        """At the first append of this process in a month: the partitions of this month and the next ones."""
        month = (recorded_at.year, recorded_at.month)
        if month == self._partitions_month or time.monotonic() < self._partitions_retry_at:
            return
        try:
            self._query("partitions", _ENSURE_PARTITIONS, (PARTITION_MONTHS_AHEAD, PARTITION_LOCK_TIMEOUT))
        except StoreError as exc:
            self._partitions_retry_at = time.monotonic() + PARTITION_RETRY_S
            log.warning("events partitions ahead not made (the DEFAULT partition takes the events meanwhile): %s", exc)
            return
        self._partitions_month = month

    def _append_once(
        self,
        sid: str,
        expected: int,
        events_text: str,
        key: str | None,
        put: tuple[Any, ...],
        before_commit: Callable[[str, tuple[int, ...]], None] | None,
        retry: bool = True,
    ) -> Appended | Stale | Replayed:
        raw, fresh = self._take()
        sent = False
        params = (sid, expected, events_text, key, *put)
        try:
            cur = self._cursor(raw, client_side=False)
            if before_commit is None:
                sent = True
                cur.execute(_APPEND, params, prepare=True)  # autocommit: the statement is the transaction
                row = cur.fetchone()
            else:  # the tests' seam: everything written, then the hook, then COMMIT
                cur.execute("BEGIN")
                sent = True
                cur.execute(_APPEND, params, prepare=True)
                row = cur.fetchone()
                if row[0] == "ok":
                    before_commit(sid, tuple(row[3]))
                cur.execute("COMMIT" if row[0] == "ok" else "ROLLBACK")
        except BaseException as exc:
            # Broken, or mid-transaction: never reuse it. Closing it makes the server roll
            # back whatever this append had written and not committed.
            self._discard(raw)
            if is_unavailable(exc):
                self.reset_pool()
                if retry and not fresh and (not sent or key is not None):
                    raise _RetryableDisconnect() from exc
            raise
        self._put(raw)
        status, version, state_json, positions, recorded_at = row
        if status == "ok":
            return Appended(tuple(positions), recorded_at.astimezone(UTC))
        if status == "replay":
            return Replayed(version)
        return Stale(version, state_json)
