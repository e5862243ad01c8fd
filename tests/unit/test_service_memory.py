"""The service's logic on the in-memory store: no database, no server, no subprocess.

Every test of ``tests/integration/test_service.py`` that needs nothing but a ``tracker`` runs here
again, on ``MemoryEventStore`` (which passes the same ``EventStore`` contract suite as SQLite and
PostgreSQL), with the same check after each one: the projection equals the fold of the log.
"""

from __future__ import annotations

import inspect

import pytest

from tests.integration import test_service as on_sql
from tracker import Policy
from tracker.core import SessionProjector
from tracker.service import Tracker
from tracker.store import verify_projections
from tracker.store.memory import MemoryEventStore


@pytest.fixture
def tracker():
    clock = on_sql.Clock()
    store = MemoryEventStore(projector=SessionProjector())
    t = Tracker(store, policy=Policy(attempt_lease_s=30), clock=clock)
    t.test_clock = clock  # type: ignore[attr-defined]
    yield t
    assert verify_projections(store, SessionProjector()) == []  # after every test: state == fold(log)
    t.close()


SHARED = sorted(
    name
    for name, fn in vars(on_sql).items()
    if name.startswith("test_") and callable(fn) and list(inspect.signature(fn).parameters) == ["tracker"]
)
globals().update({name: getattr(on_sql, name) for name in SHARED})


def test_the_memory_suite_runs_the_service_suite():
    """Most of the service's tests need only a tracker; they all run here (a rename cannot drop them)."""
    assert len(SHARED) >= 10, SHARED
