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

PG_ADMIN_URL = os.environ.get("TRACKER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TRACKER_TEST_REDIS", "redis://127.0.0.1:6379/0")


def _sqlalchemy_url(libpq_url: str) -> str:
    return libpq_url.replace("postgresql://", "postgresql+psycopg://", 1)


def create_pg_database(prefix: str = "ct") -> tuple[str, str]:
    """Create a fresh database; return (name, libpq url)."""
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    return name, f"{base}/{name}"


def drop_pg_database(name: str) -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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
