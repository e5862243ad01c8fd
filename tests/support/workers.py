"""A Celery worker process the tests can also kill: the bench's ``WorkerProcess`` plus fault injection."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

from tests.support.bench import WorkerProcess


class KillableWorker(WorkerProcess):
    def kill9(self) -> None:
        """SIGKILL the worker and its pool children (its own process group)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def pool_children(self) -> list[int]:
        """Pids of the worker's pool processes."""
        if shutil.which("pgrep") is None:
            import pytest

            pytest.skip("pgrep is not installed (apt-get install procps; .ci/run does)")
        out = subprocess.run(["pgrep", "-P", str(self._running().pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]
