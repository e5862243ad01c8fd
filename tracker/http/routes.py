"""The endpoints, as routers: probes, sessions, compactions, events.

Commands are built from the request body once (``ObserveIn.to_command``, ...) and run by the
Tracker for the caller's scope (``Tracker.run``: its hooks count what they decided), each in one
trip to the thread pool, and answer their JSON already serialized;
reads go through the read side (:mod:`tracker.queries`), on the read replica when one is set
(``TRACKER_READ_DATABASE_URL``): the listing, history and feed; the session's state is read
from the primary. Every ``/v1`` route takes the
caller's fleet (:func:`caller_of`, set by ``ApiMiddleware``) and maps session ids in and
out of it.

    POST /v1/sessions/{session_id}/observe                          record a measurement, or count a request -> decision
    POST /v1/sessions/{session_id}/usage                            report what the provider billed for a measured basis
    POST /v1/sessions/{session_id}/rejection                        report the provider refused a measured basis as too long
    POST /v1/sessions/{session_id}/compactions                      open a manual compaction attempt (201)
    POST /v1/sessions/{session_id}/compactions/{attempt_id}/commit  commit it (tokens_after)
    POST /v1/sessions/{session_id}/compactions/{attempt_id}/reject  reject it (reject_reason)
    GET  /v1/sessions/{session_id}/compactions/{attempt_id}/wait    long-poll until it ends (?timeout=, at most 30 s)
    GET  /v1/sessions                                               the fleet's sessions, most recently active first (?pressure=&since=&limit=&cursor=)
    GET  /v1/sessions/{session_id}                                  the session's state (the fold of its log)
    GET  /v1/sessions/{session_id}/history                          its events (?from_version=&limit=)
    GET  /v1/events                                                 the fleet's events in global commit order (?after=&limit=)
    GET  /v1/policy                                                 the policy the fleet's new sessions start with
    GET  /v1/calibration                                            what the fleet's provider reports taught, per model
    GET  /healthz                                                   the process is up
    GET  /readyz                                                    database reachable + schema current (+ Redis, + the read replica's lag, if configured)
    GET  /metrics                                                   Prometheus metrics
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from tracker import queries
from tracker.core.commands import Calibration, Command
from tracker.errors import Unauthorized, UnknownSession
from tracker.http.errors import responses
from tracker.http.middleware import HotRoute
from tracker.http.runtime import Caller, Runtime
from tracker.http.schemas import (
    API_PREFIX,
    MAX_POSITION,
    MAX_SESSION_ID,
    MAX_VERSION,
    SESSION_ID_PATTERN,
    WAIT_MAX_S,
    AttemptOut,
    CalibrationOut,
    CommitIn,
    DecisionOut,
    FeedOut,
    HealthOut,
    HistoryOut,
    ManualIn,
    ObserveIn,
    PolicyOut,
    RejectIn,
    RejectionIn,
    RejectionReportOut,
    SessionsOut,
    SessionStateOut,
    UsageIn,
    UsageReportOut,
    WaitOut,
)

T = TypeVar("T")

# -- dependencies -------------------------------------------------------------------------------


def runtime_of(request: Request) -> Runtime:
    return request.app.state.runtime


def caller_of(request: Request) -> Caller:
    """The caller's fleet, as ``ApiMiddleware`` established it before the route was reached.

    Plain functions, not FastAPI dependencies: resolving dependencies costs more per request
    than these two lookups (the API key scheme is documented by ``ApiMiddleware.document``)."""
    fleet_id = getattr(request.state, "fleet_id", None)
    if fleet_id is None:  # pragma: no cover - ApiMiddleware answers 401 first
        raise Unauthorized("an API key is required: Authorization: Bearer <token>")
    return _caller(runtime_of(request), fleet_id)


def _caller(runtime: Runtime, fleet_id: str) -> Caller:
    """The fleet's scope; its new sessions start with its policy (looked up only by a command that may start one)."""
    return Caller(fleet_id, runtime.fleet_policy)


SessionPath = Path(
    ...,
    min_length=1,
    max_length=MAX_SESSION_ID,
    pattern=SESSION_ID_PATTERN,
    description=f"1-{MAX_SESSION_ID} characters of [A-Za-z0-9._:-]",
)
AttemptPath = Path(..., min_length=1, max_length=200)


async def _run(runtime: Runtime, command: Command[T], caller: Caller) -> T:
    """``command`` run by the Tracker for ``caller``, in one trip to the thread pool. The Tracker is
    resolved there too: on first need it is built, which connects to the database."""
    return await run_in_threadpool(lambda: runtime.tracker().run(command, caller))


def _json(data: dict[str, Any], status_code: int = 200) -> Response:
    """An answer already in its wire form: FastAPI neither validates nor serializes it again
    (the route's ``response_model`` still documents it)."""
    body = json.dumps(data, allow_nan=False, separators=(",", ":"))
    return Response(body, status_code, media_type="application/json")


def _state_out(caller: Caller, state: Any) -> dict[str, Any]:
    data = state.to_data()
    data["session_id"] = caller.external(data["session_id"])
    return data


# -- probes and metrics -------------------------------------------------------------------------

probes = APIRouter(tags=["operations"])


@probes.get("/healthz", response_model=HealthOut)
async def healthz() -> dict[str, Any]:
    """The process is up (no dependencies checked)."""
    return {"status": "ok"}


@probes.get(
    "/readyz",
    responses={
        200: {"description": "ready: every check is ok"},
        503: {"description": "not ready; `checks` says why", "content": {"application/json": {}}},
    },
)
def readyz(request: Request) -> JSONResponse:
    """The database is reachable and its schema current; Redis answers, if configured."""
    ready, checks = runtime_of(request).readiness()
    return JSONResponse(
        {"status": "ready" if ready else "not_ready", "checks": checks}, status_code=200 if ready else 503
    )


@probes.get(
    "/metrics",
    response_class=Response,
    responses={200: {"description": "Prometheus text exposition format", "content": {"text/plain": {}}}},
)
async def metrics_endpoint(request: Request) -> Response:
    """Prometheus metrics (text exposition format)."""
    data, content_type = runtime_of(request).metrics.render()
    return Response(content=data, media_type=content_type)


# -- sessions -----------------------------------------------------------------------------------

sessions = APIRouter(prefix=f"{API_PREFIX}/sessions", tags=["sessions"])


@sessions.post("/{session_id}/observe", response_model=DecisionOut, responses=responses(409, 504))
async def observe(body: ObserveIn, request: Request, session_id: str = SessionPath) -> Response:
    """Record a measurement (or count ``request`` for ``model`` over ``basis``) and decide:
    ``proceed``, ``compact`` (an attempt is opened for you), ``wait``; ``context_limit`` is a 409."""
    return await _observe(runtime_of(request), caller_of(request), session_id, body)


async def _observe(runtime: Runtime, caller: Caller, session_id: str, body: ObserveIn) -> Response:
    """The observe endpoint's work, once its input is valid (the route's and the hot route's)."""
    result = await _run(runtime, body.to_command(session_id), caller)
    data = result.to_data()
    data["session_id"] = session_id
    return _json(data)


@sessions.post("/{session_id}/usage", response_model=UsageReportOut, responses=responses())
async def report_usage(body: UsageIn, request: Request, session_id: str = SessionPath) -> Response:
    """Record what the provider billed for the request of a measured ``basis`` (its response's usage):
    a calibration sample for the measured model in this fleet. The basis must be one of the session's
    last 8 measured, the model the measured one, every count plausible; else 422 naming the field."""
    return await _report(request, session_id, body)


@sessions.post("/{session_id}/rejection", response_model=RejectionReportOut, responses=responses())
async def report_rejection(body: RejectionIn, request: Request, session_id: str = SessionPath) -> Response:
    """Record that the provider refused the request of a measured ``basis`` as too long. Its count and
    limit are read from ``message`` unless given; from then on that basis decides at the hard limit
    (``compact``, ``wait`` or ``context_limit``), and a lower limit is learned for the model."""
    return await _report(request, session_id, body)


async def _report(request: Request, session_id: str, body: UsageIn | RejectionIn) -> Response:
    """A provider report for the caller's session, answered with ``Report.to_data()``."""
    report = await _run(runtime_of(request), body.to_command(session_id), caller_of(request))
    data = report.to_data()
    data["session_id"] = session_id
    return _json(data)


# -- the hot route: observe without the framework's routing, dependencies and second parse ----------

_SESSION_ID = re.compile(SESSION_ID_PATTERN)


def _json_body(headers: Any, raw: bytes) -> Any:
    """The body as the framework would decode it, when it is plainly JSON (``Content-Type:
    application/json``, non-empty, valid); ``_NOT_PLAIN`` otherwise (the framework decides)."""
    content_type = None
    for name, value in headers or ():
        if name == b"content-type":
            content_type = value
            break
    if not raw or content_type is None:
        return _NOT_PLAIN
    media = content_type.split(b";", 1)[0].strip().lower()
    if media != b"application/json":
        return _NOT_PLAIN
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # not JSON (or nested too deep to decode): the framework's answer
        return _NOT_PLAIN


_NOT_PLAIN = object()


async def observe_hot(
    runtime: Runtime, fleet_id: str, params: dict[str, str], headers: Any, raw: bytes
) -> Response | None:
    """``POST /v1/sessions/{session_id}/observe`` for a request whose id and body are valid: the
    route's own work (:func:`_observe`) on the body validated once by ``ObserveIn``. Anything
    else (a bad id, a body that is not plainly JSON or does not validate) is None: the framework
    answers it with its own errors, so the contract is the route's whatever the path taken."""
    session_id = params["session_id"]
    if _SESSION_ID.fullmatch(session_id) is None:
        return None
    data = _json_body(headers, raw)
    if data is _NOT_PLAIN:
        return None
    try:
        body = ObserveIn.model_validate(data)
    except (ValidationError, RecursionError):
        return None
    return await _observe(runtime, _caller(runtime, fleet_id), session_id, body)


@sessions.get("", response_model=SessionsOut, responses=responses())
def list_sessions(
    request: Request,
    pressure: Literal["normal", "compact", "hard_limit"] | None = Query(None),
    since: datetime | None = Query(None, description="only sessions active at or after this time (ISO 8601)"),
    limit: int = Query(100, ge=1, le=1000),
    cursor: str | None = Query(None, min_length=1, max_length=1000, description="`next_cursor` of the previous page"),
) -> dict[str, Any]:
    """This fleet's sessions, most recently active first: pressure, occupancy, revision, open attempts,
    last activity. Page with ``next_cursor`` (keyset: pages never overlap)."""
    runtime, caller = runtime_of(request), caller_of(request)
    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=UTC)
    page = queries.sessions_page(
        runtime.views(),
        pressure=pressure,
        since=since,
        limit=limit,
        cursor=cursor,
        scope=caller,
    )
    return {"sessions": page.sessions, "next_cursor": page.next_cursor}


@sessions.get("/{session_id}", response_model=SessionStateOut, responses=responses(404))
def session_state(request: Request, session_id: str = SessionPath) -> dict[str, Any]:
    """The session's state: the fold of its log (pressure, revision, open attempts, last measurement)."""
    runtime, caller = runtime_of(request), caller_of(request)
    # the primary, never the read replica: agents build their next basis on this state (read their writes)
    state = queries.session_state(runtime.tracker().store, session_id, scope=caller)
    if state.version == 0:  # (the field is the stored id: the error body shows it as the caller knows it)
        raise UnknownSession(f"no session {session_id}", session_id=caller.internal(session_id))
    return _state_out(caller, state)


@sessions.get("/{session_id}/history", response_model=HistoryOut, responses=responses(404))
def session_history(
    request: Request,
    session_id: str = SessionPath,
    from_version: int = Query(1, ge=1, le=MAX_VERSION),
    limit: int = Query(100, ge=1, le=1000),
) -> dict[str, Any]:
    """The session's events from ``from_version``, at most ``limit``; page with ``next_from_version``."""
    runtime, caller = runtime_of(request), caller_of(request)
    page = queries.history_page(runtime.store(), session_id, from_version, limit, scope=caller)
    return {
        "session_id": session_id,
        "events": page.events,
        "next_from_version": page.resume,
        "has_more": page.has_more,
    }


# -- compactions --------------------------------------------------------------------------------

compactions = APIRouter(prefix=f"{API_PREFIX}/sessions/{{session_id}}/compactions", tags=["compactions"])


@compactions.post("", response_model=AttemptOut, status_code=201, responses=responses(409))
async def request_compaction(request: Request, body: ManualIn | None = None, session_id: str = SessionPath) -> Response:
    """Open a manual compaction attempt (regardless of pressure; at most one manual attempt open)."""
    command = (body or ManualIn()).to_command(session_id)
    attempt = await _run(runtime_of(request), command, caller_of(request))
    return _json(attempt.to_data(), 201)


@compactions.post("/{attempt_id}/commit", response_model=SessionStateOut, responses=responses(404, 409))
async def commit(
    body: CommitIn, request: Request, session_id: str = SessionPath, attempt_id: str = AttemptPath
) -> Response:
    """Commit an open attempt you hold (``tokens_after`` = the counted size of the compacted context).
    ``tokens_after >= input_limit`` is recorded as a rejection and answered 409 ``summary_too_large``."""
    return await _settle_attempt(request, body.to_command(session_id, attempt_id))


@compactions.post("/{attempt_id}/reject", response_model=SessionStateOut, responses=responses(404, 409))
async def reject(
    body: RejectIn, request: Request, session_id: str = SessionPath, attempt_id: str = AttemptPath
) -> Response:
    """Reject an open attempt you hold (the compaction failed); its basis is exhausted."""
    return await _settle_attempt(request, body.to_command(session_id, attempt_id))


async def _settle_attempt(request: Request, command: Command[Any]) -> Response:
    """Commit or reject for the caller, answered with the session's state."""
    caller = caller_of(request)
    state = await _run(runtime_of(request), command, caller)
    return _json(_state_out(caller, state))


@compactions.get("/{attempt_id}/wait", response_model=WaitOut, responses=responses(404, 408, 429))
async def wait(
    request: Request,
    session_id: str = SessionPath,
    attempt_id: str = AttemptPath,
    timeout: float = Query(
        10.0, ge=0, le=WAIT_MAX_S, allow_inf_nan=False, description=f"seconds to wait, at most {WAIT_MAX_S:g}"
    ),
) -> dict[str, Any]:
    """Long-poll until the attempt ends (an attempt past its lease is recorded as ``lease_expired``).
    Still open after ``timeout`` seconds: 408 ``wait_timeout`` -- poll again. A wait holds no request
    thread; a fleet may hold ``TRACKER_MAX_WAITS_PER_FLEET`` at once (beyond: 429 with ``Retry-After``)."""
    runtime, caller = runtime_of(request), caller_of(request)
    outcome = await runtime.waits.wait(caller.fleet_id, caller.internal(session_id), attempt_id, timeout)
    status, _, reason = outcome.partition(":")
    return {"attempt_id": attempt_id, "outcome": outcome, "status": status, "reject_reason": reason or None}


# -- the fleet's feed ---------------------------------------------------------------------------

events = APIRouter(prefix=API_PREFIX, tags=["events"])


@events.get("/events", response_model=FeedOut, responses=responses())
def events_feed(
    request: Request,
    after: int = Query(0, ge=0, le=MAX_POSITION),
    limit: int = Query(100, ge=1, le=1000),
) -> dict[str, Any]:
    """This fleet's events in global commit order, after position ``after``. Resume with ``next_after``:
    a reader paging this way never misses an event that commits later with a lower position."""
    runtime, caller = runtime_of(request), caller_of(request)
    page = queries.feed_page(runtime.store(), after, limit, scope=caller)
    return {"events": page.events, "next_after": page.resume, "has_more": page.has_more}


# -- the fleet's policy -------------------------------------------------------------------------

policies = APIRouter(prefix=API_PREFIX, tags=["policy"])


@policies.get("/policy", response_model=PolicyOut, responses=responses())
def fleet_policy(request: Request) -> dict[str, Any]:
    """The policy this fleet's new sessions start with: its own (``tracker fleet policy``), else the
    server's. A session keeps the policy it started with; a change reaches new sessions within
    ``TRACKER_API_KEY_CACHE_S``."""
    runtime, caller = runtime_of(request), caller_of(request)
    current = runtime.fleets().current_policy(caller.fleet_id)
    own = current["policy"]
    return {
        "source": "server" if own is None else "fleet",
        "version": current["version"],
        "changed_at": current["at"],
        "policy": runtime.tracker().policy.to_data() if own is None else own,
    }


# -- the fleet's calibration --------------------------------------------------------------------

calibration = APIRouter(prefix=API_PREFIX, tags=["calibration"])


@calibration.get("/calibration", response_model=CalibrationOut, responses=responses())
async def fleet_calibration(request: Request) -> Response:
    """What this fleet's usage reports and rejections taught, per model and counter kind: samples,
    median and p90 of billed / counted, the factor decisions use, drift of exact counters, the learned
    limit. Only this fleet's reports: another fleet's never show here nor move its decisions."""
    runtime, caller = runtime_of(request), caller_of(request)
    rows = await _run(runtime, Calibration(), caller)
    models = []
    for row in rows:
        data = row.to_data()
        del data["fleet"]  # the caller's own, by construction
        models.append(data)
    return _json({"models": models})


ROUTERS = (probes, sessions, compactions, events, policies, calibration)


def hot_routes() -> tuple[HotRoute, ...]:
    """The routes the middleware answers itself when it can (each with the router's own route
    object: its template labels the metrics, its pattern matches the path)."""
    hot = {observe: observe_hot}
    return tuple(
        HotRoute(method, route, hot[route.endpoint])
        for route in sessions.routes
        if isinstance(route, APIRoute) and route.endpoint in hot
        for method in sorted(route.methods or ())
    )
