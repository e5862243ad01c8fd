"""ASGI middleware: the body limit, authentication, and request metrics.

Order in the app, outermost first: metrics (every request is counted) > auth (before
any body is read) > body limit (before anything parses the body).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio

from tracker import telemetry
from tracker.errors import BodyTimeout, PayloadTooLarge, TrackerError, Unauthorized
from tracker.http.errors import error_response
from tracker.http.schemas import API_PREFIX

if TYPE_CHECKING:  # pragma: no cover
    from tracker.http.runtime import Metrics, Runtime

#: the request methods metrics and spans name; any other method string is ``other`` (labels come from a closed set)
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def method_label(scope: Any) -> str:
    method = scope.get("method")
    return method if method in KNOWN_METHODS else "other"


def route_label(scope: Any) -> str:
    """The matched route's template (a closed set: the app's routes), else ``unmatched``."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else "unmatched"


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes`` with 413 before anything parses them.

    A declared Content-Length over the limit is refused at once; a chunked body is
    counted as it arrives. The rest of an oversized body is read and dropped (up to
    ``drain_bytes``) so the client gets to read the 413 instead of a reset connection.
    """

    def __init__(
        self, app: Any, max_bytes: int, metrics: Metrics | None = None, timeout_s: float | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s  # the whole body must arrive within this (None: no bound)
        self.drain_bytes = max(16 * 1024 * 1024, 8 * max_bytes)
        self.metrics = metrics

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
        deadline = None if self.timeout_s is None else anyio.current_time() + self.timeout_s
        while True:
            try:
                with anyio.fail_after(None if deadline is None else max(0.0, deadline - anyio.current_time())):
                    message = await receive()
            except TimeoutError:
                exc = BodyTimeout(
                    f"the request body did not arrive within {self.timeout_s:g} s", limit_s=self.timeout_s
                )
                await error_response(exc, metrics=self.metrics, headers={"Connection": "close"})(
                    {"type": "http"}, receive, send
                )
                return
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
        exc = PayloadTooLarge(
            "body", f"the request body exceeds the limit of {self.max_bytes} bytes", size=size, limit=self.max_bytes
        )
        response = error_response(exc, metrics=self.metrics, headers={"Connection": "close"})
        await response({"type": "http"}, receive, send)


class AuthMiddleware:
    """Authenticate every ``/v1/`` request before its body is read or parsed.

    A missing, malformed, unknown or revoked key is answered 401 here (so no error
    about the body can come first, and no unauthenticated body is buffered); the
    caller's fleet goes to ``request.state.fleet_id`` for the endpoint.
    """

    #: the scheme as the OpenAPI document names it
    SCHEME = "HTTPBearer"

    def __init__(self, app: Any, runtime: Runtime) -> None:
        self.app = app
        self.runtime = runtime

    @classmethod
    def document(cls, schema: dict[str, Any]) -> dict[str, Any]:
        """Say in an OpenAPI document what this middleware enforces: every ``/v1/`` operation
        needs a bearer key (the routes take the fleet it established, not a dependency)."""
        schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
        schemes[cls.SCHEME] = {
            "type": "http",
            "scheme": "bearer",
            "description": "a fleet API key (`tracker key create FLEET`)",
        }
        for path, operations in schema.get("paths", {}).items():
            if path.startswith(API_PREFIX + "/"):
                for operation in operations.values():
                    operation["security"] = [{cls.SCHEME: []}]
        return schema

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
            await error_response(error, metrics=self.runtime.metrics)(scope, receive, send)
            return
        scope.setdefault("state", {})["fleet_id"] = fleet_id
        telemetry.annotate(telemetry.FLEET, fleet_id)
        await self.app(scope, receive, send)


class MetricsMiddleware:
    """Request count and latency by method and route template (never the raw path); one span per
    request (continuing the caller's ``traceparent``), named by the route template."""

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

        method = method_label(scope)
        with telemetry.bound(), telemetry.server_span(method, scope.get("headers")) as span:
            try:
                await self.app(scope, receive, send_status)
            finally:
                template = route_label(scope)
                self.metrics.latency.labels(method, template).observe(time.perf_counter() - started)
                self.metrics.requests.labels(method, template, str(status[0])).inc()
                span.rename(f"{method} {template}")
                span.set("http.route", template)
                span.set("http.response.status_code", status[0])
