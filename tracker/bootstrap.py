"""The composition root: every adapter and the ``Tracker`` are built here, from typed ``Settings``.

The library (``Tracker.from_settings``), the CLI, the HTTP app, the Celery worker and the
bench all go through these functions; nothing else decides which store, coordinator or
counting backend a process uses. It sits between the adapters and the service layer, so
imports still point one way: ``Tracker.from_settings`` asks it for the parts.

    settings = Settings.load()                       # once per process: reads TRACKER_*
    tracker = Tracker.from_settings(settings)        # = Tracker(**vars(build_components(settings)))
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
    from tracker.store.base import Projector
    from tracker.store.sql import SqlEventStore


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
