"""Coordination on Redis Cluster and Sentinel, started for real (tests/support/redis_topologies.py).

A 3-master Cluster with one replica per master, and a Sentinel watching a primary and a
replica. Single-flight must hold through a failover of either: real processes race on one
session while the master serving its keys is handed over or killed; the log then shows no
second automatic attempt on a basis, no acknowledged write missing, and the projection equal
to the fold. The lock is an optimisation: during the failover the coordinator runs
uncoordinated and the store's version check guards.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import redis

from tests.support.cli import run_tracker
from tests.support.loopback import missing
from tests.support.procs import free_port
from tests.support.races import run_race
from tests.support.redis_topologies import RedisClusterTopology, SentinelTopology
from tracker.coordination import RedisCoordinator, coordinator_from_url
from tracker.settings import Settings
from tracker.store.migrate import upgrade

pytestmark = [pytest.mark.serial, pytest.mark.redis]

PROCS = 4


def _need_redis() -> None:
    absent = missing("redis-server", "redis-cli")
    if absent:
        pytest.skip(f"{absent} is not installed (Debian package redis-server / redis-tools)")


@pytest.fixture(scope="module")
def cluster():
    _need_redis()
    with RedisClusterTopology(masters=3, replicas=1) as c:
        yield c


@pytest.fixture(scope="module")
def sentinel():
    _need_redis()
    with SentinelTopology(replicas=1) as s:
        yield s


@pytest.fixture
def race_db(pg_url):
    upgrade(pg_url)
    return pg_url


# -- the URL and the settings -------------------------------------------------------------------------


def test_the_cli_refuses_a_bad_redis_url_in_one_line_without_the_password(tmp_path):
    env = {"TRACKER_REDIS_URL": "redis+clustr://u:hunter2@h:7000", "TRACKER_DATABASE_URL": f"sqlite:///{tmp_path}/t.db"}
    import os

    proc = run_tracker(
        [sys.executable, "-m", "tracker.cli", "info"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode != 0
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    assert "TRACKER_REDIS_URL" in out and "unknown scheme 'redis+clustr'" in out
    assert "hunter2" not in out


# -- the cluster ----------------------------------------------------------------------------------


def test_a_sessions_keys_share_one_slot_and_the_lock_excludes_and_wakes(cluster):
    a = RedisCoordinator(cluster.url, ttl_s=5.0, wait_s=0.3)
    b = RedisCoordinator(cluster.url, ttl_s=5.0, wait_s=3.0)
    try:
        probe = redis.Redis(host="127.0.0.1", port=cluster.master_of("x"))
        for sid in ("s1", "fleet:agent-7", "we{ird}", "}x{"):
            lock, wake = a.keys(sid)
            assert probe.cluster("keyslot", lock) == probe.cluster("keyslot", wake), sid
        probe.close()
        with a.session_lock("s1") as held:
            assert held is True
            with a.session_lock("s1") as second:
                assert second is False  # held elsewhere: waited 0.3 s, then uncoordinated
            got: list[float] = []

            def wait_for_it() -> None:
                t0 = time.monotonic()
                with b.session_lock("s1") as ok:
                    assert ok
                    got.append(time.monotonic() - t0)

            waiter = threading.Thread(target=wait_for_it)
            waiter.start()
            time.sleep(0.2)
        waiter.join(5)
        assert got and got[0] < 1.0  # the release's wake-up, not the TTL (5 s)
        # the release script ran on the cluster with both keys: lock deleted, one wake-up left behind
        with a.session_lock("lonely") as held:
            assert held
        from redis.cluster import RedisCluster

        direct = RedisCluster.from_url(cluster.url.replace("redis+cluster://", "redis://").split(",")[0])
        lock, wake = a.keys("lonely")
        assert (direct.exists(lock), direct.llen(wake)) == (0, 1)
        assert 0 < direct.pttl(wake) <= 5000
        direct.close()
    finally:
        a.close()
        b.close()


def test_attempt_ended_reaches_a_listener_whichever_node_it_was_published_on(cluster):
    listener, publisher = RedisCoordinator(cluster.url, prefix="ct-pub:"), RedisCoordinator(cluster.url)
    heard: list[str] = []
    stop = listener.listen(heard.append)
    try:
        time.sleep(0.5)  # subscribed
        publisher.attempt_ended("via-client")
        masters = sorted({cluster.master_of(k) for k in ("a", "b", "c", "d", "e", "f", "g", "h")})
        assert len(masters) == 3
        for port in masters:  # PUBLISH on each master by hand: the cluster bus forwards it to every node
            c = redis.Redis(host="127.0.0.1", port=port)
            c.publish("ct-pub:attempt-ended", f"node-{port}")
            c.close()
        deadline = time.monotonic() + 3
        want = {f"node-{p}" for p in masters}
        while time.monotonic() < deadline and not want <= set(heard):
            time.sleep(0.05)
        assert want <= set(heard), heard
        assert "via-client" not in heard  # another prefix, another channel
    finally:
        stop()
        listener.close()
        publisher.close()


def test_hints_still_arrive_after_the_subscribers_node_is_killed(cluster):
    """The subscription sits on the master of the channel's slot; kill it, and the listener resubscribes."""
    listener, publisher = (
        RedisCoordinator(cluster.url, prefix="ct-kill:"),
        RedisCoordinator(cluster.url, prefix="ct-kill:"),
    )
    heard: list[str] = []
    stop = listener.listen(heard.append)
    try:
        time.sleep(0.5)
        old, _new = cluster.kill_master_of("ct-kill:attempt-ended")
        deadline = time.monotonic() + 10
        n = 0
        while time.monotonic() < deadline and not any(h.startswith("after-") for h in heard):
            publisher.attempt_ended(f"after-{n}")  # lost while the listener reconnects: hints, not truth
            n += 1
            time.sleep(0.2)
        assert any(h.startswith("after-") for h in heard), heard
    finally:
        stop()
        listener.close()
        publisher.close()
    cluster.revive(old)


def test_a_cluster_that_is_down_degrades_to_uncoordinated_instead_of_crashing(tmp_path):
    from tracker import Tracker

    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    coordinator = coordinator_from_url(url)  # builds nothing yet: a process starts with the cluster down
    with coordinator.session_lock("s") as held:
        assert held is False
    coordinator.attempt_ended("s")  # a hint lost, not an error
    coordinator.close()
    t = Tracker.from_settings(Settings.of(database_url=f"sqlite:///{tmp_path}/t.db", redis_url=url))
    try:
        assert t.state("s").version == 0
    finally:
        t.close()


def _scripts_run(port: int) -> int:
    """EVALSHA/EVAL calls a node served to clients (a replica applies a script's effects, not the call)."""
    c = redis.Redis(host="127.0.0.1", port=port)
    try:
        stats = c.info("commandstats")
    finally:
        c.close()
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))


def _assert_single_flight(summary: dict, counts: dict) -> None:
    print("race:", summary, counts)
    assert counts["compact"] == summary["automatic_attempts"] >= 1  # every acknowledged attempt is one in the log
    assert summary["acknowledged_writes"] > 50
    assert counts["unavailable"] == 0  # the store was never unavailable: only Redis moved


@pytest.mark.slow
def test_single_flight_holds_through_a_cluster_failover(cluster, race_db):
    sid = "cluster-failover"
    lock_key = RedisCoordinator(cluster.url).keys(sid)[0]

    successor = cluster.replica_of(cluster.master_of(lock_key))
    before = _scripts_run(successor)

    def failover(start_at: float) -> tuple[int, int]:
        time.sleep(max(0.0, start_at + 1.0 - time.time()))
        return cluster.failover(lock_key)

    summary, counts, (old, new) = run_race(
        race_db, cluster.url, procs=PROCS, duration_s=3.5, session_id=sid, during=failover
    )
    assert cluster.master_of(lock_key) == new == successor != old
    _assert_single_flight(summary, counts)
    assert _scripts_run(new) > before  # locks were held and released on the new master: coordination resumed


@pytest.mark.slow
def test_single_flight_holds_when_the_master_of_the_sessions_slot_is_killed(cluster, race_db):
    sid = "cluster-kill"
    lock_key = RedisCoordinator(cluster.url).keys(sid)[0]

    successor = cluster.replica_of(cluster.master_of(lock_key))
    before = _scripts_run(successor)

    def kill(start_at: float) -> tuple[int, int]:
        time.sleep(max(0.0, start_at + 0.5 - time.time()))
        return cluster.kill_master_of(lock_key)

    summary, counts, (old, new) = run_race(
        race_db, cluster.url, procs=PROCS, duration_s=5.0, session_id=sid, during=kill
    )
    assert cluster.master_of(lock_key) == new == successor != old
    _assert_single_flight(summary, counts)
    assert _scripts_run(new) > before  # coordination resumed on the elected replica
    cluster.revive(old)


# -- sentinel -----------------------------------------------------------------------------------------


def test_sentinel_locks_and_hints_follow_the_primary(sentinel):
    a, b = RedisCoordinator(sentinel.url), RedisCoordinator(sentinel.url, wait_s=0.3)
    heard: list[str] = []
    stop = a.listen(heard.append)
    try:
        with a.session_lock("s") as held, b.session_lock("s") as other:
            assert (held, other) == (True, False)
        time.sleep(0.5)
        b.attempt_ended("s")
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not heard:
            time.sleep(0.05)
        assert heard == ["s"]
        primary = redis.Redis(host="127.0.0.1", port=sentinel.primary_port())
        with a.session_lock("s"):
            assert primary.exists(a.keys("s")[0]) == 1  # on the primary Sentinel names
        primary.close()
    finally:
        stop()
        a.close()
        b.close()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sentinel_failover", "kill_primary"])
def test_single_flight_holds_through_a_sentinel_failover(sentinel, race_db, how):
    successor = next(p for p in sentinel.servers if p != sentinel.primary_port() and sentinel.servers[p].alive)
    before = _scripts_run(successor)

    def failover(start_at: float) -> tuple[int, int]:
        time.sleep(max(0.0, start_at + 0.7 - time.time()))
        return sentinel.failover() if how == "sentinel_failover" else sentinel.kill_primary()

    summary, counts, (old, new) = run_race(race_db, sentinel.url, procs=PROCS, duration_s=5.0, during=failover)
    assert sentinel.primary_port() == new == successor != old
    _assert_single_flight(summary, counts)
    assert _scripts_run(new) > before  # coordination resumed on the promoted replica


def test_hints_follow_the_primary_after_a_graceful_sentinel_failover(sentinel):
    """``SENTINEL FAILOVER`` leaves the old primary answering as one for ~10 s: the subscriber asks
    Sentinel every second and resubscribes on the new primary well before that."""
    dead = [p for p, server in sentinel.servers.items() if not server.alive]
    for port in dead:  # the kill test above left a primary without its replica
        sentinel.revive(port)
    listener = RedisCoordinator(sentinel.url, prefix="ct-follow:")
    heard: list[str] = []
    stop = listener.listen(heard.append)
    try:
        time.sleep(0.5)
        old, new = sentinel.failover()
        publisher = RedisCoordinator(sentinel.url, prefix="ct-follow:")  # connects to the new primary
        t0 = time.monotonic()
        n = 0
        while time.monotonic() - t0 < 5 and not heard:
            publisher.attempt_ended(f"after-{n}")
            n += 1
            time.sleep(0.2)
        publisher.close()
        assert heard, "no hint arrived after the failover"
        # the subscription itself moved to the new primary (it would sit on the old one otherwise)
        c = redis.Redis(host="127.0.0.1", port=new)
        try:
            assert dict(c.pubsub_numsub("ct-follow:attempt-ended")) == {b"ct-follow:attempt-ended": 1}
        finally:
            c.close()
    finally:
        stop()
        listener.close()


@pytest.mark.parametrize("topology", ["cluster", "sentinel"])
def test_readyz_checks_redis_on_either_topology(request, tmp_path, topology):
    from tracker.http.runtime import Runtime

    url = request.getfixturevalue(topology).url
    runtime = Runtime(Settings.of(database_url=f"sqlite:///{tmp_path}/t.db", redis_url=url))
    try:
        ready, checks = runtime.readiness()
        assert checks["redis"] == {"status": "ok"}, checks
        assert ready, checks
    finally:
        runtime.close()


def test_the_old_untagged_key_layout_would_fail_on_a_cluster(cluster):
    """Why the hash tag: ``tracker:lock:<sid>`` and ``…:wake`` land in different slots, and a two-key
    script over them is refused (the topology is a real cluster, not one node)."""
    from redis.cluster import RedisCluster
    from redis.exceptions import RedisClusterException, ResponseError

    from tracker.coordination import _RELEASE

    client = RedisCluster(host="127.0.0.1", port=int(cluster.url.split(":")[-1]))
    try:
        old = ["tracker:lock:s1", "tracker:lock:s1:wake"]
        assert client.keyslot(old[0]) != client.keyslot(old[1])
        with pytest.raises((RedisClusterException, ResponseError), match="(?i)slot"):
            client.eval(_RELEASE, 2, *old, "token", 1000)
        tagged = list(RedisCoordinator(cluster.url).keys("s1"))
        assert client.eval(_RELEASE, 2, *tagged, "token", 1000) == 0  # same slot: runs (nothing to release)
    finally:
        client.close()
