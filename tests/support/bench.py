"""What the tests use of the shipped bench, from one place.

The bench needs these itself (it starts servers and workers, races writer processes, measures
calibration against the simulated provider and writes with a small projector), so they stay in
``tracker/bench``; a test imports them from here, never from ``tracker.bench`` directly (except
tests/e2e/test_bench.py, which tests the bench).
"""

from __future__ import annotations

# ruff: noqa: F401 - re-exported for the tests
from tracker.bench.calibration import BAND_FROM, CASES, MIXED, SHIFTED, SIM_MODELS, mixed_fleet, resumed
from tracker.bench.console import build_session
from tracker.bench.procs import (
    WorkerProcess,
    barrier_pool,
    create_scratch_db,
    drop_scratch_db,
    free_port,
    start_server,
    stop_process_group,
    stop_server,
)
from tracker.bench.sim_provider import (
    ANTHROPIC_LIKE,
    CJK_DOCUMENTS,
    CODING_AGENT,
    GEMINI_LIKE,
    MULTILINGUAL_ASSISTANT,
    TOOLS,
    Profile,
    SimProvider,
    Workload,
    request_of,
    session,
)
from tracker.bench.store import EVENT, CountingProjector, measured_event
