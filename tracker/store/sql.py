"""The event store on SQLAlchemy 2: PostgreSQL (psycopg 3) and SQLite.

Schema: ``tracker.store.schema`` (SQLAlchemy Core tables), created and changed only
by the Alembic migrations in ``alembic/`` (``tracker.store.migrate``).

Writes
------
One append = one transaction: the events (versions ``expected+1 …``, no gaps) and
the session's projection row (folded by the caller's ``Projector``) commit
together or not at all. Optimistic concurrency: the caller passes the version it
last saw; ``UNIQUE (session_id, version)`` plus a compare-and-set on
``sessions.version`` make exactly one of several racing writers win each version;
the others get ``ConcurrencyConflict`` (with ``expected``/``actual``). An append
may carry an idempotency key (stored on its first event, ``UNIQUE (session_id,
idempotency_key)``, with ``batch_size``); a retry with the same key returns the
original result with ``replayed=True`` and writes nothing, even when
``expected_version`` is stale. All input is validated before anything is written.

*PostgreSQL hot path*: two round trips, both sent as one simple-protocol message
each (client-side bound, psycopg ``ClientCursor``)::

    BEGIN; SELECT … FROM ct_append_events(…)        -- events, INSERT … RETURNING
    SELECT ct_put_session(…); COMMIT                 -- projection CAS, then commit

(plus ``SELECT version, state FROM sessions`` in the first message when the
session's state at ``expected_version`` is not cached). Both server functions
come from migration 0001. A conflict fails the statement (unique_violation /
CT409), which also skips the COMMIT queued behind it. The state after each append
is cached per (session, version) -- a version's state never changes -- so the
usual "load, decide, append" loop does not re-read the projection. Append
connections stay checked out between calls (autocommit, explicit transactions),
so the pool's checkout/reset work is skipped too; hot reads (``read_stream``,
``read_all``, ``load``, ``stream_version``) use them with prepared statements.
Everything else goes through SQLAlchemy Core.

*SQLite*: ``BEGIN IMMEDIATE`` takes the database's single write lock before the
version check, so check + insert + projection are atomic; WAL mode, a busy
timeout, ``synchronous=FULL``.

Commit-order tailing (``read_all``)
-----------------------------------
A reader that pages through ``read_all(after_position)`` must never skip an event
that commits later with a lower position.

*SQLite* has one writer at a time and positions are drawn inside the write
transaction, so position order is commit order and a read snapshot is a prefix.

*PostgreSQL*: positions come from the identity sequence (CACHE 1), but
transactions commit in any order, so position order alone is not safe: a tailer
could read position 11 (committed) while 10 is still in flight, resume after 11
and never see 10. We use a transaction-id watermark, made sound by a tiny
critical section:

1. Every append goes through ``ct_append_events`` as the first statement of its
   transaction. Under a session-level advisory lock ``L`` it only (a) assigns the
   transaction its id (``pg_current_xact_id()``) and (b) draws the events'
   positions (``nextval``), then releases ``L`` and inserts the rows, recording
   the transaction id in ``events.txid``. ``L`` is held for microseconds and never
   across the insert or the commit, so appends still commit in parallel.
2. Hence, for any two appending transactions A and B: ``xid(A) < xid(B)`` iff
   every position of A is below every position of B (xids and sequence values
   both grow with time, and each transaction takes both inside one ``L`` section).
3. ``read_all`` is one statement returning the rows with
   ``txid < pg_snapshot_xmin(pg_current_snapshot())`` (``xmin`` of that very
   statement's snapshot), ordered by position. Every transaction with an xid below
   ``xmin`` has ended, and its committed rows are visible in the snapshot; every
   transaction that can still commit (running now, or not yet started) has an xid
   ``>= xmin`` and so, by (2), only positions above every position returned. The
   result is therefore a prefix of the final log in position order: the next call,
   after the last position seen, cannot miss anything. Committed rows with
   ``txid >= xmin`` are simply returned by a later call.

Without step 1 the watermark alone is not enough: B (higher xid) can draw a lower
position than A (lower xid); once A commits, the watermark passes A's rows while B,
holding the lower position, is still running. Trade-off: an event becomes visible to ``read_all`` only once
every transaction that got an xid before it (anywhere in the PostgreSQL cluster,
not only appends) has ended, so a long-running writing transaction delays tailing
(never safety). ``read_stream`` and ``load`` are not affected.

Faults
------
Connection loss, a stopped or restarted server, ``database is locked`` beyond the
busy timeout -> ``StoreUnavailable``; the server rolls the open transaction back,
so nothing is half-written. Connections that sat idle for more than
``PG_PING_IDLE_S`` are pinged before use (``pool_pre_ping`` on every checkout
would cost a round trip per append); a disconnect seen on a connection in use
invalidates the pool, and a call that hit a dead connection before sending COMMIT
is retried once on a fresh one, so the first call after a server restart already
works. If the connection drops *during* COMMIT the outcome cannot be known by any
client: ``StoreUnavailable`` is raised, and a retry with the same idempotency key
makes that safe. A forked child never reuses its parent's connections.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import weakref
from collections import OrderedDict
from datetime import datetime, timezone
from typing import Any, Callable, Iterator, Sequence

from sqlalchemy import Text, cast, create_engine, event, func, insert, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from tracker.core.model import check_session_id
from tracker.errors import (
    ConcurrencyConflict,
    InvalidInput,
    PayloadTooLarge,
    StoreError,
    StoreUnavailable,
    TrackerError,
)
from tracker.store import migrate
from tracker.store.base import (
    DEFAULT_MAX_EVENT_BYTES,
    MAX_EVENT_TYPE_LEN,
    MAX_EVENTS_PER_APPEND,
    MAX_IDEMPOTENCY_KEY_LEN,
    PROJECTION_COLUMNS,
    AppendResult,
    NewEvent,
    Projector,
    StoredEvent,
)
from tracker.store.schema import events as events_t
from tracker.store.schema import sessions as sessions_t

UTC = timezone.utc
CONFLICT_SQLSTATE = "CT409"  # raised by ct_put_session: the projection is not at the expected version
UNIQUE_VIOLATION = "23505"  # ct_append_events: that version or idempotency key is taken
CONFLICT_SQLSTATES = (CONFLICT_SQLSTATE, UNIQUE_VIOLATION)
READ_BATCH = 2000
STATE_CACHE_SIZE = 4096

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
_SESSION_PREFIX = re.compile(r"[A-Za-z0-9._:-]{1,200}")


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


# -- PostgreSQL hot-path statements (fixed text, no SQL compilation per call) ---------------------

# Appends: client-side bound (psycopg ClientCursor) so that several statements travel in
# one round trip: "BEGIN; [pre-read;] append" and "projection; COMMIT". A conflict fails
# the statement (unique_violation from the insert, CT409 from ct_put_session), which
# also skips the COMMIT queued behind it.
_PG_PRE_READ = "SELECT version, state::text FROM sessions WHERE session_id = %s::text"
_PG_APPEND = (
    "SELECT out_position, out_version, out_recorded_at "
    "FROM ct_append_events(%s::text, %s::integer, %s::text, %s::text, %s::text)"
)
_PG_BEGIN_APPEND = "BEGIN; " + _PG_APPEND
_PG_BEGIN_PRE_READ_APPEND = "BEGIN; " + _PG_PRE_READ + "; " + _PG_APPEND
_PG_PUT_SESSION = (
    "SELECT ct_put_session(%s::text, %s::integer, %s::integer, %s::text, %s::text, %s::integer, %s::integer, %s::integer)"
)
_PG_PUT_SESSION_COMMIT = _PG_PUT_SESSION + "; COMMIT"
#: idle append connections kept by a store (beyond this they go back to the pool)
PG_IDLE_APPEND_CONNECTIONS = 8
# Hot reads on PostgreSQL (server-side bound, prepared by psycopg after a few uses).
_PG_EVENT_COLS = "position, session_id, version, type, data, recorded_at, idempotency_key"
_PG_READ_STREAM = (
    f"SELECT {_PG_EVENT_COLS} FROM events WHERE session_id = %s AND version > %s AND version <= %s "
    "ORDER BY version LIMIT %s"
)
# The watermark and the rows come from the same statement, hence the same snapshot.
_PG_READ_ALL = (
    f"SELECT {_PG_EVENT_COLS} FROM events WHERE position > %s "
    "AND txid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint ORDER BY position LIMIT %s"
)
# The same with a session-id prefix filter (``starts_with``: exact, case-sensitive, no LIKE wildcards).
_PG_READ_ALL_PREFIX = (
    f"SELECT {_PG_EVENT_COLS} FROM events WHERE position > %s AND starts_with(session_id, %s) "
    "AND txid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint ORDER BY position LIMIT %s"
)
_PG_LOAD = "SELECT version, state::text FROM sessions WHERE session_id = %s"
_PG_STREAM_VERSION = "SELECT coalesce(max(version), 0) FROM events WHERE session_id = %s"
_MAX_VERSION = 2**31 - 1


# -- errors ----------------------------------------------------------------------------------------


def _unavailable_types() -> tuple[type[BaseException], ...]:
    import sqlite3

    # sa_exc.TimeoutError: no pooled connection free within pool_timeout (every connection busy,
    # e.g. many request threads of `tracker serve` at once) -- the database is unavailable to us now.
    types: list[type[BaseException]] = [
        sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError, sqlite3.OperationalError,
    ]
    try:
        import psycopg

        types += [psycopg.OperationalError, psycopg.InterfaceError]
    except ImportError:  # pragma: no cover - psycopg is a dependency
        pass
    return tuple(types)


_UNAVAILABLE = _unavailable_types()


def _db_error_types() -> tuple[type[BaseException], ...]:
    import sqlite3

    types: list[type[BaseException]] = [sa_exc.SQLAlchemyError, sqlite3.Error]
    try:
        import psycopg

        types.append(psycopg.Error)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


_DB_ERRORS = _db_error_types()


def _db_error(exc: BaseException, what: str) -> TrackerError:
    """Map a driver/SQLAlchemy exception to the store's typed errors."""
    if isinstance(exc, TrackerError):
        return exc
    detail = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else exc.__class__.__name__
    if isinstance(exc, _UNAVAILABLE) or (isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated):
        return StoreUnavailable(f"the database is unavailable ({what}): {detail}", operation=what)
    return StoreError(f"database error ({what}): {detail}", operation=what)


# -- engine ----------------------------------------------------------------------------------------


#: A pooled PostgreSQL connection idle for longer than this is pinged before use. (A ping
#: on every checkout, i.e. ``pool_pre_ping``, costs one round trip per append: ~25%.)
PG_PING_IDLE_S = 1.0


def make_engine(url: str) -> Engine:
    """An engine configured for the store: psycopg + idle pings on PostgreSQL, WAL + BEGIN IMMEDIATE on SQLite."""
    url = migrate.normalize_url(url)
    if url.startswith("sqlite"):
        if url.rstrip("/") in ("sqlite:", "sqlite:/") or ":memory:" in url or "mode=memory" in url:
            raise InvalidInput("database_url", "an in-memory SQLite database cannot be used; give a file (sqlite:///path.db)")
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, pool_pre_ping=True)

        @event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_conn, _record):  # noqa: ANN001
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA busy_timeout = 30000")
            cur.execute("PRAGMA journal_mode = WAL")
            cur.execute("PRAGMA synchronous = FULL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("ct_write") else "BEGIN")

        return engine
    if url.startswith("postgresql"):
        engine = create_engine(
            url,
            pool_size=5,
            max_overflow=10,
            pool_recycle=1800,
            connect_args={"connect_timeout": 5, "application_name": "context-tracker"},
        )
        dialect = engine.dialect

        # Pessimistic disconnect handling, like pool_pre_ping, but only for connections
        # that sat idle: a hot connection is not pinged, and a failure on it is retried
        # once by the append path (nothing can have been committed) and invalidates the
        # pool, so the next call reconnects.
        @event.listens_for(engine, "checkin")
        def _pg_checkin(_dbapi_conn, record):  # noqa: ANN001
            record.info["ct_idle_since"] = time.monotonic()

        @event.listens_for(engine, "checkout")
        def _pg_checkout(dbapi_conn, record, _proxy):  # noqa: ANN001
            idle_since = record.info.get("ct_idle_since")
            if idle_since is not None and time.monotonic() - idle_since > PG_PING_IDLE_S:
                try:
                    alive = dialect.do_ping(dbapi_conn)
                except Exception as exc:  # noqa: BLE001 - any failure means "reconnect"
                    raise sa_exc.DisconnectionError(str(exc)) from exc
                if not alive:
                    raise sa_exc.DisconnectionError("ping failed")

        return engine
    raise InvalidInput("database_url", f"unsupported database URL {url.split(':', 1)[0]!r} (use sqlite:/// or postgresql://)")


def open_store(
    url: str,
    *,
    projector: Projector | None = None,
    check_schema: bool = True,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
) -> "SqlEventStore":
    """Open the event store at ``url``. Refuses a missing/older schema (SchemaOutOfDate) unless check_schema=False."""
    if not isinstance(max_event_bytes, int) or max_event_bytes <= 0:
        raise InvalidInput("max_event_bytes", "must be a positive integer")
    engine = make_engine(url)
    try:
        if check_schema:
            migrate.check_schema(engine)
    except BaseException:
        engine.dispose()
        raise
    return SqlEventStore(engine, projector=projector, max_event_bytes=max_event_bytes)


# -- the store -------------------------------------------------------------------------------------


class SqlEventStore:
    """``EventStore`` on SQLite or PostgreSQL. Thread-safe; one instance per process is plenty."""

    def __init__(self, engine: Engine, *, projector: Projector | None = None, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES):
        self._engine = engine
        self.backend = engine.dialect.name
        self._pg = self.backend == "postgresql"
        self.projector = projector
        self.max_event_bytes = max_event_bytes
        self._cache: OrderedDict[str, tuple[int, str]] = OrderedDict()
        self._cache_lock = threading.Lock()
        #: Test seam: called as hook(session_id, positions) after everything of an append
        #: is written and before COMMIT (used to widen race windows in tests).
        self._before_commit: Callable[[str, tuple[int, ...]], None] | None = None
        # PostgreSQL append connections, kept checked out between appends (in autocommit
        # mode, transactions are explicit) to skip the pool's checkout/reset work.
        self._pg_idle: list[tuple[Any, float]] = []
        self._pg_idle_lock = threading.Lock()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (store := ref()) is not None and store._after_fork())

    def _after_fork(self) -> None:
        """In a forked child (e.g. a prefork worker): never touch the parent's connections."""
        self._pg_idle = []
        self._pg_idle_lock = threading.Lock()
        self._cache_lock = threading.Lock()
        self._engine.dispose(close=False)

    @property
    def engine(self) -> Engine:
        return self._engine

    def close(self) -> None:
        with self._pg_idle_lock:
            idle, self._pg_idle = self._pg_idle, []
        for raw, _ in idle:
            self._pg_release(raw)
        self._engine.dispose()

    # -- PostgreSQL append connections -------------------------------------------------------------

    def _pg_take(self) -> tuple[Any, bool]:
        """(connection, fresh): an idle append connection, pinged if it sat idle, or a new checkout."""
        while True:
            with self._pg_idle_lock:
                if not self._pg_idle:
                    break
                raw, since = self._pg_idle.pop()
            if time.monotonic() - since <= PG_PING_IDLE_S:
                return raw, False
            try:
                alive = self._engine.dialect.do_ping(raw.driver_connection)
            except Exception:  # noqa: BLE001
                alive = False
            if alive:
                return raw, True
            self._pg_discard(raw)
            self._invalidate_pool()
        raw = self._engine.raw_connection()  # the checkout pings a connection that sat idle in the pool
        try:
            raw.driver_connection.autocommit = True
        except BaseException:
            self._pg_discard(raw)
            raise
        return raw, True

    def _pg_put(self, raw: Any) -> None:
        with self._pg_idle_lock:
            if len(self._pg_idle) < PG_IDLE_APPEND_CONNECTIONS:
                self._pg_idle.append((raw, time.monotonic()))
                return
        self._pg_release(raw)

    @staticmethod
    def _pg_release(raw: Any) -> None:
        try:
            raw.driver_connection.autocommit = False
            raw.close()
        except Exception:  # noqa: BLE001 - a broken connection
            SqlEventStore._pg_discard(raw)

    @staticmethod
    def _pg_discard(raw: Any) -> None:
        try:
            raw.invalidate()
            raw.close()
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> "SqlEventStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- validation ------------------------------------------------------------------------------

    def _validate(
        self, session_id: Any, expected_version: Any, events: Any, idempotency_key: Any
    ) -> tuple[list[str], list[str], list[dict[str, Any]]]:
        check_session_id(session_id)
        if not isinstance(expected_version, int) or isinstance(expected_version, bool) or expected_version < 0:
            raise InvalidInput("expected_version", f"must be an integer >= 0, got {expected_version!r}")
        if idempotency_key is not None:
            if not isinstance(idempotency_key, str) or not 1 <= len(idempotency_key) <= MAX_IDEMPOTENCY_KEY_LEN:
                raise InvalidInput("idempotency_key", f"must be a string of 1-{MAX_IDEMPOTENCY_KEY_LEN} characters")
            if _CONTROL.search(idempotency_key):
                raise InvalidInput("idempotency_key", "must not contain control characters")
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
                raise InvalidInput(f"events[{i}].type", f"must be a non-empty string of at most {MAX_EVENT_TYPE_LEN} characters")
            if _CONTROL.search(etype):
                raise InvalidInput(f"events[{i}].type", "must not contain control characters")
            if not isinstance(data, dict):
                raise InvalidInput(f"events[{i}].data", f"must be a JSON object (dict), got {type(data).__name__}")
            try:
                text = _dumps(data)
            except (TypeError, ValueError, RecursionError) as exc:
                raise InvalidInput(f"events[{i}].data", f"not JSON-serialisable: {exc}") from None
            size = len(text.encode("utf-8"))
            if size > self.max_event_bytes:
                raise PayloadTooLarge(
                    f"events[{i}].data",
                    f"{size} bytes of JSON exceeds the limit of {self.max_event_bytes} bytes",
                    size=size,
                    limit=self.max_event_bytes,
                )
            if "\\u0000" in text and _JSON_NUL.search(text):
                raise InvalidInput(f"events[{i}].data", "strings must not contain NUL (\\u0000)")
            types.append(etype)
            texts.append(text)
            datas.append(json.loads(text))  # what a reader will get back
        return types, texts, datas

    # -- state cache -----------------------------------------------------------------------------

    def _cache_get(self, session_id: str, version: int) -> str | None:
        with self._cache_lock:
            hit = self._cache.get(session_id)
            if hit is None or hit[0] != version:
                return None
            self._cache.move_to_end(session_id)
            return hit[1]

    def _cache_put(self, session_id: str, version: int, state_json: str) -> None:
        with self._cache_lock:
            self._cache[session_id] = (version, state_json)
            self._cache.move_to_end(session_id)
            while len(self._cache) > STATE_CACHE_SIZE:
                self._cache.popitem(last=False)

    def _cache_drop(self, session_id: str) -> None:
        with self._cache_lock:
            self._cache.pop(session_id, None)

    # -- projection helpers ----------------------------------------------------------------------

    def _fold(self, state: dict[str, Any], stored: Sequence[StoredEvent], projector: Projector | None = None) -> dict[str, Any]:
        proj = projector or self.projector
        assert proj is not None
        many = getattr(proj, "apply_many", None)
        if many is not None:
            return many(state, stored)
        for ev in stored:
            state = proj.apply(state, ev)
        return state

    def fold_stream(self, session_id: str, to_version: int | None = None, projector: Projector | None = None) -> tuple[dict[str, Any], int]:
        """Rebuild a session's state from the log alone (streamed). Returns (state, version)."""
        proj = projector or self.projector
        if proj is None:
            raise InvalidInput("projector", "folding needs a projector")
        state = proj.initial(session_id)
        version = 0
        batch: list[StoredEvent] = []
        for ev in self.read_stream(session_id, 1, to_version):
            batch.append(ev)
            version = ev.version
            if len(batch) >= READ_BATCH:
                state = self._fold(state, batch, proj)
                batch = []
        if batch:
            state = self._fold(state, batch, proj)
        return state, version

    def _columns(self, state: dict[str, Any]) -> tuple[Any, Any, Any, int]:
        assert self.projector is not None
        cols = self.projector.columns(state) or {}
        return (cols.get("pressure"), cols.get("revision"), cols.get("occupancy_bp"), int(cols.get("open_attempts") or 0))

    # -- append ----------------------------------------------------------------------------------

    def append(
        self,
        session_id: str,
        expected_version: int,
        events: Sequence[NewEvent],
        *,
        idempotency_key: str | None = None,
    ) -> AppendResult:
        types, texts, datas = self._validate(session_id, expected_version, events, idempotency_key)
        try:
            if self._pg:
                return self._append_pg(session_id, expected_version, types, texts, datas, idempotency_key)
            return self._append_sqlite(session_id, expected_version, types, texts, datas, idempotency_key)
        except TrackerError as exc:
            if isinstance(exc, StoreUnavailable):
                self._cache_drop(session_id)
            raise
        except _DB_ERRORS as exc:
            self._cache_drop(session_id)
            raise _db_error(exc, "append") from exc

    def _new_state(
        self,
        base: dict[str, Any],
        session_id: str,
        positions: Sequence[int],
        first_version: int,
        types: list[str],
        datas: list[dict[str, Any]],
        recorded_at: datetime,
        key: str | None,
    ) -> dict[str, Any]:
        stored = [
            StoredEvent(pos, session_id, first_version + i, types[i], datas[i], recorded_at, key if i == 0 else None)
            for i, pos in enumerate(positions)
        ]
        return self._fold(base, stored)

    @staticmethod
    def _cursor(raw: Any, client_side: bool) -> Any:
        """A cursor cached on the pooled connection (ClientCursor: several statements per round trip)."""
        import psycopg

        conn = raw.driver_connection
        slot = "ct_ccursor" if client_side else "ct_cursor"
        cur = raw.info.get(slot)
        if cur is None or cur.closed or cur.connection is not conn:
            cur = raw.info[slot] = psycopg.ClientCursor(conn) if client_side else psycopg.Cursor(conn)
        return cur

    def _pg_query(self, what: str, sql: str, params: tuple[Any, ...], retry: bool = True) -> list[tuple[Any, ...]]:
        """One autocommit statement on a PostgreSQL connection; typed errors; one retry on a dead connection."""
        try:
            raw, fresh = self._pg_take()
        except _DB_ERRORS as exc:
            raise _db_error(exc, what) from exc
        try:
            cur = self._cursor(raw, client_side=False)
            cur.execute(sql, params)
            rows = cur.fetchall()
        except BaseException as exc:
            self._pg_discard(raw)
            if isinstance(exc, _UNAVAILABLE):
                self._invalidate_pool()
                if retry and not fresh:
                    return self._pg_query(what, sql, params, retry=False)
            if isinstance(exc, _DB_ERRORS):
                raise _db_error(exc, what) from exc
            raise
        self._pg_put(raw)
        return rows

    @staticmethod
    def _pg_event(row: tuple[Any, ...]) -> StoredEvent:
        return StoredEvent(row[0], row[1], row[2], row[3], row[4], row[5].astimezone(UTC), row[6])

    def _append_pg(
        self, sid: str, expected: int, types: list[str], texts: list[str], datas: list[dict[str, Any]], key: str | None
    ) -> AppendResult:
        try:
            return self._append_pg_once(sid, expected, types, texts, datas, key)
        except _RetryableDisconnect:
            # The pooled connection was dead (e.g. the server restarted since its last use)
            # and nothing was committed: once more on a fresh connection.
            return self._append_pg_once(sid, expected, types, texts, datas, key, retry=False)

    def _append_pg_once(
        self,
        sid: str,
        expected: int,
        types: list[str],
        texts: list[str],
        datas: list[dict[str, Any]],
        key: str | None,
        retry: bool = True,
    ) -> AppendResult:
        import psycopg

        proj = self.projector
        base_json = self._cache_get(sid, expected) if proj is not None else None
        pre_read = proj is not None and base_json is None
        types_json = _dumps(types)
        data_json = "[" + ",".join(texts) + "]"
        raw, fresh = self._pg_take()
        conflict = committing = False
        try:
            cur = self._cursor(raw, client_side=True)
            try:
                if pre_read:
                    cur.execute(_PG_BEGIN_PRE_READ_APPEND, (sid, sid, expected, types_json, data_json, key), prepare=False)
                    cur.nextset()  # -> the pre-read
                    row = cur.fetchone()
                    cur.nextset()  # -> the append
                    if (row[0] if row else 0) != expected:  # e.g. expected_version ahead of the stream
                        raise _Conflict()
                else:
                    cur.execute(_PG_BEGIN_APPEND, (sid, expected, types_json, data_json, key), prepare=False)
                    cur.nextset()
                    row = None
                rows = cur.fetchall()
                rows.sort(key=lambda r: r[1])
                positions = tuple(r[0] for r in rows)
                recorded_at = rows[0][2].astimezone(UTC)
                last = expected + len(rows)
                state = state_json = None
                if proj is not None:
                    if base_json is not None:
                        base = json.loads(base_json)
                    elif row is None:
                        base = proj.initial(sid)
                    elif row[1] is None:  # appended without a projector so far: rebuild from the log
                        base, _ = self.fold_stream(sid, expected)
                    else:
                        base = json.loads(row[1])
                    state = self._new_state(base, sid, positions, expected + 1, types, datas, recorded_at, key)
                    state_json = _dumps(state)
                    put = (sid, expected, last, state_json, *self._columns(state))
                else:
                    put = (sid, expected, last, None, None, None, None, None)
                if self._before_commit is None:
                    committing = True
                    cur.execute(_PG_PUT_SESSION_COMMIT, put, prepare=False)
                else:
                    cur.execute(_PG_PUT_SESSION, put)
                    self._before_commit(sid, positions)
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
            self._pg_discard(raw)
            if isinstance(exc, _UNAVAILABLE):
                self._invalidate_pool()
                if retry and not fresh and not committing:
                    raise _RetryableDisconnect() from exc
            raise
        self._pg_put(raw)
        if conflict:
            return self._resolve_conflict(sid, expected, key)
        if state_json is not None:
            self._cache_put(sid, last, state_json)
        return AppendResult(sid, expected + 1, last, positions, False, state)

    def _invalidate_pool(self) -> None:
        """After a disconnect: make every pooled connection reconnect (or be pinged) before reuse."""
        pool = self._engine.pool
        try:
            pool._invalidate(None)  # type: ignore[attr-defined]  # what SQLAlchemy itself does on a disconnect
        except Exception:  # noqa: BLE001
            self._engine.dispose(close=False)

    def _append_sqlite(
        self, sid: str, expected: int, types: list[str], texts: list[str], datas: list[dict[str, Any]], key: str | None
    ) -> AppendResult:
        proj = self.projector
        s, e = sessions_t.c, events_t.c
        with self._engine.connect() as conn:
            conn = conn.execution_options(ct_write=True)
            with conn.begin():  # BEGIN IMMEDIATE: we hold the write lock from here to COMMIT
                row = conn.execute(select(s.version, cast(s.state, Text)).where(s.session_id == sid)).first()
                if key is not None:
                    replay = self._replay(conn, sid, key)
                    if replay is not None:
                        return replay
                actual = int(
                    conn.execute(select(func.coalesce(func.max(e.version), 0)).where(e.session_id == sid)).scalar_one()
                )
                if actual != expected or (row[0] if row else 0) != expected:
                    raise self._conflict_error(sid, expected, actual)
                base = None
                if proj is not None:
                    base_json = self._cache_get(sid, expected)
                    if base_json is None and row is not None:
                        base_json = row[1]
                    if base_json is not None:
                        base = json.loads(base_json)
                    elif row is None:
                        base = proj.initial(sid)
                    else:
                        base, _ = self.fold_stream(sid, expected)
                recorded_at = datetime.now(UTC)
                params = [
                    {
                        "session_id": sid,
                        "version": expected + 1 + i,
                        "type": types[i],
                        "data": datas[i],
                        "recorded_at": recorded_at,
                        "idempotency_key": key if i == 0 else None,
                        "batch_size": len(types) if i == 0 else None,
                    }
                    for i in range(len(types))
                ]
                stmt = insert(events_t).returning(e.position, e.version, sort_by_parameter_order=True)
                rows = sorted(conn.execute(stmt, params).all(), key=lambda r: r[1])
                positions = tuple(r[0] for r in rows)
                last = expected + len(rows)
                state = state_json = None
                values: dict[str, Any] = {"version": last, "updated_at": recorded_at, "state": None}
                if proj is not None:
                    assert base is not None
                    state = self._new_state(base, sid, positions, expected + 1, types, datas, recorded_at, key)
                    state_json = _dumps(state)
                    pressure, revision, occupancy, open_attempts = self._columns(state)
                    values.update(
                        state=json.loads(state_json),
                        pressure=pressure,
                        revision=revision,
                        occupancy_bp=occupancy,
                        open_attempts=open_attempts,
                    )
                if expected == 0:
                    conn.execute(insert(sessions_t).values(session_id=sid, created_at=recorded_at, **values))
                else:
                    res = conn.execute(update(sessions_t).where(s.session_id == sid, s.version == expected).values(**values))
                    if res.rowcount != 1:  # cannot happen while we hold the write lock
                        raise self._conflict_error(sid, expected, expected)
                if self._before_commit is not None:
                    self._before_commit(sid, positions)
        if state_json is not None:
            self._cache_put(sid, last, state_json)
        return AppendResult(sid, expected + 1, last, positions, False, state)

    def _conflict_error(self, sid: str, expected: int, actual: int) -> TrackerError:
        if actual == expected:
            return StoreError(
                f"session {sid}: the projection row is missing or out of step with the log at version {actual}; "
                "run `tracker verify`",
                session_id=sid,
            )
        exc = ConcurrencyConflict(
            f"session {sid}: expected version {expected}, but the stream is at {actual}",
            session_id=sid,
            expected=expected,
            actual=actual,
        )
        exc.session_id = sid  # type: ignore[attr-defined]
        exc.expected = expected  # type: ignore[attr-defined]
        exc.actual = actual  # type: ignore[attr-defined]
        return exc

    def find_idempotent(self, session_id: str, idempotency_key: str) -> AppendResult | None:
        """The result of the earlier append made with this key, or None (lets a caller skip re-deciding)."""
        return self._run("append", lambda conn: self._replay(conn, session_id, idempotency_key))

    def _resolve_conflict(self, sid: str, expected: int, key: str | None) -> AppendResult:
        """After a lost race: the original result if the key was already used, else ConcurrencyConflict."""
        def look(conn: Connection) -> AppendResult | int:
            if key is not None:
                replay = self._replay(conn, sid, key)
                if replay is not None:
                    return replay
            e = events_t.c
            return int(conn.execute(select(func.coalesce(func.max(e.version), 0)).where(e.session_id == sid)).scalar_one())

        found = self._run("append", look)
        if isinstance(found, AppendResult):
            return found
        raise self._conflict_error(sid, expected, found)

    def _replay(self, conn: Connection, sid: str, key: str) -> AppendResult | None:
        e = events_t.c
        hit = conn.execute(select(e.version, e.batch_size).where(e.session_id == sid, e.idempotency_key == key)).first()
        if hit is None:
            return None
        first, n = hit[0], hit[1] or 1
        last = first + n - 1
        positions = tuple(
            conn.execute(
                select(e.position).where(e.session_id == sid, e.version.between(first, last)).order_by(e.version)
            ).scalars()
        )
        state = None
        if self.projector is not None:
            s = sessions_t.c
            row = conn.execute(select(s.version, cast(s.state, Text)).where(s.session_id == sid)).first()
            if row is not None and row[0] == last and row[1] is not None:
                state = json.loads(row[1])
            else:
                state, _ = self.fold_stream(sid, last)
        return AppendResult(sid, first, last, positions, True, state)

    # -- reads -----------------------------------------------------------------------------------

    def _run(self, what: str, fn: Callable[[Connection], Any]) -> Any:
        """``fn(conn)`` on a Core connection; typed errors; once more if the pooled connection was dead."""
        for attempt in (1, 2):
            try:
                with self._engine.connect() as conn:
                    return fn(conn)
            except _DB_ERRORS as exc:
                dead = isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated
                if attempt == 1 and dead:
                    continue
                raise _db_error(exc, what) from exc

    @staticmethod
    def _event(row: Any) -> StoredEvent:
        return StoredEvent(row[0], row[1], row[2], row[3], row[4], row[5], row[6])

    _EVENT_COLS = (
        events_t.c.position,
        events_t.c.session_id,
        events_t.c.version,
        events_t.c.type,
        events_t.c.data,
        events_t.c.recorded_at,
        events_t.c.idempotency_key,
    )

    def read_stream(self, session_id: str, from_version: int = 1, to_version: int | None = None) -> Iterator[StoredEvent]:
        """The session's events from ``from_version`` to ``to_version`` (inclusive), fetched in batches."""
        check_session_id(session_id)
        if not isinstance(from_version, int) or isinstance(from_version, bool) or from_version < 1:
            raise InvalidInput("from_version", "must be an integer >= 1")
        if to_version is not None and (not isinstance(to_version, int) or isinstance(to_version, bool)):
            raise InvalidInput("to_version", "must be an integer or None")
        return self._read_stream(session_id, from_version, to_version)

    def _read_stream(self, session_id: str, from_version: int, to_version: int | None) -> Iterator[StoredEvent]:
        e = events_t.c
        after = from_version - 1
        while True:
            if to_version is not None and after >= to_version:
                return
            if self._pg:
                upto = _MAX_VERSION if to_version is None else to_version
                rows = self._pg_query("read_stream", _PG_READ_STREAM, (session_id, after, upto, READ_BATCH))
                for row in rows:
                    yield self._pg_event(row)
                if len(rows) < READ_BATCH:
                    return
                after = rows[-1][2]
                continue
            cond = [e.session_id == session_id, e.version > after]
            if to_version is not None:
                cond.append(e.version <= to_version)
            stmt = select(*self._EVENT_COLS).where(*cond).order_by(e.version).limit(READ_BATCH)
            rows = self._run("read_stream", lambda conn: conn.execute(stmt).all())
            for row in rows:
                yield self._event(row)
            if len(rows) < READ_BATCH:
                return
            after = rows[-1][2]

    def read_all(self, after_position: int = 0, limit: int = 1000, *, session_prefix: str | None = None) -> list[StoredEvent]:
        """Events with position > after_position in commit-safe order (see the module docstring).

        ``session_prefix``: only events of sessions whose id starts with it (exact and
        case-sensitive on both backends). The filter is part of the same statement, so the
        result is still a prefix of the (filtered) log in commit order.
        """
        if not isinstance(after_position, int) or isinstance(after_position, bool) or after_position < 0:
            raise InvalidInput("after_position", "must be an integer >= 0")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise InvalidInput("limit", "must be an integer >= 1")
        if session_prefix is not None and (
            not isinstance(session_prefix, str) or not _SESSION_PREFIX.fullmatch(session_prefix)
        ):
            raise InvalidInput("session_prefix", "must be 1-200 characters of [A-Za-z0-9._:-] or None")
        if self._pg:
            if session_prefix is None:
                rows = self._pg_query("read_all", _PG_READ_ALL, (after_position, limit))
            else:
                rows = self._pg_query("read_all", _PG_READ_ALL_PREFIX, (after_position, session_prefix, limit))
            return [self._pg_event(r) for r in rows]
        e = events_t.c
        cond = [e.position > after_position]
        if session_prefix is not None:
            # substr, not LIKE: SQLite's LIKE is case-insensitive and '_' is a wildcard
            cond.append(func.substr(e.session_id, 1, len(session_prefix)) == session_prefix)
        stmt = select(*self._EVENT_COLS).where(*cond).order_by(e.position).limit(limit)
        return [self._event(r) for r in self._run("read_all", lambda conn: conn.execute(stmt).all())]

    def stream_version(self, session_id: str) -> int:
        check_session_id(session_id)
        if self._pg:
            return int(self._pg_query("stream_version", _PG_STREAM_VERSION, (session_id,))[0][0])
        e = events_t.c
        stmt = select(func.coalesce(func.max(e.version), 0)).where(e.session_id == session_id)
        return int(self._run("stream_version", lambda conn: conn.execute(stmt).scalar_one()))

    def load(self, session_id: str) -> tuple[dict[str, Any] | None, int]:
        """(projection state, version); (None, 0) for an unknown session."""
        check_session_id(session_id)
        if self._pg:
            rows = self._pg_query("load", _PG_LOAD, (session_id,))
            row = rows[0] if rows else None
        else:
            s = sessions_t.c
            stmt = select(s.version, cast(s.state, Text)).where(s.session_id == session_id)
            row = self._run("load", lambda conn: conn.execute(stmt).first())
        if row is None:
            return None, 0
        version, text = row
        if text is None:
            if self.projector is None or version == 0:
                return None, version
            state, _ = self.fold_stream(session_id, version)
            self._cache_put(session_id, version, _dumps(state))
            return state, version
        if self.projector is not None:
            self._cache_put(session_id, version, text)
        return json.loads(text), version

    def list_sessions(
        self, *, pressure: str | None = None, active_since: datetime | None = None, limit: int = 1000
    ) -> list[dict[str, Any]]:
        """Projection rows (all columns of ``sessions``), most recently updated first."""
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise InvalidInput("limit", "must be an integer >= 1")
        if active_since is not None and not isinstance(active_since, datetime):
            raise InvalidInput("active_since", "must be a datetime")
        s = sessions_t.c
        stmt = select(sessions_t)
        if pressure is not None:
            stmt = stmt.where(s.pressure == pressure)
        if active_since is not None:
            if active_since.tzinfo is None:
                active_since = active_since.replace(tzinfo=UTC)
            stmt = stmt.where(s.updated_at >= active_since)
        stmt = stmt.order_by(s.updated_at.desc(), s.session_id).limit(limit)
        return [dict(r._mapping) for r in self._run("list_sessions", lambda conn: conn.execute(stmt).all())]

    def session_ids(self) -> Iterator[str]:
        """Every session with a projection row, in id order (fetched in batches)."""
        s = sessions_t.c
        after: str | None = None
        while True:
            stmt = select(s.session_id).order_by(s.session_id).limit(READ_BATCH)
            if after is not None:
                stmt = stmt.where(s.session_id > after)
            ids = self._run("session_ids", lambda conn: list(conn.execute(stmt).scalars()))
            yield from ids
            if len(ids) < READ_BATCH:
                return
            after = ids[-1]

    # -- verification support ----------------------------------------------------------------------

    def _log_versions(self) -> Iterator[tuple[str, int]]:
        """(session_id, last version) for every stream in the log, in id order."""
        e = events_t.c
        after: str | None = None
        while True:
            stmt = select(e.session_id, func.max(e.version)).group_by(e.session_id).order_by(e.session_id).limit(READ_BATCH)
            if after is not None:
                stmt = stmt.where(e.session_id > after)
            rows = self._run("verify", lambda conn: conn.execute(stmt).all())
            yield from ((r[0], int(r[1])) for r in rows)
            if len(rows) < READ_BATCH:
                return
            after = rows[-1][0]

    def _projection_row(self, session_id: str) -> dict[str, Any] | None:
        stmt = select(sessions_t).where(sessions_t.c.session_id == session_id)
        row = self._run("verify", lambda conn: conn.execute(stmt).first())
        return None if row is None else dict(row._mapping)


class _Conflict(Exception):
    """Internal: the stream is not at the expected version."""


class _RetryableDisconnect(Exception):
    """Internal: an append failed on a dead pooled connection before COMMIT was sent."""


# -- verify ----------------------------------------------------------------------------------------


def _normal(value: Any) -> Any:
    return json.loads(_dumps(value))


def verify_projections(store: SqlEventStore, projector: Projector) -> list[dict[str, Any]]:
    """Re-fold every session from the log and compare with its stored projection.

    Returns the differences (empty list = every projection equals the fold), each
    ``{"session_id", "field", "stored", "expected"}`` where field is ``row`` (a
    projection row without events or events without a projection row),
    ``version``, ``state`` or one of the listing columns.
    """
    diffs: list[dict[str, Any]] = []
    log = dict(store._log_versions())
    projected = set()
    for sid in store.session_ids():
        projected.add(sid)
        if sid not in log:
            diffs.append({"session_id": sid, "field": "row", "stored": "projection row", "expected": "no events"})
    for sid, version in log.items():
        row = store._projection_row(sid)
        if row is None:
            diffs.append({"session_id": sid, "field": "row", "stored": None, "expected": f"projection at version {version}"})
            continue
        state, folded_version = store.fold_stream(sid, None, projector)
        if folded_version != version:  # the log moved on while we read it; re-check this one
            version = folded_version
            row = store._projection_row(sid) or row
        expected_state = _normal(state)
        if row["version"] != version:
            diffs.append({"session_id": sid, "field": "version", "stored": row["version"], "expected": version})
            continue  # a newer append raced us, or the row is stale: the rest would only repeat it
        if row["state"] != expected_state:
            diffs.append({"session_id": sid, "field": "state", "stored": row["state"], "expected": expected_state})
        cols = projector.columns(state) or {}
        for name in PROJECTION_COLUMNS:
            want = cols.get(name)
            if name == "open_attempts":
                want = int(want or 0)
            if row[name] != want:
                diffs.append({"session_id": sid, "field": name, "stored": row[name], "expected": want})
    return diffs
