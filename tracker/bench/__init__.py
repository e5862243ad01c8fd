"""``tracker bench``: one JSON object, one section per layer, every figure from this run.

    from tracker.bench import run_bench
    result = run_bench(quick=True, only={"core", "store"})
    if not result["ok"]:          # a section could not run: result["failed"] names it,
        ...                       # result[name]["error"] says why

Sections, in the order they run (``service`` measures the store's raw-INSERT baseline beside
each of its rounds):

==========  ==========================================  ===========================
section     measures                                     against
==========  ==========================================  ===========================
core        pure decisions/s, fold events/s              nothing (no I/O)
store       appends vs. raw psycopg INSERT, fold         Postgres (scratch database)
counting    exact encoding vs. tiktoken, in-process      Celery broker
            and Celery counts
service     ``Tracker.observe`` with 1/4/16 processes    Postgres + Redis
http        ``observe`` over ``tracker serve`` vs.       Postgres + Redis
            in-process
scale       audit reads on 10k/1M(/10M)-event logs       Postgres (scratch databases)
            (feed, history, tail, pressure filter)
calibration compaction point and decided/billed before   Postgres (scratch database)
            and after 20 reports of a simulated
            provider; catch-up and estimate costs
retention   archive and restore events/s at 1M events,  SQLite (temporary file),
            the live table's size before and after      Postgres (scratch database)
            (and a vacuum), observe's p99 beside an
            archive against none
==========  ==========================================  ===========================

Where it measures comes from ``Settings.bench`` (see :class:`Targets`); the Postgres server
only hosts scratch databases (``ct_bench_*``, dropped afterwards). Figures are defined once,
in :mod:`tracker.bench.stats`.

Failure: a section that cannot run (Postgres down, no broker, …) is reported as
``{"error": "…", "against": {…}}`` in its place, the other sections still run, and the result
has ``"ok": false`` and ``"failed": [names]``; ``tracker bench`` exits non-zero then. An unknown
section name raises ``InvalidInput`` (field ``only``) before anything runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tracker.errors import InvalidInput
from tracker.settings import Settings, mask

LOCAL_PG = "postgresql://postgres@127.0.0.1:5432/test"
LOCAL_REDIS = "redis://127.0.0.1:6379/0"


@dataclass(frozen=True)
class Targets:
    """The servers the bench measures against, resolved from ``Settings``.

    Each one is the ``TRACKER_BENCH_*`` setting when set, else the tracker's own setting
    (``TRACKER_DATABASE_URL`` when it is Postgres, ``TRACKER_REDIS_URL``, ``TRACKER_BROKER_URL``),
    else the local server: ``postgresql://postgres@127.0.0.1:5432/test``, ``redis://127.0.0.1:6379/0``
    (Redis also as the broker).
    """

    pg: str
    redis: str
    broker: str

    @classmethod
    def from_settings(cls, settings: Settings) -> Targets:
        bench = settings.bench
        own_db = settings.store.database_url
        return cls(
            pg=bench.bench_pg or (own_db if own_db.startswith("postgresql") else LOCAL_PG),
            redis=bench.bench_redis or settings.coordination.redis_url or LOCAL_REDIS,
            broker=bench.bench_broker or settings.counting.broker_url or LOCAL_REDIS,
        )


class Progress(Protocol):
    def print(self, text: str) -> Any: ...


@dataclass(frozen=True)
class Section:
    """One layer's bench: ``run(quick, targets, settings, result so far)`` → its figures."""

    run: Callable[[bool, Targets, Settings, dict[str, Any]], dict[str, Any]]
    against: Callable[[Targets], dict[str, str]]


def _core(quick: bool, targets: Targets, settings: Settings, result: dict[str, Any]) -> dict[str, Any]:
    from tracker.bench.core import run_core_bench

    return run_core_bench(quick)


def _store(quick: bool, targets: Targets, settings: Settings, result: dict[str, Any]) -> dict[str, Any]:
    from tracker.bench.store import run_store_bench

    return run_store_bench(targets.pg, quick)


def _counting(quick: bool, targets: Targets, settings: Settings, result: dict[str, Any]) -> dict[str, Any]:
    from tracker.bench.counting import run_counting_bench

    return run_counting_bench(settings, quick, targets.broker)


def _service(quick: bool, targets: Targets, settings: Settings, result: dict[str, Any]) -> dict[str, Any]:
    from tracker.bench.service import run_service_bench

    return run_service_bench(targets.pg, targets.redis, quick)  # with its own raw INSERT baseline, per round


def _http(quick: bool, targets: Targets, settings: Settings, result: dict[str, Any]) -> dict[str, Any]:
    from tracker.bench.http import run_http_bench

    return run_http_bench(targets.pg, targets.redis, quick)


def _scale(quick: bool, targets: Targets, settings: Settings, result: dict[str, Any]) -> dict[str, Any]:
    from tracker.bench.scale import run_scale_bench

    return run_scale_bench(targets.pg, quick)


def _pooler(quick: bool, targets: Targets, settings: Settings, result: dict[str, Any]) -> dict[str, Any]:
    from tracker.bench.pooler import run_pooler_bench

    return run_pooler_bench(targets.pg, quick)


def _calibration(quick: bool, targets: Targets, settings: Settings, result: dict[str, Any]) -> dict[str, Any]:
    from tracker.bench.calibration import run_calibration_bench

    return run_calibration_bench(targets.pg, quick)


def _retention(quick: bool, targets: Targets, settings: Settings, result: dict[str, Any]) -> dict[str, Any]:
    from tracker.bench.retention import run_retention_bench

    return run_retention_bench(targets.pg, quick)


SECTIONS: dict[str, Section] = {
    "core": Section(_core, lambda t: {}),
    "store": Section(_store, lambda t: {"postgres": mask(t.pg)}),
    "counting": Section(_counting, lambda t: {"broker": mask(t.broker)}),
    "service": Section(_service, lambda t: {"postgres": mask(t.pg), "redis": mask(t.redis)}),
    "http": Section(_http, lambda t: {"postgres": mask(t.pg), "redis": mask(t.redis)}),
    "scale": Section(_scale, lambda t: {"postgres": mask(t.pg)}),
    "pooler": Section(
        _pooler, lambda t: {"postgres": mask(t.pg), "pgbouncer": "started by the bench (transaction mode)"}
    ),
    "calibration": Section(_calibration, lambda t: {"postgres": mask(t.pg)}),
    "retention": Section(_retention, lambda t: {"sqlite": "a file in a temporary directory", "postgres": mask(t.pg)}),
}


def run_bench(
    quick: bool = False,
    only: set[str] | None = None,
    progress: Progress | None = None,
    *,
    settings: Settings | None = None,
) -> dict[str, Any]:
    """Run the sections in order and return one JSON-ready dict (see the module doc).

    ``quick``: smaller runs (well under a minute each). ``only``: the section names to run
    (default all). ``progress``: anything with ``print(text)`` (a rich console) to report each
    section as it starts and fails. ``settings``: default ``Settings.load()``.

    The result: ``{"quick", "cpus", "ok", "failed", <section>: {..., "against": {...}}, ...}``.
    """
    unknown = (only or set()) - set(SECTIONS)
    if unknown:
        raise InvalidInput("only", f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    settings = settings if settings is not None else Settings.load()
    targets = Targets.from_settings(settings)
    result: dict[str, Any] = {"quick": quick, "cpus": os.cpu_count(), "ok": True, "failed": []}
    for name, section in SECTIONS.items():
        if only and name not in only:
            continue
        against = section.against(targets)
        if progress is not None:
            where = ", ".join(f"{k} {v}" for k, v in against.items())
            from rich.markup import escape

            progress.print(f"[dim]bench: {name}{escape(' against ' + where) if where else ''}…[/]")
        try:
            figures = section.run(quick, targets, settings, result)
        except Exception as exc:  # noqa: BLE001 - a section that cannot run says why, the others still report
            figures = {"error": f"{type(exc).__name__}: {exc}"}
        result[name] = {**figures, "against": against}
        if "error" in figures:
            result["ok"] = False
            result["failed"].append(name)
            if progress is not None:
                from rich.markup import escape

                progress.print(f"[red]bench: {name} failed: {escape(figures['error'])}[/]")
    return result
