"""Shared fixtures: real PostgreSQL and Redis on loopback, one throwaway database per test run.

Every test run creates its own database (``ct_<random>``) on the server at
``TRACKER_TEST_PG`` (default ``postgresql://postgres@127.0.0.1:5432/test``) and
drops it afterwards, so parallel runs and helper processes never collide.
Redis tests use their own key prefix / logical database for the same reason.
"""

from __future__ import annotations

import os
import uuid

import pytest

from tracker.bench.procs import create_scratch_db, drop_scratch_db
from tracker.settings import normalize_database_url

PG_ADMIN_URL = os.environ.get("TRACKER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TRACKER_TEST_REDIS", "redis://127.0.0.1:6379/0")


def _sqlalchemy_url(libpq_url: str) -> str:
    return normalize_database_url(libpq_url)


def create_pg_database(prefix: str = "ct") -> tuple[str, str]:
    """Create a fresh database; return (name, libpq url)."""
    return create_scratch_db(PG_ADMIN_URL, prefix)


def drop_pg_database(name: str) -> None:
    drop_scratch_db(PG_ADMIN_URL, name)


@pytest.fixture
def pg_url():
    """A SQLAlchemy URL (postgresql+psycopg://...) to a fresh, empty database; dropped afterwards."""
    name, url = create_pg_database()
    try:
        yield _sqlalchemy_url(url)
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
            yield _sqlalchemy_url(url)
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
