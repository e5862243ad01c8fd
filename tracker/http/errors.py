"""Errors over HTTP: the one status table, the error body and the exception handlers.

Every error is JSON ``{"code", "error", "message", ...details}`` (``field`` names the bad
input where there is one) with a stable ``code``. :data:`ERROR_STATUS` is the one table
from error class to HTTP status; it is looked up along the exception's MRO, so the most
specific class listed wins, and anything else is 500 (``internal_error`` when it is not a
``TrackerError``). The OpenAPI document's error descriptions are generated from it, and so
is the table in docs/http-api.md: ``python -m tracker.http.errors`` prints it.

Refusals that are decisions are on the record before the caller hears about them
(:data:`RECORDED_REFUSALS`); every other 4xx writes nothing.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tracker import telemetry
from tracker.core.model import SessionScope
from tracker.errors import (
    COUNT_ERRORS,
    ArchivedSession,
    AttemptError,
    BodyTimeout,
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
    TooManyWaits,
    TrackerError,
    Unauthorized,
    UnknownAttempt,
    UnknownSession,
    WaitTimeout,
)
from tracker.http.schemas import ErrorBody

log = logging.getLogger("tracker.http")

#: THE mapping from error class to HTTP status. The most specific class listed wins.
ERROR_STATUS: dict[type[TrackerError], int] = {
    PayloadTooLarge: 413,  # a body over TRACKER_MAX_BODY_BYTES, refused before parsing
    InvalidInput: 422,  # FastAPI's own validation errors are reshaped into it (invalid_session_id for the path id)
    ContextLimitError: 409,  # recorded (ContextLimitReached) before the answer
    StaleBasis: 409,  # recorded (MeasurementRefused)
    CountTimeout: 504,  # recorded (CountFailed)
    CountError: 422,  # recorded (CountFailed); a malformed *given* measurement is refused before anything is written
    UnknownAttempt: 404,
    AttemptError: 409,  # summary_too_large is recorded as a rejection
    # 408, not 504: nothing upstream failed. The wait the caller asked for ran out while the attempt
    # was still open -- a normal outcome of a long poll -- and a 5xx would page whoever watches errors.
    WaitTimeout: 408,
    StoreUnavailable: 503,  # nothing was written
    SchemaOutOfDate: 503,  # run `tracker db upgrade`
    ConcurrencyConflict: 409,  # retry (with the same idempotency key)
    UnknownSession: 404,  # also a session of another fleet
    ArchivedSession: 409,  # moved to an archive: `tracker restore` it first
    StoreError: 500,
    Unauthorized: 401,  # missing, malformed, unknown or revoked key; checked before the body is read
    NotFound: 404,  # no such route
    MethodNotAllowed: 405,
    TooManyWaits: 429,  # the fleet's cap on concurrent long-polls (TRACKER_MAX_WAITS_PER_FLEET); with Retry-After
    BodyTimeout: 408,  # the body did not arrive within TRACKER_BODY_TIMEOUT_S; the connection is closed
    TrackerError: 500,
}

#: Refusals that are decisions: recorded in the session's log before the answer (behaviour.md "Decisions", "Counting").
_RECORDED: tuple[type[TrackerError], ...] = (
    ContextLimitError,
    StaleBasis,
    SummaryTooLarge,
    CountError,
    *COUNT_ERRORS.values(),
)
RECORDED_REFUSALS: frozenset[str] = frozenset(cls.code for cls in _RECORDED)


def status_of(cls: type[BaseException]) -> int:
    for base in cls.__mro__:
        if base in ERROR_STATUS:
            return ERROR_STATUS[base]
    return 500


def status_for(exc: BaseException) -> int:
    return status_of(type(exc))


# -- the table, generated -----------------------------------------------------------------------


def _error_classes(cls: type[TrackerError] = TrackerError) -> Iterator[type[TrackerError]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _error_classes(sub)


def codes_by_status() -> dict[int, list[str]]:
    """Every error ``code`` under the status it is answered with (from ``ERROR_STATUS``)."""
    table: dict[int, list[str]] = {}
    for cls in _error_classes():
        codes = table.setdefault(status_of(cls), [])
        if cls.code not in codes:
            codes.append(cls.code)
    return dict(sorted(table.items()))


def describe(status: int) -> str:
    """The OpenAPI description of an error status: its phrase and the codes it carries."""
    codes = codes_by_status().get(status, [])
    return f"{HTTPStatus(status).phrase}: " + ", ".join(f"`{c}`" for c in codes)


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The documented error responses of a /v1 route (401, 413, 422 and 503 can happen on every one)."""
    return {s: {"model": ErrorBody, "description": describe(s)} for s in (401, 413, 422, 503, *statuses)}


def markdown_table() -> str:
    rows = ["| status | `code` |", "|---|---|"]
    for status, codes in codes_by_status().items():
        rows.append(f"| {status} | {', '.join(f'`{c}`' for c in codes)} |")
    return "\n".join(rows)


# -- the error body -----------------------------------------------------------------------------


#: What a 5xx body says instead of the error's own message (which may name hosts, ports and the driver's text).
GENERIC_MESSAGES: dict[str, str] = {
    "store_unavailable": "the database is unavailable; nothing was written",
    "schema_out_of_date": "the database schema is not current; run `tracker db upgrade`",
    "count_timeout": "no valid count within the count timeout",
}


def error_body(exc: TrackerError, scope: SessionScope | None = None) -> tuple[int, dict[str, Any]]:
    """``(status, body)`` of an error, its ``session_id`` (an error about a session carries it as a
    field, never in its message) shown as ``scope``'s caller knows it (``SessionScope.external``).

    A 5xx body is the code and a generic message only (the detail is logged, never sent): a
    database or driver message names hosts, ports and internals a client has no business seeing.
    """
    status = status_for(exc)
    if status >= 500:
        message = GENERIC_MESSAGES.get(exc.code, "the service cannot answer right now")
        return status, {"code": exc.code, "error": type(exc).__name__, "message": message}
    body = exc.to_dict()
    session_id = body.get("session_id")
    if scope is not None and isinstance(session_id, str):
        body["session_id"] = scope.external(session_id)
    return status, json.loads(json.dumps(body, default=str, allow_nan=False))


def error_response(
    exc: TrackerError,
    *,
    scope: SessionScope | None = None,
    metrics: Any = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The JSON response for ``exc`` (counted in ``metrics.errors``; 401 says ``WWW-Authenticate: Bearer``)."""
    status, body = error_body(exc, scope)
    if metrics is not None:
        metrics.errors.labels(exc.code).inc()
    telemetry.annotate(telemetry.ERROR_CODE, exc.code)
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    retry_after = exc.details.get("retry_after_s")
    if isinstance(retry_after, (int, float)):
        headers = {**(headers or {}), "Retry-After": str(max(1, math.ceil(retry_after)))}
    if status >= 500:
        log.warning("answered %s %s: %s %s", status, exc.code, exc.message, exc.details or "")
    return JSONResponse(body, status_code=status, headers=headers)


# -- exception handlers -------------------------------------------------------------------------


def _answer(request: Request, exc: TrackerError) -> JSONResponse:
    fleet = getattr(request.state, "fleet_id", None)
    scope = SessionScope(fleet) if fleet else None
    return error_response(exc, scope=scope, metrics=request.app.state.runtime.metrics)


async def on_tracker_error(request: Request, exc: TrackerError) -> JSONResponse:
    return _answer(request, exc)


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's own validation errors, reshaped: ``invalid_session_id`` for the path id, else ``invalid_input``."""
    errors = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ())]
        where = loc[1:] if loc and loc[0] in ("body", "path", "query", "header", "cookie") else loc
        if err.get("type") == "json_invalid":
            where = []  # loc is ("body", <offset>): the body as a whole
        errors.append(
            {
                "field": ".".join(where) or (loc[0] if loc else "body"),
                "problem": str(err.get("msg", "")),
                "type": str(err.get("type", "")),
            }
        )
    first = errors[0] if errors else {"field": "body", "problem": "invalid"}
    error: TrackerError
    if first["field"] == "session_id":
        error = InvalidSessionId(first["problem"], errors=errors)
    else:
        error = InvalidInput(first["field"], first["problem"], errors=errors)
    return _answer(request, error)


async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's routing errors as typed errors: no such route, method not allowed, undecodable body."""
    error: TrackerError
    if exc.status_code == 404:
        error = NotFound(f"no route {request.method} {request.url.path}")
    elif exc.status_code == 405:
        error = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}")
    elif exc.status_code == 400:  # e.g. a body that is not UTF-8
        error = InvalidInput("body", str(exc.detail))
    else:
        body = {"code": f"http_{exc.status_code}", "error": "HTTPException", "message": str(exc.detail)}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))
    return _answer(request, error)


async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    request.app.state.runtime.metrics.errors.labels("internal_error").inc()
    return JSONResponse(
        {"code": "internal_error", "error": type(exc).__name__, "message": "internal error"}, status_code=500
    )


EXCEPTION_HANDLERS: dict[Any, Any] = {
    TrackerError: on_tracker_error,
    RequestValidationError: on_validation_error,
    StarletteHTTPException: on_http_error,
    Exception: on_unexpected,
}


if __name__ == "__main__":  # pragma: no cover - prints docs/http-api.md's table
    print(markdown_table())
