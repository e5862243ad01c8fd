"""The event store on SQLAlchemy 2: PostgreSQL (psycopg 3) and SQLite.

``SqlEventStore`` keeps what is the same on both backends -- the projection cache, folding,
idempotency look-ups -- and hands the append and the hot reads to its backend:
``tracker.store.postgres.PgFastPath`` (fixed statements, idle-connection stash, one
``ct_append`` call per append) or ``tracker.store.sqlite.SqliteBackend`` (``BEGIN IMMEDIATE``).
Input checks: ``tracker.store.validate``. The read side's listings and narrow reads:
``tracker.store.views``. Schema: ``tracker.store.schema``, created and changed only by the
Alembic migrations (``tracker.store.migrate``). Engines and ``open_store``:
``tracker.store.engine``. Driver errors become typed errors in one place:
``tracker.store.errors.map_db_errors``.

Writes
------
One append = one transaction: the events (versions ``expected+1 …``, no gaps) and
the session's projection row (folded by the caller's ``Projector``) commit
together or not at all. Optimistic concurrency: the caller passes the version it
last saw; ``UNIQUE (session_id, version)`` (on PostgreSQL, whose ``events`` is partitioned, the
``ct_events_unique`` triggers of migration 0011) plus a compare-and-set on
``sessions.version`` make exactly one of several racing writers win each version;
the others get ``ConcurrencyConflict`` (with ``expected``/``actual``, and the current
state when it is known). An append may carry an idempotency key (stored on its first
event, unique per session -- a partial index over the events that have one, migration
0006 -- with ``batch_size``); a retry with the same key returns the original result with
``replayed=True`` and writes nothing, even when ``expected_version`` is stale. All input
is validated before anything is written.

The state after each append is cached per session with its version -- a version's
state never changes -- so the usual "load, decide, append" loop does not re-read
the projection.

Commit-order tailing (``read_all``): a reader paging through ``read_all(after_position)``
never skips an event that commits later with a lower position. Why, on each backend: the
module docs of ``tracker.store.sqlite`` (one writer) and ``tracker.store.postgres`` (a
transaction-id watermark, proved beside its statement).

Faults
------
Connection loss, a stopped or restarted server, ``database is locked`` beyond the
busy timeout -> ``StoreUnavailable``; the server rolls the open transaction back,
so nothing is half-written. Connections that sat idle for more than
``PG_PING_IDLE_S`` are pinged before use; a disconnect seen on a connection in use
invalidates the pool. A read that hit a dead pooled connection is run once more on a
fresh one. A PostgreSQL append that failed on a dead connection from the stash is run
once more on a fresh one only when that is safe: nothing had been sent yet, or the
append carries an idempotency key (``ct_append`` checks the key first). Otherwise --
the statement was sent, and its autocommit may or may not have happened -- no client
can know the outcome: ``StoreUnavailable`` is raised, and a retry with the same
idempotency key makes that safe. A SQLite append is never retried. A forked child
never reuses its parent's connections.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any, Protocol

from sqlalchemy import Text, cast, exists, func, literal, select
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql import Select

from tracker._lru import LRU
from tracker.errors import ConcurrencyConflict, StoreError
from tracker.store import validate
from tracker.store.base import DEFAULT_MAX_EVENT_BYTES, AppendResult, Projector, StoredEvent, conflict_error
from tracker.store.common import CheckedAppend, LogStore
from tracker.store.errors import map_db_errors, run_core
from tracker.store.postgres import Appended, PgFastPath, Replayed, Stale
from tracker.store.schema import events as events_t
from tracker.store.schema import sessions as sessions_t
from tracker.store.sqlite import SqliteBackend

__all__ = ["READ_BATCH", "STATE_CACHE_SIZE", "BeforeCommit", "SqlEventStore"]

READ_BATCH = 2000
STATE_CACHE_SIZE = 4096

#: ``hook(session_id, positions)``: see ``SqlEventStore.before_commit``.
BeforeCommit = Callable[[str, tuple[int, ...]], None]

#: the ``recorded_at`` a projector sees while the state is folded before the append (it is
#: drawn by the database in the append's statement, and projectors do not read it)
_NOT_YET = datetime.fromtimestamp(0, UTC)


class _Backend(Protocol):
    """The reads a backend serves its own way (PostgreSQL: ``PgFastPath``; SQLite: ``SqliteBackend``)."""

    def read_stream_page(
        self, session_id: str, after: int, to_version: int | None, limit: int
    ) -> list[StoredEvent]: ...

    def read_all(
        self, after_position: int, limit: int, session_prefix: str | None, types: tuple[str, ...] | None
    ) -> list[StoredEvent]: ...

    def stream_version(self, session_id: str) -> int: ...

    def projection_state(self, session_id: str) -> tuple[int, str | None] | None: ...

    def keyed_version(self, session_id: str, idempotency_key: str) -> int | None: ...

    def after_fork(self) -> None: ...

    def close(self) -> None: ...


class SqlEventStore(LogStore):
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
        self._pg: PgFastPath | None = PgFastPath(engine) if self.backend == "postgresql" else None
        self._sqlite: SqliteBackend | None = None if self._pg is not None else SqliteBackend(engine)
        self._reads: _Backend = self._pg if self._pg is not None else self._sqlite  # type: ignore[assignment]
        ref = weakref.ref(self)

        def after_fork_in_child() -> None:
            store = ref()
            if store is not None:
                store._after_fork()

        os.register_at_fork(after_in_child=after_fork_in_child)

    def _after_fork(self) -> None:
        """In a forked child (e.g. a prefork worker): never touch the parent's connections."""
        self._reads.after_fork()
        self._engine.dispose(close=False)

    @property
    def engine(self) -> Engine:
        """This store's engine: for the composition root (``tracker.bootstrap``) and tests only;
        no caller of ``EventStore`` sees it (it is not on the port)."""
        return self._engine

    def close(self) -> None:
        self._reads.close()
        self._engine.dispose()

    def _run(self, what: str, fn: Callable[[Connection], Any]) -> Any:
        return run_core(self._engine, what, fn)

    def _rows(self, what: str, stmt: Select[Any]) -> list[Any]:
        return run_core(self._engine, what, lambda conn: conn.execute(stmt).all())

    # -- projection cache ------------------------------------------------------------------------

    def _cache_get(self, session_id: str, version: int) -> str | None:
        """The cached state JSON of the session at exactly ``version``, or None."""
        hit = self._states.get(session_id)
        return hit[1] if hit is not None and hit[0] == version else None

    def _cache_put(self, session_id: str, version: int, state_json: str) -> None:
        self._states.put(session_id, (version, state_json))

    # -- folding ---------------------------------------------------------------------------------

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

    # -- append ----------------------------------------------------------------------------------

    def _parses(self, projected: dict[str, Any] | None) -> bool:
        # Postgres, given the state after the append, folds nothing: it needs no parsed data.
        return self._pg is None or projected is None or self.projector is None

    def _append(self, append: CheckedAppend) -> AppendResult:
        """The checked append on this store's backend (see the module doc); without ``projected``
        (the service gives it: it decided on that state), the store folds."""
        try:
            with map_db_errors("append"):
                if self._pg is not None:
                    return self._append_pg(self._pg, append)
                assert self._sqlite is not None
                return self._append_sqlite(self._sqlite, append)
        except StoreError as exc:
            if not isinstance(exc, ConcurrencyConflict):  # (a conflict leaves every cached version valid)
                self._states.discard(append.session_id)
            raise

    def _append_pg(self, pg: PgFastPath, append: CheckedAppend) -> AppendResult:
        sid, expected, key, projected = append.session_id, append.expected, append.key, append.projected
        proj = self.projector
        state: dict[str, Any] | None = None
        state_json: str | None = None
        put: tuple[Any, ...] = (None, None, None, None, None)
        if proj is not None:
            # The state after the append, folded before the one-statement call: the
            # projector reads only the events' type, data and version (see ``Projector``).
            cached_json: str | None = None
            row: tuple[int, str | None] | None = None
            if projected is None:
                cached_json = self._cache_get(sid, expected)
                if cached_json is None:
                    row = pg.projection_state(sid)
                    if (row[0] if row else 0) != expected:  # stale, or expected_version ahead of the stream
                        if key is not None or row is None:
                            return self._resolve_conflict(sid, expected, key)  # (a replay, perhaps)
                        return self._settle(sid, expected, Stale(row[0], row[1]), None)
            positions = (0,) * len(append.types)  # not known yet; a projector does not read them
            state, state_json, cols = append.projection(
                proj, lambda: self._base_state(proj, sid, expected, cached_json, row), positions, _NOT_YET
            )
            put = (state_json, *cols)
        out = pg.append(
            sid,
            expected,
            "\n".join(append.canonical_texts()),  # compact JSON holds no raw newline
            key,
            put,
            before_commit=self.before_commit,
        )
        return self._settle(sid, expected, out, (state, state_json))

    def _append_sqlite(self, backend: SqliteBackend, append: CheckedAppend) -> AppendResult:
        sid, expected, key = append.session_id, append.expected, append.key
        proj = self.projector
        folded: list[tuple[dict[str, Any] | None, str | None]] = [(None, None)]

        def project(
            row: tuple[int, str | None] | None, positions: tuple[int, ...], recorded_at: datetime
        ) -> tuple[Any, ...] | None:
            # under the write lock, the events inserted: the row is the one at ``expected``
            if proj is None:
                return None
            state, state_json, cols = append.projection(
                proj,
                lambda: self._base_state(proj, sid, expected, self._cache_get(sid, expected), row),
                positions,
                recorded_at,
            )
            folded[0] = (state, state_json)
            return (state_json, *cols)

        canonical = append.canonical_texts()
        out = backend.append(
            sid, expected, append.types, append.datas, key, project, canonical, before_commit=self.before_commit
        )
        return self._settle(sid, expected, out, folded[0])

    def _settle(
        self,
        sid: str,
        expected: int,
        out: Appended | Stale | Replayed,
        folded: tuple[dict[str, Any] | None, str | None] | None,
    ) -> AppendResult:
        """A backend's outcome as the store's: the result (cached), the original of a replay, or the conflict."""
        if isinstance(out, Stale):
            current = None
            if out.state_json is not None and out.version != expected:
                self._cache_put(sid, out.version, out.state_json)
                current = json.loads(out.state_json)
            raise conflict_error(sid, expected, out.version, current)
        if isinstance(out, Replayed):
            return self._resolve_conflict(sid, expected, None, first_version=out.first_version)
        last = expected + len(out.positions)
        state, state_json = folded or (None, None)
        if state_json is not None:
            self._cache_put(sid, last, state_json)
        return AppendResult(sid, expected + 1, last, out.positions, False, state)

    # -- idempotency -----------------------------------------------------------------------------

    def find_idempotent(self, session_id: str, idempotency_key: str) -> AppendResult | None:
        # one statement finds the key (a miss, the usual case, costs nothing more); a hit reads its append
        first = self._reads.keyed_version(session_id, idempotency_key)
        if first is None:
            return None
        return self._run("append", lambda conn: self._replay_at(conn, session_id, first))

    def _resolve_conflict(
        self, sid: str, expected: int, key: str | None, *, first_version: int | None = None
    ) -> AppendResult:
        """After a lost race: the original result if the key was already used (the append starting
        at ``first_version``, when the backend said so), else ConcurrencyConflict."""

        def look(conn: Connection) -> AppendResult | int:
            if first_version is not None:
                return self._replay_at(conn, sid, first_version)
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
        raise conflict_error(sid, expected, found)

    def _replay(self, conn: Connection, sid: str, key: str) -> AppendResult | None:
        e = events_t.c
        hit = conn.execute(select(e.version).where(e.session_id == sid, e.idempotency_key == key)).first()
        return None if hit is None else self._replay_at(conn, sid, int(hit[0]))

    def _replay_at(self, conn: Connection, sid: str, first: int) -> AppendResult:
        """The result of the (committed) append whose first event is at version ``first``."""
        e = events_t.c
        n = conn.execute(select(e.batch_size).where(e.session_id == sid, e.version == first)).scalar_one() or 1
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
        validate.check_read_stream(session_id, from_version, to_version)
        return self._read_stream(session_id, from_version, to_version)

    def _read_stream(self, session_id: str, from_version: int, to_version: int | None) -> Iterator[StoredEvent]:
        after = from_version - 1
        first = True
        while to_version is None or after < to_version:
            # Versions have no gaps, so a batch is a closed range: the planner reads exactly it
            # (an open upper bound made it misestimate and scan every later row of a long stream).
            upto = after + READ_BATCH if to_version is None else min(to_version, after + READ_BATCH)
            page = self._reads.read_stream_page(session_id, after, upto, READ_BATCH)
            if not page and first:
                # an archived session's stream starts at its SessionArchived record
                # (tracker.store.archive), which may lie past the first page: start there
                first = False
                start = self._first_version_after(session_id, after)
                if start is not None and start - 1 > after:
                    after = start - 1
                    continue
            yield from page
            if len(page) < READ_BATCH:
                return
            first = False
            after = page[-1].version

    def _first_version_after(self, session_id: str, after: int) -> int | None:
        e = events_t.c
        stmt = select(func.min(e.version)).where(e.session_id == session_id, e.version > after)
        return run_core(self._engine, "read_stream", lambda conn: conn.execute(stmt).scalar_one())

    def _read_all(
        self, after_position: int, limit: int, session_prefix: str | None, kinds: tuple[str, ...] | None
    ) -> list[StoredEvent]:
        """Commit-safe on both backends (see the module docstring). The ``session_prefix`` and ``types``
        filters are part of the same statement, so the result is still a prefix of the (filtered) log in
        commit order."""
        return self._reads.read_all(after_position, limit, session_prefix, kinds)

    def _stream_version(self, session_id: str) -> int:
        return self._reads.stream_version(session_id)

    def load(self, session_id: str) -> tuple[dict[str, Any] | None, int]:
        validate.check_session_id(session_id)
        row = self._reads.projection_state(session_id)
        if row is None:
            return None, 0
        version, text = row
        if text is None:
            if self.projector is None or version == 0:
                return None, version
            state, _ = self.fold_stream(session_id, version)
            self._cache_put(session_id, version, validate.dumps(state))
            return state, version
        if self.projector is not None:
            self._cache_put(session_id, version, text)
        return json.loads(text), version

    # -- verification reads (tracker.store.verify) -----------------------------------------------

    def log_versions(self) -> Iterator[tuple[str, int]]:
        """(session_id, last version in the log) of every session the store knows: every stream of
        the log in id order, then every projection row without events, with 0 (fetched in batches)."""
        e, s = events_t.c, sessions_t.c
        yield from self._batched(select(e.session_id, func.max(e.version)).group_by(e.session_id), e.session_id)
        orphans = select(s.session_id, literal(0)).where(~exists().where(e.session_id == s.session_id))
        yield from self._batched(orphans, s.session_id)

    def _batched(self, stmt: Select[Any], key: Any) -> Iterator[tuple[str, int]]:
        after: str | None = None
        while True:
            page = stmt.order_by(key).limit(READ_BATCH)
            rows = self._rows("verify", page if after is None else page.where(key > after))
            yield from ((str(r[0]), int(r[1])) for r in rows)
            if len(rows) < READ_BATCH:
                return
            after = rows[-1][0]

    def chain_links(self, session_id: str) -> Iterator[tuple[int, str, dict[str, Any], bytes | None]]:
        """(version, type, data, hash) of each of the session's events, in version order, fetched in
        batches (``tracker.store.verify.verify_chains``: not on the ``EventStore`` port)."""
        validate.check_session_id(session_id)
        e = events_t.c
        after = 0
        while True:
            stmt = (
                select(e.version, e.type, e.data, e.hash)
                .where(e.session_id == session_id, e.version > after)
                .order_by(e.version)
                .limit(READ_BATCH)
            )
            rows = self._rows("verify", stmt)
            for r in rows:
                yield int(r[0]), r[1], r[2], None if r[3] is None else bytes(r[3])
            if len(rows) < READ_BATCH:
                return
            after = int(rows[-1][0])

    def projection_row(self, session_id: str) -> dict[str, Any] | None:
        """The session's whole projection row (every column of ``sessions``), or None."""
        validate.check_session_id(session_id)
        stmt = select(sessions_t).where(sessions_t.c.session_id == session_id)
        row = self._run("verify", lambda conn: conn.execute(stmt).first())
        return None if row is None else dict(row._mapping)
