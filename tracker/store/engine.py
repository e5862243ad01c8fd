"""Engines for the event store's database, and ``open_store``.

``make_engine(url)`` configures SQLAlchemy for how the store uses each backend:

*SQLite* (a file; in-memory databases are refused, since each connection would get
its own): WAL mode, a 30 s busy timeout, ``synchronous=FULL``, and ``BEGIN
IMMEDIATE`` for connections marked ``execution_options(ct_write=True)``, so a write
transaction takes the database's single write lock before it reads anything.

*PostgreSQL* (psycopg 3): a pooled connection that sat idle for more than
``PG_PING_IDLE_S`` is pinged at checkout; a hot connection is not (``pool_pre_ping``
on every checkout would cost a round trip per append). A failure on a hot connection
is handled by the store (see ``tracker.store.postgres``).

*Behind a transaction pooler* (``pooler="transaction"``, ``TRACKER_DATABASE_POOLER``: PgBouncer
with ``pool_mode = transaction``): psycopg's ``prepare_threshold`` is None, so no statement is
ever prepared on the server (it wins over the store's ``prepare=True``): a prepared statement
lives on one server connection, and the pooler hands the next transaction another one
(``prepared statement "_pg3_0" already exists`` / ``does not exist``). Nothing else the store
does needs a session: every statement is autocommit or inside one transaction, no ``SET``,
``LISTEN``, temporary table or ``WITH HOLD`` cursor; the advisory lock ``ct_append`` takes is
released inside the same statement (see docs/topologies.md).

URLs are normalised by ``tracker.settings.normalize_database_url`` (``postgres://``
and ``postgresql://`` get the psycopg driver), the project's only URL normaliser.
"""

from __future__ import annotations

import random
import sqlite3
import time
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from tracker.errors import InvalidInput
from tracker.settings import normalize_database_url
from tracker.store import migrate
from tracker.store.base import DEFAULT_MAX_EVENT_BYTES, Projector
from tracker.store.postgres import PG_PING_IDLE_S
from tracker.store.sql import SqlEventStore

__all__ = ["POOLERS", "make_engine", "open_store"]

#: ``TRACKER_DATABASE_POOLER`` values: what sits between the tracker and PostgreSQL
POOLERS = ("none", "transaction")


def make_engine(url: str, *, pooler: str = "none") -> Engine:
    """An engine configured for the store: psycopg + idle pings on PostgreSQL, WAL + BEGIN IMMEDIATE on SQLite.

    ``pooler="transaction"``: PostgreSQL is reached through a transaction pooler (no server-side
    prepared statements). Ignored for SQLite.
    """
    if pooler not in POOLERS:
        raise InvalidInput("database_pooler", f"must be one of {', '.join(POOLERS)}, got {pooler!r}")
    url = normalize_database_url(url)
    if url.startswith("sqlite"):
        return _sqlite_engine(url)
    if url.startswith("postgresql"):
        return _postgres_engine(url, pooler)
    raise InvalidInput(
        "database_url", f"unsupported database URL {url.split(':', 1)[0]!r} (use sqlite:/// or postgresql://)"
    )


def _sqlite_engine(url: str) -> Engine:
    if url.rstrip("/") in ("sqlite:", "sqlite:/") or ":memory:" in url or "mode=memory" in url:
        raise InvalidInput(
            "database_url", "an in-memory SQLite database cannot be used; give a file (sqlite:///path.db)"
        )
    engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, pool_pre_ping=True)

    @event.listens_for(engine, "connect")
    def _sqlite_connect(dbapi_conn, _record):  # noqa: ANN001
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout = 30000")
        _ensure_wal(cur)
        cur.execute("PRAGMA synchronous = FULL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _sqlite_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("ct_write") else "BEGIN")

    return engine


def _ensure_wal(cur: Any) -> None:
    """Switch the file to WAL once; it is a property of the file, so later connections only check it.

    Changing the journal mode needs an exclusive lock and SQLite answers ``database is locked`` at
    once, without its busy handler, while another connection holds the file. So the switch is
    retried for a while; the check alone takes no such lock.
    """
    if str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
        return
    deadline = time.monotonic() + 30
    while True:
        try:
            cur.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.01 + random.random() * 0.04)


def _postgres_engine(url: str, pooler: str = "none") -> Engine:
    connect_args: dict[str, Any] = {"connect_timeout": 5, "application_name": "context-tracker"}
    if pooler == "transaction":
        connect_args["prepare_threshold"] = None  # never prepare: the next transaction may get another backend
    engine = create_engine(url, pool_size=5, max_overflow=10, pool_recycle=1800, connect_args=connect_args)
    dialect = engine.dialect

    # Pessimistic disconnect handling, like pool_pre_ping, but only for connections
    # that sat idle: a hot connection is not pinged; a failure on it invalidates the
    # pool, so the next call reconnects, and the store runs the call once more only
    # when that is safe (reads; an append that sent nothing or carries an idempotency
    # key: see tracker.store.postgres).
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


def open_store(
    url: str,
    *,
    projector: Projector | None = None,
    check_schema: bool = True,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    pooler: str = "none",
) -> SqlEventStore:
    """Open the event store at ``url``. Refuses a missing/older schema (SchemaOutOfDate) unless check_schema=False.

    ``pooler``: ``TRACKER_DATABASE_POOLER`` (``"transaction"`` behind PgBouncer in transaction mode).
    """
    if not isinstance(max_event_bytes, int) or max_event_bytes <= 0:
        raise InvalidInput("max_event_bytes", "must be a positive integer")
    engine = make_engine(url, pooler=pooler)
    try:
        if check_schema:
            migrate.check_schema(engine)
    except BaseException:
        engine.dispose()
        raise
    return SqlEventStore(engine, projector=projector, max_event_bytes=max_event_bytes)
