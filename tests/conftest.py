"""The fixtures every tier shares, and how the suite runs in parallel.

The tiers: ``tests/unit`` (no service, no subprocess), ``tests/integration`` (real PostgreSQL, Redis,
a Celery worker), ``tests/e2e`` (the CLI, ``tracker serve``, a browser). The helpers are in
``tests/support`` (db, api, cli, procs, workers and the test doubles); test modules import them from
there, never from this file.

Parallel runs (pytest-xdist, ``-n 2 --dist loadgroup`` from pyproject's addopts): unit tests are
spread one by one; the tests of an integration or e2e module stay together on one worker (their
module-scoped servers are built once); tests that measure time or race processes against each other
run in the ``serial`` group, one after another on one worker, and alone: while one of them runs, the
other worker waits (a file lock the workers share: exclusive for a ``serial`` test, shared for any
other). Besides the CPU, the races keep transactions open on the PostgreSQL server without a pause,
and the event feed only shows what every transaction older than it has finished with.
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
    # hold a transaction open to hold the feed back (which would hide every other test's feed reads)
    "tests.integration.test_calibration_book": {"test_own_reports_count_at_once_and_others_after_a_refresh"},
    "tests.integration.test_store_views": {
        "test_the_feed_held_back_by_a_transaction_in_another_database_and_the_gauges_say_so"
    },
    "tests.e2e.test_cli_e2e": {"test_export_says_what_a_transaction_open_elsewhere_on_the_server_holds_back"},
    "tests.e2e.test_console": {"test_the_overview_says_when_the_event_feed_is_held_back"},
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__ if getattr(item, "module", None) is not None else ""
        if any(True for _ in item.iter_markers("xdist_group")):
            continue
        if module in SERIAL_MODULES or getattr(item, "originalname", item.name) in SERIAL_TESTS.get(module, ()):
            item.add_marker(pytest.mark.xdist_group("serial"))
        elif module.startswith(("tests.integration.", "tests.e2e.")):
            item.add_marker(pytest.mark.xdist_group(module.rsplit(".", 1)[-1]))


def _is_serial(item: pytest.Item) -> bool:
    return any(m.args[:1] == ("serial",) or m.kwargs.get("name") == "serial" for m in item.iter_markers("xdist_group"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under pytest-xdist: a ``serial`` test (its setup, module fixtures included, call and teardown) holds
    the workers' lock exclusively, every other test shares it; a waiting ``serial`` test lets no new test
    start (the turnstile), so it never starves."""
    workerinput = getattr(item.config, "workerinput", None)
    if workerinput is None:  # one process: nothing runs beside anything
        yield
        return
    base = Path(tempfile.gettempdir()) / f"ct-pytest-{workerinput['testrunuid']}"
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if _is_serial(item) else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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
