"""The service's logic on the in-memory store: no database, no server, no subprocess.

The service suite (tests/support/service_suite.py, which tests/integration/test_service.py runs on
SQLite and PostgreSQL) runs here again, on ``MemoryEventStore`` (which passes the same ``EventStore``
contract suite as SQLite and PostgreSQL), with the same check after each test: the projection equals
the fold of the log.
"""

from __future__ import annotations

import pytest

from tests.support.service_suite import *  # noqa: F403 - the shared service suite, run on this module's tracker
from tracker import Policy
from tracker.core import SessionProjector
from tracker.service import Tracker
from tracker.store import verify_projections
from tracker.store.memory import MemoryEventStore


@pytest.fixture
def tracker(clock):
    store = MemoryEventStore(projector=SessionProjector())
    t = Tracker(store, policy=Policy(attempt_lease_s=30), clock=clock)
    yield t
    assert verify_projections(store, SessionProjector()) == []  # after every test: state == fold(log)
    t.close()
