"""A fake Anthropic / OpenAI token-counting server on loopback, for the HTTP counter tests.

    with FakeProvider() as fake:
        fake.mode = "ok"            # ok | slow | 429 | 500 | 503 | malformed | not_object | no_tokens
                                    # | wrong_model | wrong_object | negative | 401 | 400 | hang
        fake.url                    # http://127.0.0.1:<port>
        fake.requests               # [(path, headers, body_json)]

It serves ``POST /v1/messages/count_tokens`` (-> ``{"input_tokens": n}``) and
``POST /v1/responses/input_tokens`` (-> ``{"object": "response.input_tokens",
"input_tokens": n}``), with ``n = len(canonical body JSON) // 4`` so a test can
predict it. It checks the auth header each provider requires and answers 401
without it.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ANTHROPIC_PATH = "/v1/messages/count_tokens"
OPENAI_PATH = "/v1/responses/input_tokens"


def expected_tokens(body: dict[str, Any]) -> int:
    return len(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)) // 4


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass

    def _send(
        self, status: int, body: bytes, content_type: str = "application/json", extra: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _json(self, status: int, data: Any, extra: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(data).encode(), extra=extra)

    def do_POST(self) -> None:  # noqa: N802
        fake = self.server.fake
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        with fake.lock:
            fake.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            mode = fake.mode
        if self.path not in (ANTHROPIC_PATH, OPENAI_PATH):
            return self._json(404, {"error": {"type": "not_found", "message": self.path}})
        if self.path == ANTHROPIC_PATH and not self.headers.get("x-api-key"):
            return self._json(
                401, {"type": "error", "error": {"type": "authentication_error", "message": "x-api-key missing"}}
            )
        if self.path == OPENAI_PATH and not (self.headers.get("authorization") or "").startswith("Bearer "):
            return self._json(401, {"error": {"message": "missing bearer token"}})
        if not isinstance(body, dict) or "model" not in body:
            return self._json(400, {"error": {"message": "body must be a JSON object with model"}})
        tokens = expected_tokens(body)
        ok: dict[str, Any] = {"input_tokens": tokens}
        if self.path == OPENAI_PATH:
            ok = {"object": "response.input_tokens", "input_tokens": tokens}
        if mode == "ok":
            return self._json(200, ok)
        if mode == "slow":
            time.sleep(fake.delay_s)
            return self._json(200, ok)
        if mode == "hang":  # headers sent, body never finishes
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", "1000")
            self.end_headers()
            self.wfile.write(b'{"input_tokens": ')
            self.wfile.flush()
            time.sleep(fake.delay_s)
            return
        if mode == "429":
            return self._json(429, {"error": {"type": "rate_limit_error"}}, extra={"retry-after": "7"})
        if mode in ("500", "503", "529"):
            return self._json(int(mode), {"error": {"type": "api_error", "message": "boom"}})
        if mode in ("400", "401", "404"):
            return self._json(int(mode), {"error": {"type": "invalid_request_error", "message": f"mode {mode}"}})
        if mode == "malformed":
            return self._send(200, b'{"input_tokens": 12', content_type="application/json")
        if mode == "html":
            return self._send(200, b"<html>gateway</html>", content_type="text/html")
        if mode == "not_object":
            return self._json(200, [tokens])
        if mode == "no_tokens":
            return self._json(
                200, {"object": "response.input_tokens"} if self.path == OPENAI_PATH else {"tokens": tokens}
            )
        if mode == "wrong_model":
            return self._json(200, {**ok, "model": "some-other-model"})
        if mode == "wrong_object":
            return self._json(200, {"object": "response", "input_tokens": tokens})
        if mode == "negative":
            return self._json(200, {**ok, "input_tokens": -5})
        if mode == "string_tokens":
            return self._json(200, {**ok, "input_tokens": str(tokens)})
        return self._json(500, {"error": f"unknown fake mode {mode}"})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    fake: FakeProvider


class FakeProvider:
    def __init__(self) -> None:
        self.mode = "ok"
        self.delay_s = 3.0
        self.requests: list[tuple[str, dict[str, str], Any]] = []
        self.lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.fake = self
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-provider", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeProvider:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset(self, mode: str = "ok") -> None:
        with self.lock:
            self.mode = mode
            self.requests.clear()

    def __enter__(self) -> FakeProvider:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
