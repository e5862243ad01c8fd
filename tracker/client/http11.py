"""The HTTP/1.1 wire of both clients: one sans-I/O response parser, and kept-alive connections over it.

:func:`response_reader` reads one response without doing any I/O (it yields what it needs next and is
sent those bytes); :class:`SyncWire` (sockets, any thread) and :class:`AsyncWire` (asyncio streams,
on one event loop) drive it on their connections. This costs a call a fraction of a general-purpose
client's CPU; httpx carries the calls instead when it has something to add (``tracker.client.base``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Generator
from typing import Any, TypeVar
from urllib.parse import urlencode, urlsplit

import httpx

from tracker.client.calls import Call
from tracker.errors import InvalidInput

MAX_HEAD_LINE = 65_536
MAX_HEAD_LINES = 200
KEEP_IDLE = 20  # connections kept open between calls (httpx's default keep-alive limit)


class Answer:
    """A response: its status and body (what the clients read of it, from either wire)."""

    __slots__ = ("content", "status_code")

    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code, self.content = status_code, content

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class Unreachable(Exception):
    """The request did not get an answer: connection refused or lost, timeout, a garbled response."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


def encode(call: Call[Any]) -> tuple[str, bytes | None]:
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


#: what :func:`response_reader` asks for next, besides a count of bytes: one line, or the rest of the stream
_LINE, _REST = -1, -2


def response_reader() -> Generator[int, bytes, tuple[Answer, bool]]:
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
    return Answer(meta.status, content), not meta.close


class Origin:
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

    def __init__(self, origin: Origin, timeout: float, ssl_context: Any) -> None:
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

    def exchange(self, head: bytes, body: bytes | None) -> tuple[Answer, bool]:
        """Send one request, read its response: (the answer, whether the connection can be reused)."""
        self.sock.sendall(head + body if body is not None else head)
        reader = response_reader()
        want = next(reader)
        try:
            while True:
                want = reader.send(self._read(want))
        except StopIteration as done:
            return done.value

    def _read(self, want: int) -> bytes:
        """What the response reader asks for: a line, the rest of the stream, or exactly ``want`` bytes."""
        if want == _LINE:
            return self.file.readline(MAX_HEAD_LINE)
        if want == _REST:
            return self.file.read()
        data = self.file.read(want)
        if len(data) != want:
            raise ValueError("the connection closed mid-body")
        return data

    def close(self) -> None:
        try:
            self.file.close()
            self.sock.close()
        except OSError:  # pragma: no cover - closing a broken socket
            pass


C = TypeVar("C", "_SocketConnection", "_StreamConnection")


def _kept(idle: list[C]) -> C | None:
    """An idle connection the server has not closed meanwhile (those it has are closed here), or None."""
    while idle:
        conn = idle.pop()
        if not conn.stale():
            return conn
        conn.close()
    return None


class SyncWire:
    """The sync client's connections: any thread takes an idle one (or opens one) for a call."""

    def __init__(self, origin: Origin, timeout: float) -> None:
        self.origin, self.timeout = origin, timeout
        self._ssl = origin.ssl_context()
        self._idle: list[_SocketConnection] = []
        self._lock = threading.Lock()

    def send(self, method: str, target: str, body: bytes | None) -> Answer:
        head = self.origin.head(method, target, body)
        while True:
            with self._lock:
                conn = _kept(self._idle)
            reused = conn is not None
            try:
                if conn is None:
                    conn = _SocketConnection(self.origin, self.timeout, self._ssl)
                answer, keep = conn.exchange(head, body)
            except (OSError, ValueError) as exc:
                if conn is not None:
                    conn.close()
                if reused and isinstance(exc, (ConnectionError, ValueError)) and not isinstance(exc, TimeoutError):
                    continue  # a kept-alive connection the server had just closed: once more on a new one
                raise Unreachable(exc) from exc
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
    async def open(cls, origin: Origin, ssl_context: Any) -> _StreamConnection:
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

    async def exchange(self, head: bytes, body: bytes | None) -> tuple[Answer, bool]:
        self.writer.write(head + body if body is not None else head)
        reader, r = response_reader(), self.reader
        want = next(reader)
        try:
            while True:
                got = await (r.readline() if want == _LINE else r.read() if want == _REST else r.readexactly(want))
                want = reader.send(got)
        except StopIteration as done:
            return done.value

    def close(self) -> None:
        self.writer.close()


class AsyncWire:
    """The async client's connections, on the event loop that first used them."""

    def __init__(self, origin: Origin, timeout: float) -> None:
        self.origin, self.timeout = origin, timeout
        self._ssl = origin.ssl_context()
        self._idle: list[_StreamConnection] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def send(self, method: str, target: str, body: bytes | None) -> Answer:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # connections belong to one loop: a new loop starts afresh
            self._idle, self._loop = [], loop
        head = self.origin.head(method, target, body)
        while True:
            conn = _kept(self._idle)
            reused = conn is not None
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
                raise Unreachable(exc) from exc
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


def on_asyncio() -> bool:
    """Whether the running event loop is asyncio's (the async wire's streams need it; trio's goes through httpx)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def httpx_answer(response: httpx.Response) -> Answer:
    return Answer(response.status_code, response.content)
