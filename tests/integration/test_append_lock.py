"""``ct_append`` leaves no advisory lock behind when it fails inside the locked section.

The append lock (``APPEND_LOCK_KEY``) is session-level: if an error landed between
``pg_advisory_lock`` and ``pg_advisory_unlock`` (a ``statement_timeout``, a
``pg_cancel_backend``), the server connection kept it, and through a transaction pooler the
next client got that connection with the lock held: every append then waited forever.
Migration 0008 releases it on every exit. These tests make the append fail *inside* the
locked section: another transaction holds a lock on the positions' sequence
(``ALTER SEQUENCE``, left open), so the append takes the advisory lock, then waits in
``nextval``, and is cancelled there. The same server connection is then checked.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors

from tests.support.loopback import missing
from tests.support.pgbouncer import PgBouncer
from tracker.store import migrate, upgrade
from tracker.store.schema import APPEND_LOCK_KEY

pytestmark = pytest.mark.postgres

PREVIOUS = "0007_fleet_policies"  # the last revision with 0003's ct_append

# one Tick at version 1 of the session named by the first parameter (the third: its canonical text)
_CALL_HEAD = "SELECT out_status, out_version FROM ct_append(%s, %s, %s, NULL, '{}', 'normal', 1, 0, 0)"
# the same call to the function of migrations 0003-0008 (events as JSON arrays of types and data)
_CALL_0008 = (
    "SELECT out_status, out_version FROM ct_append(%s, %s, '[\"Tick\"]', '[{}]', NULL, '{}', 'normal', 1, 0, 0)"
)


def _call(conn: psycopg.Connection, sid: str, *, head: bool = True) -> Any:
    if head:
        return conn.execute(_CALL_HEAD, (sid, 0, f'["{sid}",1,"Tick",{{}}]'))
    return conn.execute(_CALL_0008, (sid, 0))


_MY_ADVISORY_LOCKS = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def _wait_until_blocked(observer: psycopg.Connection, pid: int, wait_event: str) -> None:
    """Until backend ``pid`` waits on a heavyweight lock of kind ``wait_event``."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        row = observer.execute(
            "SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        if row == ("Lock", wait_event):
            return
        time.sleep(0.02)
    raise AssertionError(f"backend {pid} never waited on a {wait_event} lock")


def _cancelled_append(url: str, how: str, *, hold: str, head: bool = True) -> tuple[psycopg.Connection, list[str]]:
    """Run one ``ct_append`` on a fresh autocommit connection that fails while blocked:
    ``hold="sequence"``: inside the locked section (waiting in nextval, advisory lock held);
    ``hold="advisory"``: still waiting for the advisory lock itself.
    ``how``: ``statement_timeout`` or ``pg_cancel_backend``. Returns the (still open)
    connection that ran it and the notices it received."""
    libpq = _libpq(url)
    appender = psycopg.connect(libpq, autocommit=True)
    notices: list[str] = []
    appender.add_notice_handler(lambda d: notices.append(f"{d.severity}: {d.message_primary}"))
    pid = appender.info.backend_pid
    with psycopg.connect(libpq) as blocker, psycopg.connect(libpq, autocommit=True) as observer:
        if hold == "sequence":
            blocker.execute("ALTER SEQUENCE events_position_seq CACHE 1")  # its transaction stays open
            wait_event = "relation"
        else:
            blocker.execute("SELECT pg_advisory_lock(%s)", (APPEND_LOCK_KEY,))
            wait_event = "advisory"
        errors: list[BaseException] = []
        if how == "statement_timeout":
            appender.execute("SET statement_timeout = '500ms'")
            try:
                _call(appender, "s", head=head)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        else:

            def run() -> None:
                try:
                    _call(appender, "s", head=head)
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)

            t = threading.Thread(target=run)
            t.start()
            _wait_until_blocked(observer, pid, wait_event)
            assert observer.execute("SELECT pg_cancel_backend(%s)", (pid,)).fetchone() == (True,)
            t.join(10)
            assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], pg_errors.QueryCanceled), errors
        blocker.rollback()
        if hold == "advisory":
            blocker.execute("SELECT pg_advisory_unlock(%s)", (APPEND_LOCK_KEY,))
            blocker.commit()
    if how == "statement_timeout":
        appender.execute("RESET statement_timeout")
    return appender, notices


@pytest.mark.parametrize("how", ["statement_timeout", "pg_cancel_backend"])
def test_an_append_cancelled_inside_the_lock_leaves_no_lock_on_its_connection(pg_url, how):
    upgrade(pg_url)
    appender, notices = _cancelled_append(pg_url, how, hold="sequence")
    try:
        assert appender.execute(_MY_ADVISORY_LOCKS).fetchone() == (0,)
        # nobody else is kept waiting: another connection takes the lock at once ...
        with psycopg.connect(_libpq(pg_url), autocommit=True) as other:
            assert other.execute("SELECT pg_try_advisory_lock(%s)", (APPEND_LOCK_KEY,)).fetchone() == (True,)
            other.execute("SELECT pg_advisory_unlock(%s)", (APPEND_LOCK_KEY,))
            # ... and appends there, and on the cancelled append's connection, go through
            other.execute("SET lock_timeout = '5s'")
            assert _call(other, "t").fetchone() == ("ok", 1)
        assert _call(appender, "s").fetchone() == ("ok", 1)
        assert appender.execute(_MY_ADVISORY_LOCKS).fetchone() == (0,)
        assert notices == []
    finally:
        appender.close()


@pytest.mark.parametrize("how", ["statement_timeout", "pg_cancel_backend"])
def test_an_append_cancelled_while_waiting_for_the_lock_raises_the_cancel_alone(pg_url, how):
    """Cancelled before it got the lock: nothing to release, no WARNING from an unlock of a
    lock not held, the cancel is the error the caller sees."""
    upgrade(pg_url)
    appender, notices = _cancelled_append(pg_url, how, hold="advisory")
    try:
        assert appender.execute(_MY_ADVISORY_LOCKS).fetchone() == (0,)
        assert notices == []
        assert _call(appender, "s").fetchone() == ("ok", 1)
    finally:
        appender.close()


def test_the_previous_ct_append_left_the_lock_behind(pg_url):
    """The probe above sees the fault this revision removes: with migration 0003's function
    the cancelled append's connection still holds the append lock."""
    assert migrate.head_revision() != PREVIOUS
    upgrade(pg_url, PREVIOUS)
    appender, _ = _cancelled_append(pg_url, "pg_cancel_backend", hold="sequence", head=False)
    try:
        assert appender.execute(_MY_ADVISORY_LOCKS).fetchone() == (1,)
        with psycopg.connect(_libpq(pg_url), autocommit=True) as other:
            assert other.execute("SELECT pg_try_advisory_lock(%s)", (APPEND_LOCK_KEY,)).fetchone() == (False,)
    finally:
        appender.close()


def _ct_append_source(url: str) -> str:
    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        row = conn.execute("SELECT prosrc FROM pg_proc WHERE proname = 'ct_append'").fetchall()
    assert len(row) == 1
    return row[0][0]


def test_downgrade_restores_the_previous_function_verbatim(pg_url):
    upgrade(pg_url, PREVIOUS)
    previous = _ct_append_source(pg_url)
    upgrade(pg_url)
    assert _ct_append_source(pg_url) != previous
    assert "query_canceled" in _ct_append_source(pg_url)
    migrate.downgrade(pg_url, PREVIOUS)
    assert _ct_append_source(pg_url) == previous


# -- through PgBouncer in transaction mode: the fault as operators would meet it ---------------------


@pytest.fixture(scope="module")
def bouncer():
    absent = missing("pgbouncer")
    if absent:
        pytest.skip("pgbouncer is not installed (Debian package pgbouncer)")
    with PgBouncer(pool_mode="transaction", pool_size=2) as b:
        yield b


@pytest.mark.parametrize(("revision", "left"), [("head", 0), (PREVIOUS, 1)])
def test_a_timed_out_append_through_pgbouncer_leaves_no_lock_on_the_pooled_connection(pg_url, bouncer, revision, left):
    """A client's append times out inside the lock (``SET LOCAL statement_timeout``, as a
    transaction pooler allows); the server connection goes back to PgBouncer's pool. With the
    previous function it still held the append lock there (``left`` 1), and every append on
    another connection waited on it."""
    upgrade(pg_url, revision)
    name = pg_url.rsplit("/", 1)[1]
    libpq = _libpq(pg_url)
    pooled = _libpq(bouncer.url(name))
    with psycopg.connect(libpq) as blocker, psycopg.connect(libpq, autocommit=True) as observer:
        blocker.execute("ALTER SEQUENCE events_position_seq CACHE 1")  # its transaction stays open
        with psycopg.connect(pooled, prepare_threshold=None) as client:
            client.execute("SET LOCAL statement_timeout = '500ms'")
            with pytest.raises(pg_errors.QueryCanceled):
                _call(client, "s", head=revision == "head")
            client.rollback()
        blocker.rollback()
        held = observer.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = %s) AND pid <> pg_backend_pid()",
            (name,),
        ).fetchone()
        assert held == (left,)
        if left == 0:
            observer.execute("SET lock_timeout = '5s'")
            assert _call(observer, "t").fetchone() == ("ok", 1)
            with psycopg.connect(pooled, prepare_threshold=None, autocommit=True) as client:
                assert _call(client, "s").fetchone() == ("ok", 1)
