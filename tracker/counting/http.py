"""Provider counters over HTTP (quality ``exact_provider``).

* Anthropic: ``POST {base}/v1/messages/count_tokens`` with ``{model, system, messages, tools}``
  -> ``{"input_tokens": n}``. Headers ``x-api-key``, ``anthropic-version``
  (``TRACKER_ANTHROPIC_VERSION``, default ``2023-06-01``) and ``anthropic-beta`` when the
  model entry sets ``options.anthropic_beta`` (e.g. the 1M-context variants).
* OpenAI: ``POST {base}/v1/responses/input_tokens`` with ``{model, input, tools}``
  -> ``{"object": "response.input_tokens", "input_tokens": n}``. Header
  ``Authorization: Bearer <key>``.

Settings come from :class:`~tracker.settings.ProviderSettings` (``from_settings``):
``TRACKER_ANTHROPIC_BASE_URL`` (default ``https://api.anthropic.com``),
``TRACKER_ANTHROPIC_API_KEY``, ``TRACKER_OPENAI_BASE_URL`` (default
``https://api.openai.com``), ``TRACKER_OPENAI_API_KEY``.

One request per count, no retries: the whole call lives inside the count's
deadline (``count_timeout_s``), and whatever fails is reported as one of the five
typed count failures:

=====================================================  ==========================================
what happened                                          raised
=====================================================  ==========================================
timeout (connect, write, read, pool) or no time left   ``CountTimeout`` (cause ``timeout``)
network error (refused, reset, DNS, TLS)               ``CountTimeout`` (cause ``network``)
HTTP 429                                               ``CountTimeout`` (cause ``rate_limited``,
                                                       ``retry_after`` when the provider sent it)
HTTP 5xx (incl. 529 overloaded)                        ``CountTimeout`` (cause ``provider_error``)
HTTP 401 / 403, or no API key configured               ``InvalidCountModel`` (cause ``auth``)
any other non-2xx (400, 404, 413, 422 …)               ``InvalidCountModel`` (cause ``rejected``)
request holds an image placeholder without its data    ``InvalidCountModel`` (cause ``unsupported``)
2xx body not JSON / not an object / no input_tokens    ``MalformedMeasurement`` (field ``response``
                                                       or ``input_tokens``)
OpenAI ``object`` not ``response.input_tokens``        ``MalformedMeasurement`` (field ``object``)
response names another model                           ``InvalidCountModel`` (via ``validate_count``)
negative / non-integer ``input_tokens``                ``MalformedMeasurement`` (via ``validate_count``)
=====================================================  ==========================================

The reasoning: 429 / 5xx / network trouble mean "no valid count in time" — exactly
the documented ``CountTimeout`` — and nothing guessed is used; auth and 4xx mean this counter
cannot count this model/request as configured.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tracker.counting.base import QUALITY_EXACT_PROVIDER, CountResult, ModelSpec, remaining_time
from tracker.counting.request import CanonicalRequest, ImagePart, Message, TextPart, ToolCallPart, ToolResultPart
from tracker.errors import CountTimeout, InvalidCountModel, MalformedMeasurement

if TYPE_CHECKING:  # pragma: no cover
    import httpx  # imported where a count is sent: a process that never asks a provider never loads it
    from pydantic import SecretStr

    from tracker.settings import ProviderSettings

DEFAULT_TIMEOUT_S = 10.0  # only when a counter is called outside a backend (no deadline set)
ANTHROPIC_VERSION = "2023-06-01"


class HttpCounter:
    """Shared machinery: one pooled httpx client per process, one POST per count."""

    name = "http"
    quality = QUALITY_EXACT_PROVIDER
    path = ""
    key_setting = ""

    def __init__(self, base_url: str, api_key: str | None, *, default_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key or None
        self.default_timeout_s = default_timeout_s
        self._client: httpx.Client | None = None
        self._client_pid: int | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.base_url + self.path

    def _http(self) -> httpx.Client:
        pid = os.getpid()
        client = self._client
        if client is None or self._client_pid != pid:  # a forked worker child gets its own pool
            with self._lock:
                if self._client is None or self._client_pid != pid:
                    import httpx

                    self._client = httpx.Client(
                        limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
                        transport=httpx.HTTPTransport(retries=0),
                    )
                    self._client_pid = pid
                client = self._client
        assert client is not None
        return client

    def close(self) -> None:
        with self._lock:
            if self._client is not None and self._client_pid == os.getpid():
                self._client.close()
            self._client = None

    # -- to be provided by the provider classes ----------------------------------------------

    def body(self, request: CanonicalRequest, model: ModelSpec) -> dict[str, Any]:  # pragma: no cover
        raise NotImplementedError

    def headers(self, model: ModelSpec) -> dict[str, str]:  # pragma: no cover
        raise NotImplementedError

    def check_response(self, data: Mapping[str, Any], model: ModelSpec) -> None:
        """Provider-specific shape checks on a 2xx JSON object."""

    # -- the count ---------------------------------------------------------------------------

    def count(self, request: CanonicalRequest, model: ModelSpec) -> CountResult:
        if not self.api_key:
            raise InvalidCountModel(
                f"{model.name}: no API key for {self.name} (set {self.key_setting})", model=model.name, cause="auth"
            )
        body = self.body(request, model)
        payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        remaining = remaining_time(self.default_timeout_s)
        if remaining <= 0:
            raise CountTimeout(f"{model.name}: no time left to ask {self.name}", model=model.name, cause="timeout")
        headers = {"content-type": "application/json", "accept": "application/json", **self.headers(model)}
        import httpx

        started = time.monotonic()
        try:
            resp = self._http().post(self.url, content=payload, headers=headers, timeout=httpx.Timeout(remaining))
        except httpx.TimeoutException as exc:
            raise CountTimeout(
                f"{model.name}: {self.name} did not answer within {remaining:.2f}s ({type(exc).__name__})",
                model=model.name,
                cause="timeout",
            ) from None
        except httpx.HTTPError as exc:  # connect refused, reset, protocol errors …
            raise CountTimeout(
                f"{model.name}: {self.name} unreachable: {type(exc).__name__}: {exc}", model=model.name, cause="network"
            ) from None
        elapsed_ms = int((time.monotonic() - started) * 1000)
        return self._interpret(resp, request, model, elapsed_ms)

    def _interpret(
        self, resp: httpx.Response, request: CanonicalRequest, model: ModelSpec, elapsed_ms: int
    ) -> CountResult:
        status = resp.status_code
        where = f"{model.name}: {self.name} answered HTTP {status}"
        if status == 429:
            details: dict[str, Any] = {"model": model.name, "cause": "rate_limited", "status": status}
            if resp.headers.get("retry-after"):
                details["retry_after"] = resp.headers["retry-after"]
            raise CountTimeout(f"{where} (rate limited)", **details)
        if status >= 500:
            raise CountTimeout(f"{where}: {_snippet(resp)}", model=model.name, cause="provider_error", status=status)
        if status in (401, 403):
            raise InvalidCountModel(
                f"{where} (authentication): {_snippet(resp)}", model=model.name, cause="auth", status=status
            )
        if not 200 <= status < 300:
            raise InvalidCountModel(f"{where}: {_snippet(resp)}", model=model.name, cause="rejected", status=status)
        try:
            data = resp.json()
        except ValueError:
            raise MalformedMeasurement(
                f"{where} with a body that is not JSON: {_snippet(resp)}", field="response"
            ) from None
        if not isinstance(data, dict):
            raise MalformedMeasurement(f"{where} with JSON that is not an object", field="response")
        if "input_tokens" not in data:
            raise MalformedMeasurement(f"{where} without input_tokens", field="input_tokens")
        self.check_response(data, model)
        reported = data.get("model")
        if reported is None or reported == model.provider_model or reported == model.name:
            reported_name = model.name
        else:
            reported_name = str(reported)
        return CountResult(data["input_tokens"], reported_name, self.quality, request.fingerprint)


def _secret(value: SecretStr | None) -> str | None:
    return value.get_secret_value() if value is not None else None


def _snippet(resp: httpx.Response, limit: int = 300) -> str:
    try:
        text = resp.text
    except Exception:  # noqa: BLE001  # pragma: no cover - undecodable body
        return "<undecodable body>"
    text = " ".join(text.split())
    return text[:limit] + ("…" if len(text) > limit else "")


def _placeholder_error(model: ModelSpec, counter: str) -> InvalidCountModel:
    return InvalidCountModel(
        f"{model.name}: {counter} needs the image itself (a source), not a size-only placeholder",
        model=model.name,
        cause="unsupported",
    )


# -- Anthropic --------------------------------------------------------------------------------


class AnthropicHttpCounter(HttpCounter):
    name = "anthropic_http"
    path = "/v1/messages/count_tokens"
    key_setting = "TRACKER_ANTHROPIC_API_KEY"

    def __init__(self, base_url: str, api_key: str | None, *, version: str = ANTHROPIC_VERSION, **kw: Any) -> None:
        super().__init__(base_url, api_key, **kw)
        self.version = version

    @classmethod
    def from_settings(cls, providers: ProviderSettings) -> AnthropicHttpCounter:
        return cls(
            providers.anthropic_base_url,
            _secret(providers.anthropic_api_key),
            version=providers.anthropic_version or ANTHROPIC_VERSION,
        )

    def headers(self, model: ModelSpec) -> dict[str, str]:
        h = {"x-api-key": self.api_key or "", "anthropic-version": self.version}
        beta = model.options.get("anthropic_beta")
        if beta:
            h["anthropic-beta"] = beta if isinstance(beta, str) else ",".join(beta)
        return h

    def body(self, request: CanonicalRequest, model: ModelSpec) -> dict[str, Any]:
        system: list[dict[str, Any]] = [{"type": "text", "text": p.text} for p in request.system if p.text]
        messages: list[dict[str, Any]] = []
        for m in request.messages:
            if m.role in ("system", "developer"):
                # Anthropic has one system prompt: system-like messages join it, in order
                system.extend({"type": "text", "text": p.text} for p in m.content if isinstance(p, TextPart) and p.text)
                continue
            role = "assistant" if m.role == "assistant" else "user"
            blocks = [b for b in (self._block(p, model) for p in m.content) if b is not None]
            messages.append({"role": role, "content": blocks})
        body: dict[str, Any] = {"model": model.provider_model, "messages": messages}
        if system:
            body["system"] = system
        if request.tools:
            body["tools"] = [
                {
                    "name": t.name,
                    "description": t.description,
                    "input_schema": _plain(t.parameters) or {"type": "object"},
                }
                for t in request.tools
            ]
        return body

    def _block(self, part: Any, model: ModelSpec) -> dict[str, Any] | None:
        if isinstance(part, TextPart):
            return {"type": "text", "text": part.text} if part.text else None
        if isinstance(part, ImagePart):
            if part.source is None:
                raise _placeholder_error(model, self.name)
            return {"type": "image", "source": _plain(part.source)}
        if isinstance(part, ToolCallPart):
            args = _plain(part.arguments)
            if part.raw or not isinstance(args, dict):
                args = {"arguments": part.arguments_text()}
            return {"type": "tool_use", "id": part.id, "name": part.name, "input": args}
        if isinstance(part, ToolResultPart):
            block: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": part.tool_call_id,
                "content": [b for b in (self._block(p, model) for p in part.content) if b is not None],
            }
            if part.is_error:
                block["is_error"] = True
            return block
        raise TypeError(f"unknown part {part!r}")  # pragma: no cover


# -- OpenAI -----------------------------------------------------------------------------------


class OpenAIHttpCounter(HttpCounter):
    name = "openai_http"
    path = "/v1/responses/input_tokens"
    key_setting = "TRACKER_OPENAI_API_KEY"

    @classmethod
    def from_settings(cls, providers: ProviderSettings) -> OpenAIHttpCounter:
        return cls(providers.openai_base_url, _secret(providers.openai_api_key))

    def headers(self, model: ModelSpec) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"}

    def check_response(self, data: Mapping[str, Any], model: ModelSpec) -> None:
        obj = data.get("object", "response.input_tokens")
        if obj != "response.input_tokens":
            raise MalformedMeasurement(f"expected 'response.input_tokens', got {obj!r}", field="object")

    def body(self, request: CanonicalRequest, model: ModelSpec) -> dict[str, Any]:
        items: list[dict[str, Any]] = []
        for m in request.all_messages():
            items.extend(self._items(m, model))
        body: dict[str, Any] = {"model": model.provider_model, "input": items}
        if request.tools:
            body["tools"] = [
                {"type": "function", "name": t.name, "description": t.description, "parameters": _plain(t.parameters)}
                for t in request.tools
            ]
        return body

    def _items(self, m: Message, model: ModelSpec) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        content: list[dict[str, Any]] = []
        text_type = "output_text" if m.role == "assistant" else "input_text"
        role = "user" if m.role == "tool" else m.role

        def flush() -> None:
            if content:
                item: dict[str, Any] = {"type": "message", "role": role, "content": list(content)}
                items.append(item)
                content.clear()

        for part in m.content:
            if isinstance(part, TextPart):
                content.append({"type": text_type, "text": part.text})
            elif isinstance(part, ImagePart):
                content.append(self._image(part, model))
            elif isinstance(part, ToolCallPart):
                flush()
                items.append(
                    {"type": "function_call", "call_id": part.id, "name": part.name, "arguments": part.arguments_text()}
                )
            elif isinstance(part, ToolResultPart):
                flush()
                if all(isinstance(p, TextPart) for p in part.content):
                    output: Any = "".join(p.text for p in part.content if isinstance(p, TextPart))
                else:
                    output = [
                        {"type": "input_text", "text": p.text} if isinstance(p, TextPart) else self._image(p, model)
                        for p in part.content
                    ]
                items.append({"type": "function_call_output", "call_id": part.tool_call_id, "output": output})
        flush()
        return items

    def _image(self, part: ImagePart, model: ModelSpec) -> dict[str, Any]:
        if part.source is None:
            raise _placeholder_error(model, self.name)
        src = part.source
        url = src["url"] if src.get("type") == "url" else f"data:{src['media_type']};base64,{src['data']}"
        return {"type": "input_image", "image_url": url, "detail": part.detail or "auto"}


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
