"""One contract, three implementations: the embedded ``Tracker``, ``TrackerClient`` and ``AsyncTrackerClient``.

The remote clients talk to a real ``tracker serve`` (uvicorn) on loopback, backed by a fresh
PostgreSQL database and Redis; the embedded Tracker runs on its own SQLite file. Every case
runs against all three and expects the same answers, the same result types and the same
typed errors. Client-only behaviour (retries that reuse the idempotency key, what is and is
not retried) is tested against a small fake server on loopback that fails on purpose.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

from tests.support.api import api_server
from tests.support.measurements import sid
from tests.support.procs import free_port
from tracker import (
    AsyncTrackerClient,
    Attempt,
    ContextLimitError,
    InvalidInput,
    ManualAttemptOpen,
    NotAttemptHolder,
    Report,
    Result,
    SessionState,
    Settings,
    StaleBasis,
    StoreUnavailable,
    Tracker,
    TrackerClient,
    UnknownAttempt,
    WaitTimeout,
)
from tracker.errors import CountTimeout
from tracker.protocol import AsyncTrackerProtocol, TrackerProtocol
from tracker.store import StoredEvent, upgrade

LIMIT = 100_000


class Loop:
    """A private event loop in a thread: the async client is driven through it like a sync one."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Sync:
    """Calls a sync or an async implementation the same way (the contract is per method, not per style)."""

    def __init__(self, impl: Any, loop: Loop | None) -> None:
        self.impl, self.loop = impl, loop

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.impl, name)
        if self.loop is None:
            return method
        if name in ("history", "sessions"):  # async iterators

            async def collect(*a: Any, **kw: Any) -> list[Any]:
                return [e async for e in method(*a, **kw)]

            return lambda *a, **kw: iter(self.loop.run(collect(*a, **kw)))
        return lambda *a, **kw: self.loop.run(method(*a, **kw))


@pytest.fixture(scope="module")
def server():
    with api_server(fleets=(f"contract-{uuid.uuid4().hex[:6]}",)) as s:
        yield s.url, s.token_a


@pytest.fixture(params=["embedded", "sync-client", "async-client"])
def tracker(request, tmp_path) -> Iterator[Sync]:
    if request.param == "embedded":
        db = f"sqlite:///{tmp_path / 'contract.db'}"
        upgrade(db)
        t = Tracker.from_settings(Settings.of(database_url=db))
        assert isinstance(t, TrackerProtocol)
        yield Sync(t, None)
        t.close()
        return
    url, token = request.getfixturevalue("server")
    if request.param == "sync-client":
        c = TrackerClient(url, token)
        assert isinstance(c, TrackerProtocol)
        yield Sync(c, None)
        c.close()
        return
    loop = Loop()
    ac = loop.run(_make_async(url, token))
    assert isinstance(ac, AsyncTrackerProtocol)
    yield Sync(ac, loop)
    loop.run(ac.aclose())
    loop.close()


async def _make_async(url: str, token: str) -> AsyncTrackerClient:
    return AsyncTrackerClient(url, token)


def m(basis: str, tokens: int, limit: int = LIMIT) -> dict[str, Any]:
    return {"basis": basis, "input_tokens": tokens, "input_limit": limit}


def test_proceed_then_compact_then_commit(tracker):
    s = sid()
    r = tracker.observe(s, measurement=m("r1:a", 10_000))
    assert isinstance(r, Result) and r.action == "proceed" and r.session_id == s
    assert r.decision.pressure == "normal" and r.decision.occupancy_bp == 1000
    r = tracker.observe(s, measurement=m("r1:b", 85_000))
    assert r.action == "compact" and r.decision.trigger == "threshold"
    a = r.attempt
    assert isinstance(a, Attempt) and a.reason == "automatic" and a.fencing_token == 1
    assert a.history_budget == int(0.95 * LIMIT)
    state = tracker.commit(s, a.attempt_id, a.fencing_token, tokens_after=20_000)
    assert isinstance(state, SessionState) and state.revision == 2 and state.session_id == s
    assert tracker.state(s).revision == 2
    events = list(tracker.history(s))
    assert all(isinstance(e, StoredEvent) for e in events)
    assert [e.type for e in events] == [
        "SessionStarted",
        "ContextMeasured",
        "ContextMeasured",
        "CompactionStarted",
        "CompactionCommitted",
    ]
    assert [e.version for e in events] == [1, 2, 3, 4, 5]
    assert [e.type for e in tracker.history(s, 4)] == ["CompactionStarted", "CompactionCommitted"]


def sessions_of(tracker: Sync, **filters: Any) -> list[dict[str, Any]]:
    """The sessions listing: ``client.sessions()`` remotely, the read side's pages on the embedded store
    (listing is a read, not a command: ``Tracker`` has no ``sessions()``)."""
    if isinstance(tracker.impl, Tracker):
        from tracker import queries
        from tracker.bootstrap import build_views

        rows, cursor, views = [], None, build_views(tracker.impl.store)
        while True:
            page = queries.sessions_page(views, limit=2, cursor=cursor, **filters)
            rows += page.sessions
            if (cursor := page.next_cursor) is None:
                return rows
    return list(tracker.sessions(page_size=2, **filters))


def test_sessions_listing(tracker):
    mine = [sid() for _ in range(3)]
    before = {r["session_id"] for r in sessions_of(tracker)}
    tracker.observe(mine[0], measurement=m("r1:a", 10_000))
    tracker.observe(mine[1], measurement=m("r1:a", 90_000))
    tracker.observe(mine[2], measurement=m("r1:a", 20_000))
    rows = [r for r in sessions_of(tracker) if r["session_id"] not in before]
    assert [r["session_id"] for r in rows] == mine[::-1]  # most recently active first, no fleet prefix
    busy = rows[1]
    assert {k: busy[k] for k in ("version", "pressure", "occupancy_bp", "revision", "open_attempts")} == {
        "version": 3,
        "pressure": "compact",
        "occupancy_bp": 9000,
        "revision": 1,
        "open_attempts": 1,
    }
    assert datetime.fromisoformat(busy["updated_at"]) >= datetime.fromisoformat(busy["created_at"])
    assert mine[1] in {r["session_id"] for r in sessions_of(tracker, pressure="compact")}
    assert not {mine[0], mine[2]} & {r["session_id"] for r in sessions_of(tracker, pressure="compact")}
    since = datetime.fromisoformat(rows[1]["updated_at"])
    assert [r["session_id"] for r in sessions_of(tracker, since=since)][:2] == [mine[2], mine[1]]
    with pytest.raises(InvalidInput):
        sessions_of(tracker, pressure="bogus")


def test_refusals_are_the_same_typed_errors(tracker):
    s = sid()
    r = tracker.observe(s, measurement=m("r1:x", 90_000))
    a = r.attempt
    with pytest.raises(NotAttemptHolder):
        tracker.commit(s, a.attempt_id, a.fencing_token + 7, tokens_after=10)
    tracker.reject(s, a.attempt_id, a.fencing_token, "execution_failed")
    # the basis is exhausted: at the hard limit nothing is eligible
    with pytest.raises(ContextLimitError) as exc:
        tracker.observe(s, measurement=m("r1:x", LIMIT))
    assert exc.value.code == "context_limit" and exc.value.details["input_limit"] == LIMIT
    # the refusal is on the record before the caller hears it
    assert [e.type for e in tracker.history(s)][-1] == "ContextLimitReached"
    with pytest.raises(UnknownAttempt):
        tracker.wait(s, "no-such-attempt", timeout=0.2)


def test_stale_basis_and_bad_input(tracker):
    s = sid()
    a = tracker.observe(s, measurement=m("r1:a", 90_000)).attempt
    tracker.commit(s, a.attempt_id, a.fencing_token, tokens_after=1000)
    with pytest.raises(StaleBasis):
        tracker.observe(s, measurement=m("r1:a", 5_000))
    before = len(list(tracker.history(s)))
    with pytest.raises(InvalidInput) as exc:
        tracker.observe(s, measurement=m("r2:b", 5_000), compaction_threshold=1.5)
    assert exc.value.field == "compaction_threshold"
    assert len(list(tracker.history(s))) == before  # bad input writes nothing


def test_idempotent_retry_gets_the_original_answer(tracker):
    s = sid()
    first = tracker.observe(s, measurement=m("r1:a", 85_000), idempotency_key="k-1")
    again = tracker.observe(s, measurement=m("r1:a", 85_000), idempotency_key="k-1")
    assert again.version == first.version and again.attempt.attempt_id == first.attempt.attempt_id
    assert [e.type for e in tracker.history(s)] == ["SessionStarted", "ContextMeasured", "CompactionStarted"]


def test_usage_and_rejection_reports(tracker):
    """The provider's reports: the same ``Report`` from every implementation, a retry with its key
    records once, bad input writes nothing, and a rejected basis then decides at the hard limit."""
    s = sid()
    tracker.observe(s, measurement=m("r1:a", 40_000))
    u = tracker.report_usage(s, basis="a", input_tokens=30_000, cache_read_tokens=2_000, idempotency_key="u-1")
    assert isinstance(u, Report) and u.type == "UsageReported" and u.session_id == s and u.version == 3
    assert u.event.counted_tokens == 40_000 and u.event.billed_tokens == 32_000 and u.event.basis == "r1:a"
    again = tracker.report_usage(s, basis="a", input_tokens=30_000, cache_read_tokens=2_000, idempotency_key="u-1")
    assert again == u
    before = len(list(tracker.history(s)))
    assert before == 3
    for bad, field in [
        (dict(basis="a", input_tokens=-1), "input_tokens"),
        (dict(basis="zz", input_tokens=1), "basis"),
        (dict(basis="a", input_tokens=1, model="gpt-4o"), "model"),
        (dict(basis="a", input_tokens=1, output_tokens=10 * LIMIT), "output_tokens"),
    ]:
        with pytest.raises(InvalidInput) as exc:
            tracker.report_usage(s, **bad)
        assert exc.value.field == field, (bad, exc.value)
    with pytest.raises(TypeError, match=r"report_usage\(\) got an unexpected keyword argument 'cached'"):
        tracker.report_usage(s, basis="a", input_tokens=1, cached=3)
    assert len(list(tracker.history(s))) == before
    r = tracker.report_rejection(s, basis="r1:a", message=f"prompt is too long: 101234 tokens > {LIMIT} maximum")
    assert r.type == "ProviderRejected" and r.event.input_tokens == 101_234 and r.event.input_limit == LIMIT
    assert r.event.form == "anthropic.prompt_too_long"
    d = tracker.observe(s, measurement=m("r1:a", 40_000))
    assert d.action == "compact" and d.decision.rejected and d.decision.trigger == "hard_limit"


def test_manual_attempt_and_wait(tracker):
    s = sid()
    tracker.observe(s, measurement=m("r1:a", 1_000))
    a = tracker.request_compaction(s)
    assert a.reason == "manual"
    with pytest.raises(ManualAttemptOpen):
        tracker.request_compaction(s)
    with pytest.raises(WaitTimeout):
        tracker.wait(s, a.attempt_id, timeout=0.3)
    committer = threading.Timer(0.5, lambda: tracker.commit(s, a.attempt_id, a.fencing_token, tokens_after=500))
    committer.start()
    started = time.monotonic()
    assert tracker.wait(s, a.attempt_id, timeout=20) == "committed"
    assert time.monotonic() - started < 10
    committer.join()


# -- client-only behaviour, against a fake server that fails on purpose --------------------------


class Flaky(http.server.BaseHTTPRequestHandler):
    """Answers the first ``fail`` requests with ``status``/``body``, then a valid observe answer."""

    script: list[tuple[int, dict[str, Any]]] = []
    seen: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Flaky.seen.append(body)
        self._answer(*(Flaky.script.pop(0) if Flaky.script else (200, OBSERVED)))

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        """A read: the first ``fail`` answers scripted, then the server's policy (``GET /v1/policy``)."""
        Flaky.seen.append({"path": self.path})
        self._answer(*(Flaky.script.pop(0) if Flaky.script else (200, SERVER_POLICY)))

    def _answer(self, status: int, answer: dict[str, Any]) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


OBSERVED = {
    "session_id": "s",
    "version": 2,
    "action": "proceed",
    "pressure": "normal",
    "pressure_before": "normal",
    "occupancy_bp": 100,
    "threshold_bp": 8000,
    "threshold_source": "default",
    "compact_level": 80_000,
    "rearm_level": 60_000,
    "hard_level": LIMIT,
    "growth_fired": False,
    "trigger": None,
    "basis": "r1:a",
    "revision": 1,
    "attempt": None,
    "waiting_on": None,
}
SERVER_POLICY = {"source": "server", "version": 0, "changed_at": None, "policy": {"compact_at_bp": 7000}}
UNAVAILABLE = {"code": "store_unavailable", "error": "StoreUnavailable", "message": "database down"}


@pytest.fixture
def flaky():
    Flaky.script, Flaky.seen = [], []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_503_is_retried_with_the_same_idempotency_key(flaky):
    Flaky.script = [(503, UNAVAILABLE), (503, UNAVAILABLE)]
    with TrackerClient(flaky, "t", backoff_s=0.01) as c:
        r = c.observe("s", measurement=m("r1:a", 100))
    assert r.action == "proceed" and len(Flaky.seen) == 3
    keys = {body["idempotency_key"] for body in Flaky.seen}
    assert len(keys) == 1 and next(iter(keys))  # generated once, reused on every retry


def test_a_report_is_retried_with_the_same_idempotency_key(flaky):
    report = {"session_id": "s", "version": 3, "type": "UsageReported", "basis": "r1:a", "model": "m"}
    report |= {"quality": "heuristic_estimate", "counted_tokens": 100, "input_tokens": 90, "at": 1.0}
    Flaky.script = [(503, UNAVAILABLE), (200, report)]
    with TrackerClient(flaky, "t", backoff_s=0.01) as c:
        r = c.report_usage("s", basis="r1:a", input_tokens=90)
    assert r.event.input_tokens == 90 and len(Flaky.seen) == 2
    assert [{k: v for k, v in b.items() if k != "idempotency_key"} for b in Flaky.seen] == [
        {"basis": "r1:a", "input_tokens": 90}
    ] * 2  # the fields given, nothing else
    keys = {b["idempotency_key"] for b in Flaky.seen}
    assert len(keys) == 1 and next(iter(keys))


def test_retries_give_up_with_the_typed_error(flaky):
    Flaky.script = [(503, UNAVAILABLE)] * 3
    with TrackerClient(flaky, "t", retries=2, backoff_s=0.01) as c, pytest.raises(StoreUnavailable):
        c.observe("s", measurement=m("r1:a", 100), idempotency_key="mine")
    assert [b["idempotency_key"] for b in Flaky.seen] == ["mine"] * 3


def test_a_recorded_count_timeout_and_a_refusal_are_not_retried(flaky):
    Flaky.script = [(504, {"code": "count_timeout", "error": "CountTimeout", "message": "slow"})]
    with TrackerClient(flaky, "t", backoff_s=0.01) as c, pytest.raises(CountTimeout):
        c.observe("s", measurement=m("r1:a", 100))
    assert len(Flaky.seen) == 1
    Flaky.seen.clear()
    Flaky.script = [
        (409, {"code": "context_limit", "error": "ContextLimitError", "message": "full", "input_limit": LIMIT})
    ]
    with TrackerClient(flaky, "t", backoff_s=0.01) as c, pytest.raises(ContextLimitError) as exc:
        c.observe("s", measurement=m("r1:a", LIMIT))
    assert exc.value.details["input_limit"] == LIMIT and len(Flaky.seen) == 1


def test_the_policy_read_is_retried_as_every_read(flaky):
    from tracker.client import FleetPolicy
    from tracker.core import Policy

    server_policy = FleetPolicy(source="server", version=0, changed_at=None, policy=Policy(compact_at_bp=7000))
    Flaky.script = [(503, UNAVAILABLE), (502, {})]
    with TrackerClient(flaky, "t", backoff_s=0.01) as c:
        assert c.policy() == server_policy
    assert Flaky.seen == [{"path": "/v1/policy"}] * 3
    Flaky.seen.clear()
    Flaky.script = [(503, UNAVAILABLE)]

    async def remote() -> FleetPolicy:
        async with AsyncTrackerClient(flaky, "t", backoff_s=0.01) as c:
            return await c.policy()

    assert asyncio.run(remote()) == server_policy and len(Flaky.seen) == 2
    Flaky.seen.clear()
    Flaky.script = [(503, UNAVAILABLE)] * 2
    with TrackerClient(flaky, "t", retries=1, backoff_s=0.01) as c, pytest.raises(StoreUnavailable):
        c.policy()
    assert len(Flaky.seen) == 2


def test_connection_refused_is_retried_then_store_unavailable():
    port = free_port()  # nothing listens here
    started = time.monotonic()
    with (
        TrackerClient(f"http://127.0.0.1:{port}", "t", retries=2, backoff_s=0.01) as c,
        pytest.raises(StoreUnavailable),
    ):
        c.state("s")
    assert time.monotonic() - started < 10


def test_an_unknown_keyword_is_a_type_error_that_writes_nothing(tracker):
    """The keyword arguments are declared once (``ObserveOptions``, ``CompactionOptions``); a name they do
    not declare is refused as Python refuses it, by every implementation, before anything is sent."""
    s = sid()
    tracker.observe(s, measurement=m("r1:a", 5_000))
    before = len(list(tracker.history(s)))
    with pytest.raises(TypeError, match=r"observe\(\) got an unexpected keyword argument 'measurment'"):
        tracker.observe(s, measurment=m("r1:b", 5_000))
    with pytest.raises(TypeError, match=r"request_compaction\(\) got an unexpected keyword argument 'bass'"):
        tracker.request_compaction(s, bass="r1:a")
    assert len(list(tracker.history(s))) == before
