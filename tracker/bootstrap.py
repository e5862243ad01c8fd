"""The composition root: every adapter, the ``Tracker`` and the server's parts are built here, from typed ``Settings``.

It sits above the service layer and the read side, below the entry points: the service's
``Tracker`` takes only its parts, and this module wires them. The library, the CLI, the HTTP
app, the Celery worker and the bench all go through these functions; nothing else decides
which store, coordinator or counting backend a process uses.

    settings = Settings.load()                   # once per process: reads TRACKER_*
    tracker = Tracker.from_settings(settings)    # the public Tracker: build_tracker(settings)
    app = build_app(settings)                    # a server's parts, built once: Tracker, views, fleets ...
    with build_reader(settings) as db: ...       # a CLI read command: store + views + fleets (read side)
    with build_writer(settings) as w: ...        # a CLI report command: a Tracker that counts nothing

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from tracker import service
from tracker.calibrations import CalibrationBook
from tracker.core import SessionProjector
from tracker.core.policy import Policy
from tracker.errors import SchemaOutOfDate, StoreUnavailable
from tracker.settings import CoordinationSettings, Settings, StoreSettings, sqlite_path

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
    settings: StoreSettings, *, projector: Projector | None = None, check_schema: bool = True, create: bool = True
) -> SqlEventStore:
    """The event store at ``TRACKER_DATABASE_URL`` (refuses a missing or older schema unless told not to).

    The embedded default needs no set-up: a SQLite file that does not exist yet is created,
    with the newest schema, on first use (``create=False``: refused, ``SchemaOutOfDate``, as a
    command that only reads or administers does). Any other database — an existing SQLite file,
    and Postgres always — must have been migrated with ``tracker db upgrade``; otherwise this
    raises ``SchemaOutOfDate`` saying so. Postgres is never migrated implicitly.
    """
    from tracker.store import open_store

    if check_schema:
        (create_sqlite_if_missing if create else require_sqlite_file)(settings.database_url)
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
    settings: StoreSettings, *, projector: Projector | None = None, check_schema: bool = True, create: bool = True
) -> SqlEventStore:
    """The read side's event store: at ``TRACKER_READ_DATABASE_URL``, read-only, when it is set
    (a streaming replica; its schema is the primary's, replicated); else ``build_store``."""
    if settings.read_database_url is None:
        return build_store(settings, projector=projector, check_schema=check_schema, create=create)
    from tracker.store import open_store

    if check_schema:
        require_sqlite_file(settings.read_database_url)  # a replica is never made here
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


def build_storage(
    settings: StoreSettings, *, projector: Projector | None = None, check_schema: bool = True, create: bool = True
) -> Storage:
    """``build_store`` and, on the same engine, the views and the fleets (the CLI, the bench)."""
    store = build_store(settings, projector=projector, check_schema=check_schema, create=create)
    return Storage(store=store, views=build_views(store), fleets=build_fleets(store))


def build_read_storage(
    settings: StoreSettings, *, projector: Projector | None = None, check_schema: bool = True, create: bool = True
) -> Storage:
    """``build_read_store`` and, on its engine, the views and the fleets (on the replica when
    ``TRACKER_READ_DATABASE_URL`` is set, else the same as ``build_storage``)."""
    store = build_read_store(settings, projector=projector, check_schema=check_schema, create=create)
    return Storage(store=store, views=build_views(store), fleets=build_fleets(store))


def require_sqlite_file(url: str) -> None:
    """Refuse a SQLite file that does not exist (``SchemaOutOfDate``): opening it would create an
    empty one (or fail on a missing folder with a bare OperationalError)."""
    path = sqlite_path(url)
    if path is not None and not path.exists():
        raise SchemaOutOfDate(f"no database at {path}; run `tracker db upgrade`", database=str(path))


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


def build_hooks(settings: Settings, *, registry: Any = None, models: ModelRegistry | None = None) -> list[TrackerHooks]:
    """The Tracker's hooks: decision metrics on ``registry`` (default: prometheus_client's own; their
    ``model`` labels from ``models``, default the settings' model registry) unless ``TRACKER_METRICS``
    is off; spans and log lines when tracing or id-logging is on (configure them first)."""
    from tracker.metrics import decision_metrics

    metrics: list[TrackerHooks] = []
    if settings.telemetry.metrics:
        metrics.append(decision_metrics(registry, models=models or build_registry(settings)))
    return [*metrics, *_trace_hooks()]


def _trace_hooks() -> list[TrackerHooks]:
    from tracker import telemetry

    return [telemetry.TelemetryHooks()] if telemetry.active() else []


# -- the Tracker --------------------------------------------------------------------------------


class Parts(TypedDict, total=False):
    """What ``Tracker.from_settings`` may be given instead of building it (``build_tracker``)."""

    store: SqlEventStore
    counting: CountingBackend
    coordinator: Coordinator
    policy: Policy
    hooks: Iterable[TrackerHooks]
    clock: Callable[[], float]
    new_id: Callable[[], str]


class Tracker(service.Tracker):
    """The public ``Tracker`` (``from tracker import Tracker``): the service layer's, plus ``from_settings``.

    The service's class takes only its parts (``Tracker(store, policy=..., counting=...)``, inherited
    here unchanged); wiring them from settings is this module's job, so the named constructor lives
    here, above the service, and the service never imports the composition root."""

    @classmethod
    def from_settings(cls, settings: Settings | None = None, **parts: Unpack[Parts]) -> Tracker:
        """A Tracker wired from ``settings`` (default: ``Settings.load()``); see ``build_tracker``."""
        return build_tracker(settings, **parts)


def build_tracker(
    settings: Settings | None = None,
    *,
    store: SqlEventStore | None = None,
    counting: CountingBackend | None = None,
    coordinator: Coordinator | None = None,
    policy: Policy | None = None,
    hooks: Iterable[TrackerHooks] | None = None,
    clock: Callable[[], float] | None = None,
    new_id: Callable[[], str] | None = None,
    registry: Any = None,
) -> Tracker:
    """The Tracker of ``settings`` (default ``Settings.load()``): the primary store (schema checked;
    the embedded default created), Redis or local locks, Celery or in-process counting, the
    settings' policy, the calibration book, the default hooks (``build_hooks``, their decision
    metrics on the Prometheus ``registry``).

    Each keyword replaces one part: tests and embedders swap one adapter and keep the rest
    (``hooks=[]``: none; ``store=``: one built by ``build_store``, then the Tracker's to close).
    """
    s = settings if settings is not None else Settings.load()
    store = store if store is not None else build_store(s.store, projector=SessionProjector())
    try:
        models = build_registry(s) if counting is None else None  # read once, for counting and metrics
        counting = counting if counting is not None else build_counting(s, registry=models)
        coordinator = coordinator if coordinator is not None else build_coordinator(s.coordination)
        hooks = hooks if hooks is not None else build_hooks(s, registry=registry, models=models)
    except BaseException:
        store.close()
        raise
    book = CalibrationBook(store, enabled=s.calibration.calibration, refresh_s=s.calibration.calibration_refresh_s)
    given: dict[str, Any] = {"clock": clock, "new_id": new_id}  # else the service's own defaults
    return Tracker(
        store,
        policy=policy or s.policy,
        counting=counting,
        coordinator=coordinator,
        hooks=hooks,
        calibrations=book,
        **{k: v for k, v in given.items() if v is not None},
    )


# -- what the entry points use ------------------------------------------------------------------


@dataclass
class App:
    """A server's parts, built once by ``build_app``: the Tracker (every command, on the primary),
    the read side (its event store and views: a replica's with ``TRACKER_READ_DATABASE_URL``), the
    fleets and the views the fleet gauges read (on the primary), the replica's lag probe.

    Building connects to nothing, so a server starts while its database is down or unmigrated;
    ``check_primary`` / ``check_read`` say whether each database is there, at the newest schema."""

    settings: Settings
    tracker: service.Tracker
    read_store: SqlEventStore
    views: SqlSessionViews
    primary_views: SqlSessionViews
    fleets: FleetStore
    lag_probe: LagProbe
    owns_tracker: bool = True

    def check_primary(self) -> None:
        """The primary answers at the newest schema (the embedded default is made on first use)."""
        if self.owns_tracker:
            create_sqlite_if_missing(self.settings.store.database_url)
        check_store_schema(self.tracker.store)

    def check_read(self) -> None:
        """The read side answers at the newest schema (the primary's check without a replica)."""
        if self.read_store is self.tracker.store:
            self.check_primary()
        else:
            check_store_schema(self.read_store)

    def close(self) -> None:
        if self.read_store is not self.tracker.store:
            self.read_store.close()
        if self.owns_tracker:
            self.tracker.close()


def build_app(settings: Settings, *, tracker: service.Tracker | None = None, registry: Any = None) -> App:
    """A server's parts from ``settings``: its Tracker (decision metrics on the Prometheus ``registry``),
    read side, fleets and lag probe. ``tracker``: one of the caller's (embedding, tests), then the
    caller's to close, its hooks its own; it must be on a store built by ``build_store``."""
    owned = tracker is None
    if tracker is None:
        store = build_store(settings.store, projector=SessionProjector(), check_schema=False)
        tracker = build_tracker(settings, store=store, registry=registry)
    primary = _sql(tracker.store, "the Tracker's store")
    try:
        read = primary
        if settings.store.read_database_url is not None:
            read = build_read_store(settings.store, projector=SessionProjector(), check_schema=False)
        primary_views = build_views(primary)
        return App(
            settings=settings,
            tracker=tracker,
            read_store=read,
            views=primary_views if read is primary else build_views(read),
            primary_views=primary_views,
            fleets=build_fleets(primary, cache_s=settings.api.api_key_cache_s),
            lag_probe=build_lag_probe(primary, read),
            owns_tracker=owned,
        )
    except BaseException:
        if owned:
            tracker.close()
        raise


def build_reader(settings: Settings, *, read: bool = True) -> Storage:
    """What a CLI command that reads or administers needs: the store, its views and fleets, on the
    read side (``read=False``: the primary). A database that is not there is refused, not made."""
    build = build_read_storage if read else build_storage
    return build(settings.store, projector=SessionProjector(), create=False)


@dataclass
class Writer:
    """What a CLI command that records a provider's report needs: a Tracker on the primary that
    counts nothing (no counting backend, no model registry, no metrics), and the fleets."""

    tracker: service.Tracker
    fleets: FleetStore

    def close(self) -> None:
        self.tracker.close()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_writer(settings: Settings) -> Writer:
    """The Tracker a report is written through (``report_usage``, ``report_rejection``): the primary
    (the embedded default created on first use), the settings' locks and policy, traces when on."""
    store = build_store(settings.store, projector=SessionProjector())
    try:
        tracker = service.Tracker(
            store, policy=settings.policy, coordinator=build_coordinator(settings.coordination), hooks=_trace_hooks()
        )
    except BaseException:
        store.close()
        raise
    return Writer(tracker=tracker, fleets=build_fleets(store))
