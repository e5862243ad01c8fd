"""Production topologies started for real on loopback: Redis Cluster, Redis Sentinel, PgBouncer.

Each is a context manager that starts the machine's own programs (``redis-server``,
``redis-cli``, ``pgbouncer``) on free 127.0.0.1 ports in a temporary directory, waits until the
topology is usable, and stops every process it started on exit. Redis runs with
``--save "" --appendonly no``. :func:`missing` names a program that is not installed, for a
``pytest.skip`` with the reason.

Also here: the race the topology tests run (:func:`racer`, :func:`run_race`, :func:`check_log`):
N processes observing one session until a deadline, recording every write the tracker
acknowledged, then the log checked: at most one automatic attempt per basis, never two open
at once, versions gap-free, the projection equal to the fold (``tracker verify``'s function),
and every acknowledged write found in the log.

And API replicas behind a balancer: :class:`Replicas` (``tracker serve`` processes on one scratch
database), :class:`Balancer` (HAProxy in front of them, with its admin socket's view of each
server), the race over HTTP (:func:`run_http_race`: a fleet of processes, each with its own
``TrackerClient``, on shared sessions; :func:`check_http_log` also finds every acknowledged call's
idempotency key in the log) and :func:`observe_rate` (uncontended observes per second).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self

from tests.support.bench import free_port
from tests.support.measurements import measurement

__all__ = [
    "Balancer",
    "PgBouncer",
    "RedisClusterTopology",
    "Replicas",
    "SentinelTopology",
    "check_http_log",
    "check_log",
    "missing",
    "observe_rate",
    "run_http_race",
    "run_race",
    "scratch_database",
    "terminate_backends",
]

LOOPBACK = "127.0.0.1"


def missing(*programs: str) -> str | None:
    """The first of ``programs`` not on PATH (also looked for in /usr/sbin), else None."""
    for program in programs:
        if shutil.which(program) is None and not Path("/usr/sbin", program).exists():
            return program
    return None


def _program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def wait_port(port: int, timeout_s: float = 10.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process on port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection((LOOPBACK, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listens on {LOOPBACK}:{port} after {timeout_s}s")


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception as exc:  # noqa: BLE001 - a server still starting or failing over
            last = exc
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout_s}s waiting for {what} (last error: {last})")


def _free_port_pair() -> tuple[int, int]:
    """Two free ports (a cluster node's client port and its bus port)."""
    while True:
        a, b = free_port(), free_port()
        if a != b:
            return a, b


class _Started:
    """``with X() as x``: :meth:`start` on entry (what it started is closed again if it fails), :meth:`close` on exit."""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Proc:
    def __init__(self, argv: list[str], port: int, log: Path) -> None:
        self.argv, self.port, self.log = argv, port, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> _Proc:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_port(self.port, proc=self.proc)
        return self

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to hand anything over."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _redis_argv(port: int, workdir: Path, *extra: str) -> list[str]:
    return [
        "redis-server",
        "--port",
        str(port),
        "--bind",
        LOOPBACK,
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
        "--repl-diskless-sync-delay",
        "0",  # a replica syncs at once, not after the default 5 s
        *extra,
    ]


def _client(port: int, **kw: Any) -> Any:
    import redis

    return redis.Redis(host=LOOPBACK, port=port, socket_timeout=2.0, socket_connect_timeout=1.0, **kw)


# -- Redis Cluster ------------------------------------------------------------------------------------


class RedisClusterTopology(_Started):
    """``masters`` masters with ``replicas`` replicas each, formed by ``redis-cli --cluster create``.

    ``cluster-node-timeout`` is 1 s, so a killed master's replica takes over within a few seconds.
    """

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        self.masters, self.replicas, self.node_timeout_ms = masters, replicas, node_timeout_ms
        self.dir = Path(tempfile.mkdtemp(prefix="ct-cluster-"))
        self.nodes: dict[int, _Proc] = {}

    @property
    def url(self) -> str:
        ports = sorted(self.nodes)[: self.masters]
        return "redis+cluster://" + ",".join(f"{LOOPBACK}:{p}" for p in ports)

    def start(self) -> None:
        for _ in range(self.masters * (1 + self.replicas)):
            port, bus = _free_port_pair()
            workdir = self.dir / str(port)
            workdir.mkdir()
            argv = _redis_argv(
                port,
                workdir,
                "--cluster-enabled",
                "yes",
                "--cluster-port",
                str(bus),
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(self.node_timeout_ms),
                "--appendfsync",
                "no",
            )
            self.nodes[port] = _Proc(argv, port, workdir / "redis.log").start()
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"{LOOPBACK}:{p}" for p in self.nodes),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
        )
        wait_for(self.healthy, 30, "the cluster to converge")

    def healthy(self) -> bool:
        """Every live node says ``cluster_state:ok``, knows the same masters, and every replica is in sync."""
        masters = set()
        for port, node in self.nodes.items():
            if not node.alive:
                continue
            c = _client(port)
            try:
                if c.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                    return False
                info = c.info("replication")
                if info["role"] == "slave" and info.get("master_link_status") != "up":
                    return False
                if info["role"] == "master":
                    masters.add(port)
            finally:
                c.close()
        return len(masters) == self.masters

    def _nodes_view(self, port: int) -> list[dict[str, Any]]:
        c = _client(port)
        try:
            nodes = c.execute_command("CLUSTER NODES")  # parsed by redis-py: {"host:port": {...}}
        finally:
            c.close()
        return [
            {
                "id": info["node_id"],
                "port": port if "myself" in info["flags"] else int(addr.rsplit(":", 1)[1]),
                "flags": info["flags"].split(","),
                "master_id": info["master_id"],
                "slots": info["slots"],
            }
            for addr, info in nodes.items()
        ]

    def _any_live(self) -> int:
        return next(p for p, n in self.nodes.items() if n.alive)

    def master_of(self, key: str) -> int:
        """The port of the master serving ``key``'s slot now."""
        c = _client(self._any_live())
        try:
            slot = int(c.execute_command("CLUSTER KEYSLOT", key))
        finally:
            c.close()
        for node in self._nodes_view(self._any_live()):
            if "master" not in node["flags"] or "fail" in node["flags"]:
                continue
            for lo, *hi in node["slots"]:
                if int(lo) <= slot <= int(hi[0] if hi else lo):
                    return node["port"]
        raise RuntimeError(f"no master serves slot {slot}")

    def replica_of(self, master_port: int) -> int:
        """A live, in-sync replica of the master (as the master itself reports it)."""
        c = _client(master_port)
        try:
            info = c.info("replication")
        finally:
            c.close()
        for i in range(int(info.get("connected_slaves", 0))):
            replica = info[f"slave{i}"]
            if replica.get("state") == "online" and int(replica["port"]) in self.nodes:
                return int(replica["port"])
        raise RuntimeError(f"master {master_port} has no in-sync replica")

    def failover(self, key: str) -> tuple[int, int]:
        """``CLUSTER FAILOVER`` on the replica of ``key``'s master (a graceful hand-over); (old, new) ports."""
        old = self.master_of(key)
        new = self.replica_of(old)
        c = _client(new)
        try:
            c.execute_command("CLUSTER FAILOVER")
        finally:
            c.close()
        wait_for(lambda: self.master_of(key) == new and self.healthy(), 30, f"replica {new} to take over")
        return old, new

    def kill_master_of(self, key: str, wait: bool = True) -> tuple[int, int]:
        """SIGKILL the master of ``key``'s slot; wait until its replica serves the slot. (old, new) ports."""
        old = self.master_of(key)
        new = self.replica_of(old)
        self.nodes[old].kill()
        if wait:
            wait_for(lambda: self.master_of(key) == new, 30, f"replica {new} to be elected")
        return old, new

    def revive(self, port: int) -> None:
        """Start a killed node again (same port, same ``nodes.conf``): it rejoins as a replica."""
        self.nodes[port].start()
        wait_for(self.healthy, 30, f"node {port} to rejoin")

    def close(self) -> None:
        for node in self.nodes.values():
            node.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- Redis Sentinel -----------------------------------------------------------------------------------


class SentinelTopology(_Started):
    """A primary, ``replicas`` replicas and one Sentinel (quorum 1) monitoring them as ``service``."""

    def __init__(self, service: str = "ctprimary", replicas: int = 1, down_after_ms: int = 1000) -> None:
        self.service, self.replicas, self.down_after_ms = service, replicas, down_after_ms
        self.dir = Path(tempfile.mkdtemp(prefix="ct-sentinel-"))
        self.servers: dict[int, _Proc] = {}
        self.sentinel: _Proc | None = None
        self.sentinel_port = 0

    @property
    def url(self) -> str:
        return f"redis+sentinel://{LOOPBACK}:{self.sentinel_port}/{self.service}"

    def start(self) -> None:
        primary = free_port()
        self.servers[primary] = _Proc(_redis_argv(primary, self.dir), primary, self.dir / f"{primary}.log").start()
        for _ in range(self.replicas):
            port = free_port()
            argv = _redis_argv(port, self.dir, "--replicaof", LOOPBACK, str(primary))
            self.servers[port] = _Proc(argv, port, self.dir / f"{port}.log").start()
        self.sentinel_port = free_port()
        conf = self.dir / "sentinel.conf"  # Sentinel rewrites its own file: it must be writable
        conf.write_text(
            f"port {self.sentinel_port}\n"
            f"bind {LOOPBACK}\n"
            f"dir {self.dir}\n"
            f"sentinel monitor {self.service} {LOOPBACK} {primary} 1\n"
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.service} 10000\n"
            f"sentinel parallel-syncs {self.service} 1\n"
        )
        self.sentinel = _Proc(
            ["redis-server", str(conf), "--sentinel"], self.sentinel_port, self.dir / "sentinel.log"
        ).start()
        wait_for(self.ready, 30, "the sentinel to see the primary and an in-sync replica")

    def primary_port(self) -> int:
        c = _client(self.sentinel_port)
        try:
            _host, port = c.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", self.service)
        finally:
            c.close()
        return int(port)

    def settled(self) -> bool:
        """The sentinel sees its primary up, with no failover in progress."""
        c = _client(self.sentinel_port)
        try:
            flags = c.sentinel_masters()[self.service]
        finally:
            c.close()
        return (
            not (flags.get("is_sdown") or flags.get("is_odown") or flags.get("is_disconnected"))
            and bool(flags.get("is_master"))
            and "failover_in_progress" not in str(flags.get("flags", ""))
        )

    def ready(self) -> bool:
        c = _client(self.sentinel_port)
        try:
            replicas = c.execute_command("SENTINEL REPLICAS", self.service)
        finally:
            c.close()
        ok = 0
        for raw in replicas:  # parsed by redis-py: one dict per replica
            fields = {_text(k): _text(v) for k, v in raw.items()}
            if "s_down" not in fields.get("flags", "") and fields.get("master-link-status") == "ok":
                ok += 1
        primary = self.primary_port()
        p = _client(primary)
        try:
            role = p.info("replication")["role"]
        finally:
            p.close()
        return ok >= 1 and role == "master"

    def failover(self) -> tuple[int, int]:
        """``SENTINEL FAILOVER``: the primary is demoted, a replica promoted. (old, new) ports."""
        old = self.primary_port()
        c = _client(self.sentinel_port)
        try:
            c.execute_command("SENTINEL FAILOVER", self.service)
        finally:
            c.close()
        wait_for(lambda: self.primary_port() != old, 30, "the sentinel to promote a replica")
        new = self.primary_port()
        wait_for(lambda: _role(new) == "master" and self.settled(), 30, f"{new} to become primary")
        return old, new

    def kill_primary(self) -> tuple[int, int]:
        """SIGKILL the primary; wait until Sentinel has promoted a replica. (old, new) ports."""
        old = self.primary_port()
        self.servers[old].kill()
        wait_for(lambda: self.primary_port() != old, 30, "the sentinel to promote a replica")
        new = self.primary_port()
        wait_for(lambda: _role(new) == "master" and self.settled(), 30, f"{new} to become primary")
        return old, new

    def revive(self, port: int) -> None:
        """Start a killed server again, as a replica of the current primary; wait until Sentinel sees it in sync."""
        primary = self.primary_port()
        argv = [*_redis_argv(port, self.dir), "--replicaof", LOOPBACK, str(primary)]
        self.servers[port] = _Proc(argv, port, self.dir / f"{port}.log").start()
        wait_for(self.ready, 30, f"{port} to replicate {primary}")

    def close(self) -> None:
        if self.sentinel is not None:
            self.sentinel.kill()
        for server in self.servers.values():
            server.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _role(port: int) -> str:
    c = _client(port)
    try:
        return str(c.info("replication")["role"])
    finally:
        c.close()


# -- PgBouncer ----------------------------------------------------------------------------------------


class PgBouncer(_Started):
    """PgBouncer in front of a PostgreSQL server, every database name passed through (``* = …``).

    ``pool_mode`` ``transaction`` by default, ``auth_type = trust``, a small pool so transactions
    of different clients share server connections. As root it runs as ``user = postgres``
    (PgBouncer refuses to run as root otherwise), so its directory is handed to that user.
    """

    def __init__(
        self,
        pg_host: str = LOOPBACK,
        pg_port: int = 5432,
        *,
        pool_mode: str = "transaction",
        pool_size: int = 4,
        user: str = "postgres",
    ) -> None:
        self.pg_host, self.pg_port, self.pool_mode, self.pool_size, self.user = (
            pg_host,
            pg_port,
            pool_mode,
            pool_size,
            user,
        )
        self.dir = Path(tempfile.mkdtemp(prefix="ct-pgbouncer-"))
        self.port = free_port()
        self.proc: _Proc | None = None

    def url(self, database: str, user: str = "postgres") -> str:
        """A SQLAlchemy URL (psycopg 3) of ``database`` through this PgBouncer."""
        return f"postgresql+psycopg://{user}@{LOOPBACK}:{self.port}/{database}"

    def _write_config(self) -> Path:
        ini = self.dir / "pgbouncer.ini"
        (self.dir / "userlist.txt").write_text(f'"{self.user}" ""\n')
        lines = [
            "[databases]",
            f"* = host={self.pg_host} port={self.pg_port}",
            "",
            "[pgbouncer]",
            f"listen_addr = {LOOPBACK}",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {self.dir / 'userlist.txt'}",
            f"pool_mode = {self.pool_mode}",
            f"default_pool_size = {self.pool_size}",
            "max_client_conn = 500",
            f"admin_users = {self.user}",
            f"logfile = {self.dir / 'pgbouncer.log'}",
            f"pidfile = {self.dir / 'pgbouncer.pid'}",
            "server_login_retry = 1",
            "ignore_startup_parameters = extra_float_digits",
        ]
        if os.geteuid() == 0:
            lines.append(f"user = {self.user}")
        ini.write_text("\n".join(lines) + "\n")
        if os.geteuid() == 0:
            import pwd

            pw = pwd.getpwnam(self.user)
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, pw.pw_uid, pw.pw_gid)
        return ini

    def start(self) -> PgBouncer:
        ini = self._write_config()
        self.proc = _Proc([_program("pgbouncer"), str(ini)], self.port, self.dir / "stdout.log").start()
        return self

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            (self.dir / "pgbouncer.pid").unlink(missing_ok=True)

    def restart(self, down_s: float = 0.3) -> None:
        """SIGKILL PgBouncer (every client and server connection drops), then start it on the same port."""
        self.kill()
        time.sleep(down_s)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.start()
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def log(self) -> str:
        path = self.dir / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def terminate_backends(admin_libpq_url: str, database: str) -> int:
    """``pg_terminate_backend`` every server connection to ``database`` (PgBouncer's, under it); how many."""
    import psycopg

    with psycopg.connect(admin_libpq_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (database,),
        ).fetchall()
    return sum(1 for (ok,) in rows if ok)


# -- the race -----------------------------------------------------------------------------------------

LIMIT = 1000


def _measurement(basis: str, used: int) -> dict:
    return measurement(basis, used, LIMIT)


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
    """Connect, say ``ready``, wait for ``go``, then observe ``session_id`` for ``duration_s``;
    commit or reject every attempt opened; put the outcome on ``results``.

    Returns the counts and every acknowledged write: ``measured`` (basis, version) pairs,
    ``started``/``committed``/``rejected`` attempt ids. An unavailable store or Redis is
    counted (``unavailable``) and the loop goes on: only answers count as acknowledged.
    """
    from tracker.coordination import LocalCoordinator, RedisCoordinator
    from tracker.core import Policy, SessionProjector
    from tracker.errors import AttemptError, ContextLimitError, StaleBasis, StoreUnavailable
    from tracker.service import Tracker
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
        ready.put(seed)
        go.wait(120)
        until = time.monotonic() + duration_s
        while time.monotonic() < until:
            try:
                revision = t.state(session_id).revision
                used = rng.choice([rng.randint(300, 790), rng.randint(800, 999), LIMIT, LIMIT + rng.randint(0, 50)])
                basis = f"r{revision}:t{rng.randint(0, 5)}"  # few bases: processes race on the same ones
                try:
                    r = t.observe(session_id, measurement=_measurement(basis, used))
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
                        if rng.random() < 0.5:
                            t.commit(session_id, a.attempt_id, a.fencing_token, tokens_after=rng.randint(100, 400))
                            acked["committed"].append(a.attempt_id)
                        else:
                            t.reject(session_id, a.attempt_id, a.fencing_token, "execution_failed")
                            acked["rejected"].append(a.attempt_id)
                    except AttemptError:
                        counts["attempt_errors"] += 1
            except StoreUnavailable as exc:
                counts["unavailable"] += 1
                if len(errors) < 5:
                    errors.append(str(exc))
                time.sleep(0.05)
    finally:
        t.close()
    results.put({"counts": counts, "acked": acked, "errors": errors})


def check_log(db_url: str, session_id: str, results: list[dict]) -> dict:
    """The log's invariants after a race, and every acknowledged write in it; a summary."""
    from tracker.core import SessionProjector, fold
    from tracker.core.events import (
        CompactionCommitted,
        CompactionRejected,
        CompactionStarted,
        ContextMeasured,
        event_from_data,
    )
    from tracker.core.state import SessionState, apply
    from tracker.store import open_store, verify_projections

    store = open_store(db_url, projector=SessionProjector())
    try:
        stored = list(store.read_stream(session_id))
        events = [event_from_data(e.type, e.data) for e in stored]
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

        measured = {e.measurement["basis"] for e in events if isinstance(e, ContextMeasured)}
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
        return {
            "events": len(events),
            "automatic_attempts": automatic,
            "revision": state.revision,
            "acknowledged_writes": acked_writes,
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


# -- API replicas behind HAProxy ----------------------------------------------------------------------


class Balancer(_Started):
    """HAProxy (Debian's ``/usr/sbin/haproxy``) on a free loopback port in front of HTTP servers.

    One frontend, one backend balancing ``roundrobin`` (or ``balance``, e.g. ``uri depth 3``
    with ``hash_type="consistent"``: each session's requests to one server) over ``servers`` (name -> loopback port),
    each health-checked with ``GET <check_path>`` every ``inter_ms`` (down after ``fall`` failed
    checks, up again after ``rise`` good ones). A connection refused by a server is retried on
    another one (``retries 3``, ``option redispatch 1``): nothing was sent, so that is safe for any
    request. A request already sent to a server that dies answers 502, which the tracker's clients
    retry with the same idempotency key. Timeouts leave room for the 30 s long-poll. The admin
    socket (:meth:`servers_status`) reports each server's check status and request count. With
    ``fail_open`` each server is also a ``backup`` without a check: while every checked server is
    down (all fail ``/readyz``, e.g. Redis is down) requests still reach the servers.
    """

    def __init__(
        self,
        servers: dict[str, int],
        *,
        check_path: str = "/readyz",
        inter_ms: int = 250,
        fall: int = 2,
        rise: int = 2,
        balance: str = "roundrobin",
        hash_type: str | None = None,
        fail_open: bool = False,
    ) -> None:
        self.balance, self.hash_type, self.fail_open = balance, hash_type, fail_open
        self.servers, self.check_path, self.inter_ms, self.fall, self.rise = (
            dict(servers),
            check_path,
            inter_ms,
            fall,
            rise,
        )
        self.dir = Path(tempfile.mkdtemp(prefix="ct-haproxy-"))
        self.port = free_port()
        self.socket = self.dir / "admin.sock"
        self.proc: _Proc | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def config(self) -> str:
        lines = [
            "global",
            f"    stats socket {self.socket} mode 600 level admin",
            "    maxconn 4000",
            "",
            "defaults",
            "    mode http",
            "    timeout connect 2s",
            "    timeout client 45s",
            "    timeout server 45s",
            "    timeout http-keep-alive 10s",
            "    timeout check 2s",
            "    retries 3",
            "    option redispatch 1",
            "",
            "frontend api",
            f"    bind {LOOPBACK}:{self.port}",
            "    default_backend replicas",
            "",
            "backend replicas",
            f"    balance {self.balance}",
            *([f"    hash-type {self.hash_type}"] if self.hash_type else []),
            f"    option httpchk GET {self.check_path}",
            "    http-check expect status 200",
            f"    default-server inter {self.inter_ms}ms fall {self.fall} rise {self.rise}",
            *(f"    server {name} {LOOPBACK}:{port} check" for name, port in self.servers.items()),
        ]
        if self.fail_open:  # the same servers, unchecked, used only while every checked one is down
            lines.insert(lines.index("backend replicas") + 1, "    option allbackups")
            lines += [f"    server {name}-any {LOOPBACK}:{port} backup" for name, port in self.servers.items()]
        return "\n".join(lines) + "\n"

    def start(self) -> Balancer:
        cfg = self.dir / "haproxy.cfg"
        cfg.write_text(self.config())
        check = subprocess.run([_program("haproxy"), "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy refused its configuration:\n{check.stdout}{check.stderr}")
        # -db: stay in the foreground (the process to kill is the one started)
        self.proc = _Proc([_program("haproxy"), "-db", "-f", str(cfg)], self.port, self.dir / "haproxy.log").start()
        wait_for(lambda: all(s["status"] == "UP" for s in self.servers_status().values()), 30, "every server UP")
        return self

    def _admin(self, command: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(self.socket))
            s.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def servers_status(self) -> dict[str, dict[str, Any]]:
        """Per server of the backend: ``status`` (``UP``, ``DOWN``, ``UP 1/2``…), ``requests``
        (HTTP requests sent to it), ``responses`` (by class: ``2xx``…), ``check`` (last check's status)."""
        lines = [line for line in self._admin("show stat").splitlines() if line]
        header = lines[0].lstrip("# ").split(",")
        out: dict[str, dict[str, Any]] = {}
        for line in lines[1:]:
            row = dict(zip(header, line.split(","), strict=False))
            if row.get("pxname") == "replicas" and row.get("svname") in self.servers:
                out[row["svname"]] = {
                    "status": row["status"],
                    "requests": int(row.get("stot") or 0),
                    "responses": {k: int(row.get(f"hrsp_{k}") or 0) for k in ("2xx", "4xx", "5xx")},
                    "check": row.get("check_status", ""),
                }
        return out

    def wait_status(self, server: str, status: str, timeout_s: float = 30) -> float:
        """Wait until ``server``'s status is ``status``; the seconds it took."""
        started = time.monotonic()
        wait_for(lambda: self.servers_status()[server]["status"] == status, timeout_s, f"{server} to be {status}")
        return time.monotonic() - started

    def log(self) -> str:
        path = self.dir / "haproxy.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class Replicas:
    """``n`` ``tracker serve`` processes on one scratch PostgreSQL database (at head) and one Redis,
    with one fleet and its key, each on its own loopback port, started together.

    ``settings`` (``TRACKER_*``) configure every replica. The fleet's sessions are stored as
    ``"<fleet_id>:<session>"`` (:meth:`internal`), so the Redis keys of this fleet
    (``tracker:{<fleet_id>:<session>}:…``) are a prefix of its own in a shared Redis.
    """

    def __init__(self, n: int = 2, *, redis_url: str | None = None, **settings: str) -> None:
        self.n, self.redis_url, self.settings = n, redis_url, settings
        self.ports = [free_port() for _ in range(n)]
        self.names = [f"r{i + 1}" for i in range(n)]
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.env: dict[str, str] = {}
        self.db_url = self.token = self.fleet_id = ""
        self._db: contextlib.ExitStack | None = None

    def url(self, i: int) -> str:
        return f"http://{LOOPBACK}:{self.ports[i]}"

    def internal(self, session_id: str) -> str:
        return f"{self.fleet_id}:{session_id}"

    def __enter__(self) -> Replicas:
        from tests.support.db import REDIS_URL
        from tests.support.db import scratch_database as scratch
        from tracker.store import make_engine
        from tracker.store.fleets import FleetStore

        self._db = contextlib.ExitStack()
        try:
            self.db_url = self._db.enter_context(scratch("ct_bal", upgrade=True))
            engine = make_engine(self.db_url)
            try:
                fleets = FleetStore(engine)
                fleet = fleets.create_fleet("balanced")
                self.fleet_id, self.token = fleet["fleet_id"], fleets.create_key(fleet["fleet_id"])[1]
            finally:
                engine.dispose()
            env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKER_")}
            env.update(TRACKER_DATABASE_URL=self.db_url, TRACKER_REDIS_URL=self.redis_url or REDIS_URL)
            env.update(self.settings)
            self.env = env
            self._start_all()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, i: int) -> subprocess.Popen:
        import sys

        log = open(self.log_path(i), "ab")  # noqa: SIM115 - the child holds it; closed below
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "tracker.cli", "serve", "--port", str(self.ports[i]), "--no-access-log"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()

    def log_path(self, i: int) -> Path:
        return Path(tempfile.gettempdir()) / f"ct-replica-{self.ports[i]}.log"

    def _ready(self, i: int) -> bool:
        import httpx

        proc = self.procs[i]
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"replica {self.names[i]} exited: {self.log_path(i).read_text(errors='replace')[-2000:]}"
            )
        try:
            return httpx.get(self.url(i) + "/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def _start_all(self) -> None:
        for i in range(self.n):  # every replica imports and starts at once
            self.procs[i] = self._spawn(i)
        for i in range(self.n):
            wait_for(lambda i=i: self._ready(i), 90, f"replica {self.names[i]} to be ready")

    def start(self, i: int) -> None:
        """Start replica ``i`` again (after :meth:`kill`) on its port; wait until it is ready."""
        self.procs[i] = self._spawn(i)
        wait_for(lambda: self._ready(i), 90, f"replica {self.names[i]} to be ready")

    def kill(self, i: int) -> None:
        """SIGKILL replica ``i``: in-flight requests get no answer, nothing is handed over."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def close(self) -> None:
        from tests.support.bench import stop_server

        for i, proc in enumerate(self.procs):
            if proc is not None:
                stop_server(proc, grace_s=10)
                self.log_path(i).unlink(missing_ok=True)
        self.procs = [None] * self.n
        if self._db is not None:
            self._db.close()
            self._db = None


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
                    r = client.observe(s, measurement=_measurement(basis, used), idempotency_key=k)
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


# -- PostgreSQL streaming replication -----------------------------------------------------------------


def postgres_bin() -> Path | None:
    """The directory of the machine's PostgreSQL server programs (``initdb``, ``pg_ctl``, ``postgres``),
    the newest version under /usr/lib/postgresql (Debian), else the one ``pg_config --bindir`` names."""
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: _version_key(p.parent.name))
    for bindir in reversed(candidates):
        if all((bindir / p).exists() for p in ("initdb", "pg_ctl", "postgres", "pg_basebackup")):
            return bindir
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=False).stdout.strip()
        if out and all(Path(out, p).exists() for p in ("initdb", "pg_ctl", "postgres", "pg_basebackup")):
            return Path(out)
    return None


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(p) for p in name.split(".") if p.isdigit())


def _lsn(text: str) -> int:
    hi, _, lo = text.partition("/")
    return (int(hi, 16) << 32) | int(lo, 16)


class PgReplication(_Started):
    """A PostgreSQL primary of its own and a hot standby streaming from it, on free loopback ports.

    The primary is a fresh cluster (``initdb --auth=trust``, ``fsync = off``) in a temporary
    directory, never the shared server; the standby is made from it with
    ``pg_basebackup -R -X stream`` and streams from it. Both log every statement
    (``log_statement = all``, the application name in each line) to ``primary.log`` and
    ``replica.log``, so a test can show which server a statement went to. As root the programs
    run as the ``postgres`` user (``initdb`` refuses root). ``wait_caught_up()`` waits until the
    standby has replayed all the WAL the primary has written.
    """

    def __init__(self, *, user: str = "postgres") -> None:
        bindir = postgres_bin()
        if bindir is None:
            raise RuntimeError("no PostgreSQL server programs (initdb, pg_ctl, pg_basebackup) on this machine")
        self.bin = bindir
        self.user = user
        self.dir = Path(tempfile.mkdtemp(prefix="ct-pgrepl-"))
        self.primary_dir, self.replica_dir = self.dir / "primary", self.dir / "replica"
        self.primary_port, self.replica_port = _free_port_pair()
        self.started: list[Path] = []

    # -- URLs ---------------------------------------------------------------------------------------

    def libpq(self, database: str = "postgres", *, replica: bool = False) -> str:
        port = self.replica_port if replica else self.primary_port
        return f"postgresql://{self.user}@{LOOPBACK}:{port}/{database}"

    def url(self, database: str = "postgres", *, replica: bool = False) -> str:
        """A SQLAlchemy URL (psycopg 3) of ``database`` on the primary or on the standby."""
        return "postgresql+psycopg" + self.libpq(database, replica=replica)[len("postgresql") :]

    # -- life cycle ---------------------------------------------------------------------------------

    def _run(self, program: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        argv = [str(self.bin / program), *args]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", self.user, "--", *argv]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{program} {' '.join(args)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        return proc

    def start(self) -> None:
        if os.geteuid() == 0:
            import pwd

            pw = pwd.getpwnam(self.user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self._run("initdb", "-D", str(self.primary_dir), "--auth=trust", "-U", self.user, "--no-sync", "-E", "UTF8")
        with open(self.primary_dir / "postgresql.conf", "a") as conf:  # copied to the standby by the base backup
            conf.write(
                "\n# ct-pgrepl\n"
                f"listen_addresses = '{LOOPBACK}'\n"
                f"unix_socket_directories = '{self.dir}'\n"
                "fsync = off\nfull_page_writes = off\n"
                "shared_buffers = 16MB\nmax_connections = 80\n"
                "wal_level = replica\nmax_wal_senders = 4\nhot_standby = on\nhot_standby_feedback = on\n"
                "wal_receiver_status_interval = 1s\n"
                "log_statement = 'all'\nlog_line_prefix = '%m [%p] %a: '\n"
            )
        self._pg_ctl_start(self.primary_dir, self.primary_port, "primary.log")
        self._run(
            "pg_basebackup",
            "-h",
            LOOPBACK,
            "-p",
            str(self.primary_port),
            "-U",
            self.user,
            "-D",
            str(self.replica_dir),
            "-R",
            "-X",
            "stream",
            "--no-sync",
        )
        self._pg_ctl_start(self.replica_dir, self.replica_port, "replica.log")
        wait_for(self.streaming, 30, "the standby to stream from the primary")

    def _pg_ctl_start(self, datadir: Path, port: int, log: str) -> None:
        self._run(
            "pg_ctl", "start", "-w", "-t", "60", "-D", str(datadir), "-l", str(self.dir / log), "-o", f"-p {port}"
        )
        if datadir not in self.started:
            self.started.append(datadir)

    def _pg_ctl_stop(self, datadir: Path, mode: str = "fast") -> None:
        if (datadir / "postmaster.pid").exists():
            self._run("pg_ctl", "stop", "-w", "-t", "60", "-m", mode, "-D", str(datadir))

    def stop_replica(self, mode: str = "immediate") -> None:
        self._pg_ctl_stop(self.replica_dir, mode)

    def start_replica(self) -> None:
        self._pg_ctl_start(self.replica_dir, self.replica_port, "replica.log")
        wait_for(self.streaming, 30, "the standby to stream again")

    def close(self) -> None:
        for datadir in reversed(self.started):
            try:
                self._pg_ctl_stop(datadir, "immediate")
            except (RuntimeError, subprocess.TimeoutExpired):  # pragma: no cover - a server already gone
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- looking at it ------------------------------------------------------------------------------

    def sql(self, statement: str, *params: Any, replica: bool = False, database: str = "postgres") -> list[tuple]:
        import psycopg

        with psycopg.connect(self.libpq(database, replica=replica), autocommit=True, connect_timeout=5) as conn:
            cur = conn.execute(statement, params or None)
            return cur.fetchall() if cur.description else []

    def streaming(self) -> bool:
        """The primary has a walsender in ``streaming`` state and the standby is in recovery."""
        states = [r[0] for r in self.sql("SELECT state FROM pg_stat_replication")]
        return "streaming" in states and bool(self.sql("SELECT pg_is_in_recovery()", replica=True)[0][0])

    def lag_bytes(self) -> int:
        """WAL the primary has flushed (every acknowledged commit: ``synchronous_commit`` is on) that the
        standby has not replayed yet. (Not the insert position: a trailing record on a partly filled page
        may wait many seconds on an idle server before it is flushed and streamed.)"""
        (primary,) = self.sql("SELECT pg_current_wal_flush_lsn()::text")[0]
        (replayed,) = self.sql("SELECT coalesce(pg_last_wal_replay_lsn(), '0/0')::text", replica=True)[0]
        return max(0, _lsn(primary) - _lsn(replayed))

    def wait_caught_up(self, timeout_s: float = 30) -> None:
        wait_for(lambda: self.lag_bytes() == 0, timeout_s, "the standby to replay everything")

    def pause_replay(self) -> None:
        self.sql("SELECT pg_wal_replay_pause()", replica=True)

    def resume_replay(self) -> None:
        self.sql("SELECT pg_wal_replay_resume()", replica=True)

    def log(self, which: str = "replica") -> str:
        path = self.dir / f"{which}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def create_database(self, name: str) -> None:
        """``CREATE DATABASE`` on the primary, then wait until the standby has it."""
        self.sql(f'CREATE DATABASE "{name}"')
        self.wait_caught_up()
