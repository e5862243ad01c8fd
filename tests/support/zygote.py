"""A pre-imported interpreter that forks one process per ``tracker`` command: the CLI tests' speed-up.

Every ``tracker …`` the tests run used to be a new interpreter that imported SQLAlchemy, psycopg,
typer and the tracker before doing anything: about a second of CPU per command, several hundred
commands per suite. The zygote imports all of that once; each command is then a ``fork`` of it
with the command's own argv, environment, working folder and standard streams (file descriptors
passed over a Unix socket), its real exit status, signals and all. What the command does after
the fork is exactly what ``python -m tracker.cli`` (or the ``tracker`` console script) does after
its imports.

For the ``tracker`` console script, the child runs the script's own file (as the interpreter runs
a script: ``__main__``, ``sys.argv[0]``, ``sys.path[0]``), so ``multiprocessing`` children of a
command (``tracker demo --workers``) start as they would. What is not the same, and where it is
still run for real: the interpreter's start and its import of the tracker (the README's tour runs
its lines in ``bash`` through ``PATH``, as does one what-if command in ``tests/e2e/test_whatif_cli.py``;
every long-lived ``tracker serve`` or ``tracker worker`` and the memory-bounded audit commands of
``tests/e2e/test_streaming.py`` stay plain subprocesses); and the interpreter's own settings, read
when it starts: a command whose environment sets ``PYTHON*`` or locale variables other than the
zygote's runs as a plain subprocess (``Zygote.serves``).

    zygote = Zygote.shared()                 # one per test process, started on first use
    out = zygote.run(argv, env=..., cwd=..., input=..., timeout=..., text=True)   # a CompletedProcess

The server side is ``python -m tests.support.zygote SOCKET_PATH``; the protocol is one
``SOCK_SEQPACKET`` connection a command: the request (JSON, with stdin/stdout/stderr as SCM_RIGHTS
descriptors), then the child's pid, then its exit status.
"""

from __future__ import annotations

import atexit
import functools
import io
import json
import locale
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: the modules a command would import (the zygote imports them once, before any fork)
PRELOAD = (
    "tracker.cli",
    "tracker.cli._common",
    "tracker.cli.fleets",
    "tracker.cli.ops",
    "tracker.cli.reports",
    "tracker.cli.sessions",
    "tracker.queries",
    "tracker.bootstrap",
    "tracker.service",
    "tracker.store",
    "tracker.store.sql",
    "tracker.store.postgres",
    "tracker.store.sqlite",
    "tracker.store.migrate",
    "tracker.client",
    "tracker.audit.report",
    "tracker.audit.story",
    "tracker.audit.replay",
    "tracker.audit.whatif",
    "tracker.counting",
    "tracker.coordination",
    "tracker.settings",
    "alembic.command",
    "alembic.config",
    "psycopg",
    "redis",
    "httpx",
    "rich.console",
)
_MAX_REQUEST = 1 << 20


def _interpreter_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """What the interpreter reads from the environment when it starts (and never again)."""
    return tuple(
        sorted(
            (k, v)
            for k, v in env.items()
            if (k.startswith("PYTHON") and k != "PYTHONDONTWRITEBYTECODE")
            or k in ("LANG", "LANGUAGE")
            or k.startswith("LC_")
        )
    )


# -- the server (the zygote process) -----------------------------------------------------------------


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if threading.active_count() != 1:  # a fork would copy a lock some thread holds
        raise SystemExit(f"the zygote must not run threads, it has {threading.enumerate()}")


@functools.cache
def console_script() -> str | None:
    """The installed ``tracker`` console script's file (the one a ``pyenv`` shim or ``PATH`` leads to),
    when it is a Python script of this interpreter."""
    import sysconfig

    path = Path(sysconfig.get_path("scripts")) / "tracker"
    try:
        first = path.read_bytes()[:200].split(b"\n", 1)[0]
    except OSError:
        return None
    return str(path) if first.startswith(b"#!") and b"python" in first else None


def _exit_code(code: object) -> int:
    """What the interpreter makes of ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the command, run it, exit with its status (never returns)."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        conn.close()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        time.tzset()
        sys.argv = list(request["argv"])
        import runpy

        if request["script"]:  # the console script's own file, run as the interpreter runs a script
            script = request["script"]
            sys.argv = [script, *sys.argv[1:]]
            sys.path[0] = os.path.dirname(script)
            run: Any = lambda: runpy.run_path(script, run_name="__main__")  # noqa: E731
        else:  # [python, -m, tracker.cli, ...]; runpy sets argv[0] to the module's file, as -m does
            sys.argv = ["-m", *sys.argv[3:]]
            sys.path[0] = os.getcwd()
            run = lambda: runpy.run_module("tracker.cli", run_name="__main__", alter_sys=True)  # noqa: E731
        try:
            run()
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        for t in threading.enumerate():  # the interpreter waits for its non-daemon threads
            if t is not threading.main_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(code)


def serve(path: str) -> None:
    _preload()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # The socket's file appears at ``path`` only once it listens: the client waits for the file, and
    # a connect between bind and listen is refused (a test's first command failed so, once in a run).
    srv.bind(path + ".new")
    srv.listen(64)
    os.rename(path + ".new", path)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    parent = os.getppid()
    while True:
        ready, _, _ = select.select([srv, wake_r], [], [], 1.0)
        if os.getppid() != parent:  # the test process is gone
            return
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(str(os.waitstatus_to_exitcode(status)).encode())
                except OSError:
                    pass
                conn.close()
        if srv in ready:
            conn, _ = srv.accept()
            try:
                msg, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
                request = json.loads(msg)
            except (OSError, ValueError):
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                srv.close()
                os.close(wake_r)
                os.close(wake_w)
                for other in children.values():
                    other.close()
                _child(conn, request, fds)
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            try:
                conn.send(str(pid).encode())
            except OSError:
                pass


# -- the client (in the test process) ------------------------------------------------------------------


class Zygote:
    """The test process's zygote (see the module doc)."""

    _shared: Zygote | None = None
    _owner: int = 0

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="ct-zygote-")
        self.path = os.path.join(self._dir, "sock")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKER_")}
        self._log = open(os.path.join(self._dir, "log"), "w+b")  # noqa: SIM115 (lives as long as the zygote)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote", self.path],
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._log.seek(0)
                raise RuntimeError(f"the CLI zygote did not start:\n{self._log.read().decode(errors='replace')}")
            time.sleep(0.02)
        self.key = _interpreter_key(self.env)
        atexit.register(self.close)

    @classmethod
    def shared(cls) -> Zygote:
        if cls._shared is None or cls._owner != os.getpid() or cls._shared.proc.poll() is not None:
            cls._shared, cls._owner = cls(), os.getpid()
        return cls._shared

    def serves(self, env: Mapping[str, str]) -> bool:
        """Whether a command with this environment can fork from this zygote (same interpreter settings)."""
        return _interpreter_key(env) == self.key

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | os.PathLike[str] | None,
        input: str | bytes | None,
        timeout: float,
        text: bool,
        script: str | None = None,
    ) -> subprocess.CompletedProcess:
        """Run the command forked from the zygote; like ``subprocess.run(argv, capture_output=True, ...)``.
        ``script``: the console script's file, when ``argv[0]`` names the ``tracker`` command."""
        encoding = locale.getpreferredencoding(False)
        with (
            tempfile.TemporaryFile() as stdin,
            tempfile.TemporaryFile() as stdout,
            tempfile.TemporaryFile() as stderr,
        ):
            if input is not None:
                stdin.write(input.encode(encoding) if isinstance(input, str) else input)
                stdin.seek(0)
            request = {
                "argv": [str(a) for a in argv],
                "env": dict(env),
                "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
                "script": script,
            }
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
                try:
                    conn.connect(self.path)
                except OSError as exc:  # say why, with the zygote's own words (its stderr), rather than a bare errno
                    self._log.seek(0)
                    state = "running" if self.proc.poll() is None else f"exited with {self.proc.returncode}"
                    log = self._log.read().decode(errors="replace")
                    raise RuntimeError(f"the CLI zygote ({state}) refused a command: {exc}\n{log}") from exc
                with open(os.devnull, "rb") as devnull:
                    stdin_fd = stdin.fileno() if input is not None else devnull.fileno()
                    socket.send_fds(conn, [json.dumps(request).encode()], [stdin_fd, stdout.fileno(), stderr.fileno()])
                pid = int(conn.recv(64))
                conn.settimeout(timeout)
                try:
                    status = conn.recv(64)
                except TimeoutError:
                    os.kill(pid, signal.SIGKILL)
                    conn.settimeout(None)
                    conn.recv(64)
                    raise subprocess.TimeoutExpired(
                        list(argv), timeout, output=_read(stdout, text, encoding), stderr=_read(stderr, text, encoding)
                    ) from None
            if not status:
                raise RuntimeError("the CLI zygote closed the connection without the command's status")
            return subprocess.CompletedProcess(
                list(argv), int(status), _read(stdout, text, encoding), _read(stderr, text, encoding)
            )


def _read(f: Any, text: bool, encoding: str) -> str | bytes:
    f.seek(0)
    data = f.read()
    if not text:
        return data
    return io.TextIOWrapper(io.BytesIO(data), encoding=encoding).read()  # universal newlines, as subprocess


if __name__ == "__main__":
    serve(sys.argv[1])
