"""The suite's fixtures and how it runs in parallel (registered by tests/conftest.py's ``pytest_plugins``).

Fixtures: databases (``pg_url``, ``sqlite_url``, ``db_url`` over both backends, ``redis_url``,
``redis_prefix``), event stores (``store``: in memory, on SQLite and on PostgreSQL, its URL
``backend``), ``private_pg`` (this process's private PostgreSQL cluster), the HTTP clients ``a``
and ``b`` of fleet A and fleet B of the module's ``server`` (an :class:`~tests.support.api.ApiServer`;
``server`` itself is ``api_server(**API_SERVER)`` unless the module defines one), and a browser
(``browser``, ``page``; signing in and screenshots are tests/support/browser.py).

Markers:

* ``@pytest.mark.feed``: the test reads PostgreSQL's event feed at once after writing (``read_all``,
  an export, calibration's catch-up) or holds it back with an open transaction. The feed shows an
  event once every transaction older than it has ended on the whole *server*, so such a test gets
  its ``pg_url`` / ``db_url`` on ``private_pg``, a cluster no other test process writes to (a module
  marked so gets its module's server there too, by asking for ``private_pg``).
* ``@pytest.mark.serial`` (a module's ``pytestmark``, or one test's mark): a CPU-sensitive module
  (16-process races, latency ratios, wall-clock budgets). Under pytest-xdist (``-n 2 --dist
  loadgroup``) a serial test never runs beside an ordinary one: while it runs, the other worker runs
  another serial test or waits (two file locks, one a class, and a turnstile: a test of one class
  waits until no test of the other runs, and while it waits no new test starts, so neither class
  starves). Each serial module is a group of its own (``serial-<module>``), and these groups are
  handed out last, after the unit tests: the first waits for the other worker's last short test, not
  for a long module, and then the two workers share the serial modules between them. Two serial
  tests at once give each race about one core of the two; they were built to hold their counts and
  invariants at that (the 60 of them passed six times in a row so, twice with a third process busy
  on one core, 2026-12-07). A test that measures a latency ratio says ``@pytest.mark.serial(alone=True)``
  and runs with nothing beside it. Unit tests are spread one by one; the tests of an integration or e2e
  module stay together on one worker (their module-scoped servers are built once).
* ``@pytest.mark.slow``: takes more than a few seconds; under xdist its group is handed out early
  (``_heaviest_first``).
"""

from __future__ import annotations

import fcntl
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import pg_cluster
from tests.support.db import REDIS_URL, create_pg_database, drop_pg_database, sqlalchemy_url


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "feed: reads the event feed at once; runs on a private PostgreSQL cluster")
    config.addinivalue_line("markers", "serial: CPU-sensitive; never runs beside an ordinary test")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__ if getattr(item, "module", None) is not None else ""
        if any(True for _ in item.iter_markers("xdist_group")):
            continue
        name = module.rsplit(".", 1)[-1]
        if _is_serial(item):
            item.add_marker(pytest.mark.xdist_group("serial-" + name))
        elif module.startswith(("tests.integration.", "tests.e2e.")):
            item.add_marker(pytest.mark.xdist_group(name))
    if getattr(config, "workerinput", None) is not None:
        items[:] = _heaviest_first(items)


def _group(item: pytest.Item) -> str:
    """The xdist group ``item`` runs in (its own node id when it has none: a unit test)."""
    for mark in item.iter_markers("xdist_group"):
        return str(mark.args[0] if mark.args else mark.kwargs["name"])
    return item.nodeid


def _heaviest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The order pytest-xdist hands out groups in (``--no-loadscope-reorder``): every group with a
    ``slow`` test, then the other integration and e2e modules, then the unit tests one by one, then
    the serial modules. Short tests fill both workers before the serial modules, so the long modules
    do not end on one worker while the other has nothing left, and a serial test never waits for one:
    the first serial test waits until the other worker's current test ends, and that is a short one
    or none (handed out first, the serial tests' waits for long modules cost three minutes of a run
    of eight). Each group keeps its order."""
    grouped = [(_group(item), item) for item in items]
    rank: dict[str, int] = {}
    for group, item in grouped:
        if _is_serial(item):
            r = 3
        elif item.get_closest_marker("slow") is not None:
            r = 0
        else:
            r = 2 if item.nodeid.startswith("tests/unit/") else 1
        rank[group] = min(rank.get(group, r), r)
    return [item for _, item in sorted(grouped, key=lambda pair: rank[pair[0]])]


def _is_serial(item: pytest.Item) -> bool:
    return item.get_closest_marker("serial") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under pytest-xdist: a test (setup, module fixtures included, call, teardown) holds its class's
    lock shared, serial or ordinary, and starts only when no test of the other class holds that one;
    a test marked ``serial(alone=True)`` holds both locks exclusively. The turnstile lets no new test
    start while one waits."""
    workerinput = getattr(item.config, "workerinput", None)
    if workerinput is None:  # one process: nothing runs beside anything
        yield
        return
    base = Path(tempfile.gettempdir()) / f"ct-pytest-{workerinput['testrunuid']}"
    mark = item.get_closest_marker("serial")
    own, other = ("serial", "ordinary") if mark is not None else ("ordinary", "serial")
    alone = mark is not None and mark.kwargs.get("alone", False)
    with (
        open(f"{base}.turnstile", "a") as turnstile,
        open(f"{base}.{own}", "a") as mine,
        open(f"{base}.{other}", "a") as theirs,
    ):
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(theirs, fcntl.LOCK_EX)  # waits until no test of the other class runs
        fcntl.flock(mine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(theirs, fcntl.LOCK_UN)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(mine, fcntl.LOCK_UN)
            fcntl.flock(theirs, fcntl.LOCK_UN)


# -- databases ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def private_pg() -> Iterator[pg_cluster.PrivateCluster]:
    """This test process's private PostgreSQL cluster (started on first use, destroyed at the end)."""
    try:
        cluster = pg_cluster.started("ct_pgfeed_")
    except RuntimeError as exc:
        pytest.skip(str(exc))
    try:
        yield cluster
    finally:
        cluster.destroy()


def _admin_for(request: pytest.FixtureRequest) -> str | None:
    """The private cluster's admin URL for a ``feed`` test (None: the shared server)."""
    if request.node.get_closest_marker("feed") is None:
        return None
    cluster: pg_cluster.PrivateCluster = request.getfixturevalue("private_pg")
    return cluster.admin_url


def _postgres(request: pytest.FixtureRequest) -> Iterator[str]:
    admin = _admin_for(request)
    name, url = create_pg_database("ct", admin)
    try:
        yield sqlalchemy_url(url)
    finally:
        drop_pg_database(name, admin)


@pytest.fixture
def pg_url(request):
    """A SQLAlchemy URL (postgresql+psycopg://...) to a fresh, empty database; dropped afterwards."""
    yield from _postgres(request)


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'tracker.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    """Both real backends: the contract suites run once on each."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tracker.db'}"
    else:
        yield from _postgres(request)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def backend(request, tmp_path):
    """The database URL of each event-store backend (None: in memory), for ``store``."""
    if request.param == "memory":
        yield None
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tracker.db'}"
    else:
        yield request.getfixturevalue("pg_url")  # (a ``feed`` test's is on the private cluster)


@pytest.fixture
def store(backend):
    """An event store of each backend (``backend``), migrated, with the toy projector of
    tests/support/toy_store.py."""
    from tests.support.toy_store import ToyProjector
    from tracker.store import MemoryEventStore, open_store, upgrade

    if backend is None:
        s: Any = MemoryEventStore(projector=ToyProjector())
    else:
        upgrade(backend)
        s = open_store(backend, projector=ToyProjector())
    yield s
    s.close()


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


# -- the module's server: clients of its two fleets --------------------------------------------------


@pytest.fixture(scope="module")
def server(request) -> Iterator[Any]:
    """``tracker serve`` for the module: ``api_server(**API_SERVER)`` with the module's ``API_SERVER``
    settings (fleets, ``TRACKER_*`` settings...; tests/support/api.py). A module may define its own."""
    from tests.support.api import api_server

    with api_server(**getattr(request.module, "API_SERVER", {})) as s:
        yield s


@pytest.fixture
def a(server):
    """An HTTP client of the module's ``server`` with fleet A's key."""
    with server.client(server.token_a) as c:
        yield c


@pytest.fixture
def b(server):
    """An HTTP client of the module's ``server`` with fleet B's key."""
    with server.client(server.token_b) as c:
        yield c


# -- a browser ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's Chromium, headless, driven by Playwright (one per module)."""
    from tests.support.browser import launch

    with launch() as b:
        yield b


@pytest.fixture
def page(browser):
    """A fresh page (its own context: no cookies) 1280x1000, 20 s default timeout."""
    from tests.support.browser import new_page

    pg = new_page(browser)
    try:
        yield pg
    finally:
        pg.context.close()
