"""The HTTP API (``tracker serve``): the Tracker for polyglot fleets, over JSON.

One ``Tracker`` per server process (``Tracker.from_settings()``), sync endpoints
(FastAPI runs them on its thread pool; the Tracker, the event store and the
coordinators are thread-safe). Every session belongs to one **fleet**; a request
is authenticated with one of that fleet's API keys (``Authorization: Bearer
<token>``, see ``tracker fleet`` / ``tracker key``) and only ever sees that
fleet's sessions.

Endpoints (all under ``/v1`` need a key; the OpenAPI document is ``/openapi.json``)::

    POST /v1/sessions/{session_id}/observe                          record a measurement, or count a request -> decision
    POST /v1/sessions/{session_id}/compactions                      open a manual compaction attempt (201)
    POST /v1/sessions/{session_id}/compactions/{attempt_id}/commit  commit it (tokens_after)
    POST /v1/sessions/{session_id}/compactions/{attempt_id}/reject  reject it (reject_reason)
    GET  /v1/sessions/{session_id}/compactions/{attempt_id}/wait    long-poll until it ends (?timeout=, at most 30 s)
    GET  /v1/sessions/{session_id}                                  the session's state (the fold of its log)
    GET  /v1/sessions/{session_id}/history                          its events (?from_version=&limit=)
    GET  /v1/events                                                 the fleet's events in global commit order (?after=&limit=)
    GET  /healthz                                                   the process is up
    GET  /readyz                                                    database reachable + schema current (+ Redis if configured)
    GET  /metrics                                                   Prometheus metrics

Isolation: the internal session id is ``"<fleet_id>:<session_id>"`` (fleet ids are
10 characters, so an external id has at most 189); the prefix is added on the way in
and stripped from everything on the way out (bodies, events, error messages). A
key can therefore neither read nor write another fleet's sessions: the same
external id names a different session in each fleet, and reading a session the
caller's fleet does not have answers 404 whether or not another fleet has one.

Errors
------
Every error is JSON ``{"code", "error", "message", ...details}`` (``field`` names
the bad input where there is one) with a stable ``code``. ``ERROR_STATUS`` below
is the one table from error class to HTTP status (the most specific class wins):

==========================================================  ======  ======================================
error (``code``)                                            status  notes
==========================================================  ======  ======================================
PayloadTooLarge (``payload_too_large``)                     413     body over TRACKER_MAX_BODY_BYTES (1 MiB), before parsing
InvalidInput (``invalid_input``, ``invalid_policy``,         422     also FastAPI's own validation errors, reshaped
``invalid_session_id``)                                             (``invalid_input``; ``invalid_session_id`` for the path id)
ContextLimitError (``context_limit``)                       409     recorded (ContextLimitReached) before the answer
StaleBasis (``stale_basis``)                                409     recorded (MeasurementRefused)
CountTimeout (``count_timeout``)                            504     recorded (CountFailed)
other CountError (``invalid_count_model``,                  422     recorded (CountFailed); a malformed *given*
``quality_mismatch``, ``malformed_measurement``,                    measurement is refused before anything is written
``context_limit_unknown``)
UnknownAttempt (``unknown_attempt``)                        404
other AttemptError (``attempt_not_open``,                   409     ``summary_too_large`` is recorded as a rejection
``not_attempt_holder``, ``manual_attempt_open``,
``summary_too_large``)
WaitTimeout (``wait_timeout``)                              408     the caller's own bounded wait elapsed; long-poll again
StoreUnavailable (``store_unavailable``)                    503     nothing was written
SchemaOutOfDate (``schema_out_of_date``)                    503     run ``tracker db upgrade``
ConcurrencyConflict (``concurrency_conflict``)              409     retry (with the same idempotency key)
UnknownSession (``unknown_session``)                        404     also a session of another fleet
StoreError (``store_error``)                                500
Unauthorized (``unauthorized``)                             401     missing, malformed, unknown or revoked key;
                                                                    checked first, before the body is read
NotFound (``not_found``) / MethodNotAllowed                 404/405 no such route / method
(``method_not_allowed``)
any other TrackerError / unexpected exception               500     ``internal_error`` for unexpected ones
==========================================================  ======  ======================================

408 rather than 504 for ``wait_timeout``: nothing upstream failed -- the wait the
caller asked for (``timeout``) ran out while the attempt was still open, which is
a normal outcome of a long poll, and 5xx would page whoever watches server errors.

Refusals that are decisions are on the record before the caller hears about them
(``RECORDED_REFUSALS``); every other 4xx writes nothing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, Union

from fastapi import Depends, FastAPI, Path, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from tracker.errors import (
    AttemptError,
    ConcurrencyConflict,
    ContextLimitError,
    CountError,
    CountTimeout,
    InvalidInput,
    InvalidSessionId,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    SchemaOutOfDate,
    StaleBasis,
    StoreError,
    StoreUnavailable,
    SummaryTooLarge,
    TrackerError,
    Unauthorized,
    UnknownAttempt,
    UnknownSession,
    WaitTimeout,
)
from tracker.fleets import FLEET_ID_LEN

log = logging.getLogger("tracker.api")

API_PREFIX = "/v1"
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
WAIT_MAX_S = 30.0
MAX_INTERNAL_SESSION_ID = 200
MAX_SESSION_ID = MAX_INTERNAL_SESSION_ID - FLEET_ID_LEN - 1  # 189
SESSION_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,%d}$" % MAX_SESSION_ID
JSON_SAFE_INT = 2**53 - 1
MAX_POSITION = 2**63 - 1
MAX_VERSION = 2**31 - 1


# -- errors -------------------------------------------------------------------------------------


#: THE mapping from error class to HTTP status (see the module docstring). Looked up along
#: the exception's MRO, so the most specific class listed wins.
ERROR_STATUS: dict[type[BaseException], int] = {
    PayloadTooLarge: 413,
    InvalidInput: 422,
    ContextLimitError: 409,
    StaleBasis: 409,
    CountTimeout: 504,
    CountError: 422,
    UnknownAttempt: 404,
    AttemptError: 409,
    WaitTimeout: 408,
    StoreUnavailable: 503,
    SchemaOutOfDate: 503,
    ConcurrencyConflict: 409,
    UnknownSession: 404,
    StoreError: 500,
    Unauthorized: 401,
    NotFound: 404,
    MethodNotAllowed: 405,
    TrackerError: 500,
}

#: Refusals that are decisions: recorded in the session's log before the answer (SPEC §6, §7).
#: Every other refused request writes nothing.
RECORDED_REFUSALS = frozenset({
    ContextLimitError.code, StaleBasis.code, SummaryTooLarge.code, CountError.code, CountTimeout.code,
    "invalid_count_model", "quality_mismatch", "malformed_measurement", "context_limit_unknown",
})


def status_for(exc: BaseException) -> int:
    for cls in type(exc).__mro__:
        if cls in ERROR_STATUS:
            return ERROR_STATUS[cls]
    return 500


# -- request / response models ------------------------------------------------------------------

class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelRefIn(_In):
    provider: str = Field("unknown", min_length=1, max_length=100)
    name: str = Field(..., min_length=1, max_length=200)


class MeasurementIn(_In):
    """A count you made yourself (SPEC §2)."""

    basis: str = Field(..., min_length=1, max_length=220, description="`r<revision>:<through>`, or a bare `through` at the current revision")
    input_tokens: int = Field(..., strict=True, ge=0, le=JSON_SAFE_INT)
    input_limit: int = Field(..., strict=True, gt=0, le=JSON_SAFE_INT)
    model: Union[ModelRefIn, str, None] = Field(None, description="{provider, name} or a name")
    fingerprint: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="SHA-256 hex of the counted request")
    quality: Literal["exact_provider", "exact_local", "heuristic_estimate"] = "exact_local"


class ObserveIn(_In):
    """Exactly one of ``measurement``, or ``request`` + ``model`` + ``basis`` (counted by the tracker)."""

    measurement: MeasurementIn | None = None
    request: dict[str, Any] | None = Field(None, description="the complete LLM request (system, messages, tools) to count")
    model: str | None = Field(None, min_length=1, max_length=200, description="model name from the registry (with request)")
    basis: str | None = Field(None, min_length=1, max_length=220, description="what the request covers (with request)")
    compaction_threshold: float | None = Field(None, allow_inf_nan=False, description="per-request threshold; may only lower it")
    scope: str | None = Field(None, max_length=100)
    scope_confidence: float | None = Field(None, allow_inf_nan=False)
    overhead_tokens: int | None = Field(None, strict=True, ge=0, le=JSON_SAFE_INT)
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)


class ManualIn(_In):
    basis: str | None = Field(None, min_length=1, max_length=220)
    overhead_tokens: int | None = Field(None, strict=True, ge=0, le=JSON_SAFE_INT)
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)


class CommitIn(_In):
    fencing_token: int = Field(..., strict=True, ge=-JSON_SAFE_INT, le=JSON_SAFE_INT)
    tokens_after: int = Field(..., strict=True, ge=0, le=JSON_SAFE_INT)
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)


class RejectIn(_In):
    fencing_token: int = Field(..., strict=True, ge=-JSON_SAFE_INT, le=JSON_SAFE_INT)
    reject_reason: str = Field(..., min_length=1, max_length=200)
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)


class AttemptOut(BaseModel):
    attempt_id: str
    reason: str
    trigger: str
    basis: str
    fencing_token: int
    opened_at: float
    lease_expires_at: float
    tokens_before: int | None
    input_limit: int | None
    history_budget: int | None


class DecisionOut(BaseModel):
    session_id: str
    version: int
    action: Literal["proceed", "compact", "wait", "context_limit"]
    pressure: str
    pressure_before: str
    occupancy_bp: int
    threshold_bp: int
    threshold_source: str
    compact_level: int
    rearm_level: int
    hard_level: int
    growth_fired: bool
    trigger: str | None
    basis: str
    revision: int
    attempt: AttemptOut | None = Field(None, description="the attempt opened for this caller (action compact)")
    waiting_on: AttemptOut | None = Field(None, description="the open automatic attempt (action wait)")


class SessionStateOut(BaseModel):
    session_id: str
    version: int
    policy: dict[str, Any] | None
    revision: int
    pressure: str
    exhausted: list[str]
    open_attempts: list[AttemptOut]
    episode_automatic: int
    attempts_opened: int
    last: dict[str, Any] | None
    recent_outcomes: list[list[str]]
    counts: dict[str, int]


class EventOut(BaseModel):
    position: int
    session_id: str
    version: int
    type: str
    recorded_at: str
    data: dict[str, Any]
    idempotency_key: str | None


class HistoryOut(BaseModel):
    session_id: str
    events: list[EventOut]
    next_from_version: int = Field(..., description="from_version for the next page")
    has_more: bool


class FeedOut(BaseModel):
    events: list[EventOut]
    next_after: int = Field(..., description="`after` for the next page: the last position returned (resumable)")
    has_more: bool


class WaitOut(BaseModel):
    attempt_id: str
    outcome: str = Field(..., description="`committed` or `rejected:<reason>`")
    status: Literal["committed", "rejected"]
    reject_reason: str | None


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    code: str
    error: str
    message: str
    field: str | None = None


class HealthOut(BaseModel):
    status: str


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorBody, "description": _STATUS_TEXT.get(s, "error")} for s in (401, 413, 422, 503, *statuses)}


_STATUS_TEXT = {
    401: "missing, malformed, unknown or revoked API key (`unauthorized`)",
    404: "no such session / attempt in this fleet",
    408: "`wait_timeout`: the attempt was still open when the wait ended",
    409: "a refusal: `context_limit`, `stale_basis`, attempt errors, `concurrency_conflict`",
    413: "`payload_too_large`: the body exceeds the server's limit",
    422: "invalid input (`field` names it), or a count that could not be trusted",
    503: "`store_unavailable` / `schema_out_of_date`",
    504: "`count_timeout`: no valid count within count_timeout_s",
}


# -- configuration, metrics, runtime ------------------------------------------------------------


@dataclass(frozen=True)
class ApiConfig:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    key_cache_s: float = 1.0
    threads: int = 40
    wait_poll_s: float = 0.1

    @classmethod
    def from_env(cls, env: Any = None) -> "ApiConfig":
        env = os.environ if env is None else env

        def num(name: str, default: float, cast: Any, low: float) -> Any:
            raw = env.get(name)
            if not raw:
                return default
            try:
                value = cast(raw)
            except ValueError:
                raise InvalidInput(name, f"must be a number, got {raw!r}") from None
            if not math.isfinite(value) or value < low:
                raise InvalidInput(name, f"must be >= {low}, got {raw!r}")
            return value

        return cls(
            max_body_bytes=num("TRACKER_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES, int, 1),
            key_cache_s=num("TRACKER_API_KEY_CACHE_S", 1.0, float, 0),
            threads=num("TRACKER_API_THREADS", 40, int, 1),
        )


class Metrics:
    """Prometheus metrics on a registry of this app's own (two apps in one process never clash).

    With ``PROMETHEUS_MULTIPROC_DIR`` set (``tracker serve --workers N`` sets it), values go
    to that directory and ``/metrics`` aggregates every worker process.
    """

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.decisions = Counter("tracker_decisions_total", "Decisions by action", ["action"], registry=r)
        self.count_failures = Counter("tracker_count_failures_total", "Count failures by kind", ["kind"], registry=r)
        self.attempts_started = Counter("tracker_attempts_started_total", "Compaction attempts opened", ["reason"], registry=r)
        self.attempt_outcomes = Counter(
            "tracker_attempt_outcomes_total", "Compaction attempts ended through the API, by outcome", ["outcome"], registry=r
        )
        self.errors = Counter("tracker_http_errors_total", "Error responses by code", ["code"], registry=r)
        self.requests = Counter("tracker_http_requests_total", "HTTP requests", ["method", "route", "status"], registry=r)
        self.latency = Histogram(
            "tracker_http_request_duration_seconds", "HTTP request latency", ["method", "route"], registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
        )

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if path:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=path)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class Runtime:
    """What the app holds: settings, the one Tracker (built on first need), fleets, Redis for /readyz."""

    def __init__(self, tracker: Any = None, settings: Any = None, config: ApiConfig | None = None) -> None:
        from tracker.settings import Settings

        if settings is None and tracker is None:
            settings = Settings.from_env()
        self.settings = settings
        self.config = config or ApiConfig.from_env()
        self._tracker = tracker
        self._owned = tracker is None
        self._fleets: Any = None
        self._redis: Any = None
        self._lock = threading.Lock()
        self.metrics = Metrics()

    def tracker(self) -> Any:
        t = self._tracker
        if t is None:
            with self._lock:
                if self._tracker is None:
                    from tracker.service import Tracker

                    self._tracker = Tracker.from_settings(self.settings)
                t = self._tracker
        return t

    def fleets(self) -> Any:
        f = self._fleets
        if f is None:
            engine = self.tracker().store.engine
            with self._lock:
                if self._fleets is None:
                    from tracker.fleets import FleetStore

                    self._fleets = FleetStore(engine, cache_s=self.config.key_cache_s)
                f = self._fleets
        return f

    def fleets_if_ready(self) -> Any:
        return self._fleets

    def redis_url(self) -> str | None:
        if self.settings is not None:
            return self.settings.redis_url
        coordinator = getattr(self._tracker, "coordinator", None)
        client = getattr(coordinator, "_redis", None)
        if client is not None:
            kw = client.connection_pool.connection_kwargs
            return f"redis://{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"
        return None

    def redis_ping(self) -> None:
        import redis

        url = self.redis_url()
        if self._redis is None:
            with self._lock:
                if self._redis is None:
                    self._redis = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._redis.ping()

    def close(self) -> None:
        if self._owned and self._tracker is not None:
            self._tracker.close()
            self._tracker = None
        if self._redis is not None:
            try:
                self._redis.close()
            except Exception:  # pragma: no cover
                pass


# -- ASGI middleware ----------------------------------------------------------------------------


def _error_json(exc: TrackerError, prefix: str | None = None) -> tuple[int, dict[str, Any]]:
    body = exc.to_dict()
    if prefix:
        body = _strip(body, prefix)
    return status_for(exc), json.loads(json.dumps(body, default=str, allow_nan=False))


def _strip(value: Any, prefix: str) -> Any:
    """Remove the caller's fleet prefix from session ids in error bodies."""
    if isinstance(value, str):
        return value.replace(prefix, "")
    if isinstance(value, dict):
        return {k: _strip(v, prefix) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strip(v, prefix) for v in value]
    return value


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes`` with 413 before anything parses them.

    A declared Content-Length over the limit is refused at once; a chunked body is
    counted as it arrives. The rest of an oversized body is read and dropped (up to
    ``drain_bytes``) so the client gets to read the 413 instead of a reset connection.
    """

    def __init__(self, app: Any, max_bytes: int, metrics_errors: Any = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bytes = max(16 * 1024 * 1024, 8 * max_bytes)
        self._errors = metrics_errors

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope.get("headers") or ():
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
        if declared is not None and declared > self.max_bytes:
            await self._refuse(receive, send, declared, 0)
            return
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                await self._refuse(receive, send, declared or total, total, more=message.get("more_body", False))
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        buffered = b"".join(chunks)
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": buffered, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, receive: Any, send: Any, size: int, read: int, more: bool = True) -> None:
        while more and read <= self.drain_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            read += len(message.get("body", b""))
            more = message.get("more_body", False)
        exc = PayloadTooLarge("body", f"the request body exceeds the limit of {self.max_bytes} bytes",
                              size=size, limit=self.max_bytes)
        status, body = _error_json(exc)
        if self._errors is not None:
            self._errors.labels(exc.code).inc()
        response = JSONResponse(body, status_code=status, headers={"Connection": "close"})
        await response({"type": "http"}, receive, send)


class AuthMiddleware:
    """Authenticate every ``/v1/`` request before its body is read or parsed.

    A missing, malformed, unknown or revoked key is answered 401 here (so no error
    about the body can come first, and no unauthenticated body is buffered); the
    caller's fleet goes to ``request.state.fleet_id`` for the endpoint.
    """

    def __init__(self, app: Any, runtime: "Runtime") -> None:
        self.app = app
        self.runtime = runtime

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith(API_PREFIX + "/"):
            await self.app(scope, receive, send)
            return
        import anyio.to_thread

        token = None
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                scheme, _, credentials = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and credentials.strip():
                    token = credentials.strip()
        error: TrackerError | None = None
        fleet_id = None
        if token is None:
            error = Unauthorized("an API key is required: Authorization: Bearer <token>")
        else:
            fleets = self.runtime.fleets_if_ready()
            fleet_id = fleets.cached(token) if fleets is not None else None  # no I/O: stay on the event loop
            if fleet_id is None:
                try:
                    fleet_id = await anyio.to_thread.run_sync(lambda: self.runtime.fleets().authenticate(token))
                except TrackerError as exc:  # the database is down / not migrated: 503
                    error = exc
            if fleet_id is None and error is None:
                error = Unauthorized("the API key is malformed, unknown or revoked")
        if error is not None:
            status, body = _error_json(error)
            self.runtime.metrics.errors.labels(error.code).inc()
            headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
            await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)
            return
        scope.setdefault("state", {})["fleet_id"] = fleet_id
        await self.app(scope, receive, send)


class MetricsMiddleware:
    """Request count and latency by method and route template (never the raw path)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]

        async def send_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "?")
            self.metrics.latency.labels(method, template).observe(time.perf_counter() - started)
            self.metrics.requests.labels(method, template, str(status[0])).inc()


# -- the app ------------------------------------------------------------------------------------

bearer = HTTPBearer(auto_error=False, description="a fleet API key (`tracker key create FLEET`)")


@dataclass(frozen=True)
class Caller:
    fleet_id: str

    @property
    def prefix(self) -> str:
        return self.fleet_id + ":"

    def internal(self, session_id: str) -> str:
        from tracker.core import check_session_id

        if len(session_id) > MAX_SESSION_ID:
            raise InvalidSessionId(f"must be at most {MAX_SESSION_ID} characters over HTTP, got {len(session_id)}")
        internal = check_session_id(f"{self.prefix}{session_id}")
        if "\n" in session_id:  # check_session_id's `$` also matches before a final newline
            raise InvalidSessionId("must be 1-189 characters of [A-Za-z0-9._:-]")
        return internal

    def external(self, session_id: str) -> str:
        return session_id[len(self.prefix):] if session_id.startswith(self.prefix) else session_id


async def authenticate(request: Request, creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> Caller:
    """The caller's fleet, as ``AuthMiddleware`` established it (``creds`` documents the scheme)."""
    fleet_id = getattr(request.state, "fleet_id", None)
    if fleet_id is None:  # pragma: no cover - AuthMiddleware answers 401 first
        raise Unauthorized("an API key is required: Authorization: Bearer <token>")
    return Caller(fleet_id)


SessionPath = Path(..., min_length=1, max_length=MAX_SESSION_ID, pattern=SESSION_ID_PATTERN,
                   description=f"1-{MAX_SESSION_ID} characters of [A-Za-z0-9._:-]")
AttemptPath = Path(..., min_length=1, max_length=200)


def _event_out(caller: Caller, e: Any) -> dict[str, Any]:
    return {"position": e.position, "session_id": caller.external(e.session_id), "version": e.version, "type": e.type,
            "recorded_at": e.recorded_at.isoformat(), "data": e.data, "idempotency_key": e.idempotency_key}


def _state_out(caller: Caller, state: Any) -> dict[str, Any]:
    data = state.to_data()
    data["session_id"] = caller.external(data["session_id"])
    return data


def create_app(tracker: Any = None, *, settings: Any = None, config: ApiConfig | None = None) -> FastAPI:
    """The ASGI app. Without ``tracker``, one is built from the environment on first need
    (so the process starts, and /readyz says why, while the database is down or unmigrated)."""
    runtime = Runtime(tracker, settings, config)
    cfg = runtime.config

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        import anyio.to_thread

        anyio.to_thread.current_default_thread_limiter().total_tokens = cfg.threads
        try:
            await anyio.to_thread.run_sync(runtime.fleets)  # connect + check the schema now, if we can
        except TrackerError as exc:
            log.error("not ready yet: %s (%s); /readyz will say when it is", exc.message, exc.code)
        try:
            yield
        finally:
            runtime.close()

    from tracker import __version__

    app = FastAPI(
        title="Context Tracker",
        version=__version__,
        description="Decide when LLM agents must compact their context; one record for the whole fleet. "
        "Errors are `{code, error, message, ...}` with a stable `code`; see the status table in tracker/api.py.",
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    metrics = runtime.metrics

    # -- errors --------------------------------------------------------------------------------
    def tracker_error(request: Request, exc: TrackerError) -> JSONResponse:
        fleet = getattr(request.state, "fleet_id", None)
        status, body = _error_json(exc, fleet + ":" if fleet else None)
        metrics.errors.labels(exc.code).inc()
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        if status >= 500:
            log.warning("%s %s -> %s %s: %s", request.method, request.url.path, status, exc.code, exc.message)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(TrackerError)
    async def _on_tracker_error(request: Request, exc: TrackerError) -> JSONResponse:
        return tracker_error(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for err in exc.errors():
            loc = [str(p) for p in err.get("loc", ())]
            where = loc[1:] if loc and loc[0] in ("body", "path", "query", "header", "cookie") else loc
            if err.get("type") == "json_invalid":
                where = []  # loc is ("body", <offset>): the body as a whole
            errors.append({"field": ".".join(where) or (loc[0] if loc else "body"), "problem": str(err.get("msg", "")),
                           "type": str(err.get("type", ""))})
        first = errors[0] if errors else {"field": "body", "problem": "invalid"}
        cls = InvalidSessionId if first["field"] == "session_id" else InvalidInput
        if cls is InvalidSessionId:
            error: TrackerError = InvalidSessionId(first["problem"], errors=errors)
        else:
            error = InvalidInput(first["field"], first["problem"], errors=errors)
        return tracker_error(request, error)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error: TrackerError = NotFound(f"no route {request.method} {request.url.path}")
        elif exc.status_code == 405:
            error = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}")
        elif exc.status_code == 400:  # e.g. a body that is not UTF-8
            error = InvalidInput("body", str(exc.detail))
        else:
            status, body = exc.status_code, {"code": f"http_{exc.status_code}", "error": "HTTPException",
                                            "message": str(exc.detail)}
            return JSONResponse(body, status_code=status, headers=getattr(exc, "headers", None))
        return tracker_error(request, error)

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        metrics.errors.labels("internal_error").inc()
        return JSONResponse({"code": "internal_error", "error": type(exc).__name__, "message": "internal error"},
                            status_code=500)

    # -- probes and metrics ----------------------------------------------------------------------
    @app.get("/healthz", response_model=HealthOut, tags=["operations"])
    async def healthz() -> dict[str, Any]:
        """The process is up (no dependencies checked)."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"], responses={
        200: {"description": "ready: every check is ok"},
        503: {"description": "not ready; `checks` says why", "content": {"application/json": {}}}})
    def readyz() -> JSONResponse:
        """The database is reachable and its schema current; Redis answers, if configured."""
        from tracker.store.migrate import check_schema, head_revision

        checks: dict[str, Any] = {}
        ready = True
        try:
            check_schema(runtime.tracker().store.engine)
            checks["database"] = {"status": "ok", "schema": head_revision()}
        except TrackerError as exc:
            ready = False
            checks["database"] = {"status": "error", **_error_json(exc)[1]}
        if runtime.redis_url():
            try:
                runtime.redis_ping()
                checks["redis"] = {"status": "ok"}
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready"
                ready = False
                checks["redis"] = {"status": "error", "code": "redis_unavailable", "message": f"{type(exc).__name__}: {exc}"[:300]}
        else:
            checks["redis"] = {"status": "not_configured"}
        return JSONResponse({"status": "ready" if ready else "not_ready", "checks": checks}, status_code=200 if ready else 503)

    @app.get("/metrics", tags=["operations"], response_class=Response,
             responses={200: {"description": "Prometheus text exposition format", "content": {"text/plain": {}}}})
    async def metrics_endpoint() -> Response:
        """Prometheus metrics (text exposition format)."""
        data, content_type = metrics.render()
        return Response(content=data, media_type=content_type)

    # -- sessions --------------------------------------------------------------------------------
    @app.post(f"{API_PREFIX}/sessions/{{session_id}}/observe", response_model=DecisionOut, tags=["sessions"],
              responses=_errors(409, 504))
    def observe(body: ObserveIn, caller: Caller = Depends(authenticate), session_id: str = SessionPath) -> dict[str, Any]:
        """Record a measurement (or count ``request`` for ``model`` over ``basis``) and decide:
        ``proceed``, ``compact`` (an attempt is opened for you), ``wait``; ``context_limit`` is a 409."""
        sid = caller.internal(session_id)
        t = runtime.tracker()
        common = dict(compaction_threshold=body.compaction_threshold, scope=body.scope,
                      scope_confidence=body.scope_confidence, overhead_tokens=body.overhead_tokens,
                      idempotency_key=body.idempotency_key)
        try:
            if body.measurement is not None and body.request is None:
                if body.model is not None or body.basis is not None:
                    raise InvalidInput("measurement", "model and basis belong inside the measurement when one is given")
                result = t.observe(sid, measurement=body.measurement.model_dump(exclude_none=True), **common)
            else:
                if body.measurement is not None:
                    raise InvalidInput("request", "give exactly one of request or measurement")
                result = t.observe(sid, request=body.request, model=body.model, basis=body.basis, **common)
        except ContextLimitError:
            metrics.decisions.labels("context_limit").inc()
            raise
        except CountError as exc:
            metrics.count_failures.labels(exc.kind).inc()
            raise
        metrics.decisions.labels(result.action).inc()
        if result.action == "compact":
            metrics.attempts_started.labels("automatic").inc()
        data = result.to_data()
        data["session_id"] = session_id
        return data

    @app.post(f"{API_PREFIX}/sessions/{{session_id}}/compactions", response_model=AttemptOut, status_code=201,
              tags=["compactions"], responses=_errors(409))
    def request_compaction(body: ManualIn | None = None, caller: Caller = Depends(authenticate),
                           session_id: str = SessionPath) -> dict[str, Any]:
        """Open a manual compaction attempt (regardless of pressure; at most one manual attempt open)."""
        sid = caller.internal(session_id)
        body = body or ManualIn()
        attempt = runtime.tracker().request_compaction(sid, basis=body.basis, overhead_tokens=body.overhead_tokens,
                                                       idempotency_key=body.idempotency_key)
        metrics.attempts_started.labels("manual").inc()
        return attempt.to_data()

    @app.post(f"{API_PREFIX}/sessions/{{session_id}}/compactions/{{attempt_id}}/commit", response_model=SessionStateOut,
              tags=["compactions"], responses=_errors(404, 409))
    def commit(body: CommitIn, caller: Caller = Depends(authenticate), session_id: str = SessionPath,
               attempt_id: str = AttemptPath) -> dict[str, Any]:
        """Commit an open attempt you hold (``tokens_after`` = the counted size of the compacted context).
        ``tokens_after >= input_limit`` is recorded as a rejection and answered 409 ``summary_too_large``."""
        sid = caller.internal(session_id)
        try:
            state = runtime.tracker().commit(sid, attempt_id, body.fencing_token, body.tokens_after,
                                             idempotency_key=body.idempotency_key)
        except SummaryTooLarge:
            metrics.attempt_outcomes.labels("summary_too_large").inc()
            raise
        metrics.attempt_outcomes.labels("committed").inc()
        return _state_out(caller, state)

    @app.post(f"{API_PREFIX}/sessions/{{session_id}}/compactions/{{attempt_id}}/reject", response_model=SessionStateOut,
              tags=["compactions"], responses=_errors(404, 409))
    def reject(body: RejectIn, caller: Caller = Depends(authenticate), session_id: str = SessionPath,
               attempt_id: str = AttemptPath) -> dict[str, Any]:
        """Reject an open attempt you hold (the compaction failed); its basis is exhausted."""
        sid = caller.internal(session_id)
        state = runtime.tracker().reject(sid, attempt_id, body.fencing_token, body.reject_reason,
                                         idempotency_key=body.idempotency_key)
        metrics.attempt_outcomes.labels("rejected").inc()
        return _state_out(caller, state)

    @app.get(f"{API_PREFIX}/sessions/{{session_id}}/compactions/{{attempt_id}}/wait", response_model=WaitOut,
             tags=["compactions"], responses=_errors(404, 408))
    def wait(caller: Caller = Depends(authenticate), session_id: str = SessionPath, attempt_id: str = AttemptPath,
             timeout: float = Query(10.0, ge=0, le=WAIT_MAX_S, allow_inf_nan=False,
                                    description=f"seconds to wait, at most {WAIT_MAX_S:g}")) -> dict[str, Any]:
        """Long-poll until the attempt ends (an attempt past its lease is recorded as ``lease_expired``).
        Still open after ``timeout`` seconds: 408 ``wait_timeout`` -- poll again."""
        sid = caller.internal(session_id)
        outcome = runtime.tracker().wait(sid, attempt_id, timeout=timeout, poll_s=cfg.wait_poll_s)
        status, _, reason = outcome.partition(":")
        return {"attempt_id": attempt_id, "outcome": outcome, "status": status, "reject_reason": reason or None}

    @app.get(f"{API_PREFIX}/sessions/{{session_id}}", response_model=SessionStateOut, tags=["sessions"],
             responses=_errors(404))
    def session_state(caller: Caller = Depends(authenticate), session_id: str = SessionPath) -> dict[str, Any]:
        """The session's state: the fold of its log (pressure, revision, open attempts, last measurement)."""
        sid = caller.internal(session_id)
        state = runtime.tracker().state(sid)
        if state.version == 0:
            raise UnknownSession(f"no session {session_id}", session_id=session_id)
        return _state_out(caller, state)

    @app.get(f"{API_PREFIX}/sessions/{{session_id}}/history", response_model=HistoryOut, tags=["sessions"],
             responses=_errors(404))
    def session_history(caller: Caller = Depends(authenticate), session_id: str = SessionPath,
                        from_version: int = Query(1, ge=1, le=MAX_VERSION),
                        limit: int = Query(100, ge=1, le=1000)) -> dict[str, Any]:
        """The session's events from ``from_version``, at most ``limit``; page with ``next_from_version``."""
        sid = caller.internal(session_id)
        store = runtime.tracker().store
        events = list(store.read_stream(sid, from_version, from_version + limit))  # one extra: has_more
        if not events and store.stream_version(sid) == 0:
            raise UnknownSession(f"no session {session_id}", session_id=session_id)
        page = events[:limit]
        return {"session_id": session_id, "events": [_event_out(caller, e) for e in page],
                "next_from_version": page[-1].version + 1 if page else from_version, "has_more": len(events) > limit}

    @app.get(f"{API_PREFIX}/events", response_model=FeedOut, tags=["events"], responses=_errors())
    def events_feed(caller: Caller = Depends(authenticate), after: int = Query(0, ge=0, le=MAX_POSITION),
                    limit: int = Query(100, ge=1, le=1000)) -> dict[str, Any]:
        """This fleet's events in global commit order, after position ``after``. Resume with ``next_after``:
        a reader paging this way never misses an event that commits later with a lower position."""
        store = runtime.tracker().store
        events = store.read_all(after, limit + 1, session_prefix=caller.prefix)
        page = events[:limit]
        return {"events": [_event_out(caller, e) for e in page],
                "next_after": page[-1].position if page else after, "has_more": len(events) > limit}

    # the last added is the outermost: metrics (every request) > auth (before any body is read) > body limit
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_body_bytes, metrics_errors=metrics.errors)
    app.add_middleware(AuthMiddleware, runtime=runtime)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


def serve(host: str = "127.0.0.1", port: int = 8080, workers: int = 1, log_level: str = "info",
          access_log: bool = True) -> None:
    """Run the API on uvicorn; with ``workers > 1``, that many processes (metrics aggregated)."""
    import tempfile

    import uvicorn

    if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        import atexit
        import shutil

        path = tempfile.mkdtemp(prefix="tracker-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path  # inherited by the worker processes
        atexit.register(shutil.rmtree, path, True)
    uvicorn.run("tracker.api:create_app", factory=True, host=host, port=port, workers=workers,
                log_level=log_level, access_log=access_log, timeout_graceful_shutdown=5)
