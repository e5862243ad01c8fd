"""The durable event store (behaviour.md "Events"): an append-only log per session plus its projection.

    from tracker.store import open_store, NewEvent
    store = open_store("sqlite:///tracker.db", projector=SessionProjector())
    store.append("s1", 0, [NewEvent("SessionStarted", {...})])

Backends: SQLite (a file) and PostgreSQL (psycopg 3). The schema is managed by
Alembic (``tracker.store.migrate.upgrade(url)`` / ``tracker db upgrade``);
``open_store`` refuses a database whose schema is missing or out of date.

Modules: ``base`` (the port), ``schema`` (every table), ``errors`` (driver errors →
typed errors), ``engine`` (``make_engine``, ``open_store``), ``sql`` (``SqlEventStore``),
``postgres`` (its PostgreSQL fast path), ``verify``, ``fleets`` (tenants and API keys),
``migrate`` (Alembic).
"""

from tracker.store.base import (
    DEFAULT_MAX_EVENT_BYTES,
    AppendResult,
    EventStore,
    NewEvent,
    Projector,
    StoredEvent,
)
from tracker.store.engine import make_engine, open_store
from tracker.store.errors import is_unavailable, map_db_errors
from tracker.store.fleets import FleetStore
from tracker.store.migrate import check_schema, current_revision, head_revision, upgrade
from tracker.store.sql import SqlEventStore
from tracker.store.verify import verify_projections

__all__ = [
    "DEFAULT_MAX_EVENT_BYTES",
    "AppendResult",
    "EventStore",
    "FleetStore",
    "NewEvent",
    "Projector",
    "SqlEventStore",
    "StoredEvent",
    "check_schema",
    "current_revision",
    "head_revision",
    "is_unavailable",
    "make_engine",
    "map_db_errors",
    "open_store",
    "upgrade",
    "verify_projections",
]
