"""Clients for a ``tracker serve`` endpoint that behave like an embedded ``Tracker``.

``TrackerClient`` (sync) and ``AsyncTrackerClient`` have the ``Tracker``'s method names,
arguments, results and typed errors, so agent code switches between embedded and remote by
construction alone::

    tracker = Tracker.from_settings()                                   # embedded
    tracker = TrackerClient("http://tracker:8080", api_key=os.environ["TRACKER_KEY"])  # remote

    r = tracker.observe("session-42", request=request, model="gpt-4o", basis="msg-87")

Behaviour on the wire:

* every mutating call carries an ``idempotency_key`` (yours, or one generated for the call)
  and a retry of that call reuses it, so a retried call gets the original answer and never
  records twice;
* connection errors, ``503`` and a ``504`` that is not the tracker's own recorded
  ``count_timeout`` are retried with exponential backoff (``retries`` times); every other
  error is raised at once as the same typed error the embedded ``Tracker`` raises;
* ``wait`` long-polls (at most 30 s per request) until the attempt ends or ``timeout``.

Transport: plain HTTP/1.1 on kept-alive connections of the client's own (a socket per
connection, one small response parser for both clients), which costs a call a fraction of
a general-purpose client's CPU. httpx is used instead when it has something to add: a
``transport=`` given (an ``httpx.MockTransport`` in tests, say), a proxy the environment
names for the URL (``HTTP(S)_PROXY``, ``NO_PROXY``), or (async) an event loop other than
asyncio's. HTTPS takes httpx's own TLS context (its certificates, ``SSL_CERT_FILE``).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, Literal, TypeVar, Unpack
from urllib.parse import quote, urlencode, urlsplit

import httpx

from tracker.core.decide import Result
from tracker.core.model import Measurement
from tracker.core.outcome import Decision
from tracker.core.policy import Policy
from tracker.core.reports import Report
from tracker.core.state import Attempt, SessionState
from tracker.errors import CountTimeout, InvalidInput, StoreUnavailable, TrackerError, WaitTimeout, error_from_dict
from tracker.protocol import CompactionOptions, ObserveOptions, RejectionOptions, UsageOptions, unexpected
from tracker.store.base import StoredEvent

API_PREFIX = "/v1"
MAX_WAIT_PER_REQUEST_S = 30.0
RETRY_STATUSES = frozenset({502, 503, 504})
HISTORY_PAGE = 500

__all__ = ["AsyncTrackerClient", "FleetPolicy", "TrackerClient"]


# -- what both clients share: requests as data, answers as the Tracker's types ------------------


def _key(idempotency_key: str | None) -> str:
    return idempotency_key if idempotency_key is not None else uuid.uuid4().hex


def _measurement_body(measurement: Measurement | dict[str, Any]) -> dict[str, Any]:
    if isinstance(measurement, Measurement):
        data = measurement.to_data()
        data["basis"] = str(measurement.basis)
        return {k: v for k, v in data.items() if v is not None}
    return dict(measurement)


def _observe_body(options: ObserveOptions) -> dict[str, Any]:
    unexpected("observe", options, ObserveOptions)
    given: dict[str, Any] = dict(options)
    request, measurement, basis = given.get("request"), given.get("measurement"), given.get("basis")
    if (request is None) == (measurement is None):
        raise InvalidInput("request", "give exactly one of request= or measurement=")
    body: dict[str, Any] = {"idempotency_key": _key(given.get("idempotency_key"))}
    if measurement is not None:
        body["measurement"] = _measurement_body(measurement)
    else:
        body.update(request=request, model=given.get("model"), basis=str(basis) if basis is not None else None)
    for name in ("compaction_threshold", "scope", "scope_confidence", "overhead_tokens"):
        if given.get(name) is not None:
            body[name] = given[name]
    return body


def _result(data: dict[str, Any]) -> Result:
    return Result(session_id=data["session_id"], version=data["version"], decision=Decision.from_data(data))


def _event(data: dict[str, Any]) -> StoredEvent:
    return StoredEvent(
        position=data["position"],
        session_id=data["session_id"],
        version=data["version"],
        type=data["type"],
        data=data["data"],
        recorded_at=datetime.fromisoformat(data["recorded_at"]),
        idempotency_key=data.get("idempotency_key"),
    )


def _error(response: _Answer) -> TrackerError:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "code" in body:
        return error_from_dict(body)
    return TrackerError(
        f"HTTP {response.status_code} from the tracker: {response.text[:200]}", status=response.status_code
    )


def _retryable(response: _Answer) -> bool:
    if response.status_code not in RETRY_STATUSES:
        return False
    if response.status_code == 504:  # the tracker's own count_timeout is a recorded answer, not a glitch
        try:
            return response.json().get("code") != CountTimeout.code
        except ValueError:
            return True
    return True


def _sessions_params(
    pressure: str | None, since: datetime | float | None, page_size: int, cursor: str | None
) -> dict[str, Any]:
    params: dict[str, Any] = {"limit": page_size}
    if pressure is not None:
        params["pressure"] = pressure
    if since is not None:
        if isinstance(since, datetime):
            when = since if since.tzinfo is not None else since.replace(tzinfo=UTC)
        elif isinstance(since, (int, float)) and not isinstance(since, bool):
            when = datetime.fromtimestamp(since, UTC)
        else:
            raise InvalidInput("since", f"must be a datetime or seconds since the epoch, got {since!r}")
        params["since"] = when.isoformat()
    if cursor is not None:
        params["cursor"] = cursor
    return params


def _path(*parts: str) -> str:
    return API_PREFIX + "".join("/" + quote(p, safe="") for p in parts)


@dataclass(frozen=True)
class _Call:
    """One request as data, and how its answer becomes the ``Tracker``'s type (both clients run these)."""

    method: str
    path: str
    parse: Callable[[Any], Any]
    json: Any = None
    params: dict[str, Any] | None = None


def _observe_call(session_id: str, options: ObserveOptions) -> _Call:
    return _Call("POST", _path("sessions", session_id, "observe"), _result, json=_observe_body(options))


def _manual_call(session_id: str, options: CompactionOptions) -> _Call:
    unexpected("request_compaction", options, CompactionOptions)
    basis = options.get("basis")
    body = {
        "idempotency_key": _key(options.get("idempotency_key")),
        "basis": str(basis) if basis is not None else None,
        "overhead_tokens": options.get("overhead_tokens"),
    }
    return _Call("POST", _path("sessions", session_id, "compactions"), lambda d: Attempt(**d), json=body)


def _end_call(session_id: str, attempt_id: str, verb: str, body: dict[str, Any], idempotency_key: str | None) -> _Call:
    """A commit or a reject of the attempt."""
    path = _path("sessions", session_id, "compactions", attempt_id, verb)
    return _Call("POST", path, SessionState.from_data, json={**body, "idempotency_key": _key(idempotency_key)})


def _commit_call(
    session_id: str, attempt_id: str, fencing_token: int, tokens_after: int, idempotency_key: str | None
) -> _Call:
    body = {"fencing_token": fencing_token, "tokens_after": tokens_after}
    return _end_call(session_id, attempt_id, "commit", body, idempotency_key)


def _reject_call(
    session_id: str, attempt_id: str, fencing_token: int, reject_reason: str, idempotency_key: str | None
) -> _Call:
    body = {"fencing_token": fencing_token, "reject_reason": reject_reason}
    return _end_call(session_id, attempt_id, "reject", body, idempotency_key)


def _report_body(method: str, options: Any, kind: type) -> dict[str, Any]:
    unexpected(method, options, kind)
    body = {k: v for k, v in options.items() if v is not None}
    if "basis" in body:
        body["basis"] = str(body["basis"])
    body["idempotency_key"] = _key(options.get("idempotency_key"))
    return body


def _usage_call(session_id: str, options: UsageOptions) -> _Call:
    body = _report_body("report_usage", options, UsageOptions)
    return _Call("POST", _path("sessions", session_id, "usage"), Report.from_data, json=body)


def _rejection_call(session_id: str, options: RejectionOptions) -> _Call:
    body = _report_body("report_rejection", options, RejectionOptions)
    return _Call("POST", _path("sessions", session_id, "rejection"), Report.from_data, json=body)


def _calibration_call() -> _Call:
    return _Call("GET", _path("calibration"), lambda d: list(d["models"]))


def _state_call(session_id: str) -> _Call:
    return _Call("GET", _path("sessions", session_id), SessionState.from_data)


def _wait_call(session_id: str, attempt_id: str, left: float) -> _Call:
    path = _path("sessions", session_id, "compactions", attempt_id, "wait")
    return _Call("GET", path, lambda d: str(d["outcome"]), params={"timeout": min(left, MAX_WAIT_PER_REQUEST_S)})


def _history_call(session_id: str, version: int) -> _Call:
    params = {"from_version": version, "limit": HISTORY_PAGE}
    return _Call("GET", _path("sessions", session_id, "history"), lambda d: d, params=params)


def _sessions_call(params: dict[str, Any]) -> _Call:
    return _Call("GET", _path("sessions"), lambda d: d, params=params)


@dataclass(frozen=True)
class FleetPolicy:
    """The policy the caller's fleet's new sessions start with (``GET /v1/policy``).

    ``source``: ``"fleet"`` (the fleet's own, set with ``tracker fleet policy``) or ``"server"``
    (the fleet has none: the server's); ``version``: the fleet policy's version (``0``: the fleet
    never had one); ``changed_at``: when that version was recorded (``None`` for version 0);
    ``policy``: the policy itself, as the core's ``Policy``.
    """

    source: Literal["fleet", "server"]
    version: int
    changed_at: datetime | None
    policy: Policy

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> FleetPolicy:
        changed_at = data.get("changed_at")
        return cls(
            source=data["source"],
            version=data["version"],
            changed_at=datetime.fromisoformat(changed_at) if changed_at is not None else None,
            policy=Policy.from_data(data["policy"]),
        )


def _policy_call() -> _Call:
    return _Call("GET", _path("policy"), FleetPolicy.from_data)


class _Waiting:
    """One ``wait``: its long-polls (each at most ``MAX_WAIT_PER_REQUEST_S``) until ``timeout``."""

    def __init__(self, session_id: str, attempt_id: str, timeout: Any) -> None:
        if not isinstance(timeout, (int, float)) or timeout < 0:
            raise InvalidInput("timeout", f"must be a number >= 0, got {timeout!r}")
        self.session_id, self.attempt_id, self.timeout = session_id, attempt_id, timeout
        self.deadline = time.monotonic() + timeout

    def poll(self) -> _Call:
        return _wait_call(self.session_id, self.attempt_id, max(0.0, self.deadline - time.monotonic()))

    def polled_out(self) -> None:
        """A poll timed out: poll again, or (past the deadline) raise ``WaitTimeout``."""
        if time.monotonic() >= self.deadline:
            msg = f"attempt {self.attempt_id} still open after {self.timeout}s"
            raise WaitTimeout(msg, attempt_id=self.attempt_id) from None


_LAST = object()


class _Pages:
    """A listing fetched page by page: the request for the next page (None after the last) and each page's rows."""

    def __init__(
        self, call: Callable[[Any], _Call], at: Any, rows: Callable[[Any], list[Any]], after: Callable[[Any], Any]
    ) -> None:
        self._call, self._at, self._rows, self._after = call, at, rows, after

    def next_call(self) -> _Call | None:
        return None if self._at is _LAST else self._call(self._at)

    def rows(self, page: Any) -> list[Any]:
        self._at = self._after(page)
        return self._rows(page)


def _history_pages(session_id: str, from_version: int) -> _Pages:
    return _Pages(
        lambda version: _history_call(session_id, version),
        from_version,
        lambda page: [_event(e) for e in page["events"]],
        lambda page: page["next_from_version"] if page["has_more"] else _LAST,
    )


def _sessions_pages(pressure: str | None, since: datetime | float | None, page_size: int) -> _Pages:
    return _Pages(
        lambda cursor: _sessions_call(_sessions_params(pressure, since, page_size, cursor)),
        None,
        lambda page: page["sessions"],
        lambda page: page.get("next_cursor") or _LAST,
    )


# -- the wire: HTTP/1.1 on kept-alive connections, or httpx ----------------------------------------

MAX_HEAD_LINE = 65_536
MAX_HEAD_LINES = 200
KEEP_IDLE = 20  # connections kept open between calls (httpx's default keep-alive limit)


class _Answer:
    """A response: its status and body (what the clients read of it, from either wire)."""

    __slots__ = ("content", "status_code")

    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code, self.content = status_code, content

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class _Unreachable(Exception):
    """The request did not get an answer: connection refused or lost, timeout, a garbled response."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


def _encode(call: _Call) -> tuple[str, bytes | None]:
    """The request target (path and query) and the JSON body of ``call`` (``json.dumps`` refuses NaN, as httpx does)."""
    target = call.path if not call.params else f"{call.path}?{urlencode(call.params)}"
    if call.json is None:
        return target, None
    return target, json.dumps(call.json, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


class _Head:
    """What the status line and headers of a response say about reading it (sans I/O: both wires parse with this)."""

    __slots__ = ("chunked", "close", "length", "status")

    def __init__(self, status_line: bytes) -> None:
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ValueError(f"not an HTTP/1.x status line: {status_line[:100]!r}")
        self.status = int(parts[1])
        self.close = parts[0] == b"HTTP/1.0"  # unless it says keep-alive
        self.length: int | None = None
        self.chunked = False

    def header(self, line: bytes) -> None:
        name, sep, value = line.partition(b":")
        if not sep:
            raise ValueError(f"not a header line: {line[:100]!r}")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            self.length = int(value)
            if self.length < 0:
                raise ValueError("negative content-length")
        elif name == b"transfer-encoding":
            self.chunked = value.endswith(b"chunked")
        elif name == b"connection":
            tokens = {t.strip() for t in value.split(b",")}
            if b"close" in tokens:
                self.close = True
            elif b"keep-alive" in tokens:
                self.close = False

    @property
    def informational(self) -> bool:
        return 100 <= self.status < 200

    @property
    def bodiless(self) -> bool:
        return self.status in (204, 304) or self.informational


def _line(raw: bytes) -> bytes:
    if not raw.endswith(b"\n"):
        raise ValueError("the connection closed mid-response" if len(raw) < MAX_HEAD_LINE else "a header line too long")
    return raw


#: what :func:`_response_reader` asks for next, besides a count of bytes: one line, or the rest of the stream
_LINE, _REST = -1, -2


def _response_reader() -> Generator[int, bytes, tuple[_Answer, bool]]:
    """One HTTP/1.1 response, read sans I/O (both wires drive it): yields what it needs next (``_LINE``,
    ``_REST`` or a number of bytes), is sent those bytes, and returns (the answer, whether the connection
    can be reused). Informational (1xx) responses are skipped; garbage is a ``ValueError``."""
    while True:
        meta = _Head(_line((yield _LINE)))
        for _ in range(MAX_HEAD_LINES):
            raw = _line((yield _LINE))
            if raw in (b"\r\n", b"\n"):
                break
            meta.header(raw)
        else:
            raise ValueError("too many header lines")
        if not meta.informational:
            break
    if meta.bodiless:
        content = b""
    elif meta.chunked:
        parts = []
        while True:
            size = int(_line((yield _LINE)).split(b";", 1)[0].strip(), 16)
            if size < 0:
                raise ValueError("a negative chunk size")
            if size == 0:
                while _line((yield _LINE)) not in (b"\r\n", b"\n"):
                    pass
                break
            parts.append((yield size))
            _line((yield _LINE))
        content = b"".join(parts)
    elif meta.length is not None:
        content = yield meta.length
    else:
        content, meta.close = (yield _REST), True
    return _Answer(meta.status, content), not meta.close


class _Origin:
    """Where the requests go: host, port, TLS, the path prefix, and the fixed part of every request head."""

    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise InvalidInput("base_url", f"must be an http:// or https:// URL, got {base_url!r}")
        self.url = base_url
        self.tls = url.scheme == "https"
        self.host = url.hostname
        self.port = url.port or (443 if self.tls else 80)
        self.prefix = url.path.rstrip("/")
        default_port = self.port == (443 if self.tls else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        fixed = {"Host": host if default_port else f"{host}:{self.port}", "Accept": "*/*", **headers}
        self.fixed = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")

    def head(self, method: str, target: str, body: bytes | None) -> bytes:
        line = f"{method} {self.prefix}{target} HTTP/1.1\r\n".encode()
        if body is None:
            return line + self.fixed + b"\r\n"
        sized = b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        return line + self.fixed + sized

    def ssl_context(self) -> Any:
        return httpx.create_ssl_context(verify=True, trust_env=True) if self.tls else None

    def proxied(self) -> bool:
        """Whether the environment names a proxy for this URL (httpx, which honours it, then carries the calls)."""
        from urllib.request import getproxies, proxy_bypass

        proxies = getproxies()
        if not (proxies.get("https" if self.tls else "http") or proxies.get("all")):
            return False
        return not proxy_bypass(f"{self.host}:{self.port}")


class _SocketConnection:
    """One kept-alive HTTP/1.1 connection of the sync client."""

    def __init__(self, origin: _Origin, timeout: float, ssl_context: Any) -> None:
        sock = socket.create_connection((origin.host, origin.port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ssl_context is not None:
                sock = ssl_context.wrap_socket(sock, server_hostname=origin.host)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.file = sock.makefile("rb")

    def stale(self) -> bool:
        """The server closed it (or sent something unasked) while it was idle."""
        import select

        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def exchange(self, head: bytes, body: bytes | None) -> tuple[_Answer, bool]:
        """Send one request, read its response: (the answer, whether the connection can be reused)."""
        self.sock.sendall(head + body if body is not None else head)
        f, reader = self.file, _response_reader()
        want = next(reader)
        try:
            while True:
                if want == _LINE:
                    want = reader.send(f.readline(MAX_HEAD_LINE))
                elif want == _REST:
                    want = reader.send(f.read())
                else:
                    want = reader.send(self._exactly(want))
        except StopIteration as done:
            return done.value

    def _exactly(self, n: int) -> bytes:
        data = self.file.read(n)
        if len(data) != n:
            raise ValueError("the connection closed mid-body")
        return data

    def close(self) -> None:
        try:
            self.file.close()
            self.sock.close()
        except OSError:  # pragma: no cover - closing a broken socket
            pass


class _SyncWire:
    """The sync client's connections: any thread takes an idle one (or opens one) for a call."""

    def __init__(self, origin: _Origin, timeout: float) -> None:
        self.origin, self.timeout = origin, timeout
        self._ssl = origin.ssl_context()
        self._idle: list[_SocketConnection] = []
        self._lock = threading.Lock()

    def send(self, method: str, target: str, body: bytes | None) -> _Answer:
        head = self.origin.head(method, target, body)
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            reused = conn is not None
            if conn is not None and conn.stale():
                conn.close()
                continue
            try:
                if conn is None:
                    conn = _SocketConnection(self.origin, self.timeout, self._ssl)
                answer, keep = conn.exchange(head, body)
            except (OSError, ValueError) as exc:
                if conn is not None:
                    conn.close()
                if reused and isinstance(exc, (ConnectionError, ValueError)) and not isinstance(exc, TimeoutError):
                    continue  # a kept-alive connection the server had just closed: once more on a new one
                raise _Unreachable(exc) from exc
            if keep:
                with self._lock:
                    if len(self._idle) < KEEP_IDLE:
                        self._idle.append(conn)
                        conn = None
            if conn is not None:
                conn.close()
            return answer

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class _StreamConnection:
    """One kept-alive HTTP/1.1 connection of the async client (asyncio streams)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, origin: _Origin, ssl_context: Any) -> _StreamConnection:
        reader, writer = await asyncio.open_connection(
            origin.host,
            origin.port,
            ssl=ssl_context,
            server_hostname=origin.host if ssl_context else None,
            limit=MAX_HEAD_LINE,
        )
        sock = writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover - not a TCP socket
                pass
        return cls(reader, writer)

    def stale(self) -> bool:
        return self.writer.is_closing() or self.reader.at_eof()

    async def exchange(self, head: bytes, body: bytes | None) -> tuple[_Answer, bool]:
        self.writer.write(head + body if body is not None else head)
        r, reader = self.reader, _response_reader()
        want = next(reader)
        try:
            while True:
                if want == _LINE:
                    want = reader.send(await r.readline())
                elif want == _REST:
                    want = reader.send(await r.read())
                else:
                    want = reader.send(await r.readexactly(want))
        except StopIteration as done:
            return done.value

    def close(self) -> None:
        self.writer.close()


class _AsyncWire:
    """The async client's connections, on the event loop that first used them."""

    def __init__(self, origin: _Origin, timeout: float) -> None:
        self.origin, self.timeout = origin, timeout
        self._ssl = origin.ssl_context()
        self._idle: list[_StreamConnection] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def send(self, method: str, target: str, body: bytes | None) -> _Answer:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # connections belong to one loop: a new loop starts afresh
            self._idle, self._loop = [], loop
        head = self.origin.head(method, target, body)
        while True:
            conn = self._idle.pop() if self._idle else None
            reused = conn is not None
            if conn is not None and conn.stale():
                conn.close()
                continue
            try:
                async with asyncio.timeout(self.timeout):
                    if conn is None:
                        conn = await _StreamConnection.open(self.origin, self._ssl)
                    answer, keep = await conn.exchange(head, body)
            except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
                if conn is not None:
                    conn.close()
                retry = isinstance(exc, (ConnectionError, ValueError, asyncio.IncompleteReadError))
                if reused and retry and not isinstance(exc, TimeoutError):
                    continue  # a kept-alive connection the server had just closed: once more on a new one
                raise _Unreachable(exc) from exc
            except BaseException:  # cancelled mid-exchange: the connection is in an unknown state
                if conn is not None:
                    conn.close()
                raise
            if keep and len(self._idle) < KEEP_IDLE:
                self._idle.append(conn)
            else:
                conn.close()
            return answer

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _on_asyncio() -> bool:
    """Whether the running event loop is asyncio's (the async wire's streams need it; trio's goes through httpx)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _httpx_answer(response: httpx.Response) -> _Answer:
    return _Answer(response.status_code, response.content)


TransportT = TypeVar("TransportT", httpx.BaseTransport, httpx.AsyncBaseTransport)


class _Base(Generic[TransportT]):
    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 35.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        transport: TransportT | None = None,
    ) -> None:
        if not isinstance(retries, int) or retries < 0:
            raise InvalidInput("retries", f"must be an integer >= 0, got {retries!r}")
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}", "User-Agent": "context-tracker-client"}
        self._origin = _Origin(self.base_url, self._headers)
        self._open(transport)

    def _open(self, transport: TransportT | None) -> None:
        raise NotImplementedError

    def _delay(self, attempt: int) -> float:
        return random.uniform(0, self.backoff_s * 2**attempt)  # full jitter

    def _settle(self, call: _Call, attempt: int, response: _Answer | None, exc: Exception | None) -> Any:
        """The parsed answer, ``_RETRY`` to try again after a pause, or the typed error raised."""
        if response is None:
            if attempt == self.retries:
                cause = exc.cause if isinstance(exc, _Unreachable) else exc
                raise StoreUnavailable(f"the tracker could not be reached: {type(cause).__name__}: {cause}") from exc
            return _RETRY
        if response.status_code in (200, 201):
            return call.parse(response.json())
        if not _retryable(response) or attempt == self.retries:
            raise _error(response)
        return _RETRY


_RETRY = object()


class TrackerClient(_Base[httpx.BaseTransport]):
    """A ``Tracker`` over HTTP (sync). Use as a context manager or call ``close()``."""

    def _open(self, transport: httpx.BaseTransport | None) -> None:
        self._wire: _SyncWire | None = None
        self._http: httpx.Client | None = None
        if transport is None and not self._origin.proxied():
            self._wire = _SyncWire(self._origin, self.timeout)
        else:
            self._http = httpx.Client(
                base_url=self.base_url, headers=self._headers, timeout=self.timeout, transport=transport
            )

    def close(self) -> None:
        if self._wire is not None:
            self._wire.close()
        if self._http is not None:
            self._http.close()

    def __enter__(self) -> TrackerClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _send(self, call: _Call) -> _Answer:
        if self._wire is not None:
            target, body = _encode(call)
            return self._wire.send(call.method, target, body)
        assert self._http is not None
        try:
            return _httpx_answer(self._http.request(call.method, call.path, json=call.json, params=call.params))
        except httpx.TransportError as exc:
            raise _Unreachable(exc) from exc

    def _run(self, call: _Call) -> Any:
        for attempt in range(self.retries + 1):
            try:
                response = self._send(call)
            except _Unreachable as exc:
                answer = self._settle(call, attempt, None, exc)
            else:
                answer = self._settle(call, attempt, response, None)
            if answer is not _RETRY:
                return answer
            time.sleep(self._delay(attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    # -- the Tracker's methods (each the request its _Call builder makes, run) ------------------
    def observe(self, session_id: str, **options: Unpack[ObserveOptions]) -> Result:
        return self._run(_observe_call(session_id, options))

    def request_compaction(self, session_id: str, **options: Unpack[CompactionOptions]) -> Attempt:
        return self._run(_manual_call(session_id, options))

    def commit(
        self,
        session_id: str,
        attempt_id: str,
        fencing_token: int,
        tokens_after: int,
        idempotency_key: str | None = None,
    ) -> SessionState:
        return self._run(_commit_call(session_id, attempt_id, fencing_token, tokens_after, idempotency_key))

    def reject(
        self,
        session_id: str,
        attempt_id: str,
        fencing_token: int,
        reject_reason: str,
        idempotency_key: str | None = None,
    ) -> SessionState:
        return self._run(_reject_call(session_id, attempt_id, fencing_token, reject_reason, idempotency_key))

    def report_usage(self, session_id: str, **options: Unpack[UsageOptions]) -> Report:
        """What the provider billed for the request of a measured ``basis`` (``Tracker.report_usage``)."""
        return self._run(_usage_call(session_id, options))

    def report_rejection(self, session_id: str, **options: Unpack[RejectionOptions]) -> Report:
        """The provider refused the request of a measured ``basis`` as too long (``Tracker.report_rejection``)."""
        return self._run(_rejection_call(session_id, options))

    def calibration(self) -> list[dict[str, Any]]:
        """What this key's fleet's provider reports taught, per model and counter kind
        (``GET /v1/calibration``: ``ModelSummary.to_data()`` rows without ``fleet``).

        Client-only, like ``policy()``: the embedded ``Tracker.calibration(fleet)`` returns ``ModelSummary`` rows."""
        return self._run(_calibration_call())

    def wait(self, session_id: str, attempt_id: str, timeout: float = 30.0) -> str:
        """Block until the attempt ends: 'committed' or 'rejected:<reason>'. Raises ``WaitTimeout``."""
        waiting = _Waiting(session_id, attempt_id, timeout)
        while True:
            try:
                return self._run(waiting.poll())
            except WaitTimeout:
                waiting.polled_out()

    def state(self, session_id: str) -> SessionState:
        return self._run(_state_call(session_id))

    def history(self, session_id: str, from_version: int = 1) -> Iterator[StoredEvent]:
        """Every event of the session from ``from_version`` on, fetched page by page."""
        pages = _history_pages(session_id, from_version)
        while (call := pages.next_call()) is not None:
            yield from pages.rows(self._run(call))

    def sessions(
        self, *, pressure: str | None = None, since: datetime | float | None = None, page_size: int = 100
    ) -> Iterator[dict[str, Any]]:
        """The fleet's sessions (``GET /v1/sessions``), most recently active first, fetched page by page.

        ``pressure``: only sessions at this pressure; ``since``: only those active at or after this
        time (a datetime, or seconds since the epoch). Rows: ``session_id``, ``version``,
        ``pressure``, ``occupancy_bp``, ``revision``, ``open_attempts``, ``created_at``,
        ``updated_at`` (last activity, ISO text).
        """
        pages = _sessions_pages(pressure, since, page_size)
        while (call := pages.next_call()) is not None:
            yield from pages.rows(self._run(call))

    def policy(self) -> FleetPolicy:
        """The policy this key's fleet's new sessions start with (``GET /v1/policy``): the fleet's
        own, else the server's. Retried like every read. A session keeps the policy it started with;
        a change reaches new sessions within the server's ``TRACKER_API_KEY_CACHE_S``.

        Client-only: not part of ``TrackerProtocol``, since an embedded ``Tracker`` has no fleet
        (its policy is ``Tracker.policy``).
        """
        return self._run(_policy_call())


class AsyncTrackerClient(_Base[httpx.AsyncBaseTransport]):
    """A ``Tracker`` over HTTP for asyncio code: the same methods, awaited."""

    def _open(self, transport: httpx.AsyncBaseTransport | None) -> None:
        self._transport = transport
        self._wire: _AsyncWire | None = None
        self._http: httpx.AsyncClient | None = None
        if transport is None and not self._origin.proxied():
            self._wire = _AsyncWire(self._origin, self.timeout)

    def _httpx(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(
                base_url=self.base_url, headers=self._headers, timeout=self.timeout, transport=self._transport
            )
        return self._http

    async def aclose(self) -> None:
        if self._wire is not None:
            await self._wire.aclose()
        if self._http is not None:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncTrackerClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def _send(self, call: _Call) -> Awaitable[_Answer]:
        if self._wire is not None and _on_asyncio():
            target, body = _encode(call)
            return self._wire.send(call.method, target, body)
        return self._send_httpx(call)

    async def _send_httpx(self, call: _Call) -> _Answer:
        try:
            response = await self._httpx().request(call.method, call.path, json=call.json, params=call.params)
        except httpx.TransportError as exc:
            raise _Unreachable(exc) from exc
        return _httpx_answer(response)

    async def _run(self, call: _Call) -> Any:
        for attempt in range(self.retries + 1):
            try:
                response = await self._send(call)
            except _Unreachable as exc:
                answer = self._settle(call, attempt, None, exc)
            else:
                answer = self._settle(call, attempt, response, None)
            if answer is not _RETRY:
                return answer
            await asyncio.sleep(self._delay(attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    # -- the Tracker's methods, awaited (the same _Call builders as TrackerClient's) -------------
    async def observe(self, session_id: str, **options: Unpack[ObserveOptions]) -> Result:
        return await self._run(_observe_call(session_id, options))

    async def request_compaction(self, session_id: str, **options: Unpack[CompactionOptions]) -> Attempt:
        return await self._run(_manual_call(session_id, options))

    async def commit(
        self,
        session_id: str,
        attempt_id: str,
        fencing_token: int,
        tokens_after: int,
        idempotency_key: str | None = None,
    ) -> SessionState:
        return await self._run(_commit_call(session_id, attempt_id, fencing_token, tokens_after, idempotency_key))

    async def reject(
        self,
        session_id: str,
        attempt_id: str,
        fencing_token: int,
        reject_reason: str,
        idempotency_key: str | None = None,
    ) -> SessionState:
        return await self._run(_reject_call(session_id, attempt_id, fencing_token, reject_reason, idempotency_key))

    async def report_usage(self, session_id: str, **options: Unpack[UsageOptions]) -> Report:
        return await self._run(_usage_call(session_id, options))

    async def report_rejection(self, session_id: str, **options: Unpack[RejectionOptions]) -> Report:
        return await self._run(_rejection_call(session_id, options))

    async def calibration(self) -> list[dict[str, Any]]:
        """What this key's fleet's provider reports taught (see ``TrackerClient.calibration``)."""
        return await self._run(_calibration_call())

    async def wait(self, session_id: str, attempt_id: str, timeout: float = 30.0) -> str:
        waiting = _Waiting(session_id, attempt_id, timeout)
        while True:
            try:
                return await self._run(waiting.poll())
            except WaitTimeout:
                waiting.polled_out()

    async def state(self, session_id: str) -> SessionState:
        return await self._run(_state_call(session_id))

    async def history(self, session_id: str, from_version: int = 1) -> AsyncIterator[StoredEvent]:
        pages = _history_pages(session_id, from_version)
        while (call := pages.next_call()) is not None:
            for event in pages.rows(await self._run(call)):
                yield event

    async def sessions(
        self, *, pressure: str | None = None, since: datetime | float | None = None, page_size: int = 100
    ) -> AsyncIterator[dict[str, Any]]:
        """The fleet's sessions, most recently active first (see ``TrackerClient.sessions``)."""
        pages = _sessions_pages(pressure, since, page_size)
        while (call := pages.next_call()) is not None:
            for row in pages.rows(await self._run(call)):
                yield row

    async def policy(self) -> FleetPolicy:
        """The policy this key's fleet's new sessions start with (see ``TrackerClient.policy``).

        Client-only: not part of ``TrackerProtocol``, since an embedded ``Tracker`` has no fleet.
        """
        return await self._run(_policy_call())
