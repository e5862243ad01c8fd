"""What a server process holds: its settings, the one Tracker, the fleets, metrics, the caller.

:class:`Runtime` builds everything from the process's typed ``Settings`` on first need, so
the server starts (and ``/readyz`` says why) while the database is down or unmigrated.
What the commands decide is counted by the Tracker's own metrics hook (``tracker.metrics``,
on this app's registry), as for any library call; the routes run the Tracker's commands for the
:class:`Caller` (``Tracker.run``) and never count a decision themselves. The HTTP metrics (requests, latency,
error codes) are counted here and in the middleware.

With ``TRACKER_READ_DATABASE_URL`` the read side -- ``store()`` and ``views()``: history, the
sessions listing, the event feed, the console -- reads a streaming replica; the Tracker (every
command, ``wait``'s re-reads, the session state the agents build their next basis on) and the
fleets (API keys) stay on the primary, and so do the fleet gauges (``tracker_store_up`` is the
primary's). ``/readyz`` reports the replica's lag and answers 503 above ``TRACKER_READ_MAX_LAG_S``;
``tracker_read_replica_lag_seconds`` / ``_bytes`` / ``tracker_read_replica_up`` show it on ``/metrics``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from tracker.core.model import SessionScope
from tracker.errors import InvalidSetting, TrackerError
from tracker.http.errors import error_body
from tracker.http.waits import Waits
from tracker.metrics import decision_metrics
from tracker.settings import Settings

if TYPE_CHECKING:  # pragma: no cover
    from tracker.core import Policy
    from tracker.service import Tracker
    from tracker.store.base import EventStore, SessionViews
    from tracker.store.fleets import FleetStore
    from tracker.store.replica import LagProbe, ReplicaLag

log = logging.getLogger("tracker.http")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own variable, not a tracker setting
GAUGES_TTL_S = 5.0  # fleet gauges are read from the store at most this often per process
T = TypeVar("T")


# -- metrics ------------------------------------------------------------------------------------


class Metrics:
    """Prometheus metrics on a registry of this app's own (two apps in one process never clash).

    With ``PROMETHEUS_MULTIPROC_DIR`` set (``tracker serve --workers N`` sets it), values go
    to that directory and ``/metrics`` aggregates every worker process.
    """

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        #: the decisions' metrics: a hook of the Tracker this app builds (``Runtime.tracker``)
        self.domain = decision_metrics(r)
        self.errors = Counter("tracker_http_errors_total", "Error responses by code", ["code"], registry=r)
        self.requests = Counter(
            "tracker_http_requests_total", "HTTP requests", ["method", "route", "status"], registry=r
        )
        self.latency = Histogram(
            "tracker_http_request_duration_seconds",
            "HTTP request latency",
            ["method", "route"],
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
        )

        self.waits_open = Gauge(
            "tracker_http_waits_open",
            "wait long-polls open (none holds a request thread)",
            registry=r,
            multiprocess_mode="livesum",
        )

        self.gauges: FleetGauges | None = None
        self.replica: ReplicaGauges | None = None

    def watch(self, runtime: Runtime) -> None:
        """Serve the fleet gauges of ``runtime``'s store and its read side's lag (read at scrape time)."""
        self.gauges = FleetGauges(runtime)
        self.registry.register(self.gauges)
        self.replica = ReplicaGauges(runtime)
        self.registry.register(self.replica)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        path = os.environ.get(MULTIPROC_ENV)
        if path:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=path)
            if self.gauges is not None:  # read from the store by the process that answers: not summed
                registry.register(self.gauges)
            if self.replica is not None:
                registry.register(self.replica)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _ScrapedGauges(Generic[T]):
    """Gauges of a reading taken at scrape time, at most every ``GAUGES_TTL_S`` (``_take`` takes it;
    None when what it reads did not answer)."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._lock = threading.Lock()
        self._cached: tuple[float, T | None] | None = None

    def describe(self) -> list[Any]:
        return []  # collected on demand only: registering must not read the store

    def read(self) -> T | None:
        import time

        with self._lock:
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < GAUGES_TTL_S:
                return self._cached[1]
            try:
                value = self._take()
            except Exception:  # noqa: BLE001 - any failure to read means the store (or replica) is not up
                value = None
            self._cached = (now, value)
            return value

    def _take(self) -> T | None:  # pragma: no cover
        raise NotImplementedError


class FleetGauges(_ScrapedGauges[dict[str, Any]]):
    """Gauges per fleet, read from the store at scrape time (at most every ``GAUGES_TTL_S``).

    ``tracker_sessions{fleet,pressure}``, ``tracker_open_attempts{fleet}``,
    ``tracker_oldest_open_attempt_age_seconds{fleet}``, ``tracker_feed_held_events`` and
    ``tracker_feed_held_seconds`` (the feed's horizon, server-wide), and ``tracker_store_up`` (0 when the
    read failed: the database is down or unmigrated). Fleet labels are fleet names (``none``:
    sessions outside any fleet); pressures are the core's three.
    """

    def _take(self) -> dict[str, Any]:
        import time

        from tracker.queries import fleet_gauges

        fleets = {f["fleet_id"]: f["name"] for f in self._runtime.fleets().list_fleets()}
        return fleet_gauges(self._runtime.primary_views(), fleets, time.time())

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        data = self.read()
        yield GaugeMetricFamily(
            "tracker_store_up", "1 when the event store answered the gauges' read", 0 if data is None else 1
        )
        if data is None:
            return
        sessions = GaugeMetricFamily("tracker_sessions", "Sessions by fleet and pressure", labels=["fleet", "pressure"])
        for fleet, pressure, n in data["sessions"]:
            sessions.add_metric([fleet, pressure], n)
        yield sessions
        opened = GaugeMetricFamily("tracker_open_attempts", "Compaction attempts open, by fleet", labels=["fleet"])
        oldest = GaugeMetricFamily(
            "tracker_oldest_open_attempt_age_seconds",
            "Age of the oldest open compaction attempt, by fleet (0: none open)",
            labels=["fleet"],
        )
        for fleet, n in data["open_attempts"]:
            opened.add_metric([fleet], n)
        for fleet, age in data["oldest_open_attempt_age"]:
            oldest.add_metric([fleet], age)
        yield opened
        yield oldest
        held, held_s = data["feed_held"]
        yield GaugeMetricFamily(
            "tracker_feed_held_events",
            "Committed events the event feed does not show yet: a transaction that started before them is still open",
            held,
        )
        yield GaugeMetricFamily(
            "tracker_feed_held_seconds",
            "How long the oldest event the feed holds back has waited (0: the feed shows every committed event)",
            held_s,
        )


class ReplicaGauges(_ScrapedGauges["ReplicaLag"]):
    """The read side's lag, measured at scrape time (at most every ``GAUGES_TTL_S``).

    ``tracker_read_replica_up`` (1 when the read side's database answered the probe),
    ``tracker_read_replica_lag_seconds`` and ``tracker_read_replica_lag_bytes`` (see
    ``tracker.store.replica``; 0 when the read side reads the primary itself, without
    ``TRACKER_READ_DATABASE_URL``; absent while the replica does not answer or the lag is not known yet).
    """

    def _take(self) -> ReplicaLag | None:
        return self._runtime.replica_lag()

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        lag = self.read()
        yield GaugeMetricFamily(
            "tracker_read_replica_up",
            "1 when the read side's database (TRACKER_READ_DATABASE_URL, else the primary) answered the lag probe",
            0 if lag is None else 1,
        )
        if lag is None:
            return
        if lag.lag_s is not None:
            yield GaugeMetricFamily(
                "tracker_read_replica_lag_seconds",
                "How far the read side's replica is behind the primary, seconds (0: caught up, or no replica)",
                lag.lag_s,
            )
        yield GaugeMetricFamily(
            "tracker_read_replica_lag_bytes", "WAL the read side's replica has not replayed yet, bytes", lag.lag_bytes
        )


# -- the caller ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Caller(SessionScope):
    """The authenticated fleet: its ``SessionScope`` (sessions stored as ``"<fleet_id>:<session_id>"``)
    and the policy its new sessions start with (``policies(fleet_id)``, looked up when a command may
    start a session, in the thread that runs it: None, or no lookup, is the Tracker's)."""

    fleet_id: str
    policies: Callable[[str], Policy | None] | None = field(default=None, compare=False, repr=False)

    def start_policy(self) -> Policy | None:
        return self.policies(self.fleet_id) if self.policies is not None else None


# -- the runtime --------------------------------------------------------------------------------


class Runtime:
    """Settings, the one Tracker (built on first need), the fleets, Redis for /readyz, metrics.

    ``tracker`` may be given (embedding, tests); it is then the caller's to close, and its hooks
    are its own (``hooks=[runtime.metrics.domain]`` counts its decisions on this app's ``/metrics``).
    """

    def __init__(self, settings: Settings, *, tracker: Tracker | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.metrics.watch(self)
        self._tracker = tracker
        self._owned = tracker is None
        self._fleets: FleetStore | None = None
        self._views: SessionViews | None = None
        self._primary_views: SessionViews | None = None
        self._read_store: EventStore | None = None
        self._lag_probe: LagProbe | None = None
        self._redis: Any = None
        self._lock = threading.Lock()
        self.waits = Waits(self.tracker, settings.api.max_waits_per_fleet, self.metrics.waits_open)

    def _once(self, name: str, build: Callable[[], T]) -> T:
        """The part held in ``self.<name>``, built by ``build()`` on first need: once, under the lock
        (what ``build`` needs of the other parts is got before, outside it)."""
        part = getattr(self, name)
        if part is None:
            with self._lock:
                part = getattr(self, name)
                if part is None:
                    part = build()
                    setattr(self, name, part)
        return cast(T, part)

    def tracker(self) -> Tracker:
        t = self._tracker
        if t is None:

            def build() -> Tracker:
                from tracker.bootstrap import build_hooks
                from tracker.service import Tracker

                hooks = build_hooks(self.settings, registry=self.metrics.registry)  # decisions on /metrics
                return Tracker.from_settings(self.settings, hooks=hooks)

            t = self._once("_tracker", build)
        return t

    def fleet_policy(self, fleet_id: str) -> Policy | None:
        """The policy ``fleet_id``'s new sessions start with; None: the Tracker's (cached, ``FleetStore.policy_of``)."""
        return self.fleets().policy_of(fleet_id) if fleet_id else None

    def store(self) -> EventStore:
        """The read side's event store, for its log reads (``tracker.queries``: history, feed, the console):
        on ``TRACKER_READ_DATABASE_URL`` (read-only) when set, else the Tracker's own store."""
        if self.settings.store.read_database_url is None:
            return self.tracker().store
        r = self._read_store
        if r is None:
            from tracker.bootstrap import build_read_store
            from tracker.core import SessionProjector

            r = self._once("_read_store", lambda: build_read_store(self.settings.store, projector=SessionProjector()))
        return r

    def views(self) -> SessionViews:
        """The read side's views on the database of ``store()``: listings, the session page's reads."""
        v = self._views
        if v is None:
            from tracker.bootstrap import build_views

            store = self.store()
            v = self._once("_views", lambda: build_views(store))
        return v

    def primary_views(self) -> SessionViews:
        """Views on the Tracker's database, the primary (the fleet gauges): ``views()`` without a replica."""
        if self.settings.store.read_database_url is None:
            return self.views()
        v = self._primary_views
        if v is None:
            from tracker.bootstrap import build_views

            store = self.tracker().store
            v = self._once("_primary_views", lambda: build_views(store))
        return v

    def replica_lag(self) -> ReplicaLag:
        """How far the read side's database is behind the primary (0 without a replica); typed errors."""
        probe = self._lag_probe
        if probe is None:
            from tracker.bootstrap import build_lag_probe

            primary, read = self.tracker().store, self.store()
            probe = self._once("_lag_probe", lambda: build_lag_probe(primary, read))
        return probe.measure()

    def fleets(self) -> FleetStore:
        """The fleets and their keys on the Tracker's database."""
        f = self._fleets
        if f is None:
            from tracker.bootstrap import build_fleets

            store = self.tracker().store
            f = self._once("_fleets", lambda: build_fleets(store, cache_s=self.settings.api.api_key_cache_s))
        return f

    def fleets_if_ready(self) -> FleetStore | None:
        return self._fleets

    # -- readiness --------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """``(ready, checks)``: the database reachable with its schema current; Redis answering, if configured."""
        from tracker.bootstrap import check_store_schema
        from tracker.store import head_revision

        checks: dict[str, Any] = {}
        ready = True
        try:
            check_store_schema(self.tracker().store)
            checks["database"] = {"status": "ok", "schema": head_revision()}
        except TrackerError as exc:
            ready = False
            checks["database"] = {"status": "error", **error_body(exc)[1]}  # code + generic message only
            log.warning("not ready: database: %s (%s) %s", exc.message, exc.code, exc.details or "")
        if self.settings.coordination.redis_url:
            try:
                self._redis_client().ping()
                checks["redis"] = {"status": "ok"}
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready"
                ready = False
                # the detail (host, port, the client's text) goes to the log, never to the caller
                log.warning("not ready: redis: %s: %s", type(exc).__name__, exc)
                checks["redis"] = {"status": "error", "code": "redis_unavailable", "message": "Redis does not answer"}
        else:
            checks["redis"] = {"status": "not_configured"}
        if self.settings.store.read_database_url is not None:
            replica_ok, checks["read_replica"] = self._replica_readiness()
            ready = ready and replica_ok
        else:
            checks["read_replica"] = {"status": "not_configured"}
        return ready, checks

    def _replica_readiness(self) -> tuple[bool, dict[str, Any]]:
        """The replica answers, at the newest schema, at most ``TRACKER_READ_MAX_LAG_S`` behind."""
        from tracker.bootstrap import check_store_schema

        max_lag = self.settings.store.read_max_lag_s
        try:
            check_store_schema(self.store())
            lag = self.replica_lag()
        except TrackerError as exc:
            log.warning("not ready: read replica: %s (%s) %s", exc.message, exc.code, exc.details or "")
            return False, {"status": "error", **error_body(exc)[1]}
        check = {"status": "ok", **lag.to_data(), "max_lag_s": max_lag}
        if lag.lag_s is None or lag.lag_s > max_lag:
            check["status"] = "lagging"
            log.warning(
                "not ready: read replica lags %s s (%d bytes), more than %s s", lag.lag_s, lag.lag_bytes, max_lag
            )
            return False, check
        return True, check

    def _redis_client(self) -> Any:
        if self._redis is None:
            from tracker.coordination import redis_client

            url = self.settings.coordination.redis_url
            if url is None:
                raise InvalidSetting("TRACKER_REDIS_URL", "is not set: there is no Redis to check")
            return self._once("_redis", lambda: redis_client(url, socket_timeout=1.0, connect_timeout=1.0))
        return self._redis

    def close(self) -> None:
        self.waits.close()
        if self._read_store is not None:
            self._read_store.close()
            self._read_store = None
            self._views = None
        if self._owned and self._tracker is not None:
            self._tracker.close()
            self._tracker = None
        if self._redis is not None:
            try:
                self._redis.close()
            except Exception:  # noqa: BLE001  # pragma: no cover - closing a broken client
                pass
