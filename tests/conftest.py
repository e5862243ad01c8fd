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

* ``pg``: a ``serial`` test holds it exclusively, every other integration or e2e test shares it.
  The races keep transactions open on the PostgreSQL server without a pause, and the event feed
  only shows what every transaction older than it has finished with (on the whole server).
* ``cpu``: the tests in ``ALONE`` (latency ratios, replication lag, a balancer's fairness) hold it
  exclusively; every other test shares it. So a unit test (no server, no feed) runs beside a race,
  never beside a latency ratio.

A waiting exclusive holder lets no new test start (the turnstile), so it never starves. The order
the workers take work in: the ``serial`` group first, then the unit tests (so the second worker runs
them while the first runs the races), then the other modules, the longest first.
"""

from __future__ import annotations

import fcntl
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.support.db import REDIS_URL, create_pg_database, drop_pg_database, sqlalchemy_url

# CPU-sensitive tests (16-process races, latency ratios, wall-clock budgets): one group, so they never
# race each other for the machine's cores. (A test may also say so itself: @pytest.mark.xdist_group("serial").)
SERIAL_MODULES = {
    "tests.integration.test_service_race",
    "tests.integration.test_store_concurrency",
    "tests.integration.test_hot_path",
    "tests.integration.test_fleets_race",
    # the topologies' races: processes racing through a restarted PgBouncer or a failing-over Redis, on a
    # replica's feed under writers (their counts of acknowledged writes and killed connections need the CPU)
    "tests.integration.test_topology_pgbouncer",
    "tests.integration.test_topology_redis",
    "tests.integration.test_topology_replica",
    # a LangChain and an AI SDK agent process racing for one basis (tests/e2e/test_cross_language_race.py)
    "tests.e2e.test_cross_language_race",
}
# Tests that write on PostgreSQL and read the event feed at once: the feed shows an event only when every
# transaction older than it has ended on the whole server (any database), so another test's migration or
# open transaction beside them would hide their own writes. They run alone too.
SERIAL_TESTS = {
    "tests.integration.test_store_contract": {
        "test_read_all_is_ordered_and_pages",
        "test_read_all_session_prefix_filters_exactly_and_pages",
    },
    # holds a transaction open to hold the feed back (which would hide every other test's feed reads)
    "tests.integration.test_calibration_book": {"test_own_reports_count_at_once_and_others_after_a_refresh"},
}


# Serial tests that must not share the CPU either (the ``cpu`` lock, exclusively).
ALONE_MODULES = {
    "tests.integration.test_hot_path",  # wake-up counts and the scale bench's timings
    "tests.integration.test_topology_replica",  # replication lag within a bound
    "tests.e2e.test_topology_balancer",  # each replica's share of a fleet's requests
}
ALONE_TESTS = {
    "tests.e2e.test_api_hostile": {"test_open_waits_of_one_fleet_leave_another_fleets_observe_p99_within_2x"}
}
# The modules that take longest (minutes of CPU between them): taken first after the unit tests, so
# that no worker is left alone with one of them at the end.
LONGEST_FIRST = (
    "test_streaming",
    "test_typescript_client",
    "test_readme",
    "test_console",
    "test_cli_e2e",
    "test_api_hostile",
    "test_integrations_openai_agents",
    "test_counting_celery",
    "test_api",
    "test_api_fuzz",
    "test_cli_hostile",
    "test_integrations_langchain",
    "test_story_reads",
    "test_service",
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
        if _is_serial(item):
            return (0, 0, i)
        if _module(item).startswith("tests.unit."):
            return (1, 0, i)
        short = _module(item).rsplit(".", 1)[-1]
        return (2, LONGEST_FIRST.index(short) if short in LONGEST_FIRST else len(LONGEST_FIRST), i)

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
