"""The fixtures every tier shares, and how the suite runs in parallel.

The tiers: ``tests/unit`` (no service, no subprocess), ``tests/integration`` (real PostgreSQL, Redis,
a Celery worker), ``tests/e2e`` (the CLI, ``tracker serve``, a browser). The helpers are in
``tests/support`` (db, api, cli, procs, workers and the test doubles); test modules import them from
there, never from this file.

Parallel runs (pytest-xdist, ``-n 2 --dist loadgroup --no-loadscope-reorder`` from pyproject's
addopts): unit tests are spread one by one; the tests of an integration or e2e module stay together
on one worker (their module-scoped servers are built once); tests that race processes against each
other or read the event feed while they write run in the ``serial`` group, one after another on one
worker. Two file locks the workers share keep them apart from what would disturb them:

* ``pg``: a ``serial`` test holds it exclusively, every other test on the PostgreSQL server shares
  it (every integration and e2e module but those in ``NO_POSTGRES_MODULES``). The races keep
  transactions open on the server without a pause, and the event feed only shows what every
  transaction older than it has finished with (on the whole server).
* ``cpu``: the tests in ``ALONE`` (latency ratios, replication lag, a balancer's fairness) hold it
  exclusively; every other test shares it. So a unit test or a SQLite-only module runs beside a
  race, never beside a latency ratio.

A waiting exclusive holder lets no new test start (the turnstile), so it never starves. The order
the workers take work in: the ``serial`` group first, then the modules that need no ``pg`` lock (the
second worker runs them while the first runs the races), then the other modules, the longest first
in each, and the unit tests last (small pieces that even out the two workers' ends).
"""

from __future__ import annotations

import fcntl
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.support.db import REDIS_URL, create_pg_database, drop_pg_database, sqlalchemy_url
from tests.support.schedule import (
    ALONE_MODULES,
    ALONE_TESTS,
    LONGEST_FIRST,
    NO_POSTGRES_MODULES,
    SERIAL_MODULES,
    SERIAL_TESTS,
)


def _module(item: pytest.Item) -> str:
    return item.module.__name__ if getattr(item, "module", None) is not None else ""


def _name(item: pytest.Item) -> str:
    return getattr(item, "originalname", item.name)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = _module(item)
        if any(True for _ in item.iter_markers("xdist_group")):
            continue
        if module in SERIAL_MODULES or getattr(item, "originalname", item.name) in SERIAL_TESTS.get(module, ()):
            item.add_marker(pytest.mark.xdist_group("serial"))
        elif module.startswith(("tests.integration.", "tests.e2e.")):
            item.add_marker(pytest.mark.xdist_group(module.rsplit(".", 1)[-1]))

    def rank(pair: tuple[int, pytest.Item]) -> tuple[int, int, int]:
        i, item = pair
        module = _module(item)
        short = module.rsplit(".", 1)[-1]
        longest = LONGEST_FIRST.index(short) if short in LONGEST_FIRST else len(LONGEST_FIRST)
        if _is_serial(item):
            return (0, 0, i)
        if module in NO_POSTGRES_MODULES:
            return (1, longest, i)
        if module.startswith("tests.unit."):
            return (3, 0, i)  # last: small pieces that even out the workers' ends
        return (2, longest, i)

    items[:] = [item for _, item in sorted(enumerate(items), key=rank)]


def _is_serial(item: pytest.Item) -> bool:
    return any(m.args[:1] == ("serial",) or m.kwargs.get("name") == "serial" for m in item.iter_markers("xdist_group"))


def _is_alone(item: pytest.Item) -> bool:
    module = _module(item)
    return module in ALONE_MODULES or _name(item) in ALONE_TESTS.get(module, ())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under pytest-xdist: the ``pg`` and ``cpu`` locks of the module doc, taken in that order (so no
    two tests wait on each other) for the test's setup (module fixtures included), call and teardown."""
    workerinput = getattr(item.config, "workerinput", None)
    if workerinput is None:  # one process: nothing runs beside anything
        yield
        return
    base = Path(tempfile.gettempdir()) / f"ct-pytest-{workerinput['testrunuid']}"
    serial = _is_serial(item)
    pg_mode = (
        fcntl.LOCK_EX
        if serial
        else fcntl.LOCK_SH
        if _module(item).startswith(("tests.integration.", "tests.e2e."))
        else None
    )
    cpu_mode = fcntl.LOCK_EX if serial and _is_alone(item) else fcntl.LOCK_SH
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.pg", "a") as pg, open(f"{base}.cpu", "a") as cpu:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if pg_mode is not None:
            fcntl.flock(pg, pg_mode)
        fcntl.flock(cpu, cpu_mode)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(cpu, fcntl.LOCK_UN)
            if pg_mode is not None:
                fcntl.flock(pg, fcntl.LOCK_UN)


@pytest.fixture
def pg_url():
    """A SQLAlchemy URL (postgresql+psycopg://...) to a fresh, empty database; dropped afterwards."""
    name, url = create_pg_database()
    try:
        yield sqlalchemy_url(url)
    finally:
        drop_pg_database(name)


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'tracker.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    """Both real backends: the contract suites run once on each."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tracker.db'}"
    else:
        name, url = create_pg_database()
        try:
            yield sqlalchemy_url(url)
        finally:
            drop_pg_database(name)


@pytest.fixture
def redis_url():
    """The real Redis server; a unique key namespace is given by ``redis_prefix``."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    yield REDIS_URL


@pytest.fixture
def redis_prefix():
    return f"cttest:{uuid.uuid4().hex[:10]}:"
