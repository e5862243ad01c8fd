"""`tracker bench` prints one JSON object with figures (speed is reported, never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.cli import run_tracker
from tests.support.db import PG_ADMIN_URL, REDIS_URL
from tests.support.procs import free_port
from tracker.bench import SECTIONS, Targets, run_bench
from tracker.settings import Settings


def _bench(*args: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``tracker bench --json *args`` in a subprocess (its completed process: stdout and stderr as text)."""
    return run_tracker(
        [sys.executable, "-m", "tracker.cli", "bench", "--json", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_bench_core_prints_figures():
    out = _bench("--quick", "--only", "core", timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    core = result["core"]
    assert core["decisions"] > 0 and core["events"] >= core["decisions"]
    assert core["decisions_per_s"] > 0 and core["fold_events_per_s"] > 0
    assert core["decisions_per_cpu_s"] > 0 and core["fold_events_per_cpu_s"] > 0 and core["rounds"] == 3
    assert core["replayed_equal"] == core["decisions"]  # replay re-decided every measurement the same


def test_bench_unknown_section_is_refused():
    out = _bench("--only", "nope", timeout=60)
    assert out.returncode == 2, out.stderr
    error = json.loads(out.stdout)
    assert error["code"] == "invalid_input" and error["field"] == "only", error
    assert "unknown sections ['nope']" in error["message"] and ", ".join(SECTIONS) in error["message"], error


def _closed_pg() -> str:
    return f"postgresql://postgres:secret@127.0.0.1:{free_port()}/test"


def test_a_section_that_cannot_run_fails_the_bench_and_says_where():
    result = run_bench(quick=True, only={"core", "store"}, settings=Settings.of(bench_pg=_closed_pg()))
    assert result["ok"] is False and result["failed"] == ["store"]
    assert "StoreUnavailable" in result["store"]["error"]
    assert result["store"]["against"]["postgres"].startswith("postgresql://postgres:********@127.0.0.1:")
    assert "secret" not in json.dumps(result)
    assert result["core"]["decisions"] > 0 and "error" not in result["core"]


def test_cli_exits_non_zero_when_a_section_fails():
    env = {**os.environ, "TRACKER_BENCH_PG": _closed_pg()}
    out = _bench("--quick", "--only", "store", timeout=120, env=env)
    assert out.returncode != 0
    result = json.loads(out.stdout)
    assert result["ok"] is False and result["failed"] == ["store"]


def test_targets_come_from_settings():
    assert Targets.from_settings(Settings.of()) == Targets(
        pg="postgresql://postgres@127.0.0.1:5432/test",
        redis="redis://127.0.0.1:6379/0",
        broker="redis://127.0.0.1:6379/0",
    )
    own = Settings.of(database_url="postgres://u@db:5432/app", redis_url="redis://r:6379/1", broker_url="amqp://mq//")
    assert Targets.from_settings(own) == Targets(
        pg="postgresql+psycopg://u@db:5432/app", redis="redis://r:6379/1", broker="amqp://mq//"
    )
    bench = Settings.of(
        database_url="postgres://u@db/app",
        bench_pg="postgresql://b@pg/x",
        bench_redis="redis://b/2",
        bench_broker="redis://b/3",
    )
    assert Targets.from_settings(bench) == Targets(pg="postgresql://b@pg/x", redis="redis://b/2", broker="redis://b/3")
    sqlite = Settings.of(database_url="sqlite:///x.db")
    assert Targets.from_settings(sqlite).pg == "postgresql://postgres@127.0.0.1:5432/test"


def test_sections_in_run_order():
    assert list(SECTIONS) == [
        "core",
        "store",
        "counting",
        "service",
        "http",
        "scale",
        "pooler",
        "calibration",
        "retention",
    ]


@pytest.mark.slow
@pytest.mark.postgres
def test_the_store_section_measures_both_sides_and_where_their_backends_wait():
    from tracker.bench.store import EVENT, run_store_bench

    r = run_store_bench(PG_ADMIN_URL, quick=True, writer_counts=(2,))  # (in a scratch database of its own)
    assert r["appends_per_s"]["2"] > 0 and r["raw_insert_per_s"]["2"] > 0
    low, high = r["spread"]["append_vs_raw"]["2"]
    assert low <= r["append_vs_raw"]["2"] <= high
    assert r["fold_events_per_s"] > 0 and r["raw_read_events_per_s"] > 0
    waits = r["waits"]
    assert waits["writers"] == 2
    for side in ("store", "raw"):
        shares = waits[side]
        # shares of one whole (the top six, each rounded to 3 decimals: their sum may exceed 1 by that rounding)
        assert 0.5 < sum(shares.values()) <= 1 + 0.0005 * len(shares) and all(0 < v <= 1 for v in shares.values()), (
            shares
        )
        # each writer waits for its own client between two commands, and for its commits' WAL flush
        assert "Client:ClientRead" in shares and any(k.startswith(("IO:WAL", "LWLock:WAL")) for k in shares), shares
    # every append writes at least its event's JSON to the WAL (the figure is server-wide: others only add)
    event_bytes = len(json.dumps(EVENT.data))
    assert r["wal_bytes"]["store"] >= event_bytes and r["wal_bytes"]["raw"] >= event_bytes, r["wal_bytes"]


@pytest.mark.postgres
@pytest.mark.redis
def test_the_service_section_measures_observe_beside_raw_and_what_one_observe_writes():
    from tracker.bench.service import run_service_bench
    from tracker.bench.store import EVENT

    r = run_service_bench(PG_ADMIN_URL, REDIS_URL, quick=True, process_counts=(1,))  # (a scratch database)
    assert r["processes"]["1"]["observe_per_s"] > 0 and r["raw_insert_per_s"]["1"] > 0
    low, high = r["spread"]["observe_vs_raw"]["1"]
    assert low <= r["observe_vs_raw"]["1"] <= high
    # an observe writes its ContextMeasured event (about the size of the store section's) and the
    # session's projection row; the figure is server-wide, so other writers can only add to it
    assert r["wal_bytes_per_observe"] >= len(json.dumps(EVENT.data)), r["wal_bytes_per_observe"]


@pytest.mark.postgres
@pytest.mark.slow
def test_the_retention_section_archives_restores_and_measures_observe_beside_it():
    env = {**os.environ, "TRACKER_BENCH_PG": PG_ADMIN_URL}
    out = _bench("--quick", "--only", "retention", timeout=240, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["ok"] is True and result["failed"] == [], result
    r = result["retention"]
    assert r["against"]["sqlite"] and r["against"]["postgres"].startswith("postgresql://")
    for backend, vacuum in (("sqlite", "VACUUM"), ("postgres", "VACUUM FULL events")):
        b = r[backend]
        assert b["events"] == b["sessions"] * r["events_per_session"] > 0, b
        assert b["archive_events_per_s"] > 0 and b["restore_events_per_s"] > 0, b
        # every loaded event came back, and no SessionArchived record is left
        assert b["counts_match"] is True and b["events_after_restore"] == b["events"], b
        sizes = b["table_bytes"]
        assert sizes["before_archive"] > 0 and 0 < sizes["after_vacuum"] < sizes["before_archive"], sizes
        assert b["vacuum"] == vacuum and b["segments"] >= 1 and b["archive_bytes"] > 0, b
        observe = b["observe"]
        for window in ("without_archive", "with_archive"):
            w = observe[window]
            assert w["calls"] > 0 and w["errors"] == 0, w
            assert 0 < w["ms_p50"] <= w["ms_p99"] <= w["ms_max"], w
        assert observe["p99_ratio"] > 0, observe
    files = r["sqlite"]["file_bytes"]  # a delete frees pages inside the file; VACUUM gives them back
    assert 0 < files["after_vacuum"] < files["before_archive"], files
