"""A count worker's own Prometheus metrics and the ``/metrics`` port it serves them on.

``tracker_worker_count_duration_seconds{quality}``  how long each successful count took, by the
                                                     quality the counter gave
``tracker_worker_count_failures_total{kind}``       counts that failed, by ``CountError`` kind
``tracker_worker_tasks_total{outcome}``             every task, ``ok`` or ``failed``

Label values come from closed sets (the core's qualities, the error tree's count-error kinds,
``other``). The prefork pool counts in child processes, so with a port configured
(``TRACKER_WORKER_METRICS_PORT``) the worker runs prometheus_client's multiprocess mode: each
child writes its values to a directory, and the main process serves their sum.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from tracker.core.model import QUALITIES
from tracker.errors import COUNT_ERRORS

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own variable, not a tracker setting
KINDS = (*sorted(COUNT_ERRORS), "other")
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_metrics: WorkerMetrics | None = None


class WorkerMetrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry(auto_describe=True)
        self.duration = Histogram(
            "tracker_worker_count_duration_seconds",
            "Count task latency in the worker, by counter quality",
            ["quality"],
            registry=r,
            buckets=BUCKETS,
        )
        self.failures = Counter(
            "tracker_worker_count_failures_total", "Count tasks that failed, by kind", ["kind"], registry=r
        )
        self.tasks = Counter("tracker_worker_tasks_total", "Count tasks run, by outcome", ["outcome"], registry=r)
        # every series of the closed label sets exists from the start (at 0), so rates never miss one
        for quality in (*QUALITIES, "other"):
            self.duration.labels(quality)
        for kind in KINDS:
            self.failures.labels(kind)
        for outcome in ("ok", "failed"):
            self.tasks.labels(outcome)

    def observe(self, answer: Any, seconds: float) -> None:
        """One task's answer (``run_count_task``'s ``{"ok": …}``) and how long it took."""
        if isinstance(answer, dict) and answer.get("ok"):
            quality = str((answer.get("result") or {}).get("quality"))
            self.duration.labels(quality if quality in QUALITIES else "other").observe(seconds)
            self.tasks.labels("ok").inc()
            return
        error = answer.get("error") if isinstance(answer, dict) else None
        kind = str(error.get("kind")) if isinstance(error, dict) else "other"
        self.failures.labels(kind if kind in KINDS else "other").inc()
        self.tasks.labels("failed").inc()


def metrics() -> WorkerMetrics:
    """This process's worker metrics (made on first use: in a pool child, after the fork)."""
    global _metrics
    if _metrics is None:
        _metrics = WorkerMetrics()
    return _metrics


def prepare_multiprocess() -> str:
    """Point prometheus_client at a directory shared by the pool's children (before they start)."""
    path = os.environ.get(MULTIPROC_ENV)
    if not path:
        path = tempfile.mkdtemp(prefix="tracker-worker-metrics-")
        os.environ[MULTIPROC_ENV] = path  # inherited by the pool children
    import prometheus_client.values as values

    values.ValueClass = values.get_value_class()  # chosen at import time: choose again now the variable is set
    return path


def serve(port: int, host: str = "0.0.0.0") -> Any:
    """Serve ``/metrics`` on ``port`` from this (the worker's main) process; the sum of every child."""
    from prometheus_client import CollectorRegistry, start_http_server

    metrics()  # the zeros, before the first count
    path = os.environ.get(MULTIPROC_ENV)
    if path:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=path)
    else:
        registry = metrics().registry
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
