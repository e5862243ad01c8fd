"""Scratch databases for the tests: one throwaway PostgreSQL database per use, upgraded on request.

Every database (``<prefix>_<random>``) is made on the server at ``TRACKER_TEST_PG`` (default
``postgresql://postgres@127.0.0.1:5432/test``) and dropped afterwards, so parallel runs, pytest-xdist
workers and helper processes never collide. Redis tests use ``TRACKER_TEST_REDIS`` (default
``redis://127.0.0.1:6379/0``) with a key prefix or a private server of their own.

``settled(read, done)`` reads again until the value is complete: PostgreSQL's event feed (and what is
read through it: exports, the calibration reports) shows an event once every transaction older than it
has ended on the whole server -- another test's migration too -- so a read right after a write may
not show it yet. ``feed_shows(store, position)`` / ``feed_passed(store, session_id)`` wait for that;
``transaction_open_elsewhere()`` causes it on purpose.

Nothing here connects at import: the unit tier imports none of it anyway.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from tracker.settings import normalize_database_url
from tracker.store import EventStore

PG_ADMIN_URL = os.environ.get("TRACKER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TRACKER_TEST_REDIS", "redis://127.0.0.1:6379/0")

T = TypeVar("T")


def settled(read: Callable[[], T], done: Callable[[T], bool], *, timeout_s: float = 30.0) -> T:
    """``read()`` until ``done(value)``; after ``timeout_s``, the last value read (the caller's
    assertion then says what is missing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def feed_shows(store: EventStore, position: int, *, timeout_s: float = 30.0) -> bool:
    """Wait until the store's global feed (``read_all``) shows the event at ``position`` -- and so,
    in commit order, every event committed before it; False after ``timeout_s``."""
    return bool(settled(lambda: store.read_all(position - 1, 1), bool, timeout_s=timeout_s))


def feed_passed(store: EventStore, session_id: str, *, timeout_s: float = 30.0) -> bool:
    """``feed_shows`` the session's last event (True at once for a session without events)."""
    events = list(store.read_stream(session_id))
    return not events or feed_shows(store, events[-1].position, timeout_s=timeout_s)


def server_of(url: str) -> str:
    """The admin URL (libpq, database ``postgres``) of the server a database URL is on."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql", database="postgres").render_as_string(hide_password=False)


@contextmanager
def transaction_open_elsewhere(beside: str | None = None) -> Iterator[Callable[[], None]]:
    """A transaction that has taken an id, left open in a scratch database of its own on the server
    of the database ``beside`` (the shared server without it): it holds every database's event feed
    back there (the horizon is the server's) until the ``end()`` yielded is called, or the block ends.
    Tests that do this run on a private cluster (``@pytest.mark.feed``), so they hold back no one else."""
    import psycopg

    admin = server_of(beside) if beside else None
    name, url = create_pg_database("ct_other", admin)
    try:
        with psycopg.connect(url) as conn:
            conn.execute("SELECT pg_current_xact_id()")
            yield conn.rollback
    finally:
        drop_pg_database(name, admin)


def sqlalchemy_url(libpq_url: str) -> str:
    """``postgresql://…`` as the store takes it (``postgresql+psycopg://…``)."""
    return normalize_database_url(libpq_url)


def create_pg_database(prefix: str = "ct", admin_url: str | None = None) -> tuple[str, str]:
    """Create a fresh, empty database on the shared server (or the one at ``admin_url``); return
    (name, libpq url)."""
    from tests.support.bench import create_scratch_db

    return create_scratch_db(admin_url or PG_ADMIN_URL, prefix)


def drop_pg_database(name: str, admin_url: str | None = None) -> None:
    from tests.support.bench import drop_scratch_db

    drop_scratch_db(admin_url or PG_ADMIN_URL, name)


@contextmanager
def scratch_database(prefix: str = "ct", *, upgrade: bool = False, admin_url: str | None = None) -> Iterator[str]:
    """A fresh database for the ``with`` block (its SQLAlchemy URL), at the head revision with
    ``upgrade``; dropped afterwards. On the shared server, or on the one at ``admin_url`` (a private
    cluster's)."""
    name, url = create_pg_database(prefix, admin_url)
    try:
        db_url = sqlalchemy_url(url)
        if upgrade:
            from tracker.store import upgrade as upgrade_to_head

            upgrade_to_head(db_url)
        yield db_url
    finally:
        drop_pg_database(name, admin_url)
