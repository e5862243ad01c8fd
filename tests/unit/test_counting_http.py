"""HTTP provider counters against a fake provider server on loopback (tests/support/fake_provider.py)."""

from __future__ import annotations

import time
from contextlib import closing

import pytest

from tests.support.fake_provider import ANTHROPIC_PATH, OPENAI_PATH, FakeProvider, expected_tokens
from tracker.core.model import Basis
from tracker.core.policy import Policy
from tracker.counting import CanonicalRequest, InProcessCounting, ModelRegistry
from tracker.counting.http import AnthropicHttpCounter, OpenAIHttpCounter
from tracker.errors import CountTimeout, InvalidCountModel, MalformedMeasurement
from tracker.settings import Settings

REQUEST = {
    "system": "You are a careful coding agent.",
    "messages": [
        {"role": "user", "content": "List the files and read setup.py"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Listing."},
                {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "."}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "setup.py\nREADME.md\nsrc/"}],
        },
        {"role": "user", "content": "Now summarise, in Deutsch bitte: Grüße 👋"},
    ],
    "tools": [
        {
            "name": "ls",
            "description": "List a directory",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        }
    ],
}
BASIS = Basis(1, "m4")


@pytest.fixture(scope="module")
def fake():
    with FakeProvider() as server:
        yield server


@pytest.fixture
def registry(fake):
    providers = Settings.of(
        anthropic_base_url=fake.url,
        anthropic_api_key="sk-ant-test-key",
        openai_base_url=fake.url + "/",
        openai_api_key="sk-openai-test-key",
    ).providers
    overrides = {
        "models": {
            "claude-sonnet-4-5": {"counter": "anthropic_http"},
            "claude-sonnet-4-5-1m": {"counter": "anthropic_http"},
            "gpt-5": {"counter": "openai_http"},
        }
    }
    models = ModelRegistry.load(overrides, providers=providers)
    yield models
    models.close()


@pytest.fixture
def backend(registry):
    return InProcessCounting(registry)  # (its counters' connections are closed with the registry)


def policy(timeout_s: float = 1.0) -> Policy:
    return Policy(count_timeout_s=timeout_s)


def test_anthropic_success_body_and_auth_headers(fake, backend):
    fake.reset("ok")
    m = backend.measure(REQUEST, model="claude-sonnet-4-5", basis=BASIS, policy=policy())
    assert m.quality == "exact_provider"
    assert m.model.provider == "anthropic" and m.model.name == "claude-sonnet-4-5"
    assert m.fingerprint == CanonicalRequest.from_dict(REQUEST).fingerprint
    path, headers, body = fake.requests[-1]
    assert path == ANTHROPIC_PATH
    assert headers["x-api-key"] == "sk-ant-test-key"
    assert headers["anthropic-version"] == "2023-06-01"
    assert "anthropic-beta" not in headers
    assert m.input_tokens == expected_tokens(body)
    assert body["model"] == "claude-sonnet-4-5"
    assert body["system"] == [{"type": "text", "text": "You are a careful coding agent."}]
    assert body["tools"][0]["input_schema"]["required"] == ["path"]
    assert body["messages"][1]["content"][1] == {
        "type": "tool_use",
        "id": "toolu_1",
        "name": "ls",
        "input": {"path": "."},
    }
    assert body["messages"][2]["content"][0]["type"] == "tool_result"
    assert body["messages"][3]["content"][0]["text"].endswith("👋")
    assert m.input_limit == 200_000 - 16_384 - 8_192


def test_anthropic_1m_variant_sends_beta_header_and_api_model(fake, backend):
    fake.reset("ok")
    m = backend.measure(REQUEST, model="claude-sonnet-4-5-1m", basis=BASIS, policy=policy())
    _, headers, body = fake.requests[-1]
    assert headers["anthropic-beta"] == "context-1m-2025-08-07"
    assert body["model"] == "claude-sonnet-4-5"  # the provider's name for it
    assert m.model.name == "claude-sonnet-4-5-1m"
    assert m.input_limit == 1_000_000 - 16_384 - 8_192


def test_openai_success_body_and_bearer(fake, backend):
    fake.reset("ok")
    m = backend.measure(REQUEST, model="gpt-5", basis=BASIS, policy=policy())
    path, headers, body = fake.requests[-1]
    assert path == OPENAI_PATH
    assert headers["authorization"] == "Bearer sk-openai-test-key"
    assert m.quality == "exact_provider" and m.input_tokens == expected_tokens(body)
    kinds = [item.get("type") for item in body["input"]]
    assert kinds == ["message", "message", "message", "function_call", "function_call_output", "message"]
    assert body["input"][0] == {
        "type": "message",
        "role": "system",
        "content": [{"type": "input_text", "text": "You are a careful coding agent."}],
    }
    assert body["input"][3] == {
        "type": "function_call",
        "call_id": "toolu_1",
        "name": "ls",
        "arguments": '{"path":"."}',
    }
    assert body["tools"][0]["type"] == "function" and body["tools"][0]["name"] == "ls"


def test_slow_provider_is_count_timeout_within_budget(fake, backend):
    fake.reset("slow")
    fake.delay_s = 3.0
    started = time.monotonic()
    with pytest.raises(CountTimeout) as info:
        backend.measure(REQUEST, model="claude-sonnet-4-5", basis=BASIS, policy=policy(0.5))
    elapsed = time.monotonic() - started
    assert elapsed < 0.5 + 0.25, elapsed
    assert info.value.details.get("cause") == "timeout"


def test_body_that_never_finishes_is_count_timeout(fake, registry):
    fake.reset("hang")
    fake.delay_s = 2.0
    # called directly: its own timeout
    with closing(OpenAIHttpCounter(fake.url, "k", default_timeout_s=0.4)) as counter:
        spec = registry.get("gpt-5")
        started = time.monotonic()
        with pytest.raises(CountTimeout):
            counter.count(CanonicalRequest.from_dict(REQUEST), spec)
    assert time.monotonic() - started < 1.0


def test_closing_the_backend_closes_the_counters_connections_and_a_later_count_opens_them_again(fake, registry):
    """``Tracker.close`` closes its counting backend: a provider counter's kept-alive connections go with it."""
    fake.reset("ok")
    counting = InProcessCounting(registry)
    first = counting.measure(REQUEST, model="claude-sonnet-4-5", basis=BASIS, policy=policy())
    client = registry.counter_for("claude-sonnet-4-5")._http()  # the pool the count used
    counting.close()
    assert client.is_closed
    again = counting.measure(REQUEST, model="claude-sonnet-4-5", basis=BASIS, policy=policy())
    assert again.input_tokens == first.input_tokens and len(fake.requests) == 2
    counting.close()


@pytest.mark.parametrize("mode", ["429", "500", "503", "529"])
def test_rate_limits_and_server_errors_are_count_timeout(fake, backend, mode):
    fake.reset(mode)
    with pytest.raises(CountTimeout) as info:
        backend.measure(REQUEST, model="claude-sonnet-4-5", basis=BASIS, policy=policy())
    assert info.value.details["status"] == int(mode)
    assert info.value.details["cause"] == ("rate_limited" if mode == "429" else "provider_error")
    if mode == "429":
        assert info.value.details["retry_after"] == "7"
    assert len(fake.requests) == 1  # no hidden retries


def test_network_error_is_count_timeout(registry):
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with closing(AnthropicHttpCounter(f"http://127.0.0.1:{port}", "k")) as counter, pytest.raises(CountTimeout) as info:
        counter.count(CanonicalRequest.from_dict(REQUEST), registry.get("claude-sonnet-4-5"))
    assert info.value.details["cause"] == "network"


@pytest.mark.parametrize(
    "mode,field",
    [("malformed", "response"), ("html", "response"), ("not_object", "response"), ("no_tokens", "input_tokens")],
)
def test_malformed_json_is_malformed_measurement(fake, backend, mode, field):
    fake.reset(mode)
    for model in ("claude-sonnet-4-5", "gpt-5"):
        with pytest.raises(MalformedMeasurement) as info:
            backend.measure(REQUEST, model=model, basis=BASIS, policy=policy())
        assert info.value.field == field


def test_openai_wrong_object_is_malformed(fake, backend):
    fake.reset("wrong_object")
    with pytest.raises(MalformedMeasurement) as info:
        backend.measure(REQUEST, model="gpt-5", basis=BASIS, policy=policy())
    assert info.value.field == "object"


@pytest.mark.parametrize("mode", ["negative", "string_tokens"])
def test_bad_token_values_are_malformed(fake, backend, mode):
    fake.reset(mode)
    with pytest.raises(MalformedMeasurement) as info:
        backend.measure(REQUEST, model="claude-sonnet-4-5", basis=BASIS, policy=policy())
    assert info.value.field == "input_tokens"


def test_wrong_model_in_response_is_invalid_count_model(fake, backend):
    fake.reset("wrong_model")
    for model in ("claude-sonnet-4-5", "gpt-5"):
        with pytest.raises(InvalidCountModel) as info:
            backend.measure(REQUEST, model=model, basis=BASIS, policy=policy())
        assert info.value.details["reported_model"] == "some-other-model"


@pytest.mark.parametrize("mode,cause", [("401", "auth"), ("400", "rejected"), ("404", "rejected")])
def test_client_errors_are_invalid_count_model(fake, backend, mode, cause):
    fake.reset(mode)
    with pytest.raises(InvalidCountModel) as info:
        backend.measure(REQUEST, model="gpt-5", basis=BASIS, policy=policy())
    assert info.value.details["cause"] == cause and info.value.details["status"] == int(mode)


def test_missing_api_key_fails_before_any_request(fake):
    fake.reset("ok")
    registry = ModelRegistry.load(
        {"claude-sonnet-4-5": {"counter": "anthropic_http"}},
        providers=Settings.of(anthropic_base_url=fake.url).providers,
    )
    with pytest.raises(InvalidCountModel) as info:
        InProcessCounting(registry).measure(REQUEST, model="claude-sonnet-4-5", basis=BASIS, policy=policy())
    assert info.value.details["cause"] == "auth"
    assert fake.requests == []


def test_server_sees_no_request_without_key_header(fake, registry):
    """The fake really checks auth: a counter with an empty key header gets 401 -> InvalidCountModel."""
    fake.reset("ok")
    with closing(AnthropicHttpCounter(fake.url, "k")) as counter:
        counter.headers = lambda model: {"anthropic-version": "2023-06-01"}  # type: ignore[method-assign]  # no x-api-key
        with pytest.raises(InvalidCountModel) as info:
            counter.count(CanonicalRequest.from_dict(REQUEST), registry.get("claude-sonnet-4-5"))
    assert info.value.details["status"] == 401


def test_image_placeholder_cannot_be_sent_to_a_provider(fake, backend):
    fake.reset("ok")
    req = {"messages": [{"role": "user", "content": [{"type": "image", "width": 800, "height": 600}]}]}
    with pytest.raises(InvalidCountModel) as info:
        backend.measure(req, model="claude-sonnet-4-5", basis=BASIS, policy=policy())
    assert info.value.details["cause"] == "unsupported"
    assert fake.requests == []
    with_source = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}}
                ],
            }
        ]
    }
    backend.measure(with_source, model="claude-sonnet-4-5", basis=BASIS, policy=policy())
    _, _, body = fake.requests[-1]
    assert body["messages"][0]["content"][0] == {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
    }
    backend.measure(with_source, model="gpt-5", basis=BASIS, policy=policy())
    _, _, body = fake.requests[-1]
    assert body["input"][0]["content"][0] == {
        "type": "input_image",
        "image_url": "data:image/png;base64,iVBORw0KGgo=",
        "detail": "low",
    }


def test_api_key_upgrades_shipped_anthropic_models_to_http(fake):
    plain = ModelRegistry.load(providers=Settings.of().providers)
    assert plain.get("claude-opus-4-1").counter == "heuristic"
    keyed = ModelRegistry.load(providers=Settings.of(anthropic_api_key="k", anthropic_base_url=fake.url).providers)
    assert keyed.get("claude-opus-4-1").counter == "anthropic_http"
    assert keyed.get("gpt-4o").counter == "exact_local"  # OpenAI keeps the local exact counter
    assert keyed.get("gemini-2.5-pro").counter == "heuristic"


def test_the_registry_never_reads_the_environment(fake, monkeypatch):
    """Keys and base URLs come only from the ProviderSettings passed in, never from TRACKER_* directly."""
    monkeypatch.setenv("TRACKER_ANTHROPIC_API_KEY", "from-the-env")
    monkeypatch.setenv("TRACKER_ANTHROPIC_BASE_URL", fake.url)
    registry = ModelRegistry.load()
    assert registry.get("claude-opus-4-1").counter == "heuristic"
    counter = ModelRegistry.load({"claude-opus-4-1": {"counter": "anthropic_http"}}).counter_for("claude-opus-4-1")
    assert isinstance(counter, AnthropicHttpCounter)
    assert counter.api_key is None and counter.base_url == "https://api.anthropic.com"
    keyed = ModelRegistry.load(providers=Settings.load().providers)  # the one reader of TRACKER_*
    assert keyed.get("claude-opus-4-1").counter == "anthropic_http"
    assert keyed.counter_for("claude-opus-4-1").api_key == "from-the-env"  # type: ignore[attr-defined]
