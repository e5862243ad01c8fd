"""API replicas behind a balancer: two ``tracker serve`` processes behind HAProxy, one database.

Two ``tracker serve`` replicas share one scratch PostgreSQL database and the shared Redis (the
fleet's sessions, ``<fleet_id>:<session>``, are its own key prefix there); HAProxy (Debian's 2.6)
balances them round-robin on one loopback port and health-checks ``/readyz``. A fleet of 12
real processes, each with its own ``TrackerClient`` on the HAProxy URL and the fleet's key,
races on three shared sessions. Afterwards the log must hold: at most one automatic attempt per
(session, basis), never two open at once, versions gap-free, projection = fold (``tracker
verify``'s function), and every acknowledged observe, commit and reject in it (by the attempt
ids and the idempotency keys each process recorded). The same race runs direct to one replica
for the throughput figure, and again while one replica is SIGKILLed mid-run: the clients retry
with their idempotency keys and carry on through the other replica, and nothing acknowledged
is lost. Last, with a private Redis stopped: every replica fails /readyz, so HAProxy checked
strictly answers 503, and with the replicas as unchecked backups (the deploy file's fail-open)
decisions go on. Figures: docs/topologies.md "API replicas behind a balancer".
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.loopback import missing
from tests.support.procs import PrivateRedis
from tests.support.races import observe_rate, run_http_race
from tests.support.replicas import Balancer, Replicas
from tracker.client import TrackerClient

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.serial]

PROCS = 12
SESSIONS = 3
# the policy the race needs (short leases, a few automatic attempts per episode), short Redis locks
# (a lock a killed replica held frees in 2 s)
SETTINGS = {"TRACKER_ATTEMPT_LEASE_S": "5", "TRACKER_MAX_AUTOMATIC_PER_EPISODE": "3", "TRACKER_LOCK_TTL_S": "2"}


@pytest.fixture(scope="module")
def topology():
    absent = missing("haproxy")
    if absent:
        pytest.skip(f"{absent} is not installed (Debian package haproxy)")
    with Replicas(2, **SETTINGS) as replicas, Balancer(dict(zip(replicas.names, replicas.ports, strict=True))) as lb:
        yield replicas, lb


def _requests(lb: Balancer) -> dict[str, int]:
    return {name: s["requests"] for name, s in lb.servers_status().items()}


def test_a_fleet_races_through_the_balancer_and_direct(topology):
    replicas, lb = topology
    before = _requests(lb)
    balanced, counts, _ = run_http_race(lb.url, replicas, procs=PROCS, sessions=SESSIONS, duration_s=4)
    after = _requests(lb)
    direct, direct_counts, _ = run_http_race(replicas.url(0), replicas, procs=PROCS, sessions=SESSIONS, duration_s=4)
    served = {name: after[name] - before[name] for name in after}
    # capacity without contention (one session per process, every answer `proceed`), in the order
    # direct, balanced, balanced, direct so that a change of load on the machine shows
    windows = [observe_rate(url, replicas, procs=PROCS, duration_s=1.5) for url in (replicas.url(0), lb.url) * 2]
    capacity = {"direct": (windows[0] + windows[3]) / 2, "balanced": (windows[1] + windows[2]) / 2}
    print(f"\nthrough HAProxy, 2 replicas: {balanced} {counts} served {served}")
    print(f"direct to one replica: {direct} {direct_counts}")
    print(
        f"observes/s: {balanced['observes_per_s']} through HAProxy (2 replicas) vs "
        f"{direct['observes_per_s']} direct (1 server), racing on {SESSIONS} sessions; without contention "
        f"{capacity['balanced']:.1f} vs {capacity['direct']:.1f} (windows direct, balanced, balanced, direct: {windows})"
    )

    for summary, c in ((balanced, counts), (direct, direct_counts)):
        # check_log / check_http_log asserted the invariants and that nothing acknowledged is missing
        assert c["compact"] == summary["automatic_attempts"] >= 3, (summary, c)
        assert c["context_limit"] > 0 and c["wait"] + c["proceed"] > 0, c
        assert c["unavailable"] == 0 and c["other_errors"] == 0, (c, summary["errors"])
        assert summary["acknowledged_keys"] >= summary["observes"] > 0
    # round-robin: both replicas served the fleet, about equally
    total = sum(served.values())
    assert total >= balanced["observes"], (served, balanced)
    assert all(n > 0.3 * total for n in served.values()), served
    assert min(windows) > 0, windows


def test_a_replica_killed_mid_run_loses_nothing(topology):
    replicas, lb = topology
    survivor, victim = replicas.names

    def kill(started: float) -> dict:
        time.sleep(max(0.0, started + 2.0 - time.monotonic()))
        at_kill = _requests(lb)
        replicas.kill(1)
        down_s = lb.wait_status(victim, "DOWN", timeout_s=15)
        return {"at_kill": at_kill, "down_s": round(down_s, 2), "at_down": _requests(lb)}

    summary, counts, fault = run_http_race(lb.url, replicas, procs=PROCS, sessions=SESSIONS, duration_s=6, during=kill)
    end = _requests(lb)
    print(f"\nreplica {victim} SIGKILLed mid-run: {summary} {counts} {fault} end {end}")

    # nothing acknowledged is lost and single-flight held (asserted by the log check); no call gave up
    assert counts["unavailable"] == 0 and counts["other_errors"] == 0, (counts, summary["errors"])
    assert counts["compact"] <= summary["automatic_attempts"], (summary, counts)
    # the kill met traffic: requests in flight were cut off (answered 502 by HAProxy, or dropped) and
    # the clients retried them, or, when none was in flight at the kill, HAProxy sent new ones to the
    # dead replica until its check marked it DOWN and redispatched them (a machine under load can
    # leave no request in flight at the instant of the kill)
    cut = counts["http_502"] + counts["http_503"] + counts["transport_errors"]
    assert cut > 0 or fault["at_down"][victim] > fault["at_kill"][victim], (counts, fault)
    # once the check marked the victim DOWN nothing more went to it; the survivor carried on
    assert fault["down_s"] < 5, fault
    assert end[victim] == fault["at_down"][victim], (fault, end)
    assert end[survivor] > fault["at_down"][survivor], (fault, end)

    # the replica comes back: the health check on /readyz puts it into rotation again
    replicas.start(1)
    up_s = lb.wait_status(victim, "UP", timeout_s=30)
    back = _requests(lb)[victim]
    with TrackerClient(lb.url, replicas.token) as c:
        for i in range(6):
            c.observe(f"back-{i}", measurement={"basis": "r1:m1", "input_tokens": 10, "input_limit": 1000})
    assert _requests(lb)[victim] > back, "the revived replica gets requests again"
    print(f"{victim} back in rotation {up_s:.2f} s after it was ready")


def test_redis_down_fails_every_readyz_and_the_balancer_fails_open():
    """/readyz fails on every replica at once when Redis stops answering, though the replicas still
    decide (uncoordinated, the store's version check guards): checked strictly, HAProxy answers 503
    to everything; with the replicas as unchecked backups (deploy/haproxy/haproxy.cfg) it goes on."""
    absent = missing("haproxy", "redis-server")
    if absent:
        pytest.skip(f"{absent} is not installed")

    redis = PrivateRedis().start()
    try:
        with Replicas(2, redis_url=redis.url, **SETTINGS) as replicas:
            servers = dict(zip(replicas.names, replicas.ports, strict=True))
            with Balancer(servers) as strict, Balancer(servers, fail_open=True) as fail_open:
                redis.stop()
                for lb in (strict, fail_open):
                    for name in replicas.names:
                        lb.wait_status(name, "DOWN", timeout_s=15)
                m = {"measurement": {"basis": "r1:m1", "input_tokens": 10, "input_limit": 1000}}
                headers = {"Authorization": f"Bearer {replicas.token}"}
                refused = httpx.post(f"{strict.url}/v1/sessions/s-strict/observe", json=m, headers=headers, timeout=30)
                assert refused.status_code == 503, refused.text  # HAProxy's own: no server
                with TrackerClient(fail_open.url, replicas.token) as c:
                    answers = [c.observe(f"s-open-{i}", measurement=m["measurement"]).action for i in range(6)]
                assert answers == ["proceed"] * 6
    finally:
        redis.close()
