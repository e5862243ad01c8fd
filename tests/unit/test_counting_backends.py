"""In-process counting backend, validation of counts, and the typed failures (no mocks: test counters)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.counters import test_models
from tracker.bootstrap import build_counting
from tracker.core.model import Basis, Measurement
from tracker.core.policy import Policy
from tracker.counting import CanonicalRequest, CeleryCounting, CountResult, InProcessCounting, ModelRegistry
from tracker.counting.backends import run_count_task, validate_count
from tracker.errors import (
    ContextLimitUnknown,
    CountTimeout,
    InvalidCountModel,
    InvalidInput,
    MalformedMeasurement,
    QualityMismatch,
    count_error_from_dict,
)
from tracker.settings import Settings

REQUEST = {
    "system": "You are terse.",
    "messages": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? Explain in one sentence, s'il vous plaît."},
    ],
}
BASIS = Basis(2, "msg-3")


@pytest.fixture(scope="module")
def registry():
    return ModelRegistry.load(test_models(sleep_s=5.0))


@pytest.fixture(scope="module")
def backend(registry):
    b = InProcessCounting(registry)
    b.warm()
    return b


def test_measure_exact_in_process(backend):
    m = backend.measure(REQUEST, model="gpt-4o", basis=BASIS, policy=Policy())
    assert isinstance(m, Measurement)
    assert m.basis == BASIS and m.model.provider == "openai" and m.model.name == "gpt-4o"
    assert m.quality == "exact_local" and m.input_limit == 128_000 - 16_384 - 8_192
    assert m.fingerprint == CanonicalRequest.from_dict(REQUEST).fingerprint
    same = backend.measure(
        CanonicalRequest.from_dict(REQUEST), model="gpt-4o-2024-08-06", basis="r2:msg-3", policy=Policy()
    )
    assert same.input_tokens == m.input_tokens and same.basis == BASIS and same.model.name == "gpt-4o"


def test_heuristic_for_claude_is_allowed_only_when_conservative_counts_are(backend):
    m = backend.measure(REQUEST, model="claude-sonnet-4-5", basis=BASIS, policy=Policy())
    assert m.quality == "heuristic_estimate"
    exact = backend.measure(REQUEST, model="gpt-4o", basis=BASIS, policy=Policy())
    assert m.input_tokens >= exact.input_tokens
    with pytest.raises(QualityMismatch):
        backend.measure(REQUEST, model="claude-sonnet-4-5", basis=BASIS, policy=Policy(counter_policy="require_exact"))


def test_require_exact_refuses_a_heuristic_counter_before_counting(backend):
    started = time.monotonic()
    with pytest.raises(QualityMismatch):  # the sleep counter declares heuristic_estimate: never started
        backend.measure(REQUEST, model="sleep", basis=BASIS, policy=Policy(counter_policy="require_exact"))
    assert time.monotonic() - started < 0.2


def test_hung_counter_does_not_hang_the_caller(backend):
    policy = Policy(count_timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(CountTimeout) as info:
        backend.measure(REQUEST, model="sleep", basis=BASIS, policy=policy)
    elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 0.3 + 0.1, elapsed
    assert info.value.kind == "CountTimeout" and info.value.details["cause"] == "timeout"
    # the caller can count again at once, while the hung counter is still sleeping
    assert backend.measure(REQUEST, model="gpt-4o", basis=BASIS, policy=policy).input_tokens > 0


def test_saturated_by_hung_counters_fails_fast(registry):
    backend = InProcessCounting(registry, max_inflight=2)
    policy = Policy(count_timeout_s=0.2)
    for _ in range(2):
        with pytest.raises(CountTimeout):
            backend.measure(REQUEST, model="sleep", basis=BASIS, policy=policy)
    started = time.monotonic()
    with pytest.raises(CountTimeout) as info:
        backend.measure(REQUEST, model="gpt-4o", basis=BASIS, policy=policy)
    assert info.value.details["cause"] == "saturated" and time.monotonic() - started < 0.05


@pytest.mark.parametrize(
    "model,error,field",
    [
        ("test_wrong_model", InvalidCountModel, None),
        ("test_wrong_quality", QualityMismatch, None),
        ("test_negative_tokens", MalformedMeasurement, "input_tokens"),
        ("test_float_tokens", MalformedMeasurement, "input_tokens"),
        ("test_missing_tokens", MalformedMeasurement, "input_tokens"),
        ("test_wrong_fingerprint", MalformedMeasurement, "fingerprint"),
        ("test_crash", CountTimeout, None),
    ],
)
def test_each_failure_kind_in_process(backend, model, error, field):
    with pytest.raises(error) as info:
        backend.measure(REQUEST, model=model, basis=BASIS, policy=Policy())
    assert type(info.value) is error
    if field:
        assert info.value.field == field
    if model == "test_crash":
        assert info.value.details["cause"] == "counter_error"


def test_unknown_model_is_context_limit_unknown(backend):
    with pytest.raises(ContextLimitUnknown):
        backend.measure(REQUEST, model="gpt-7", basis=BASIS, policy=Policy())


def test_bad_request_is_invalid_input_naming_the_field(backend):
    with pytest.raises(InvalidInput) as info:
        backend.measure({"messages": [{"role": "user", "content": 42}]}, model="gpt-4o", basis=BASIS, policy=Policy())
    assert info.value.field == "messages[0].content"


def test_validate_count_rules(registry):
    req = CanonicalRequest.from_dict(REQUEST)
    spec = registry.get("gpt-4o")
    good = CountResult(10, "gpt-4o", "exact_local", req.fingerprint)

    def check(raw, policy=Policy(), limit=1000):
        return validate_count(
            raw, request=req, spec=spec, declared_quality="exact_local", policy=policy, basis=BASIS, input_limit=limit
        )

    assert check(good).input_tokens == 10
    assert check(good.to_data()).input_tokens == 10
    assert check({**good.to_data(), "input_tokens": 0}).input_tokens == 0
    with pytest.raises(InvalidCountModel):
        check({**good.to_data(), "model": "gpt-4o-mini"})
    with pytest.raises(QualityMismatch):
        check({**good.to_data(), "quality": "exact_provider"})
    with pytest.raises(QualityMismatch):
        validate_count(
            CountResult(10, "gpt-4o", "heuristic_estimate", req.fingerprint),
            request=req,
            spec=spec,
            declared_quality="heuristic_estimate",
            policy=Policy(counter_policy="require_exact"),
            basis=BASIS,
            input_limit=1000,
        )
    for bad in (-1, 1.5, True, "10", None):
        with pytest.raises(MalformedMeasurement) as info:
            check({**good.to_data(), "input_tokens": bad})
        assert info.value.field == "input_tokens"
    for key in ("model", "quality", "fingerprint"):
        data = good.to_data()
        del data[key]
        with pytest.raises(MalformedMeasurement) as info:
            check(data)
        assert info.value.field == key
    with pytest.raises(MalformedMeasurement) as info:
        check({**good.to_data(), "fingerprint": "0" * 64})
    assert info.value.field == "fingerprint"
    with pytest.raises(MalformedMeasurement) as info:
        check(good, limit=0)
    assert info.value.field == "input_limit"
    with pytest.raises(MalformedMeasurement):
        check(["not", "a", "count"])


def test_task_body_returns_failures_as_data_that_round_trip(registry):
    req = CanonicalRequest.from_dict(REQUEST).to_dict()
    ok = run_count_task(req, "gpt-4o", timeout_s=2.0, registry=registry)
    assert ok["ok"] is True and ok["result"]["model"] == "gpt-4o" and ok["result"]["quality"] == "exact_local"
    unknown = run_count_task(req, "not-here", timeout_s=2.0, registry=registry)
    assert unknown["ok"] is False
    err = count_error_from_dict(unknown["error"])
    assert type(err) is InvalidCountModel and err.kind == "InvalidCountModel"
    bad_req = run_count_task({"messages": 5}, "gpt-4o", timeout_s=2.0, registry=registry)
    assert type(count_error_from_dict(bad_req["error"])) is MalformedMeasurement
    crash = run_count_task(req, "test_crash", timeout_s=2.0, registry=registry)
    rebuilt = count_error_from_dict(crash["error"])
    assert type(rebuilt) is CountTimeout and rebuilt.details["cause"] == "counter_error"
    malformed = MalformedMeasurement("must be >= 0", field="input_tokens", model="m")
    again = count_error_from_dict(malformed.to_dict())
    assert type(again) is MalformedMeasurement and again.field == "input_tokens" and str(again) == str(malformed)


def test_build_counting_picks_the_backend(registry):
    assert isinstance(build_counting(Settings.of(), registry=registry), InProcessCounting)
    celery = build_counting(Settings.of(broker_url="redis://127.0.0.1:6379/0", count_queue="q1"), registry=registry)
    assert isinstance(celery, CeleryCounting) and celery.queue == "q1"
    assert celery.app.conf.broker_url == "redis://127.0.0.1:6379/0"
    assert celery.app.conf.result_backend == "redis://127.0.0.1:6379/0"
    rabbit = build_counting(Settings.of(broker_url="amqp://guest:guest@127.0.0.1:5672//"), registry=registry)
    assert rabbit.app.conf.result_backend == "redis://127.0.0.1:6379/0"  # Redis results with a RabbitMQ broker
    assert celery.owns_app and rabbit.owns_app  # made for the backend: closed with it
    celery.close()
    rabbit.close()


def test_concurrent_in_process_counts_agree(backend):
    results: list[int] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(20):
            n = backend.measure(REQUEST, model="gpt-4o", basis=BASIS, policy=Policy()).input_tokens
            with lock:
                results.append(n)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 160 and len(set(results)) == 1
