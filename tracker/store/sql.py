"""The event store on SQLAlchemy 2: PostgreSQL (psycopg 3) and SQLite.

Schema: ``tracker.store.schema`` (SQLAlchemy Core tables), created and changed only
by the Alembic migrations in ``alembic/`` (``tracker.store.migrate``). Engines and
``open_store``: ``tracker.store.engine``. The PostgreSQL hot path (fixed statements,
idle-connection stash, appends and hot reads): ``tracker.store.postgres``. Driver
errors become typed errors in one place: ``tracker.store.errors.map_db_errors``.

Writes
------
One append = one transaction: the events (versions ``expected+1 …``, no gaps) and
the session's projection row (folded by the caller's ``Projector``) commit
together or not at all. Optimistic concurrency: the caller passes the version it
last saw; ``UNIQUE (session_id, version)`` plus a compare-and-set on
``sessions.version`` make exactly one of several racing writers win each version;
the others get ``ConcurrencyConflict`` (with ``expected``/``actual``). An append
may carry an idempotency key (stored on its first event, unique per session -- a partial index
over the events that have one, migration 0006 -- with ``batch_size``); a retry with the same key returns the
original result with ``replayed=True`` and writes nothing, even when
``expected_version`` is stale. All input is validated before anything is written.

The state after each append is cached per session with its version -- a version's
state never changes -- so the usual "load, decide, append" loop does not re-read
the projection.

*PostgreSQL*: one round trip per append, a prepared call of the server function
``ct_append`` (migration 0003) that checks the idempotency key, compare-and-sets the
projection row and inserts the events in one autocommit statement; a stale version or a
used key comes back as a result row, not an error. See ``tracker.store.postgres``.

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

1. Every append goes through ``ct_append``, one statement in its own transaction. Under a session-level advisory lock ``L`` it only (a) assigns the
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

import heapq
import itertools
import json
import os
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from sqlalchemy import Text, and_, case, cast, func, insert, or_, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql import Select

from tracker._lru import LRU
from tracker.core.model import check_session_id
from tracker.errors import (
    ConcurrencyConflict,
    InvalidInput,
    PayloadTooLarge,
    StoreError,
    TrackerError,
)
from tracker.store.base import (
    DEFAULT_MAX_EVENT_BYTES,
    MAX_EVENT_TYPE_LEN,
    MAX_EVENTS_PER_APPEND,
    MAX_IDEMPOTENCY_KEY_LEN,
    AppendResult,
    NewEvent,
    Projector,
    StoredEvent,
)
from tracker.store.errors import map_db_errors
from tracker.store.postgres import PgFastPath, Replayed, Stale
from tracker.store.schema import events as events_t
from tracker.store.schema import sessions as sessions_t

__all__ = ["READ_BATCH", "STATE_CACHE_SIZE", "BeforeCommit", "SqlEventStore"]

READ_BATCH = 2000
STATE_CACHE_SIZE = 4096

#: ``hook(session_id, positions)``: see ``SqlEventStore.before_commit``.
BeforeCommit = Callable[[str, tuple[int, ...]], None]

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
_SESSION_PREFIX = re.compile(r"[A-Za-z0-9._:-]{1,200}")


#: the ``recorded_at`` a projector sees while the state is folded before the append (it is
#: drawn by the database in the append's statement, and projectors do not read it)
_NOT_YET = datetime.fromtimestamp(0, UTC)


def fleet_of(session_id: str) -> str:
    """The ``events.fleet`` of a session: the text before its first ':' ('' without one)."""
    head, sep, _ = session_id.partition(":")
    return head if sep else ""


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _run(engine: Engine, what: str, fn: Callable[[Connection], Any]) -> Any:
    """``fn(conn)`` on a Core connection; typed errors; once more if the pooled connection was dead."""
    with map_db_errors(what):
        try:
            with engine.connect() as conn:
                return fn(conn)
        except sa_exc.DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
        with engine.connect() as conn:
            return fn(conn)


_EVENT_COLS = (
    events_t.c.position,
    events_t.c.session_id,
    events_t.c.version,
    events_t.c.type,
    events_t.c.data,
    events_t.c.recorded_at,
    events_t.c.idempotency_key,
)


def _event(row: Any) -> StoredEvent:
    return StoredEvent(row[0], row[1], row[2], row[3], row[4], row[5], row[6])


class _HotReads(Protocol):
    """The reads a backend serves its own way (PostgreSQL: ``PgFastPath``; SQLite: ``_CoreReads``)."""

    def read_stream_page(
        self, session_id: str, after: int, to_version: int | None, limit: int
    ) -> list[StoredEvent]: ...

    def read_all(self, after_position: int, limit: int, session_prefix: str | None) -> list[StoredEvent]: ...

    def stream_version(self, session_id: str) -> int: ...

    def projection_state(self, session_id: str) -> tuple[int, str | None] | None: ...


class _CoreReads:
    """The hot reads through SQLAlchemy Core (SQLite)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def read_stream_page(self, session_id: str, after: int, to_version: int | None, limit: int) -> list[StoredEvent]:
        e = events_t.c
        cond = [e.session_id == session_id, e.version > after]
        if to_version is not None:
            cond.append(e.version <= to_version)
        stmt = select(*_EVENT_COLS).where(*cond).order_by(e.version).limit(limit)
        return [_event(r) for r in _run(self._engine, "read_stream", lambda conn: conn.execute(stmt).all())]

    def read_all(self, after_position: int, limit: int, session_prefix: str | None) -> list[StoredEvent]:
        e = events_t.c
        cond = [e.position > after_position]
        if session_prefix is not None:
            # substr, not LIKE: SQLite's LIKE is case-insensitive and '_' is a wildcard
            cond.append(func.substr(e.session_id, 1, len(session_prefix)) == session_prefix)
        stmt = select(*_EVENT_COLS).where(*cond).order_by(e.position).limit(limit)
        return [_event(r) for r in _run(self._engine, "read_all", lambda conn: conn.execute(stmt).all())]

    def stream_version(self, session_id: str) -> int:
        e = events_t.c
        stmt = select(func.coalesce(func.max(e.version), 0)).where(e.session_id == session_id)
        return int(_run(self._engine, "stream_version", lambda conn: conn.execute(stmt).scalar_one()))

    def projection_state(self, session_id: str) -> tuple[int, str | None] | None:
        s = sessions_t.c
        stmt = select(s.version, cast(s.state, Text)).where(s.session_id == session_id)
        row = _run(self._engine, "load", lambda conn: conn.execute(stmt).first())
        return None if row is None else (row[0], row[1])


def _fold(proj: Projector, state: dict[str, Any], stored: Sequence[StoredEvent]) -> dict[str, Any]:
    many = getattr(proj, "apply_many", None)
    if many is not None:
        return many(state, stored)
    for ev in stored:
        state = proj.apply(state, ev)
    return state


def _columns(proj: Projector, state: dict[str, Any]) -> tuple[Any, Any, Any, int]:
    """(pressure, revision, occupancy_bp, open_attempts) of the projection row."""
    cols = proj.columns(state) or {}
    return (cols.get("pressure"), cols.get("revision"), cols.get("occupancy_bp"), int(cols.get("open_attempts") or 0))


# -- the store -------------------------------------------------------------------------------------


class SqlEventStore:
    """``EventStore`` on SQLite or PostgreSQL. Thread-safe; one instance per process is plenty."""

    def __init__(
        self, engine: Engine, *, projector: Projector | None = None, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
    ):
        self._engine = engine
        self.backend = engine.dialect.name
        self.projector = projector
        self.max_event_bytes = max_event_bytes
        #: session id -> (version, state JSON) of the last state this store wrote or read
        self._states: LRU[str, tuple[int, str]] = LRU(STATE_CACHE_SIZE)
        #: Fault-injection seam for tests: called as ``hook(session_id, positions)`` after
        #: everything of an append is written and before its COMMIT (e.g. to widen race
        #: windows, or to stop the server mid-transaction). None (the default) in production.
        self.before_commit: BeforeCommit | None = None
        # PostgreSQL: the psycopg fast path (appends and hot reads); SQLite: Core throughout.
        self._pg: PgFastPath | None = PgFastPath(engine) if self.backend == "postgresql" else None
        self._reads: _HotReads = self._pg if self._pg is not None else _CoreReads(engine)
        ref = weakref.ref(self)

        def after_fork_in_child() -> None:
            store = ref()
            if store is not None:
                store._after_fork()

        os.register_at_fork(after_in_child=after_fork_in_child)

    def _after_fork(self) -> None:
        """In a forked child (e.g. a prefork worker): never touch the parent's connections."""
        if self._pg is not None:
            self._pg.after_fork()
        self._engine.dispose(close=False)

    @property
    def engine(self) -> Engine:
        return self._engine

    def close(self) -> None:
        if self._pg is not None:
            self._pg.close()
        self._engine.dispose()

    def __enter__(self) -> SqlEventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, what: str, fn: Callable[[Connection], Any]) -> Any:
        return _run(self._engine, what, fn)

    def _rows(self, what: str, stmt: Select[Any]) -> list[Any]:
        return _run(self._engine, what, lambda conn: conn.execute(stmt).all())

    # -- validation ------------------------------------------------------------------------------

    def _validate(
        self, session_id: Any, expected_version: Any, events: Any, idempotency_key: Any, parse: bool = True
    ) -> tuple[list[str], list[str], list[dict[str, Any]]]:
        """(types, JSON texts, and — with ``parse`` — the data as a reader will get it back)."""
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
                raise InvalidInput(
                    f"events[{i}].type", f"must be a non-empty string of at most {MAX_EVENT_TYPE_LEN} characters"
                )
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
            if parse:
                datas.append(json.loads(text))  # what a reader will get back
        return types, texts, datas

    # -- projection cache ------------------------------------------------------------------------

    def _cache_get(self, session_id: str, version: int) -> str | None:
        """The cached state JSON of the session at exactly ``version``, or None."""
        hit = self._states.get(session_id)
        return hit[1] if hit is not None and hit[0] == version else None

    def _cache_put(self, session_id: str, version: int, state_json: str) -> None:
        self._states.put(session_id, (version, state_json))

    # -- projection helpers ----------------------------------------------------------------------

    def fold_stream(
        self, session_id: str, to_version: int | None = None, projector: Projector | None = None
    ) -> tuple[dict[str, Any], int]:
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
                state = _fold(proj, state, batch)
                batch = []
        if batch:
            state = _fold(proj, state, batch)
        return state, version

    def _base_state(
        self, proj: Projector, sid: str, expected: int, cached_json: str | None, row: tuple[Any, ...] | None
    ) -> dict[str, Any]:
        """The session's state at ``expected``: cached, from its projection ``row`` (version, state JSON)
        read in the append's transaction, or folded from the log."""
        if cached_json is not None:
            return json.loads(cached_json)
        if row is None:
            return proj.initial(sid)
        if row[1] is None:  # appended without a projector so far: rebuild from the log
            return self.fold_stream(sid, expected)[0]
        return json.loads(row[1])

    @staticmethod
    def _new_state(
        proj: Projector,
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
        return _fold(proj, base, stored)

    # -- append ----------------------------------------------------------------------------------

    def append(
        self,
        session_id: str,
        expected_version: int,
        events: Sequence[NewEvent],
        *,
        idempotency_key: str | None = None,
        projected: dict[str, Any] | None = None,
    ) -> AppendResult:
        """Append ``events`` at ``expected_version`` (see the module doc).

        ``projected``: the projection state after these events when the caller has already
        folded it (the service has: it decided on that state); it must be what the projector
        would fold, and ``tracker verify`` checks that it was. Default: the store folds.
        """
        # Postgres, given the state after the append, folds nothing: it needs no parsed data.
        parse = self._pg is None or projected is None or self.projector is None
        types, texts, datas = self._validate(session_id, expected_version, events, idempotency_key, parse)
        try:
            with map_db_errors("append"):
                if self._pg is not None:
                    return self._append_pg(
                        self._pg, session_id, expected_version, types, texts, datas, idempotency_key, projected
                    )
                return self._append_sqlite(
                    session_id, expected_version, types, texts, datas, idempotency_key, projected
                )
        except StoreError as exc:
            if not isinstance(exc, ConcurrencyConflict):  # (a conflict leaves every cached version valid)
                self._states.discard(session_id)
            raise

    def _append_pg(
        self,
        pg: PgFastPath,
        sid: str,
        expected: int,
        types: list[str],
        texts: list[str],
        datas: list[dict[str, Any]],
        key: str | None,
        projected: dict[str, Any] | None,
    ) -> AppendResult:
        proj = self.projector
        state: dict[str, Any] | None = None
        state_json: str | None = None
        put: tuple[Any, ...] = (None, None, None, None, None)
        if proj is not None:
            # The state after the append, folded before the one-statement call: the
            # projector reads only the events' type, data and version (see ``Projector``).
            if projected is not None:
                state = projected
            else:
                cached_json = self._cache_get(sid, expected)
                if cached_json is None:
                    row = pg.projection_state(sid)
                    if (row[0] if row else 0) != expected:  # stale, or expected_version ahead of the stream
                        if key is not None or row is None:
                            return self._resolve_conflict(sid, expected, key)  # (a replay, perhaps)
                        raise self._conflict_error(sid, expected, row[0], row[1])
                    base = self._base_state(proj, sid, expected, None, row)
                else:
                    base = json.loads(cached_json)
                positions = (0,) * len(types)  # not known yet; a projector does not read them
                state = self._new_state(proj, base, sid, positions, expected + 1, types, datas, _NOT_YET, key)
            state_json = _dumps(state)
            put = (state_json, *_columns(proj, state))
        out = pg.append(
            sid,
            expected,
            _dumps(types),
            "[" + ",".join(texts) + "]",
            key,
            put,
            before_commit=self.before_commit,
        )
        if isinstance(out, Stale):
            if out.state_json is not None and out.version != expected:
                self._cache_put(sid, out.version, out.state_json)
            raise self._conflict_error(sid, expected, out.version, out.state_json)
        if isinstance(out, Replayed):
            return self._resolve_conflict(sid, expected, key)
        last = expected + len(out.positions)
        if state_json is not None:
            self._cache_put(sid, last, state_json)
        return AppendResult(sid, expected + 1, last, out.positions, False, state)

    def _append_sqlite(
        self,
        sid: str,
        expected: int,
        types: list[str],
        texts: list[str],
        datas: list[dict[str, Any]],
        key: str | None,
        projected: dict[str, Any] | None,
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
                    current = row[1] if row is not None and row[0] == actual else None
                    raise self._conflict_error(sid, expected, actual, current)
                base = None
                if proj is not None and projected is None:
                    base = self._base_state(proj, sid, expected, self._cache_get(sid, expected), row)
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
                        "fleet": fleet_of(sid),
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
                    if projected is not None:
                        state = projected
                    else:
                        assert base is not None
                        state = self._new_state(
                            proj, base, sid, positions, expected + 1, types, datas, recorded_at, key
                        )
                    state_json = _dumps(state)
                    pressure, revision, occupancy, open_attempts = _columns(proj, state)
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
                    res = conn.execute(
                        update(sessions_t).where(s.session_id == sid, s.version == expected).values(**values)
                    )
                    if res.rowcount != 1:  # cannot happen while we hold the write lock
                        raise self._conflict_error(sid, expected, expected)
                if self.before_commit is not None:
                    self.before_commit(sid, positions)
        if state_json is not None:
            self._cache_put(sid, last, state_json)
        return AppendResult(sid, expected + 1, last, positions, False, state)

    @staticmethod
    def _conflict_error(sid: str, expected: int, actual: int, state_json: str | None = None) -> TrackerError:
        if actual == expected:
            return StoreError(
                f"session {sid}: the projection row is missing or out of step with the log at version {actual}; "
                "run `tracker verify`",
                session_id=sid,
            )
        conflict = ConcurrencyConflict(
            f"session {sid}: expected version {expected}, but the stream is at {actual}",
            session_id=sid,
            expected=expected,
            actual=actual,
        )
        if state_json is not None:
            conflict.current_state = json.loads(state_json)
        return conflict

    # -- idempotency -----------------------------------------------------------------------------

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
            return int(
                conn.execute(select(func.coalesce(func.max(e.version), 0)).where(e.session_id == sid)).scalar_one()
            )

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

    def read_stream(
        self, session_id: str, from_version: int = 1, to_version: int | None = None
    ) -> Iterator[StoredEvent]:
        """The session's events from ``from_version`` to ``to_version`` (inclusive), fetched in batches."""
        check_session_id(session_id)
        if not isinstance(from_version, int) or isinstance(from_version, bool) or from_version < 1:
            raise InvalidInput("from_version", "must be an integer >= 1")
        if to_version is not None and (not isinstance(to_version, int) or isinstance(to_version, bool)):
            raise InvalidInput("to_version", "must be an integer or None")
        return self._read_stream(session_id, from_version, to_version)

    def _read_stream(self, session_id: str, from_version: int, to_version: int | None) -> Iterator[StoredEvent]:
        after = from_version - 1
        while to_version is None or after < to_version:
            # Versions have no gaps, so a batch is a closed range: the planner reads exactly it
            # (an open upper bound made it misestimate and scan every later row of a long stream).
            upto = after + READ_BATCH if to_version is None else min(to_version, after + READ_BATCH)
            page = self._reads.read_stream_page(session_id, after, upto, READ_BATCH)
            yield from page
            if len(page) < READ_BATCH:
                return
            after = page[-1].version

    def read_all(
        self, after_position: int = 0, limit: int = 1000, *, session_prefix: str | None = None
    ) -> list[StoredEvent]:
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
        return self._reads.read_all(after_position, limit, session_prefix)

    def stream_version(self, session_id: str) -> int:
        check_session_id(session_id)
        return self._reads.stream_version(session_id)

    def load(self, session_id: str) -> tuple[dict[str, Any] | None, int]:
        """(projection state, version); (None, 0) for an unknown session."""
        check_session_id(session_id)
        row = self._reads.projection_state(session_id)
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
        self,
        *,
        pressure: str | None = None,
        active_since: datetime | None = None,
        limit: int = 1000,
        session_prefix: str | None = None,
        after: tuple[datetime, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Projection rows (all columns of ``sessions``), most recently updated first (then by id).

        ``session_prefix``: only sessions whose id starts with it (exact, case-sensitive);
        ``after``: the ``(updated_at, session_id)`` of the last row of the previous page (keyset
        paging: the rows that come after it in this order).
        """
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise InvalidInput("limit", "must be an integer >= 1")
        if active_since is not None and not isinstance(active_since, datetime):
            raise InvalidInput("active_since", "must be a datetime")
        if session_prefix is not None and (
            not isinstance(session_prefix, str) or not _SESSION_PREFIX.fullmatch(session_prefix)
        ):
            raise InvalidInput("session_prefix", "must be 1-200 characters of [A-Za-z0-9._:-] or None")
        if after is not None and not (
            isinstance(after, tuple)
            and len(after) == 2
            and isinstance(after[0], datetime)
            and isinstance(after[1], str)
        ):
            raise InvalidInput("after", "must be an (updated_at datetime, session_id) pair or None")
        s = sessions_t.c
        stmt = select(sessions_t)
        if pressure is not None:
            stmt = stmt.where(s.pressure == pressure)
        if active_since is not None:
            if active_since.tzinfo is None:
                active_since = active_since.replace(tzinfo=UTC)
            stmt = stmt.where(s.updated_at >= active_since)
        if session_prefix is not None:
            # substr, not LIKE: SQLite's LIKE is case-insensitive and '_' is a wildcard
            stmt = stmt.where(func.substr(s.session_id, 1, len(session_prefix)) == session_prefix)
        if after is not None:
            at, sid = after
            if at.tzinfo is None:
                at = at.replace(tzinfo=UTC)
            stmt = stmt.where(or_(s.updated_at < at, and_(s.updated_at == at, s.session_id > sid)))
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
            ids = [row[0] for row in self._rows("session_ids", stmt)]
            yield from ids
            if len(ids) < READ_BATCH:
                return
            after = ids[-1]

    # -- verification reads (tracker.store.verify) -----------------------------------------------

    def log_versions(self) -> Iterator[tuple[str, int]]:
        """(session_id, last version) of every stream in the log, in id order (fetched in batches)."""
        e = events_t.c
        after: str | None = None
        while True:
            stmt = (
                select(e.session_id, func.max(e.version))
                .group_by(e.session_id)
                .order_by(e.session_id)
                .limit(READ_BATCH)
            )
            if after is not None:
                stmt = stmt.where(e.session_id > after)
            rows = self._rows("verify", stmt)
            yield from ((r[0], int(r[1])) for r in rows)
            if len(rows) < READ_BATCH:
                return
            after = rows[-1][0]

    def projection_row(self, session_id: str) -> dict[str, Any] | None:
        """The session's whole projection row (every column of ``sessions``), or None."""
        stmt = select(sessions_t).where(sessions_t.c.session_id == session_id)
        row = self._run("verify", lambda conn: conn.execute(stmt).first())
        return None if row is None else dict(row._mapping)

    # -- gauges (tracker.queries.fleet_gauges, at scrape time) ------------------------------------

    def session_summary(self, namespace_len: int) -> dict[str, Any]:
        """Where the sessions stand, in two grouped reads of the projection (no state is parsed
        except of sessions with an attempt open): ``{"pressure": [(namespace, pressure, sessions,
        open_attempts)], "oldest_open": [(namespace, opened_at)]}``. ``namespace`` is the session
        id's first ``namespace_len`` characters when a ``:`` follows them, else ``""``.
        """
        s = sessions_t.c
        ns = case(
            (func.substr(s.session_id, namespace_len + 1, 1) == ":", func.substr(s.session_id, 1, namespace_len)),
            else_="",
        ).label("ns")
        grouped = select(ns, s.pressure, func.count(), func.coalesce(func.sum(s.open_attempts), 0)).group_by(
            ns, s.pressure
        )
        opened = select(s.session_id, s.state).where(s.open_attempts > 0)

        def read(conn: Connection) -> dict[str, Any]:
            rows = [(r[0], r[1], int(r[2]), int(r[3])) for r in conn.execute(grouped).all()]
            oldest: dict[str, float] = {}
            for sid, state in conn.execute(opened):
                data = json.loads(state) if isinstance(state, str) else state
                times = [a.get("opened_at") for a in (data or {}).get("open_attempts", ())]
                times = [t for t in times if isinstance(t, int | float)]
                if not times:
                    continue
                key = sid[:namespace_len] if sid[namespace_len : namespace_len + 1] == ":" else ""
                oldest[key] = min(oldest.get(key, min(times)), min(times))
            return {"pressure": rows, "oldest_open": sorted(oldest.items())}

        return self._run("session_summary", read)

    # -- narrow reads of one session (the session page: tracker.audit.story) ----------------------
    # Each reads only the rows it returns (through the index on (session_id, type, version),
    # migration 0005), so a page built from them costs about the same on a 100k-event session as
    # on a 10k one.

    def count_by_type(self, session_id: str, to_version: int | None = None) -> dict[str, int]:
        """How many events of each type the session has (up to ``to_version``): one grouped read of the index."""
        check_session_id(session_id)
        e = events_t.c
        cond = [e.session_id == session_id, *_upto(to_version)]
        stmt = select(e.type, func.count()).where(*cond).group_by(e.type)
        return {str(r[0]): int(r[1]) for r in self._rows("count_by_type", stmt)}

    def read_types(
        self,
        session_id: str,
        types: Sequence[str],
        from_version: int = 1,
        to_version: int | None = None,
        *,
        limit: int | None = None,
    ) -> Iterator[StoredEvent]:
        """The session's events of the given ``types`` from ``from_version`` to ``to_version``
        (inclusive), in version order, at most ``limit`` of them; fetched in batches."""
        check_session_id(session_id)
        kinds = _check_types(types)
        if not isinstance(from_version, int) or isinstance(from_version, bool) or from_version < 1:
            raise InvalidInput("from_version", "must be an integer >= 1")
        _check_version("to_version", to_version)
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise InvalidInput("limit", "must be an integer >= 1 or None")
        return self._read_types(session_id, kinds, from_version, to_version, limit)

    def _read_types(
        self, session_id: str, kinds: list[str], from_version: int, to_version: int | None, limit: int | None
    ) -> Iterator[StoredEvent]:
        # one ordered walk of the index per type, merged here: with ``type IN (…)`` and a version
        # range the planners walk (session_id, version) instead and read every event of the session
        walks = [self._read_type(session_id, k, from_version, to_version, limit) for k in kinds]
        merged = walks[0] if len(walks) == 1 else heapq.merge(*walks, key=lambda ev: ev.version)
        return merged if limit is None else itertools.islice(merged, limit)

    def _read_type(
        self, session_id: str, kind: str, from_version: int, to_version: int | None, limit: int | None
    ) -> Iterator[StoredEvent]:
        e = events_t.c
        after, left = from_version - 1, limit
        while left is None or left > 0:
            n = READ_BATCH if left is None else min(READ_BATCH, left)
            stmt = (
                select(*_EVENT_COLS)
                .where(e.session_id == session_id, e.type == kind, e.version > after, *_upto(to_version))
                .order_by(e.version)
                .limit(n)
            )
            page = [_event(r) for r in self._rows("read_types", stmt)]
            yield from page
            if len(page) < n:
                return
            after = page[-1].version
            if left is not None:
                left -= len(page)

    def last_of_types(
        self, session_id: str, types: Sequence[str], count: int = 1, to_version: int | None = None
    ) -> list[StoredEvent]:
        """The newest ``count`` events of the given ``types`` (up to ``to_version``), oldest first."""
        check_session_id(session_id)
        kinds = _check_types(types)
        _check_version("to_version", to_version)
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= 100_000:
            raise InvalidInput("count", "must be an integer from 1 to 100000")
        e = events_t.c
        stmt = (
            select(*_EVENT_COLS)
            .where(e.session_id == session_id, e.type.in_(kinds), *_upto(to_version))
            .order_by(e.version.desc())
            .limit(count)
        )
        return [_event(r) for r in reversed(self._rows("last_of_types", stmt))]

    def sample_of_type(
        self, session_id: str, type_: str, points: int, to_version: int | None = None, *, total: int | None = None
    ) -> list[StoredEvent]:
        """At most ``points`` + 1 events of one type, spread evenly over the session by rank: the
        first event of each of ``points`` equal runs, and the last one; in version order. Only the
        index is scanned to pick them; only the picked rows are read. ``total``: how many events of
        that type there are up to ``to_version``, when the caller knows (else they are counted)."""
        check_session_id(session_id)
        kind = _check_types([type_])[0]
        _check_version("to_version", to_version)
        if not isinstance(points, int) or isinstance(points, bool) or not 1 <= points <= 100_000:
            raise InvalidInput("points", "must be an integer from 1 to 100000")
        if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < 0):
            raise InvalidInput("total", "must be an integer >= 0 or None")
        e = events_t.c
        cond = [e.session_id == session_id, e.type == kind, *_upto(to_version)]

        def read(conn: Connection) -> list[StoredEvent]:
            n = total if total is not None else int(conn.execute(select(func.count()).where(*cond)).scalar_one())
            if n == 0:
                return []
            ranked = select(e.version.label("v"), func.row_number().over(order_by=e.version).label("rn"))
            r = ranked.where(*cond).subquery().c
            # rank rn opens a new run when floor((rn-1)·points/n) moves on (integer division on both backends)
            picked = select(r.v).where(
                or_(r.rn == 1, r.rn == n, ((r.rn - 1) * points) // n > ((r.rn - 2) * points) // n)
            )
            versions = list(conn.execute(picked).scalars())  # then the picked rows only, by their versions
            out: list[StoredEvent] = []
            for i in range(0, len(versions), 500):
                stmt = (
                    select(*_EVENT_COLS)
                    .where(e.session_id == session_id, e.version.in_(versions[i : i + 500]))
                    .order_by(e.version)
                )
                out.extend(_event(row) for row in conn.execute(stmt).all())
            return out

        return self._run("sample_of_type", read)

    def read_versions(
        self, session_id: str, versions: Sequence[int], types: Sequence[str] | None = None
    ) -> list[StoredEvent]:
        """The session's events at the given ``versions`` (only those of ``types``, if given), in version order."""
        check_session_id(session_id)
        kinds = None if types is None else _check_types(types)
        wanted = sorted({v for v in versions if isinstance(v, int) and not isinstance(v, bool) and v >= 1})
        e = events_t.c
        out: list[StoredEvent] = []
        for i in range(0, len(wanted), 500):
            cond = [e.session_id == session_id, e.version.in_(wanted[i : i + 500])]
            if kinds is not None:
                cond.append(e.type.in_(kinds))
            stmt = select(*_EVENT_COLS).where(*cond).order_by(e.version)
            out.extend(_event(r) for r in self._rows("read_versions", stmt))
        return out

    def find_by_data(
        self, session_id: str, types: Sequence[str], key: str, value: str, limit: int = 100
    ) -> list[StoredEvent]:
        """The session's events of the given ``types`` whose ``data[key]`` is the string ``value``,
        in version order (at most ``limit``). Only events of those types are looked at."""
        check_session_id(session_id)
        kinds = _check_types(types)
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", key):
            raise InvalidInput("key", "must be a JSON field name of [A-Za-z0-9_]")
        if not isinstance(value, str) or len(value) > 1000:
            raise InvalidInput("value", "must be a string of at most 1000 characters")
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 10_000:
            raise InvalidInput("limit", "must be an integer from 1 to 10000")
        e = events_t.c
        stmt = (
            select(*_EVENT_COLS)
            .where(e.session_id == session_id, e.type.in_(kinds), e.data[key].as_string() == value)
            .order_by(e.version)
            .limit(limit)
        )
        return [_event(r) for r in self._rows("find_by_data", stmt)]


def _upto(to_version: int | None) -> list[Any]:
    return [] if to_version is None else [events_t.c.version <= to_version]


def _check_version(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise InvalidInput(name, "must be an integer or None")


def _check_types(types: Any) -> list[str]:
    if isinstance(types, str) or not isinstance(types, Sequence) or not types:
        raise InvalidInput("types", "must be a non-empty list of event types")
    kinds = list(dict.fromkeys(types))
    for t in kinds:
        if not isinstance(t, str) or not 1 <= len(t) <= MAX_EVENT_TYPE_LEN:
            raise InvalidInput("types", f"each must be a string of 1-{MAX_EVENT_TYPE_LEN} characters")
    return kinds
