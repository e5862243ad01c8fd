"""The clients' own HTTP/1.1 wire against a scripted server: what a general-purpose client handles
and a short parser could miss (chunked bodies, a kept-alive connection the server has closed,
HTTP/1.0, keep-alive reuse, garbled answers), for ``TrackerClient`` and ``AsyncTrackerClient``."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tracker import AsyncTrackerClient, InvalidSessionId, StoreUnavailable, TrackerClient, UnknownSession
from tracker.client import FleetPolicy
from tracker.core import Policy

POLICY = {"source": "server", "version": 0, "changed_at": None, "policy": {"compact_at_bp": 7000}}
EXPECTED = FleetPolicy(source="server", version=0, changed_at=None, policy=Policy(compact_at_bp=7000))


def sized(body: bytes, *headers: str, version: str = "HTTP/1.1") -> bytes:
    head = "".join(f"{h}\r\n" for h in (f"{version} 200 OK", "Content-Type: application/json", *headers))
    return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


def chunked(body: bytes, size: int = 7) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + chunks + b"0\r\nX-Trailer: yes\r\n\r\n"


class Scripted:
    """A loopback server answering each request with the next scripted ``(raw bytes, close after)``."""

    def __init__(self, script: list[tuple[bytes, bool]]) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            buffered = b""
            while True:
                while b"\r\n\r\n" not in buffered:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffered += data
                head, _, buffered = buffered.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                while len(buffered) < length:
                    buffered += conn.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + buffered[:length])
                buffered = buffered[length:]
                raw, close = self.script.pop(0) if self.script else (sized(json.dumps(POLICY).encode()), False)
                conn.sendall(raw)
                if close:
                    return

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def scripted() -> Iterator[Any]:
    servers: list[Scripted] = []

    def make(script: list[tuple[bytes, bool]]) -> Scripted:
        servers.append(Scripted(script))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def both(url: str, **kw: Any) -> list[FleetPolicy | BaseException]:
    """Two policy reads by the sync client, then two by the async one (each on its own connections)."""
    out: list[FleetPolicy | BaseException] = []
    with TrackerClient(url, "key", backoff_s=0.01, **kw) as c:
        for _ in range(2):
            try:
                out.append(c.policy())
            except StoreUnavailable as exc:
                out.append(exc)

    async def remote() -> None:
        async with AsyncTrackerClient(url, "key", backoff_s=0.01, **kw) as c:
            for _ in range(2):
                try:
                    out.append(await c.policy())
                except StoreUnavailable as exc:
                    out.append(exc)

    asyncio.run(remote())
    return out


def test_a_chunked_answer_with_extensions_and_trailers_is_read_whole(scripted):
    body = json.dumps(POLICY).encode()
    server = scripted([(chunked(body), False), (chunked(body, 1), False)] * 2)
    assert both(server.url) == [EXPECTED] * 4
    assert server.connections == 2  # one kept-alive connection per client


def test_a_kept_alive_connection_the_server_closed_is_replaced(scripted):
    body = json.dumps(POLICY).encode()
    # each answer says nothing of closing, then the server closes: the next call finds the connection dead
    server = scripted([(sized(body), True)] * 4)
    assert both(server.url, retries=0) == [EXPECTED] * 4
    assert server.connections == 4


def test_http_1_0_closes_unless_it_keeps_alive(scripted):
    body = json.dumps(POLICY).encode()
    server = scripted([(sized(body, version="HTTP/1.0"), True)] * 4)
    assert both(server.url, retries=0) == [EXPECTED] * 4
    assert server.connections == 4
    kept = scripted([(sized(body, "Connection: keep-alive", version="HTTP/1.0"), False)] * 4)
    assert both(kept.url, retries=0) == [EXPECTED] * 4
    assert kept.connections == 2


def test_a_body_to_the_end_of_the_connection_is_read_then_the_connection_dropped(scripted):
    body = json.dumps(POLICY).encode()
    raw = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n" + body
    server = scripted([(raw, True)] * 4)
    assert both(server.url, retries=0) == [EXPECTED] * 4
    assert server.connections == 4


def test_a_garbled_or_cut_answer_is_retried_then_store_unavailable(scripted):
    body = json.dumps(POLICY).encode()
    garbled = (b"SMTP ready\r\n\r\n", True)
    cut = (sized(body)[:-5], True)  # the connection closes five bytes short of the body
    server = scripted([garbled, cut, garbled, cut])
    out = both(server.url, retries=0)
    assert all(isinstance(x, StoreUnavailable) for x in out), out
    server = scripted([garbled, cut])  # retried: the first call's third try gets the answer
    assert both(server.url, retries=2) == [EXPECTED] * 4
    assert len(server.requests) == 6


def test_the_request_is_what_httpx_sent(scripted):
    """The request line, the headers the server reads, a JSON body with its length, a query string."""
    unknown = json.dumps({"code": "unknown_session", "error": "UnknownSession", "message": "no session"}).encode()
    refusal = sized(unknown).replace(b"200 OK", b"404 Not Found")
    server = scripted([(sized(json.dumps(POLICY).encode()), False), (refusal, False), (refusal, False)])
    with TrackerClient(server.url + "/base/", "sekrit", backoff_s=0.01) as c:
        assert c.policy() == EXPECTED
        with pytest.raises(InvalidSessionId):  # refused as the server would, before anything is sent
            c.observe("a b/c", measurement={"basis": "r1:é", "input_tokens": 1, "input_limit": 10})
        with pytest.raises(UnknownSession):
            c.observe("a:b.c", measurement={"basis": "r1:é", "input_tokens": 1, "input_limit": 10}, idempotency_key="k")
        with pytest.raises(UnknownSession):
            list(c.history("s", from_version=3))
    get, post, history = server.requests
    assert get.startswith(b"GET /base/v1/policy HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer sekrit\r\n" in get and b"\r\nUser-Agent: context-tracker-client\r\n" in get
    assert f"\r\nHost: {server.url.removeprefix('http://')}\r\n".encode() in get
    assert post.startswith(b"POST /base/v1/sessions/a%3Ab.c/observe HTTP/1.1\r\n")
    head, _, body = post.partition(b"\r\n\r\n")
    assert b"\r\nContent-Type: application/json\r\n" in head and f"Content-Length: {len(body)}".encode() in head
    assert json.loads(body) == {
        "idempotency_key": "k",
        "measurement": {"basis": "r1:é", "input_tokens": 1, "input_limit": 10},
    }
    assert history.startswith(b"GET /base/v1/sessions/s/history?from_version=3&limit=500 HTTP/1.1\r\n")


def test_a_nan_is_refused_before_anything_is_sent(scripted):
    server = scripted([])
    with TrackerClient(server.url, "k") as c, pytest.raises(ValueError):
        c.observe(
            "s", measurement={"basis": "a", "input_tokens": 1, "input_limit": 10}, compaction_threshold=float("nan")
        )
    assert server.requests == []


def test_an_informational_answer_is_skipped_and_bad_framing_is_garbled(scripted):
    body = json.dumps(POLICY).encode()
    server = scripted([(b"HTTP/1.1 100 Continue\r\nX-A: b\r\n\r\n" + sized(body), False)] * 4)
    assert both(server.url) == [EXPECTED] * 4
    negative = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\nx\r\n0\r\n\r\n", True)
    endless = (b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 200 + b"\r\n", True)
    server = scripted([negative, endless] * 2)
    out = both(server.url, retries=0)
    assert all(isinstance(x, StoreUnavailable) for x in out), out
