"""Creating the same fleets from several processes at once: one wins each name, the others get FleetExists."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from tests.support.procs import racing_context
from tracker.store.migrate import upgrade

pytestmark = pytest.mark.serial  # CPU-sensitive: never beside an ordinary test (tests/support/plugin.py)

NAMES = [f"agents-{i}" for i in range(40)]


def _create(url: str, start: mp.synchronize.Barrier) -> list[str]:
    from sqlalchemy import create_engine

    from tracker.errors import FleetExists
    from tracker.store.fleets import FleetStore

    store = FleetStore(create_engine(url))
    start.wait(60)
    out = []
    for name in NAMES:  # every process races every other on each name in turn
        try:
            store.create_fleet(name)
            out.append("created")
        except FleetExists:
            out.append("exists")
    return out


def test_concurrent_create_same_name(pg_url):
    upgrade(pg_url)
    ctx = racing_context()
    n = 6
    barrier = ctx.Manager().Barrier(n)
    with ctx.Pool(n) as pool:
        results = pool.starmap(_create, [(pg_url, barrier)] * n)
    for i, name in enumerate(NAMES):
        assert sorted(r[i] for r in results) == ["created"] + ["exists"] * (n - 1), name
