"""The durable event store (behaviour.md "Events"): an append-only log per session plus its projection.

    from tracker.store import open_store, NewEvent
    store = open_store("sqlite:///tracker.db", projector=SessionProjector())
    started = SessionStarted(policy=Policy())
    store.append("s1", 0, [NewEvent(started.TYPE, started.to_data())])

Backends: SQLite (a file) and PostgreSQL (psycopg 3). The schema is managed by
Alembic (``tracker.store.migrate.upgrade(url)`` / ``tracker db upgrade``);
``open_store`` refuses a database whose schema is missing or out of date.

Modules: ``base`` (the ports: ``EventStore``, ``SessionViews``), ``validate`` (every input
check), ``schema`` (every table), ``errors`` (driver errors → typed errors), ``engine``
(``make_engine``, ``open_store``), ``sql`` (``SqlEventStore``: cache, fold, idempotency, backend
dispatch), its backends ``postgres`` (the fast path) and ``sqlite``, ``memory``
(``MemoryEventStore``), ``views`` (``SqlSessionViews``, the read side), ``verify``, ``fleets``
(tenants and API keys), ``migrate`` (Alembic). ``tracker.bootstrap`` builds the store, its views
and its fleets on one engine.
"""

from tracker.store.base import (
    DEFAULT_MAX_EVENT_BYTES,
    AppendResult,
    EventStore,
    NewEvent,
    Projector,
    SessionViews,
    StoredEvent,
)
from tracker.store.engine import make_engine, open_store
from tracker.store.errors import is_unavailable, map_db_errors
from tracker.store.fleets import FleetStore
from tracker.store.memory import MemoryEventStore
from tracker.store.migrate import check_schema, current_revision, head_revision, upgrade
from tracker.store.sql import SqlEventStore
from tracker.store.verify import verify_decisions, verify_projections
from tracker.store.views import SqlSessionViews

__all__ = [
    "DEFAULT_MAX_EVENT_BYTES",
    "AppendResult",
    "EventStore",
    "FleetStore",
    "MemoryEventStore",
    "NewEvent",
    "Projector",
    "SessionViews",
    "SqlEventStore",
    "SqlSessionViews",
    "StoredEvent",
    "check_schema",
    "current_revision",
    "head_revision",
    "is_unavailable",
    "make_engine",
    "map_db_errors",
    "open_store",
    "upgrade",
    "verify_decisions",
    "verify_projections",
]
