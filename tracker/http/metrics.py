"""The HTTP app's Prometheus metrics: requests, latency, error codes, open waits, and gauges read at scrape time.

:class:`Metrics` is a registry of the app's own (two apps in one process never clash); the
Tracker's decision metrics count on it too (a hook, ``tracker.metrics``), as for any library
call. The fleet gauges and the read replica's lag are read when ``/metrics`` is scraped, from a
:class:`GaugeSource` (the server's ``Runtime``), at most every ``GAUGES_TTL_S`` per process.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from tracker.metrics import decision_metrics

if TYPE_CHECKING:  # pragma: no cover
    from tracker.store.base import SessionViews
    from tracker.store.fleets import FleetStore
    from tracker.store.replica import ReplicaLag

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own variable, not a tracker setting
GAUGES_TTL_S = 5.0  # fleet gauges are read from the store at most this often per process
T = TypeVar("T")


class GaugeSource(Protocol):
    """What the scraped gauges read: the fleets and the views on the primary, the read side's lag."""

    def fleets(self) -> FleetStore: ...

    def primary_views(self) -> SessionViews: ...

    def replica_lag(self) -> ReplicaLag: ...


class Metrics:
    """Prometheus metrics on a registry of this app's own (two apps in one process never clash).

    With ``PROMETHEUS_MULTIPROC_DIR`` set (``tracker serve --workers N`` sets it), values go
    to that directory and ``/metrics`` aggregates every worker process.
    """

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        #: the decisions' metrics: a hook of the Tracker the app builds (``bootstrap.build_app``)
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

    def watch(self, source: GaugeSource) -> None:
        """Serve the fleet gauges of ``source``'s primary and its read side's lag (read at scrape time)."""
        self.gauges = FleetGauges(source)
        self.registry.register(self.gauges)
        self.replica = ReplicaGauges(source)
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

    def __init__(self, source: GaugeSource) -> None:
        self._source = source
        self._lock = threading.Lock()
        self._cached: tuple[float, T | None] | None = None

    def describe(self) -> list[Any]:
        return []  # collected on demand only: registering must not read the store

    def read(self) -> T | None:
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
        from tracker.queries import fleet_gauges

        fleets = {f["fleet_id"]: f["name"] for f in self._source.fleets().list_fleets()}
        return fleet_gauges(self._source.primary_views(), fleets, time.time())

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
        return self._source.replica_lag()

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
