"""The durable event store (SPEC §8): an append-only log per session plus its projection.

    from tracker.store import open_store, NewEvent
    store = open_store("sqlite:///tracker.db", projector=SessionProjector())
    store.append("s1", 0, [NewEvent("SessionStarted", {...})])

Backends: SQLite (a file) and PostgreSQL (psycopg 3). The schema is managed by
Alembic (``tracker.store.migrate.upgrade(url)`` / ``tracker db upgrade``);
``open_store`` refuses a database whose schema is missing or out of date.
"""

from tracker.store.base import (
    DEFAULT_MAX_EVENT_BYTES,
    AppendResult,
    EventStore,
    NewEvent,
    Projector,
    StoredEvent,
)
from tracker.store.migrate import check_schema, current_revision, head_revision, upgrade
from tracker.store.sql import SqlEventStore, make_engine, open_store, verify_projections

__all__ = [
    "DEFAULT_MAX_EVENT_BYTES",
    "AppendResult",
    "EventStore",
    "NewEvent",
    "Projector",
    "SqlEventStore",
    "StoredEvent",
    "check_schema",
    "current_revision",
    "head_revision",
    "make_engine",
    "open_store",
    "upgrade",
    "verify_projections",
]
