"""Replicas started for real on loopback: API replicas behind a balancer (:class:`Replicas`:
``tracker serve`` processes on one scratch database; :class:`Balancer`: HAProxy in front of them,
with its admin socket's view of each server) and PostgreSQL streaming replication
(:class:`PgReplication`: a primary and a standby of our own, ``postgres_bin`` finds the binaries).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.bench import free_port
from tests.support.loopback import (
    LOOPBACK,
    Proc,
    Started,
    free_port_pair,
    program,
    wait_for,
)

# -- API replicas behind HAProxy ----------------------------------------------------------------------


class Balancer(Started):
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
        self.proc: Proc | None = None

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
        check = subprocess.run([program("haproxy"), "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy refused its configuration:\n{check.stdout}{check.stderr}")
        # -db: stay in the foreground (the process to kill is the one started)
        self.proc = Proc([program("haproxy"), "-db", "-f", str(cfg)], self.port, self.dir / "haproxy.log").start()
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


class PgReplication(Started):
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
        self.primary_port, self.replica_port = free_port_pair()
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
