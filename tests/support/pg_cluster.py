"""A private, throwaway PostgreSQL cluster: ``initdb`` into a temporary folder, ``pg_ctl`` on a loopback port.

Two uses. The server-fault tests stop and restart it without disturbing anyone using the shared server.
And the tests that read the event feed at once (or hold it back on purpose) run on it: PostgreSQL's feed
shows an event once every transaction older than it has ended on the *whole server*, so on the shared
server another test's open transaction would hide their writes (or theirs would hide the others').
The plugin's session fixture ``private_pg`` starts one cluster per test process (per xdist worker), and
a test marked ``@pytest.mark.feed`` gets its ``pg_url`` / ``db_url`` there (tests/support/plugin.py).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path


def pg_bin() -> Path | None:
    """The newest PostgreSQL server binaries' folder (Debian's ``postgresql`` package), or None."""
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name), reverse=True):
        if (Path(d) / "initdb").exists():
            return Path(d)
    found = shutil.which("initdb")
    return Path(found).parent if found else None


def unavailable() -> str | None:
    """Why no private cluster can run here (None when one can)."""
    if pg_bin() is None:
        return "PostgreSQL server binaries (initdb, pg_ctl) not installed"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser"
    return None


class PrivateCluster:
    def __init__(self, bindir: Path, prefix: str = "ct_pg_") -> None:
        from tests.support.procs import free_port

        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        self.data = self.root / "data"
        self.port = free_port()
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            shutil.chown(self.root, "postgres", "postgres")
        self.admin_url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self.as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=60)

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8")

    def running(self) -> bool:
        return self._run("pg_ctl", "-D", str(self.data), "status", check=False).returncode == 0

    def start(self) -> None:
        if self.running():
            return
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.root / "log"), "-w", "-t", "30", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop", check=False)

    def new_database(self) -> str:
        """A fresh database on the cluster (its SQLAlchemy URL); it goes with the cluster."""
        import psycopg

        name = f"ct_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def started(prefix: str = "ct_pg_") -> PrivateCluster:
    """A running private cluster; raises RuntimeError saying why when none can run here."""
    why = unavailable()
    if why is not None:
        raise RuntimeError(why)
    bindir = pg_bin()
    assert bindir is not None
    c = PrivateCluster(bindir, prefix)
    try:
        c.init()
        c.start()
    except (subprocess.CalledProcessError, KeyError) as exc:  # KeyError: no 'postgres' OS user
        c.destroy()
        raise RuntimeError(f"cannot run a private PostgreSQL cluster: {exc}") from exc
    return c
