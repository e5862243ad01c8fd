"""The composition root: every adapter and the ``Tracker`` are built here, from typed ``Settings``.

The library (``Tracker.from_settings``), the CLI, the HTTP app, the Celery worker and the
bench all go through these functions; nothing else decides which store, coordinator or
counting backend a process uses. It sits between the adapters and the service layer, so
imports still point one way: ``Tracker.from_settings`` asks it for the parts.

    settings = Settings.load()                       # once per process: reads TRACKER_*
    tracker = Tracker.from_settings(settings)        # = Tracker(**vars(build_components(settings)))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tracker.core.policy import Policy
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
    """The event store at ``TRACKER_DATABASE_URL`` (refuses a missing or older schema unless told not to)."""
    from tracker.store import open_store

    return open_store(settings.database_url, projector=projector, check_schema=check_schema)


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
