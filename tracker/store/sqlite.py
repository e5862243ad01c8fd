"""The event store's SQLite backend: the append and the hot reads, through SQLAlchemy Core.

One ``SqliteBackend`` belongs to one ``SqlEventStore`` on SQLite and does there what
``tracker.store.postgres.PgFastPath`` does on PostgreSQL: appends, ``read_stream`` pages,
``read_all``, ``load`` and ``stream_version``. The store keeps what is backend-neutral --
validation, the projection cache, folding, idempotency look-ups -- and hands this class the
events and a ``project`` callback that folds the projection row (see :meth:`SqliteBackend.append`).

An append is one transaction: ``BEGIN IMMEDIATE`` (``tracker.store.engine`` marks write
connections ``ct_write``) takes the database's single write lock before the version check,
so check + insert + projection are atomic; WAL mode, a busy timeout, ``synchronous=FULL``.
When the session is not at the expected version nothing is written and the current version
and state come back (``Stale``); a used idempotency key returns the version it was first
used at (``Replayed``) -- the same outcomes as ``ct_append`` on PostgreSQL.

Commit order: SQLite has one writer at a time and positions are drawn inside the write
transaction, so position order is commit order and a read snapshot is a prefix of the log:
a reader paging through ``read_all(after_position)`` never skips an event.

Faults: ``database is locked`` beyond the busy timeout becomes ``StoreUnavailable`` (the
store maps driver errors); the transaction is rolled back, so nothing is half-written. An
append is never retried. A read whose pooled connection turned out dead is run once more
on a fresh one (``tracker.store.errors.run_core``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Text, cast, func, insert, select, update
from sqlalchemy.engine import Connection, Engine

from tracker.core.model import SessionScope
from tracker.store.base import StoredEvent
from tracker.store.chain import GENESIS, chain
from tracker.store.errors import run_core
from tracker.store.postgres import Appended, Replayed, Stale
from tracker.store.schema import EVENT_COLUMNS, stored_event
from tracker.store.schema import events as events_t
from tracker.store.schema import sessions as sessions_t

__all__ = ["Project", "SqliteBackend"]

#: ``project(row, positions, recorded_at)``, called inside the append's transaction once the
#: events are inserted: ``row`` is the session's projection row as read under the write lock,
#: ``(version, state JSON or None)`` or None. Returns the new row's ``(state JSON, pressure,
#: revision, occupancy_bp, open_attempts)``, or None to store no state (no projector).
Project = Callable[[tuple[int, str | None] | None, tuple[int, ...], datetime], tuple[Any, ...] | None]


class _OutOfStep(Exception):
    """Internal: the projection row moved while the write lock was held (cannot happen): roll back."""


class SqliteBackend:
    """The append and the hot reads of one store's SQLite engine."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def after_fork(self) -> None:
        """Nothing of its own to forget (the store disposes the engine's pool in a child)."""

    def close(self) -> None:
        """Nothing of its own to close (the store disposes the engine)."""

    # -- reads ----------------------------------------------------------------------------------------

    def _rows(self, what: str, stmt: Any) -> list[Any]:
        return run_core(self._engine, what, lambda conn: conn.execute(stmt).all())

    def read_stream_page(self, session_id: str, after: int, to_version: int | None, limit: int) -> list[StoredEvent]:
        """Up to ``limit`` events of the session with ``after < version <= to_version``, in version order."""
        e = events_t.c
        cond = [e.session_id == session_id, e.version > after]
        if to_version is not None:
            cond.append(e.version <= to_version)
        stmt = select(*EVENT_COLUMNS).where(*cond).order_by(e.version).limit(limit)
        return [stored_event(r) for r in self._rows("read_stream", stmt)]

    def read_all(
        self, after_position: int, limit: int, session_prefix: str | None, types: tuple[str, ...] | None
    ) -> list[StoredEvent]:
        e = events_t.c
        cond = [e.position > after_position]
        if session_prefix is not None:
            # substr, not LIKE: SQLite's LIKE is case-insensitive and '_' is a wildcard
            cond.append(func.substr(e.session_id, 1, len(session_prefix)) == session_prefix)
        if types is not None:
            cond.append(e.type.in_(types))
        stmt = select(*EVENT_COLUMNS).where(*cond).order_by(e.position).limit(limit)
        return [stored_event(r) for r in self._rows("read_all", stmt)]

    def stream_version(self, session_id: str) -> int:
        e = events_t.c
        stmt = select(func.coalesce(func.max(e.version), 0)).where(e.session_id == session_id)
        return int(run_core(self._engine, "stream_version", lambda conn: conn.execute(stmt).scalar_one()))

    def projection_state(self, session_id: str) -> tuple[int, str | None] | None:
        """(version, state JSON) of the session's projection row, or None."""
        s = sessions_t.c
        stmt = select(s.version, cast(s.state, Text)).where(s.session_id == session_id)
        row = run_core(self._engine, "load", lambda conn: conn.execute(stmt).first())
        return None if row is None else (row[0], row[1])

    def keyed_version(self, session_id: str, idempotency_key: str) -> int | None:
        """The first version of the session's append recorded under ``idempotency_key``, or None."""
        e = events_t.c
        stmt = select(e.version).where(e.session_id == session_id, e.idempotency_key == idempotency_key)
        row = run_core(self._engine, "append", lambda conn: conn.execute(stmt).first())
        return None if row is None else int(row[0])

    # -- append ---------------------------------------------------------------------------------------

    def append(
        self,
        sid: str,
        expected: int,
        types: Sequence[str],
        datas: Sequence[dict[str, Any]],
        key: str | None,
        project: Project,
        canonical: Sequence[str],
        *,
        before_commit: Callable[[str, tuple[int, ...]], None] | None = None,
    ) -> Appended | Stale | Replayed:
        """One write transaction: the events (``datas``: already validated and parsed; ``canonical``:
        their canonical texts, ``tracker.store.chain``, hashed onto the session's chain under the
        write lock) and the projection row that ``project`` folds under the write lock.

        Returns ``Appended``; ``Stale`` (nothing written) when the session is not at ``expected``,
        with its current version and state (the state only when the row is in step with the log);
        ``Replayed`` when the idempotency key was used before. Driver errors propagate; the store
        maps them.
        """
        s, e = sessions_t.c, events_t.c
        try:
            with self._engine.connect() as conn:
                conn = conn.execution_options(ct_write=True)
                with conn.begin():  # BEGIN IMMEDIATE: we hold the write lock from here to COMMIT
                    row = conn.execute(select(s.version, cast(s.state, Text)).where(s.session_id == sid)).first()
                    if key is not None:
                        first = _key_used_at(conn, sid, key)
                        if first is not None:
                            return Replayed(first)
                    actual = int(
                        conn.execute(
                            select(func.coalesce(func.max(e.version), 0)).where(e.session_id == sid)
                        ).scalar_one()
                    )
                    if actual != expected or (row[0] if row else 0) != expected:
                        return Stale(actual, row[1] if row is not None and row[0] == actual else None)
                    prev: bytes | None = GENESIS
                    if expected:
                        found = conn.execute(
                            select(e.hash).where(e.session_id == sid, e.version == expected)
                        ).scalar_one_or_none()
                        prev = None if found is None else bytes(found)
                    hashes = chain(prev, list(canonical))
                    recorded_at = datetime.now(UTC)
                    fleet = SessionScope.fleet_of(sid)
                    params = [
                        {
                            "session_id": sid,
                            "version": expected + 1 + i,
                            "type": types[i],
                            "data": datas[i],
                            "recorded_at": recorded_at,
                            "idempotency_key": key if i == 0 else None,
                            "batch_size": len(types) if i == 0 else None,
                            "fleet": fleet,
                            "hash": hashes[i],
                        }
                        for i in range(len(types))
                    ]
                    stmt = insert(events_t).returning(e.position, e.version, sort_by_parameter_order=True)
                    rows = sorted(conn.execute(stmt, params).all(), key=lambda r: r[1])
                    positions = tuple(r[0] for r in rows)
                    last = expected + len(rows)
                    values: dict[str, Any] = {"version": last, "updated_at": recorded_at, "state": None}
                    put = project(None if row is None else (row[0], row[1]), positions, recorded_at)
                    if put is not None:
                        state_json, pressure, revision, occupancy, open_attempts = put
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
                            raise _OutOfStep()
                    if before_commit is not None:
                        before_commit(sid, positions)
            return Appended(positions, recorded_at)
        except _OutOfStep:
            return Stale(expected, None)


def _key_used_at(conn: Connection, sid: str, key: str) -> int | None:
    """The first version of the append that used the idempotency key, or None."""
    e = events_t.c
    hit = conn.execute(select(e.version).where(e.session_id == sid, e.idempotency_key == key)).first()
    return None if hit is None else int(hit[0])
