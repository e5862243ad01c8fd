"""Single-flight across real processes (behaviour.md "Decisions", last paragraph).

16 processes × 100 rounds on ONE session, on Postgres, driven through
compact pressure, the hard limit, rejections and commits. Then the log is
checked: at most one automatic attempt per (session, basis), never two open
automatic attempts at once, and the projection equals the fold. The same
again with Redis flushed mid-run, and with Redis stopped.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import uuid
import warnings

import pytest

from tests.support.measurements import measurement
from tests.support.procs import PostgresLog, PrivateRedis, racing_context
from tests.support.races import check_log, rounds_racer
from tracker.core import Policy, SessionProjector
from tracker.store import open_store
from tracker.store.migrate import upgrade

pytestmark = pytest.mark.serial  # CPU-sensitive: never beside an ordinary test (tests/support/plugin.py)

PROCS = int(os.environ.get("TRACKER_RACE_PROCS", "16"))
ROUNDS = int(os.environ.get("TRACKER_RACE_ROUNDS", "100"))


def run_race(db_url: str, redis_url: str | None, during=None) -> tuple[dict, list[dict]]:
    session_id = f"race-{uuid.uuid4().hex[:8]}"
    ctx = racing_context()
    with ctx.Pool(PROCS) as pool:
        # all processes start deciding together: forked from the preloaded server, each is ready
        # well within a second of the pool's start
        start_at = time.time() + 1.0
        results = [
            pool.apply_async(rounds_racer, (db_url, redis_url, session_id, seed, ROUNDS, start_at))
            for seed in range(PROCS)
        ]
        if during is not None:
            during(start_at)
        outcomes = [r.get(timeout=600) for r in results]
    return check_log(db_url, session_id, outcomes), [o["counts"] for o in outcomes]


@pytest.fixture
def private_redis():
    r = PrivateRedis().start()
    yield r
    r.close()


@pytest.fixture
def race_db(pg_url):
    upgrade(pg_url)
    return pg_url


@pytest.mark.slow
def test_race_with_redis(race_db, private_redis):
    log = PostgresLog.find(race_db)
    summary, counts = run_race(race_db, private_redis.url)
    total = {k: sum(c[k] for c in counts) for k in counts[0]}
    print("race with redis:", summary, total)
    assert total["compact"] == summary["automatic_attempts"] >= 3
    assert summary["revision"] > 2  # commits happened
    assert total["context_limit"] > 0 and total["wait"] + total["proceed"] > 0
    # a lost race is an answer, never a database error: the server logged nothing for this database
    if log is None:  # the race passed (reported as a pass), and what was not checked is said plainly
        warnings.warn(
            "test_race_with_redis: the PostgreSQL log is not readable here, so the server's ERROR count "
            "during the race (none expected) was not checked",
            stacklevel=1,
        )
        return
    time.sleep(0.5)  # the server writes its log asynchronously
    assert log.errors() == [], log.errors()[:5]


def test_the_postgres_log_check_sees_an_error(pg_url):
    """The log check above is not blind: one failing statement shows up as one ERROR line."""
    import psycopg

    log = PostgresLog.find(pg_url)
    if log is None:
        pytest.skip("the PostgreSQL log is not readable here")
    url = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn, pytest.raises(psycopg.errors.DivisionByZero):
        conn.execute("SELECT 1/0")
    deadline = time.time() + 5
    while not log.errors() and time.time() < deadline:
        time.sleep(0.1)
    assert len(log.errors()) == 1 and "division by zero" in log.errors()[0]


@pytest.mark.slow
def test_race_with_redis_flushed_midway(race_db, private_redis):
    def flush(start_at: float) -> None:
        while time.time() < start_at + 1.0:
            time.sleep(0.05)
        for _ in range(5):  # flush repeatedly while the race runs: locks vanish under their holders
            private_redis.flushall()
            time.sleep(0.3)

    summary, counts = run_race(race_db, private_redis.url, during=flush)
    total = {k: sum(c[k] for c in counts) for k in counts[0]}
    print("race with FLUSHALL:", summary, total)
    assert total["compact"] == summary["automatic_attempts"] >= 3


@pytest.mark.slow
def test_race_with_redis_stopped(race_db, private_redis):
    private_redis.stop()  # every process finds Redis down and runs on the database guard alone
    summary, counts = run_race(race_db, private_redis.url)
    total = {k: sum(c[k] for c in counts) for k in counts[0]}
    print("race with Redis down:", summary, total)
    assert total["compact"] == summary["automatic_attempts"] >= 3


def _holder(db_url: str, session_id: str, ready: mp.synchronize.Event) -> None:
    from tracker import Tracker

    t = Tracker(open_store(db_url, projector=SessionProjector()), policy=Policy(attempt_lease_s=1.0))
    r = t.observe(session_id, measurement=measurement("r1:a", 900))
    assert r.action == "compact"
    ready.set()
    time.sleep(3600)  # holds the attempt until killed


def test_kill_9_holder_then_lease_expires(race_db):
    from tracker import Tracker

    sid = f"kill-{uuid.uuid4().hex[:8]}"
    ctx = racing_context()
    ready = ctx.Event()
    p = ctx.Process(target=_holder, args=(race_db, sid, ready))
    p.start()
    assert ready.wait(60)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    t = Tracker(open_store(race_db, projector=SessionProjector()), policy=Policy(attempt_lease_s=1.0))
    try:
        assert t.state(sid).open_automatic is not None
        # before the lease runs out the attempt still blocks: proceed (compact pressure, attempt open)
        assert t.observe(sid, measurement=measurement("r1:b", 900)).action == "proceed"
        time.sleep(1.1)
        r = t.observe(sid, measurement=measurement("r1:c", 900))
        events = [e for e in t.history(sid)]
        assert any(e.type == "CompactionRejected" and e.data["reject_reason"] == "lease_expired" for e in events)
        assert r.action == "compact"  # the session moved on: a new attempt on a new basis
        assert check_log(race_db, sid)["automatic_attempts"] == 2
    finally:
        t.close()
