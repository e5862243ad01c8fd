"""The races the topology tests run, and the service's single-flight race.

:func:`racer` / :func:`run_race` / :func:`check_log`: N processes observing one session (until a
deadline, or for a number of rounds), recording every write the tracker acknowledged, then the log
checked: at most one automatic attempt per basis, never two open at once, versions gap-free, the
projection equal to the fold (``tracker verify``'s function), and every acknowledged write found in
the log. Over HTTP through API replicas: :func:`run_http_race` (a fleet of processes, each with its
own ``TrackerClient``, on shared sessions; :func:`check_http_log` also finds every acknowledged
call's idempotency key in the log) and :func:`observe_rate` (uncontended observes per second).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import random
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from tests.support.measurements import measurement

if TYPE_CHECKING:  # (racing processes import this module: nothing heavy at import)
    from tests.support.replicas import Replicas

# -- the race -----------------------------------------------------------------------------------------

LIMIT = 1000


def race(
    db_url: str,
    redis_url: str | None,
    session_id: str,
    seed: int,
    *,
    pooler: str = "none",
    duration_s: float | None = None,
    rounds: int | None = None,
    alternate: bool = False,
    tolerate_unavailable: bool = True,
    start: Callable[[], None] = lambda: None,
) -> dict:
    """One racing process's work: connect, ``start()`` (wait for the start line), then observe
    ``session_id`` for ``duration_s`` (or ``rounds`` times); commit or reject every attempt opened
    (a coin, or with ``alternate`` a schedule: the session's odd fencing tokens reject, the even ones
    commit, so no episode runs out of automatic attempts on rejections alone).

    Returns the counts and every acknowledged write: ``measured`` (basis, version) pairs,
    ``started``/``committed``/``rejected`` attempt ids. With ``tolerate_unavailable``, an unavailable
    store or Redis is counted (``unavailable``) and the loop goes on: only answers count as
    acknowledged; without it, it is raised.
    """
    from tracker import Tracker
    from tracker.coordination import LocalCoordinator, RedisCoordinator
    from tracker.core import Policy, SessionProjector
    from tracker.errors import AttemptError, ContextLimitError, StaleBasis, StoreUnavailable
    from tracker.store import open_store

    rng = random.Random(seed)
    coordinator = RedisCoordinator(redis_url, ttl_s=2.0, wait_s=2.0) if redis_url else LocalCoordinator()
    t = Tracker(
        open_store(db_url, projector=SessionProjector(), pooler=pooler),
        coordinator=coordinator,
        policy=Policy(attempt_lease_s=5.0, max_automatic_per_episode=3),
    )
    counts = {"compact": 0, "proceed": 0, "wait": 0, "context_limit": 0, "stale": 0, "attempt_errors": 0}
    counts["unavailable"] = 0
    acked: dict[str, list[Any]] = {"measured": [], "started": [], "committed": [], "rejected": []}
    errors: list[str] = []
    try:
        t.state(session_id)  # connected (and Redis resolved) before the start
        start()
        until = time.monotonic() + duration_s if duration_s is not None else None
        done = 0
        while (until is None or time.monotonic() < until) and (rounds is None or done < rounds):
            done += 1
            try:
                revision = t.state(session_id).revision
                used = rng.choice([rng.randint(300, 790), rng.randint(800, 999), LIMIT, LIMIT + rng.randint(0, 50)])
                basis = f"r{revision}:t{rng.randint(0, 5)}"  # few bases: processes race on the same ones
                try:
                    r = t.observe(session_id, measurement=measurement(basis, used))
                except ContextLimitError:
                    counts["context_limit"] += 1
                    continue
                except StaleBasis:
                    counts["stale"] += 1
                    continue
                counts[r.action] += 1
                acked["measured"].append((basis, r.version))
                if r.action == "compact":
                    a = r.attempt
                    acked["started"].append(a.attempt_id)
                    try:
                        if (a.fencing_token % 2 == 0) if alternate else (rng.random() < 0.5):
                            t.commit(session_id, a.attempt_id, a.fencing_token, tokens_after=rng.randint(100, 400))
                            acked["committed"].append(a.attempt_id)
                        else:
                            t.reject(session_id, a.attempt_id, a.fencing_token, "execution_failed")
                            acked["rejected"].append(a.attempt_id)
                    except AttemptError:
                        counts["attempt_errors"] += 1
            except StoreUnavailable as exc:
                if not tolerate_unavailable:
                    raise
                counts["unavailable"] += 1
                if len(errors) < 5:
                    errors.append(str(exc))
                time.sleep(0.05)
    finally:
        t.close()
    return {"counts": counts, "acked": acked, "errors": errors}


def racer(
    db_url: str,
    redis_url: str | None,
    pooler: str,
    session_id: str,
    seed: int,
    duration_s: float,
    ready: Any,
    go: Any,
    results: Any,
) -> None:
    """:func:`race` for ``duration_s`` in a process: say ``ready`` once connected, wait for ``go``, put
    the outcome on ``results``."""

    def start() -> None:
        ready.put(seed)
        go.wait(120)

    results.put(race(db_url, redis_url, session_id, seed, pooler=pooler, duration_s=duration_s, start=start))


def rounds_racer(db_url: str, redis_url: str | None, session_id: str, seed: int, rounds: int, start_at: float) -> dict:
    """:func:`race` for ``rounds`` rounds from ``start_at`` (wall clock), on the alternating schedule,
    an unavailable store raised (the service's single-flight race, in a pool)."""

    def start() -> None:
        while time.time() < start_at:
            time.sleep(0.005)

    return race(
        db_url, redis_url, session_id, seed, rounds=rounds, alternate=True, tolerate_unavailable=False, start=start
    )


def check_log(db_url: str, session_id: str, results: list[dict] | tuple = ()) -> dict:
    """The log's invariants after a race, and every acknowledged write in it; a summary."""
    from tracker.core import SessionProjector, fold
    from tracker.core.events import (
        CompactionCommitted,
        CompactionRejected,
        CompactionStarted,
        ContextMeasured,
    )
    from tracker.core.state import SessionState, apply
    from tracker.queries import events_of
    from tracker.store import open_store, verify_projections

    store = open_store(db_url, projector=SessionProjector())
    try:
        stored = list(store.read_stream(session_id))
        events = list(events_of(stored))
        versions = [e.version for e in stored]
        assert versions == list(range(1, len(versions) + 1)), "versions must be gap-free"
        seen_bases: set[str] = set()
        state = SessionState(session_id=session_id)
        max_open_auto = automatic = 0
        for e in events:
            if isinstance(e, CompactionStarted) and e.reason == "automatic":
                assert e.basis not in seen_bases, f"second automatic attempt on basis {e.basis}"
                seen_bases.add(e.basis)
                automatic += 1
            state = apply(state, e)
            max_open_auto = max(max_open_auto, sum(1 for a in state.open_attempts if a.automatic))
        assert max_open_auto <= 1, "two automatic attempts open at once"
        assert fold(events, session_id) == state
        assert verify_projections(store, SessionProjector()) == [], "projection differs from the fold"

        measured = {str(e.measurement.basis) for e in events if isinstance(e, ContextMeasured)}
        started = {e.attempt_id for e in events if isinstance(e, CompactionStarted)}
        committed = {e.attempt_id for e in events if isinstance(e, CompactionCommitted)}
        rejected = {e.attempt_id for e in events if isinstance(e, CompactionRejected)}
        lost = []
        acked_writes = 0
        for result in results:
            acked = result["acked"]
            acked_writes += sum(len(v) for v in acked.values())
            lost += [("measured", b, v) for b, v in acked["measured"] if b not in measured or v > len(versions)]
            lost += [("started", a) for a in acked["started"] if a not in started]
            lost += [("committed", a) for a in acked["committed"] if a not in committed]
            lost += [("rejected", a) for a in acked["rejected"] if a not in rejected]
        assert lost == [], f"acknowledged writes missing from the log: {lost[:5]}"
        rejections: dict[str, int] = {}
        for e in events:
            if isinstance(e, CompactionRejected):
                rejections[e.reject_reason] = rejections.get(e.reject_reason, 0) + 1
        return {
            "events": len(events),
            "automatic_attempts": automatic,
            "revision": state.revision,
            "acknowledged_writes": acked_writes,
            "rejections": rejections,
        }
    finally:
        store.close()


def run_race(
    db_url: str,
    redis_url: str | None,
    *,
    procs: int = 6,
    duration_s: float = 4.0,
    pooler: str = "none",
    session_id: str | None = None,
    during: Callable[[float], Any] | None = None,
) -> tuple[dict, dict, Any]:
    """``procs`` racer processes for ``duration_s`` on one session, all starting together once
    every one has connected; ``during(start_at)`` runs in this process meanwhile.

    Returns (log summary, summed counts, what ``during`` returned).
    """
    session_id = session_id or f"topo-{uuid.uuid4().hex[:8]}"
    # fork: a racer starts in milliseconds, not after seconds of imports on a loaded machine; each
    # builds its own store and coordinator after the fork, so no connection is shared
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    workers = [
        ctx.Process(target=racer, args=(db_url, redis_url, pooler, session_id, seed, duration_s, ready, go, results))
        for seed in range(procs)
    ]
    for w in workers:
        w.start()
    try:
        for _ in workers:
            ready.get(timeout=120)
        go.set()
        happened = during(time.time()) if during is not None else None
        outcomes = [results.get(timeout=120) for _ in workers]
    finally:
        for w in workers:
            w.join(30)
            if w.is_alive():  # pragma: no cover - a racer stuck: never leave it behind
                w.kill()
    counts: dict[str, int] = {}
    for r in outcomes:
        for k, v in r["counts"].items():
            counts[k] = counts.get(k, 0) + v
    summary = check_log(db_url, session_id, outcomes)
    summary["errors"] = [e for r in outcomes for e in r["errors"]][:3]
    return summary, counts, happened


@contextlib.contextmanager
def scratch_database(admin_libpq_url: str, prefix: str = "ct_topo") -> Iterator[tuple[str, str]]:
    """A fresh database on the server (created directly, not through a pooler): (name, libpq url); dropped after."""
    from tests.support.bench import create_scratch_db, drop_scratch_db

    name, url = create_scratch_db(admin_libpq_url, prefix)
    try:
        yield name, url
    finally:
        drop_scratch_db(admin_libpq_url, name)


def _counting_transport() -> tuple[Any, dict[str, int]]:
    """An httpx transport that counts what a client retries: 502/503/504 answers and transport errors."""
    import httpx

    seen = {"http_502": 0, "http_503": 0, "http_504": 0, "transport_errors": 0}
    names = {502: "http_502", 503: "http_503", 504: "http_504"}

    class Counting(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            try:
                response = super().handle_request(request)
            except httpx.TransportError:
                seen["transport_errors"] += 1
                raise
            if response.status_code in names:
                seen[names[response.status_code]] += 1
            return response

    return Counting(), seen


def http_racer(
    url: str,
    token: str,
    sessions: list[str],
    seed: int,
    duration_s: float,
    ready: Any,
    go: Any,
    results: Any,
) -> None:
    """One process of the fleet: its own ``TrackerClient`` on ``url`` with the fleet's key.

    Says ``ready``, waits for ``go``, then for ``duration_s`` picks one of the shared ``sessions``,
    observes it (a basis few processes share), and commits or rejects every attempt it opened.
    Every call carries an idempotency key of this process's own (``p<seed>-<n>``), which the
    client reuses on its retries. Puts on ``results``: the counts, the retries the client made
    (502/503/504, transport errors), and per session every acknowledged write: ``measured``
    (basis, version), ``started``/``committed``/``rejected`` attempt ids, and ``keys`` (the
    idempotency key of every call the tracker answered with a recorded outcome: a decision, a
    ``context_limit`` refusal, a commit, a reject).
    """
    from tracker.client import TrackerClient
    from tracker.errors import (
        AttemptError,
        ContextLimitError,
        StaleBasis,
        StoreUnavailable,
        TrackerError,
        UnknownSession,
    )

    rng = random.Random(seed)
    transport, retried = _counting_transport()
    client = TrackerClient(url, token, retries=8, backoff_s=0.1, timeout=30, transport=transport)
    counts = {"compact": 0, "proceed": 0, "wait": 0, "context_limit": 0, "stale": 0, "attempt_errors": 0}
    counts.update(unavailable=0, other_errors=0)
    acked = {s: {"measured": [], "started": [], "committed": [], "rejected": [], "keys": []} for s in sessions}
    errors: list[str] = []
    n = 0

    def key() -> str:
        nonlocal n
        n += 1
        return f"p{seed}-{n}"

    try:
        for s in sessions:
            with contextlib.suppress(UnknownSession):  # no session yet
                client.state(s)  # connected before the start
        ready.put(seed)
        go.wait(120)
        until = time.monotonic() + duration_s
        while time.monotonic() < until:
            s = rng.choice(sessions)
            mine = acked[s]
            try:
                try:
                    revision = client.state(s).revision
                except UnknownSession:
                    revision = 1
                used = rng.choice([rng.randint(300, 790), rng.randint(800, 999), LIMIT, LIMIT + rng.randint(0, 50)])
                basis = f"r{revision}:t{rng.randint(0, 5)}"
                k = key()
                try:
                    r = client.observe(s, measurement=measurement(basis, used), idempotency_key=k)
                except ContextLimitError:
                    counts["context_limit"] += 1
                    mine["keys"].append(k)  # recorded, then refused
                    continue
                except StaleBasis:
                    counts["stale"] += 1
                    continue
                counts[r.action] += 1
                mine["keys"].append(k)
                mine["measured"].append((basis, r.version))
                if r.action == "compact":
                    a = r.attempt
                    mine["started"].append(a.attempt_id)
                    k = key()
                    try:
                        if rng.random() < 0.5:
                            client.commit(s, a.attempt_id, a.fencing_token, rng.randint(100, 400), idempotency_key=k)
                            mine["committed"].append(a.attempt_id)
                        else:
                            client.reject(s, a.attempt_id, a.fencing_token, "execution_failed", idempotency_key=k)
                            mine["rejected"].append(a.attempt_id)
                        mine["keys"].append(k)
                    except AttemptError:
                        counts["attempt_errors"] += 1
            except StoreUnavailable as exc:  # retries used up: counted, never acknowledged
                counts["unavailable"] += 1
                if len(errors) < 5:
                    errors.append(str(exc))
                time.sleep(0.05)
            except TrackerError as exc:
                counts["other_errors"] += 1
                if len(errors) < 5:
                    errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        client.close()
    results.put({"counts": counts, "retried": retried, "acked": acked, "errors": errors})


def check_http_log(db_url: str, replicas: Replicas, sessions: list[str], outcomes: list[dict]) -> dict:
    """Per session, :func:`check_log` (one automatic attempt per basis, never two open, versions
    gap-free, projection = fold, every acknowledged observe/attempt in the log), then every
    acknowledged idempotency key found on the session's events. The summed summary."""
    from tracker.store import open_store

    total: dict[str, Any] = {"events": 0, "automatic_attempts": 0, "acknowledged_writes": 0, "acknowledged_keys": 0}
    store = open_store(db_url)
    try:
        for s in sessions:
            per = [{"acked": o["acked"][s]} for o in outcomes]
            summary = check_log(db_url, replicas.internal(s), per)
            for k in ("events", "automatic_attempts", "acknowledged_writes"):
                total[k] += summary[k]
            recorded = {e.idempotency_key for e in store.read_stream(replicas.internal(s)) if e.idempotency_key}
            acked_keys = [k for o in outcomes for k in o["acked"][s]["keys"]]
            lost = [k for k in acked_keys if k not in recorded]
            assert lost == [], f"{s}: acknowledged calls missing from the log (idempotency keys): {lost[:5]}"
            total["acknowledged_keys"] += len(acked_keys)
    finally:
        store.close()
    return total


def run_http_race(
    url: str,
    replicas: Replicas,
    *,
    procs: int = 12,
    sessions: int = 3,
    duration_s: float = 5.0,
    during: Callable[[float], Any] | None = None,
) -> tuple[dict, dict, Any]:
    """``procs`` :func:`http_racer` processes on ``sessions`` shared sessions through ``url`` for
    ``duration_s``, started together; ``during(start)`` runs here meanwhile; then the log checked
    (:func:`check_http_log`). Returns (summary with ``observes_per_s``, summed counts and retries,
    what ``during`` returned)."""
    tag = uuid.uuid4().hex[:8]
    names = [f"bal-{tag}-{i}" for i in range(sessions)]
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    workers = [
        ctx.Process(target=http_racer, args=(url, replicas.token, names, seed, duration_s, ready, go, results))
        for seed in range(procs)
    ]
    for w in workers:
        w.start()
    try:
        for _ in workers:
            ready.get(timeout=120)
        started = time.monotonic()
        go.set()
        happened = during(started) if during is not None else None
        outcomes = [results.get(timeout=120) for _ in workers]
    finally:
        for w in workers:
            w.join(30)
            if w.is_alive():  # pragma: no cover - a racer stuck: never leave it behind
                w.kill()
    counts: dict[str, int] = {}
    for r in outcomes:
        for k, v in [*r["counts"].items(), *r["retried"].items()]:
            counts[k] = counts.get(k, 0) + v
    summary = check_http_log(replicas.db_url, replicas, names, outcomes)
    observes = sum(counts[k] for k in ("compact", "proceed", "wait", "context_limit"))
    summary["observes"] = observes
    summary["observes_per_s"] = round(observes / duration_s, 1)
    summary["errors"] = [e for r in outcomes for e in r["errors"]][:3]
    return summary, counts, happened


def http_observer(url: str, token: str, session_id: str, duration_s: float, ready: Any, go: Any, results: Any) -> None:
    """One process observing its own session at low pressure (``proceed``, no attempts) through
    ``url`` for ``duration_s``: the request capacity, without contention. Puts its count."""
    from tracker.client import TrackerClient

    client = TrackerClient(url, token, retries=8, backoff_s=0.1, timeout=30)
    done = 0
    try:
        client.observe(session_id, measurement={"basis": "r1:m0", "input_tokens": 10, "input_limit": LIMIT})
        ready.put(session_id)
        go.wait(120)
        until = time.monotonic() + duration_s
        while time.monotonic() < until:
            done += 1
            m = {"basis": f"r1:m{done}", "input_tokens": 10 + done % 100, "input_limit": LIMIT}
            assert client.observe(session_id, measurement=m).action == "proceed"
    finally:
        client.close()
    results.put(done)


def observe_rate(url: str, replicas: Replicas, *, procs: int = 12, duration_s: float = 3.0) -> float:
    """Observes per second of ``procs`` :func:`http_observer` processes (one session each) through ``url``."""
    tag = uuid.uuid4().hex[:8]
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    workers = [
        ctx.Process(target=http_observer, args=(url, replicas.token, f"cap-{tag}-{i}", duration_s, ready, go, results))
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    try:
        for _ in workers:
            ready.get(timeout=120)
        go.set()
        done = [results.get(timeout=120) for _ in workers]
    finally:
        for w in workers:
            w.join(30)
            if w.is_alive():  # pragma: no cover
                w.kill()
    return round(sum(done) / duration_s, 1)
