"""ASGI middleware: request metrics, authentication and the body limit, as one pure-ASGI layer.

What it does for a request, in order: metrics and the request's span (every request is
counted) > authentication of ``/v1/`` requests (before any body is read) > the body limit
(before anything parses the body) > the request's hot route (:class:`HotRoute`, the observe
endpoint without the framework's routing and dependency resolution) when it can answer,
else the framework. One layer rather than three nested ones: a request crosses one
coroutine, one ``send`` wrapper and one buffered ``receive`` instead of three of each.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from tracker import telemetry
from tracker.errors import BodyTimeout, PayloadTooLarge, TrackerError, Unauthorized
from tracker.http.errors import error_response
from tracker.http.schemas import API_PREFIX

if TYPE_CHECKING:  # pragma: no cover
    from tracker.http.metrics import Metrics
    from tracker.http.runtime import Runtime

#: the request methods metrics and spans name; any other method string is ``other`` (labels come from a closed set)
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_API = API_PREFIX + "/"


def method_label(scope: Any) -> str:
    method = scope.get("method")
    return method if method in KNOWN_METHODS else "other"


def route_label(scope: Any) -> str:
    """The matched route's template (a closed set: the app's routes), else ``unmatched``."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else "unmatched"


@dataclass(frozen=True)
class HotRoute:
    """A route the middleware answers itself when it can: ``route`` (the framework's own route,
    for its template and its path pattern) and ``handle(runtime, fleet_id, path_params, headers,
    body)``, which returns the response, or None to leave the request to the framework (which
    then answers it, its errors included, exactly as if there were no hot route)."""

    method: str
    route: Any
    handle: Callable[[Any, str, dict[str, str], Any, bytes], Awaitable[Any]]

    @property
    def pattern(self) -> re.Pattern[str]:
        return self.route.path_regex


class _Metered:
    """The request metrics' children by label values, looked up once per label set (a dict
    hit instead of ``labels()``'s validation and lock on every request)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._latency: dict[tuple[str, str], Any] = {}
        self._requests: dict[tuple[str, str, int], Any] = {}

    def record(self, method: str, template: str, status: int, seconds: float) -> None:
        latency = self._latency.get((method, template))
        if latency is None:
            latency = self._latency[(method, template)] = self.metrics.latency.labels(method, template)
        requests = self._requests.get((method, template, status))
        if requests is None:
            requests = self._requests[(method, template, status)] = self.metrics.requests.labels(
                method, template, str(status)
            )
        latency.observe(seconds)
        requests.inc()


class ApiMiddleware:
    """Metrics, authentication and the body limit of every request (see the module doc).

    **Metrics**: request count and latency by method and route template (never the raw path);
    one span per request (continuing the caller's ``traceparent``), named by the route template.

    **Authentication**: every ``/v1/`` request is authenticated before its body is read or
    parsed. A missing, malformed, unknown or revoked key is answered 401 here (so no error
    about the body can come first, and no unauthenticated body is buffered); the caller's
    fleet goes to ``request.state.fleet_id`` for the endpoint.

    **Body limit**: bodies over ``max_bytes`` are refused with 413 before anything parses
    them. A declared Content-Length over the limit is refused at once; a chunked body is
    counted as it arrives. The rest of an oversized body is read and dropped (up to
    ``drain_bytes``) so the client gets to read the 413 instead of a reset connection. The
    whole body must arrive within ``timeout_s`` (None: no bound), else 408 ``body_timeout``.
    """

    #: the scheme as the OpenAPI document names it
    SCHEME = "HTTPBearer"

    def __init__(
        self,
        app: Any,
        runtime: Runtime,
        max_bytes: int,
        timeout_s: float | None = None,
        hot_routes: tuple[HotRoute, ...] = (),
    ) -> None:
        self.app = app
        self.runtime = runtime
        self.metrics = runtime.metrics
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.drain_bytes = max(16 * 1024 * 1024, 8 * max_bytes)
        self.hot_routes = hot_routes
        self._metered = _Metered(runtime.metrics)

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
            if path.startswith(_API):
                for operation in operations.values():
                    operation["security"] = [{cls.SCHEME: []}]
        return schema

    # -- metrics (outermost) ---------------------------------------------------------------
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
                await self._authenticated(scope, receive, send_status)
            finally:
                template = route_label(scope)
                self._metered.record(method, template, status[0], time.perf_counter() - started)
                span.rename(f"{method} {template}")
                span.set("http.route", template)
                span.set("http.response.status_code", status[0])

    # -- authentication --------------------------------------------------------------------
    async def _authenticated(self, scope: Any, receive: Any, send: Any) -> None:
        if not scope.get("path", "").startswith(_API):
            await self._limited(scope, receive, send, None)
            return
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
                import anyio.to_thread

                try:
                    fleet_id = await anyio.to_thread.run_sync(lambda: self.runtime.fleets().authenticate(token))
                except TrackerError as exc:  # the database is down / not migrated: 503
                    error = exc
            if fleet_id is None and error is None:
                error = Unauthorized("the API key is malformed, unknown or revoked")
        if error is not None:
            await error_response(error, metrics=self.metrics)(scope, receive, send)
            return
        scope.setdefault("state", {})["fleet_id"] = fleet_id
        telemetry.annotate(telemetry.FLEET, fleet_id)
        await self._limited(scope, receive, send, fleet_id)

    # -- the body limit --------------------------------------------------------------------
    async def _limited(self, scope: Any, receive: Any, send: Any, fleet_id: str | None) -> None:
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
        over: bool | None = None  # over the limit: whether more of the body is to come
        try:
            with anyio.fail_after(self.timeout_s):  # one deadline for the whole body
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body = message.get("body", b"")
                    total += len(body)
                    if total > self.max_bytes:
                        over = message.get("more_body", False)
                        break
                    chunks.append(body)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            exc = BodyTimeout(f"the request body did not arrive within {self.timeout_s:g} s", limit_s=self.timeout_s)
            response = error_response(exc, metrics=self.metrics, headers={"Connection": "close"})
            await response({"type": "http"}, receive, send)
            return
        if over is not None:
            await self._refuse(receive, send, declared or total, total, more=over)
            return
        buffered = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if fleet_id is not None and await self._hot(scope, receive, send, fleet_id, buffered):
            return
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": buffered, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _hot(self, scope: Any, receive: Any, send: Any, fleet_id: str, body: bytes) -> bool:
        """Answer the request by its hot route, if it has one that can; False: the framework answers."""
        if scope.get("root_path"):
            return False
        method, path = scope.get("method"), scope.get("path", "")
        for hot in self.hot_routes:
            if method != hot.method:
                continue
            match = hot.pattern.match(path)
            if match is None:
                continue
            scope["route"] = hot.route  # the metrics' label, as the router would set it
            try:
                response = await hot.handle(self.runtime, fleet_id, match.groupdict(), scope.get("headers"), body)
                if response is not None:
                    telemetry.route_selected(method, route_label(scope))  # the span's name, as the router gives it
            except TrackerError as exc:  # answered by the app's own handler, as the framework would
                from starlette.requests import Request

                from tracker.http.errors import on_tracker_error

                response = await on_tracker_error(Request(scope, receive), exc)
            if response is None:
                del scope["route"]
                return False
            await response(scope, receive, send)
            return True
        return False

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
