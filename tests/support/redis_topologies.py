"""Redis Cluster and Redis Sentinel, started for real on loopback (``redis-server``, ``redis-cli``)
on free 127.0.0.1 ports in a temporary directory, with ``--save "" --appendonly no``; each waits
until the topology is usable and stops every process it started on exit.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tests.support.bench import free_port
from tests.support.loopback import (
    LOOPBACK,
    Proc,
    Started,
    free_port_pair,
    redis_argv,
    redis_client,
    wait_for,
)

# -- Redis Cluster ------------------------------------------------------------------------------------


class RedisClusterTopology(Started):
    """``masters`` masters with ``replicas`` replicas each, formed by ``redis-cli --cluster create``.

    ``cluster-node-timeout`` is 1 s, so a killed master's replica takes over within a few seconds.
    """

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        self.masters, self.replicas, self.node_timeout_ms = masters, replicas, node_timeout_ms
        self.dir = Path(tempfile.mkdtemp(prefix="ct-cluster-"))
        self.nodes: dict[int, Proc] = {}

    @property
    def url(self) -> str:
        ports = sorted(self.nodes)[: self.masters]
        return "redis+cluster://" + ",".join(f"{LOOPBACK}:{p}" for p in ports)

    def start(self) -> None:
        for _ in range(self.masters * (1 + self.replicas)):
            port, bus = free_port_pair()
            workdir = self.dir / str(port)
            workdir.mkdir()
            argv = redis_argv(
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
            self.nodes[port] = Proc(argv, port, workdir / "redis.log").start()
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
            c = redis_client(port)
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
        c = redis_client(port)
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
        c = redis_client(self._any_live())
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
        c = redis_client(master_port)
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
        c = redis_client(new)
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


class SentinelTopology(Started):
    """A primary, ``replicas`` replicas and one Sentinel (quorum 1) monitoring them as ``service``."""

    def __init__(self, service: str = "ctprimary", replicas: int = 1, down_after_ms: int = 1000) -> None:
        self.service, self.replicas, self.down_after_ms = service, replicas, down_after_ms
        self.dir = Path(tempfile.mkdtemp(prefix="ct-sentinel-"))
        self.servers: dict[int, Proc] = {}
        self.sentinel: Proc | None = None
        self.sentinel_port = 0

    @property
    def url(self) -> str:
        return f"redis+sentinel://{LOOPBACK}:{self.sentinel_port}/{self.service}"

    def start(self) -> None:
        primary = free_port()
        self.servers[primary] = Proc(redis_argv(primary, self.dir), primary, self.dir / f"{primary}.log").start()
        for _ in range(self.replicas):
            port = free_port()
            argv = redis_argv(port, self.dir, "--replicaof", LOOPBACK, str(primary))
            self.servers[port] = Proc(argv, port, self.dir / f"{port}.log").start()
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
        self.sentinel = Proc(
            ["redis-server", str(conf), "--sentinel"], self.sentinel_port, self.dir / "sentinel.log"
        ).start()
        wait_for(self.ready, 30, "the sentinel to see the primary and an in-sync replica")

    def primary_port(self) -> int:
        c = redis_client(self.sentinel_port)
        try:
            _host, port = c.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", self.service)
        finally:
            c.close()
        return int(port)

    def settled(self) -> bool:
        """The sentinel sees its primary up, with no failover in progress."""
        c = redis_client(self.sentinel_port)
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
        c = redis_client(self.sentinel_port)
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
        p = redis_client(primary)
        try:
            role = p.info("replication")["role"]
        finally:
            p.close()
        return ok >= 1 and role == "master"

    def failover(self) -> tuple[int, int]:
        """``SENTINEL FAILOVER``: the primary is demoted, a replica promoted. (old, new) ports."""
        old = self.primary_port()
        c = redis_client(self.sentinel_port)
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
        argv = [*redis_argv(port, self.dir), "--replicaof", LOOPBACK, str(primary)]
        self.servers[port] = Proc(argv, port, self.dir / f"{port}.log").start()
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
    c = redis_client(port)
    try:
        return str(c.info("replication")["role"])
    finally:
        c.close()
