"""The composition root: every adapter and the ``Tracker`` are built here, from typed ``Settings``.

The library (``Tracker.from_settings``), the CLI, the HTTP app, the Celery worker and the
bench all go through these functions; nothing else decides which store, coordinator or
counting backend a process uses. It sits between the adapters and the service layer, so
imports still point one way: ``Tracker.from_settings`` asks it for the parts.

    settings = Settings.load()                       # once per process: reads TRACKER_*
    tracker = Tracker.from_settings(settings)        # the parts of build_components(settings)
    storage = build_storage(settings.store)          # store + views + fleets on one engine (the CLI)

The event store's database serves three ports, always on one engine built here: the
``EventStore`` (commands and replay), the read side's ``SessionViews`` (listings, gauges, the
session page) and the ``FleetStore`` (tenants and keys). No caller reaches for the engine:
``build_views(store)`` / ``build_fleets(store)`` give the other two for a store built here, and
``check_store_schema(store)`` checks its schema (``/readyz``).

The read side may read a streaming replica instead (``TRACKER_READ_DATABASE_URL``):
``build_read_store`` opens the event store there, read-only (``build_read_storage``: with its
views and fleets, for the CLI's read commands), and ``build_lag_probe(primary, read)`` measures
how far it is behind. The ``Tracker`` (every write and every decision's re-read) always uses
``build_store``, the primary.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tracker.core.policy import Policy
from tracker.errors import StoreUnavailable
from tracker.settings import CoordinationSettings, Settings, StoreSettings

if TYPE_CHECKING:  # pragma: no cover
    from tracker.coordination import Coordinator
    from tracker.counting.backends import CountingBackend
    from tracker.counting.registry import ModelRegistry
    from tracker.hooks import TrackerHooks
    from tracker.store.base import EventStore, Projector
    from tracker.store.fleets import FleetStore
    from tracker.store.replica import LagProbe
    from tracker.store.sql import SqlEventStore
    from tracker.store.views import SqlSessionViews


def build_store(
    settings: StoreSettings, *, projector: Projector | None = None, check_schema: bool = True
) -> SqlEventStore:
    """The event store at ``TRACKER_DATABASE_URL`` (refuses a missing or older schema unless told not to).

    The embedded default needs no set-up: a SQLite file that does not exist yet is created,
    with the newest schema, on first use. Any other database — an existing SQLite file, and
    Postgres always — must have been migrated with ``tracker db upgrade``; otherwise this
    raises ``SchemaOutOfDate`` saying so. Postgres is never migrated implicitly.
    """
    from tracker.store import open_store

    if check_schema:
        create_sqlite_if_missing(settings.database_url)
    return open_store(
        settings.database_url, projector=projector, check_schema=check_schema, pooler=settings.database_pooler
    )


READ_ONLY_OPTION = "-c default_transaction_read_only=on"


def read_only_url(url: str, pooler: str = "none") -> str:
    """``url`` for the read side: on PostgreSQL reached directly, every transaction read-only
    (libpq ``options``), so a read URL pointed at the primary by mistake cannot write either.
    Behind a transaction pooler (which refuses the ``options`` startup parameter) and on other
    databases the URL is left as it is: a hot standby refuses writes by itself."""
    from sqlalchemy.engine import make_url

    if not url.startswith("postgresql") or pooler != "none":
        return url
    u = make_url(url)
    options = u.query.get("options")
    existing = " ".join(options) if isinstance(options, tuple) else (options or "")
    if READ_ONLY_OPTION in existing:
        return url
    merged = f"{existing} {READ_ONLY_OPTION}".strip()
    return u.update_query_dict({"options": merged}).render_as_string(hide_password=False)


def build_read_store(
    settings: StoreSettings, *, projector: Projector | None = None, check_schema: bool = True
) -> SqlEventStore:
    """The read side's event store: at ``TRACKER_READ_DATABASE_URL``, read-only, when it is set
    (a streaming replica; its schema is the primary's, replicated); else ``build_store``."""
    if settings.read_database_url is None:
        return build_store(settings, projector=projector, check_schema=check_schema)
    from tracker.store import open_store

    url = read_only_url(settings.read_database_url, settings.database_pooler)
    return open_store(url, projector=projector, check_schema=check_schema, pooler=settings.database_pooler)


def build_lag_probe(primary: EventStore, read: EventStore) -> LagProbe:
    """How far the database of ``read`` is behind that of ``primary`` (0 for the same store)."""
    from tracker.store.replica import LagProbe

    primary_engine = _sql(primary, "the primary").engine
    return LagProbe(primary_engine, primary_engine if read is primary else _sql(read, "the read side").engine)


def _sql(store: EventStore, what: str) -> SqlEventStore:
    from tracker.store.sql import SqlEventStore

    if not isinstance(store, SqlEventStore):
        raise TypeError(f"{what} live in the event store's database: give a store built by build_store")
    return store


def build_views(store: EventStore) -> SqlSessionViews:
    """The read side's views (``SessionViews``) on the database of ``store`` (one built by ``build_store``)."""
    from tracker.store.views import SqlSessionViews

    return SqlSessionViews(_sql(store, "the views").engine)


def build_fleets(store: EventStore, *, cache_s: float = 1.0) -> FleetStore:
    """The fleets and their keys on the database of ``store``; a valid key is cached ``cache_s`` seconds."""
    from tracker.store.fleets import FleetStore

    return FleetStore(_sql(store, "fleets").engine, cache_s=cache_s)


def check_store_schema(store: EventStore) -> None:
    """``SchemaOutOfDate`` unless the database of ``store`` is at the newest schema (``/readyz``)."""
    from tracker.store.migrate import check_schema

    check_schema(_sql(store, "the schema").engine)


@dataclass
class Storage:
    """The event store, the read side's views and the fleets, on one database (one engine)."""

    store: SqlEventStore
    views: SqlSessionViews
    fleets: FleetStore

    def close(self) -> None:
        self.store.close()  # (disposes the engine the three share)

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_storage(settings: StoreSettings, *, projector: Projector | None = None, check_schema: bool = True) -> Storage:
    """``build_store`` and, on the same engine, the views and the fleets (the CLI, the bench)."""
    store = build_store(settings, projector=projector, check_schema=check_schema)
    return Storage(store=store, views=build_views(store), fleets=build_fleets(store))


def build_read_storage(
    settings: StoreSettings, *, projector: Projector | None = None, check_schema: bool = True
) -> Storage:
    """``build_read_store`` and, on its engine, the views and the fleets: the CLI's read commands
    (on the replica when ``TRACKER_READ_DATABASE_URL`` is set, else the same as ``build_storage``)."""
    store = build_read_store(settings, projector=projector, check_schema=check_schema)
    return Storage(store=store, views=build_views(store), fleets=build_fleets(store))


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///path`` URL (None for other databases and in-memory SQLite)."""
    if not url.startswith("sqlite:///") or url in ("sqlite:///", "sqlite:///:memory:"):
        return None
    return Path(url[len("sqlite:///") :].split("?", 1)[0])


def create_sqlite_if_missing(url: str) -> bool:
    """Create a SQLite database that does not exist yet, at the newest schema; True if this call made it.

    The schema is built in a private file beside the target and linked into place, so
    processes starting together never see a half-made database: one link wins, the others
    find the finished file.
    """
    from tracker.store.migrate import upgrade

    path = sqlite_path(url)
    if path is None or path.exists():
        return False
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        upgrade("sqlite:///" + tmp.as_posix())
        try:
            os.link(tmp, path)  # atomic, and refuses to replace a file another process linked first
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links
            if path.exists():
                return False
            os.replace(tmp, path)
        return True
    except OSError as exc:
        raise StoreUnavailable(f"cannot create the embedded database at {path}: {exc}", database=str(path)) from exc
    finally:
        for leftover in (tmp, *(tmp.with_name(tmp.name + suffix) for suffix in ("-journal", "-wal", "-shm"))):
            leftover.unlink(missing_ok=True)


def build_coordinator(settings: CoordinationSettings) -> Coordinator:
    """Redis session locks when ``TRACKER_REDIS_URL`` is set, else in-process locks."""
    from tracker.coordination import LocalCoordinator, RedisCoordinator

    if settings.redis_url:
        return RedisCoordinator(settings.redis_url, ttl_s=settings.lock_ttl_s)
    return LocalCoordinator()


def build_registry(settings: Settings) -> ModelRegistry:
    """The shipped model registry plus ``TRACKER_MODELS_FILE``, with provider counters where keys are set."""
    from tracker.counting.registry import ModelRegistry

    return ModelRegistry.load(settings.counting.models_file, providers=settings.providers)


def build_counting(settings: Settings, *, registry: ModelRegistry | None = None) -> CountingBackend:
    """Celery workers when ``TRACKER_BROKER_URL`` is set, else in-process counting (same timeout, same errors)."""
    from tracker.counting.backends import InProcessCounting

    registry = registry or build_registry(settings)
    if settings.counting.broker_url:
        from tracker.counting.celery import CeleryCounting, make_celery_app

        app = make_celery_app(settings.counting, default_timeout_s=settings.policy.count_timeout_s)
        return CeleryCounting(app, registry, queue=settings.counting.count_queue, owns_app=True)
    return InProcessCounting(registry)


@dataclass
class Components:
    """Everything a ``Tracker`` is made of; ``Tracker.from_settings`` is ``Tracker(**vars(build_components(s)))``."""

    store: SqlEventStore
    coordinator: Coordinator
    counting: CountingBackend
    policy: Policy


def build_components(settings: Settings | None = None, **overrides: Any) -> Components:
    """Store, coordinator, counting backend and policy wired from ``settings`` (default ``Settings.load()``).

    ``overrides`` replace single parts (``counting=``, ``coordinator=``, ``policy=``): tests and
    embedders swap one adapter and keep the rest.
    """
    from tracker.core import SessionProjector

    unknown = set(overrides) - {"counting", "coordinator", "policy"}
    if unknown:
        raise TypeError(f"unknown component(s): {', '.join(sorted(unknown))}")
    s = settings if settings is not None else Settings.load()
    store = build_store(s.store, projector=SessionProjector())
    try:
        counting = overrides.get("counting") or build_counting(s)
        coordinator = overrides.get("coordinator") or build_coordinator(s.coordination)
    except BaseException:
        store.close()
        raise
    return Components(
        store=store, coordinator=coordinator, counting=counting, policy=overrides.get("policy") or s.policy
    )


def build_hooks(settings: Settings, *, registry: Any = None) -> list[TrackerHooks]:
    """The Tracker's hooks: decision metrics on ``registry`` (default: prometheus_client's own; their
    ``model`` labels from the settings' model registry) unless ``TRACKER_METRICS`` is off; spans and
    log lines when tracing or id-logging is on (configure them first)."""
    from tracker import telemetry
    from tracker.metrics import decision_metrics

    metrics: list[TrackerHooks] = []
    if settings.telemetry.metrics:
        metrics.append(decision_metrics(registry, models=build_registry(settings)))
    return [*metrics, telemetry.TelemetryHooks()] if telemetry.active() else metrics
