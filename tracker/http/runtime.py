"""What a server process holds: its settings, the parts ``build_app`` built once, metrics, the caller.

:class:`Runtime` is the HTTP side of the composition root's :class:`~tracker.bootstrap.App`:
every part (the Tracker, the read side, the fleets, the lag probe) is built when the app is
created, connecting to nothing, so the server starts (and ``/readyz`` says why) while the
database is down or unmigrated; until a database has answered at the newest schema once, the
parts on it are refused with that typed error (503). What the commands decide is counted by
the Tracker's own metrics hook (``tracker.metrics``, on this app's registry), as for any
library call; the routes run the Tracker's commands for the :class:`Caller` (``Tracker.run``) and never
count a decision themselves. The HTTP metrics (requests, latency, error codes) are ``tracker.http.metrics``.

With ``TRACKER_READ_DATABASE_URL`` the read side -- ``store()`` and ``views()``: history, the
sessions listing, the event feed, the console -- reads a streaming replica; the Tracker (every
command, ``wait``'s re-reads, the session state the agents build their next basis on) and the
fleets (API keys) stay on the primary, and so do the fleet gauges (``tracker_store_up`` is the
primary's). ``/readyz`` reports the replica's lag and answers 503 above ``TRACKER_READ_MAX_LAG_S``;
``tracker_read_replica_lag_seconds`` / ``_bytes`` / ``tracker_read_replica_up`` show it on ``/metrics``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tracker.bootstrap import App, build_app
from tracker.core.model import SessionScope
from tracker.errors import InvalidSetting, TrackerError
from tracker.http.errors import error_body
from tracker.http.metrics import Metrics
from tracker.http.waits import Waits
from tracker.settings import Settings

if TYPE_CHECKING:  # pragma: no cover
    from tracker.core import Policy
    from tracker.service import Tracker
    from tracker.store.base import EventStore, SessionViews
    from tracker.store.fleets import FleetStore
    from tracker.store.replica import ReplicaLag

log = logging.getLogger("tracker.http")


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
    """Settings, the app's parts (``build_app``, built here once), metrics, Redis for /readyz, the waits.

    ``tracker`` may be given (embedding, tests); it is then the caller's to close, and its hooks
    are its own (``hooks=[runtime.metrics.domain]`` counts its decisions on this app's ``/metrics``).
    """

    def __init__(self, settings: Settings, *, tracker: Tracker | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.app: App = build_app(settings, tracker=tracker, registry=self.metrics.registry)
        self.metrics.watch(self)
        self._primary_ok = False  # the primary answered at the newest schema once
        self._read_ok = False  # the read side did
        self._redis: Any = None
        self._lock = threading.Lock()
        self.waits = Waits(self.tracker, settings.api.max_waits_per_fleet, self.metrics.waits_open)

    def _primary(self) -> App:
        """The parts, once the primary has answered at the newest schema (else its typed error: 503)."""
        if not self._primary_ok:
            self.app.check_primary()
            self._primary_ok = True
        return self.app

    def _read(self) -> App:
        """The parts, once the read side has answered at the newest schema (else its typed error)."""
        if not self._read_ok:
            self.app.check_read()
            self._read_ok = True
        return self.app

    def tracker(self) -> Tracker:
        return self._primary().tracker

    def fleet_policy(self, fleet_id: str) -> Policy | None:
        """The policy ``fleet_id``'s new sessions start with; None: the Tracker's (cached, ``FleetStore.policy_of``)."""
        return self.fleets().policy_of(fleet_id) if fleet_id else None

    def store(self) -> EventStore:
        """The read side's event store, for its log reads (``tracker.queries``: history, feed, the console):
        on ``TRACKER_READ_DATABASE_URL`` (read-only) when set, else the Tracker's own store."""
        return self._read().read_store

    def views(self) -> SessionViews:
        """The read side's views on the database of ``store()``: listings, the session page's reads."""
        return self._read().views

    def primary_views(self) -> SessionViews:
        """Views on the Tracker's database, the primary (the fleet gauges): ``views()`` without a replica."""
        return self._primary().primary_views

    def replica_lag(self) -> ReplicaLag:
        """How far the read side's database is behind the primary (0 without a replica); typed errors."""
        return self.app.lag_probe.measure()

    def fleets(self) -> FleetStore:
        """The fleets and their keys on the Tracker's database."""
        return self._primary().fleets

    def fleets_if_ready(self) -> FleetStore | None:
        """The fleets once the primary has answered (their key cache needs no I/O), else None."""
        return self.app.fleets if self._primary_ok else None

    # -- readiness --------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """``(ready, checks)``: the database reachable with its schema current; Redis answering, if configured."""
        from tracker.store import head_revision

        checks: dict[str, Any] = {}
        ready = True
        try:
            self.app.check_primary()
            self._primary_ok = True
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
        max_lag = self.settings.store.read_max_lag_s
        try:
            self.app.check_read()
            self._read_ok = True
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
            with self._lock:
                if self._redis is None:
                    self._redis = redis_client(url, socket_timeout=1.0, connect_timeout=1.0)
        return self._redis

    def close(self) -> None:
        self.waits.close()
        self.app.close()
        if self._redis is not None:
            try:
                self._redis.close()
            except Exception:  # noqa: BLE001  # pragma: no cover - closing a broken client
                pass
