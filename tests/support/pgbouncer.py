"""PgBouncer in front of the shared PostgreSQL server, started for real on a free loopback port,
and :func:`terminate_backends` (what a restarted server does to a pooler's connections).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from tests.support.bench import free_port
from tests.support.loopback import (
    LOOPBACK,
    Proc,
    Started,
    program,
)

# -- PgBouncer ----------------------------------------------------------------------------------------


class PgBouncer(Started):
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
        self.proc: Proc | None = None

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
        self.proc = Proc([program("pgbouncer"), str(ini)], self.port, self.dir / "stdout.log").start()
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
