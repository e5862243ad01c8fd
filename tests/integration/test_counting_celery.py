"""Counting through real Celery workers (prefork pool) on the real Redis broker, and RabbitMQ if it is up.

No mocks: each failure kind has a real cause (a counter of tests.support.counters named by
import path in the models file the worker reads, a queue nobody consumes, a worker killed with
SIGKILL).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

import pytest

from tests.support.bench import WorkerProcess
from tests.support.counters import test_models
from tests.support.db import REDIS_URL
from tests.support.procs import port_open
from tests.support.workers import KillableWorker
from tracker.core.model import Basis
from tracker.core.policy import Policy
from tracker.counting import CanonicalRequest, CeleryCounting, InProcessCounting, ModelRegistry
from tracker.counting.celery import make_celery_app
from tracker.errors import (
    ContextLimitUnknown,
    CountTimeout,
    InvalidCountModel,
    MalformedMeasurement,
    QualityMismatch,
)
from tracker.settings import Settings

pytestmark = [pytest.mark.celery, pytest.mark.redis]

RABBIT_URL = os.environ.get("TRACKER_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672//")
SLACK = 0.25
EPS = 0.35  # scheduling noise on a loaded CI box, on top of the documented slack

REQUESTS = [
    {"messages": [{"role": "user", "content": "hello world"}]},
    {
        "system": "You are a coding agent.",
        "messages": [
            {
                "role": "user",
                "content": "Fix the bug in parse():\n```python\ndef parse(s):\n    return int(s.strip()) + 1\n```",
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "run", "arguments": '{"cmd": "pytest -q"}'}}
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "c1",
                "content": "1 failed, 12 passed — ValueError: invalid literal for int() with base 10: 'x'",
            },
        ],
        "tools": [
            {
                "name": "run",
                "description": "Run a command",
                "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}},
            }
        ],
    },
    {"messages": [{"role": "user", "content": "Übersetze: 人人生而自由 🎉 " * 50}]},
]
BASIS = Basis(1, "m1")


def make_app(*, broker: str, backend: str, queue: str):
    """The caller's Celery app, configured as ``tracker.bootstrap`` configures it."""
    counting = Settings.of(broker_url=broker, result_backend=backend, count_queue=queue).counting
    return make_celery_app(counting, default_timeout_s=Policy().count_timeout_s)


def caller_registry() -> ModelRegistry:
    models = test_models(sleep_s=5.0)
    # known to the caller, absent from the worker's models file
    models["models"]["only-in-caller"] = {"provider": "test", "window": 100_000, "counter": "heuristic"}
    return ModelRegistry.load(models)


@pytest.fixture(scope="module")
def models_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "models.json"
    path.write_text(json.dumps(test_models(sleep_s=5.0)))
    return str(path)


@pytest.fixture(scope="module")
def workers(models_file):
    """The main worker, and a second one on its own queue that a test kills with SIGKILL."""
    run = uuid.uuid4().hex[:10]
    main = WorkerProcess(
        broker=REDIS_URL, backend=REDIS_URL, queue=f"ct-count-{run}", env={"TRACKER_MODELS_FILE": models_file}
    )
    doomed = KillableWorker(
        broker=REDIS_URL, backend=REDIS_URL, queue=f"ct-doomed-{run}", env={"TRACKER_MODELS_FILE": models_file}
    )
    main.start()
    doomed.start()  # both start in parallel
    app = make_app(broker=REDIS_URL, backend=REDIS_URL, queue=main.queue)
    try:
        main.wait_ready(app)
        doomed.wait_ready(app)
        yield {"main": main, "doomed": doomed, "app": app}
    finally:
        main.stop()
        doomed.stop()


@pytest.fixture(scope="module")
def celery_backend(workers):
    return CeleryCounting(workers["app"], caller_registry(), queue=workers["main"].queue)


@pytest.fixture(scope="module")
def local_backend():
    return InProcessCounting(caller_registry())


def test_exact_counts_via_celery_equal_in_process(celery_backend, local_backend):
    for raw in REQUESTS:
        for model in ("gpt-4o", "gpt-4-turbo", "claude-sonnet-4-5"):
            remote = celery_backend.measure(raw, model=model, basis=BASIS, policy=Policy())
            local = local_backend.measure(raw, model=model, basis=BASIS, policy=Policy())
            assert remote == local
            assert remote.fingerprint == CanonicalRequest.from_dict(raw).fingerprint


def test_slow_counter_is_count_timeout_within_budget(celery_backend):
    policy = Policy(count_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(CountTimeout):
        celery_backend.measure(REQUESTS[0], model="sleep", basis=BASIS, policy=policy)
    elapsed = time.monotonic() - started
    assert elapsed < 1.0 + SLACK + EPS, elapsed
    # the worker's soft limit stopped the sleeper: the worker counts again right away
    assert celery_backend.measure(REQUESTS[0], model="gpt-4o", basis=BASIS, policy=policy).input_tokens > 0


def test_no_worker_on_the_queue_is_count_timeout(workers):
    nobody = CeleryCounting(workers["app"], caller_registry(), queue=f"ct-nobody-{uuid.uuid4().hex[:8]}")
    started = time.monotonic()
    with pytest.raises(CountTimeout) as info:
        nobody.measure(REQUESTS[0], model="gpt-4o", basis=BASIS, policy=Policy(count_timeout_s=0.5))
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 0.5 + SLACK + EPS, elapsed
    assert info.value.details["cause"] == "timeout"


def test_worker_killed_mid_task_is_count_timeout_not_a_hang(workers):
    doomed = workers["doomed"]
    backend = CeleryCounting(workers["app"], caller_registry(), queue=doomed.queue)
    assert doomed.pool_children(), "prefork pool children expected"
    box: dict = {}

    def count() -> None:
        started = time.monotonic()
        try:
            backend.measure(REQUESTS[1], model="sleep", basis=BASIS, policy=Policy(count_timeout_s=2.0))
        except Exception as exc:  # the assertion is below, in the test thread
            box["error"] = exc
        box["elapsed"] = time.monotonic() - started

    thread = threading.Thread(target=count)
    thread.start()
    inspect = workers["app"].control.inspect(destination=[doomed.hostname], timeout=0.3)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:  # wait until the task is running in a pool child
        active = inspect.active() or {}
        if any(active.values()):
            break
    else:
        pytest.fail("the task never started")
    doomed.kill9()
    thread.join(timeout=2.0 + SLACK + 5)
    assert not thread.is_alive(), "the caller hung"
    assert isinstance(box.get("error"), CountTimeout), box
    assert box["elapsed"] < 2.0 + SLACK + EPS, box["elapsed"]


@pytest.mark.parametrize(
    "model,error,field",
    [
        ("test_wrong_model", InvalidCountModel, None),
        ("only-in-caller", InvalidCountModel, None),  # the worker cannot count a model it does not know
        ("test_wrong_quality", QualityMismatch, None),
        ("test_negative_tokens", MalformedMeasurement, "input_tokens"),
        ("test_float_tokens", MalformedMeasurement, "input_tokens"),
        ("test_missing_tokens", MalformedMeasurement, "input_tokens"),
        ("test_wrong_fingerprint", MalformedMeasurement, "fingerprint"),
        ("test_crash", CountTimeout, None),
    ],
)
def test_each_failure_kind_through_the_worker(celery_backend, model, error, field):
    started = time.monotonic()
    with pytest.raises(error) as info:
        celery_backend.measure(REQUESTS[1], model=model, basis=BASIS, policy=Policy())
    assert type(info.value) is error
    if field:
        assert info.value.field == field
    assert time.monotonic() - started < 1.0  # a real answer from the worker, not a timeout


def test_unknown_model_fails_before_sending(celery_backend):
    started = time.monotonic()
    with pytest.raises(ContextLimitUnknown):
        celery_backend.measure(REQUESTS[0], model="gpt-99", basis=BASIS, policy=Policy())
    with pytest.raises(ContextLimitUnknown):
        celery_backend.measure(REQUESTS[0], model="sleep", basis=BASIS, policy=Policy(reserved_output=300_000))
    with pytest.raises(QualityMismatch):
        celery_backend.measure(REQUESTS[0], model="sleep", basis=BASIS, policy=Policy(counter_policy="require_exact"))
    assert time.monotonic() - started < 0.2


def test_concurrent_counts_through_celery(celery_backend, local_backend):
    expected = local_backend.measure(REQUESTS[1], model="gpt-4o", basis=BASIS, policy=Policy()).input_tokens
    results: list = []

    def work() -> None:
        for _ in range(10):
            results.append(
                celery_backend.measure(REQUESTS[1], model="gpt-4o", basis=BASIS, policy=Policy()).input_tokens
            )

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [expected] * 40


@pytest.mark.skipif(not port_open("127.0.0.1", 5672), reason="RabbitMQ is not running on 127.0.0.1:5672")
def test_rabbitmq_broker_with_redis_results(models_file, local_backend):
    queue = f"ct-rabbit-{uuid.uuid4().hex[:10]}"
    worker = WorkerProcess(broker=RABBIT_URL, backend=REDIS_URL, queue=queue, env={"TRACKER_MODELS_FILE": models_file})
    app = make_app(broker=RABBIT_URL, backend=REDIS_URL, queue=queue)
    worker.start()
    try:
        worker.wait_ready(app)
        backend = CeleryCounting(app, caller_registry(), queue=queue)
        for raw in REQUESTS:
            assert backend.measure(raw, model="gpt-4o", basis=BASIS, policy=Policy()) == local_backend.measure(
                raw, model="gpt-4o", basis=BASIS, policy=Policy()
            )
        started = time.monotonic()
        with pytest.raises(CountTimeout):
            backend.measure(REQUESTS[0], model="sleep", basis=BASIS, policy=Policy(count_timeout_s=0.5))
        assert time.monotonic() - started < 0.5 + SLACK + EPS
        with pytest.raises(MalformedMeasurement):
            backend.measure(REQUESTS[0], model="test_negative_tokens", basis=BASIS, policy=Policy())
    finally:
        worker.stop()
        app.close()


@pytest.mark.parametrize(
    "broker,backend",
    [
        ("redis://127.0.0.1:1/0", REDIS_URL),  # nothing listens on port 1
        ("amqp://guest:guest@127.0.0.1:1//", REDIS_URL),
        (REDIS_URL, "redis://127.0.0.1:1/0"),
    ],
)
def test_unreachable_broker_or_result_backend_is_count_timeout(broker, backend):
    app = make_app(broker=broker, backend=backend, queue="ct-unreachable")
    counting = CeleryCounting(app, caller_registry(), queue="ct-unreachable")
    try:
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(CountTimeout):
                counting.measure(REQUESTS[0], model="gpt-4o", basis=BASIS, policy=Policy(count_timeout_s=0.5))
            assert time.monotonic() - started < 0.5 + SLACK + EPS
    finally:
        app.close()


@pytest.mark.parametrize(
    "env,variable",
    [
        ({"TRACKER_COUNT_TIMEOUT_S": "abc"}, "TRACKER_COUNT_TIMEOUT_S"),  # once silently replaced by 2.0
        ({"TRACKER_COUNT_TIMEOUT_S": "-1"}, "TRACKER_COUNT_TIMEOUT_S"),
        ({"TRACKER_LOCK_TTL_S": "soon"}, "TRACKER_LOCK_TTL_S"),  # any invalid setting, not only counting's
        ({"TRACKER_MODELS_FILE": "/nonexistent/models.json"}, "TRACKER_MODELS_FILE"),
    ],
)
def test_worker_with_an_invalid_setting_exits_at_start_naming_it(env, variable):
    worker = WorkerProcess(broker=REDIS_URL, backend=REDIS_URL, queue=f"ct-invalid-{uuid.uuid4().hex[:8]}", env=env)
    worker.start()
    try:
        assert worker.proc is not None
        code = worker.proc.wait(timeout=60)
        output = worker.output()
        assert code != 0, output
        assert variable in output and "cannot start" in output, output
        assert "Traceback" not in output, output  # one line naming the variable, not a stack
    finally:
        worker.stop()
