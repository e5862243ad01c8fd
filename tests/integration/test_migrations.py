"""Alembic migrations vs. the SQLAlchemy models, on real SQLite and PostgreSQL.

Structured over ``migrate.revisions()``, so every new revision is covered
automatically: upgrading from empty and from every earlier revision reaches a
schema identical to the models, re-upgrading is a no-op, every step downgrades.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect

import tracker
from tests.support.db import create_pg_database, drop_pg_database
from tests.support.db import sqlalchemy_url as _sqlalchemy_url
from tests.support.procs import racing_context
from tracker.errors import SchemaOutOfDate
from tracker.settings import normalize_database_url
from tracker.store import NewEvent, migrate, open_store
from tracker.store.schema import include_object, metadata

REVISIONS = migrate.revisions()
EARLIER = ["base", *REVISIONS[:-1]]  # every starting point older than head


def schema_diff(url: str) -> list:
    engine = create_engine(normalize_database_url(url))
    try:
        with engine.connect() as conn:
            opts = {"compare_type": True, "include_object": include_object(conn.dialect.name)}
            ctx = MigrationContext.configure(conn, opts=opts)
            return compare_metadata(ctx, metadata)
    finally:
        engine.dispose()


def tables(url: str) -> set[str]:
    engine = create_engine(normalize_database_url(url))
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def check_head(url: str) -> None:
    engine = create_engine(normalize_database_url(url))
    try:
        migrate.check_schema(engine)
    finally:
        engine.dispose()


def test_revision_history_is_linear_and_located_next_to_the_package():
    assert Path(tracker.__file__).resolve().parents[1] / "alembic" == migrate.ALEMBIC_DIR
    assert (migrate.ALEMBIC_DIR / "env.py").is_file()
    assert REVISIONS and REVISIONS[-1] == migrate.head_revision()
    assert len(set(REVISIONS)) == len(REVISIONS)


def test_models_and_migrations_agree(db_url):
    migrate.upgrade(db_url)
    assert schema_diff(db_url) == []
    command.check(migrate.alembic_config(db_url))  # `alembic check`: raises if autogenerate finds a diff
    assert {"events", "sessions", "alembic_version"} <= tables(db_url)


@pytest.fixture
def fresh_url_factory(request, tmp_path):
    """Make more empty databases of the db_url's backend (one per starting revision)."""
    created: list[str] = []
    counter = iter(range(1000))

    def make(backend: str) -> str:
        if backend == "sqlite":
            return f"sqlite:///{tmp_path / f'm{next(counter)}.db'}"
        name, url = create_pg_database()
        created.append(name)
        return _sqlalchemy_url(url)

    yield make
    for name in created:
        drop_pg_database(name)


@pytest.mark.parametrize("start", EARLIER)
def test_upgrade_from_every_earlier_revision(db_url, start):
    if start != "base":
        migrate.upgrade(db_url, start)
    with pytest.raises(SchemaOutOfDate, match="tracker db upgrade"):
        check_head(db_url)
    assert migrate.upgrade(db_url) == migrate.head_revision()
    check_head(db_url)
    assert schema_diff(db_url) == []
    # idempotent: a second upgrade changes nothing
    assert migrate.upgrade(db_url) == migrate.head_revision()
    assert schema_diff(db_url) == []
    store = open_store(db_url)
    try:
        assert store.append("after-upgrade", 0, [NewEvent("Tick", {})]).last_version == 1
    finally:
        store.close()


def test_every_step_downgrades_and_upgrades_again(db_url):
    migrate.upgrade(db_url)
    for rev in reversed(REVISIONS):  # head -> ... -> base, one step at a time
        assert migrate.current_revision(db_url) == rev
        migrate.downgrade(db_url, "-1")
    assert migrate.current_revision(db_url) is None
    assert tables(db_url) <= {"alembic_version"}
    if db_url.startswith("postgresql"):
        engine = create_engine(db_url)
        with engine.connect() as conn:
            from sqlalchemy import text

            assert conn.execute(text("SELECT count(*) FROM pg_proc WHERE proname LIKE 'ct\\_%'")).scalar_one() == 0
        engine.dispose()
    migrate.upgrade(db_url)
    assert schema_diff(db_url) == []


def test_upgrade_needs_no_paths_from_the_user(db_url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nowhere near alembic/ or an alembic.ini
    assert migrate.upgrade(db_url) == migrate.head_revision()


def _upgrade_in_process(url: str) -> str | None:
    return migrate.upgrade(url)


@pytest.mark.postgres
def test_concurrent_upgrades_queue_up(pg_url):
    """Several processes (and threads) running `tracker db upgrade` at once all succeed."""
    ctx = racing_context()
    with ctx.Pool(3) as pool:
        pending = [pool.apply_async(_upgrade_in_process, (pg_url,)) for _ in range(3)]
        errors: list[BaseException] = []

        def in_thread():
            try:
                migrate.upgrade(pg_url)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=in_thread) for _ in range(2)]
        for t in threads:
            t.start()
        results = [p.get(60) for p in pending]
        for t in threads:
            t.join(60)
    assert results == [migrate.head_revision()] * 3 and errors == []
    assert migrate.current_revision(pg_url) == migrate.head_revision()
    assert schema_diff(pg_url) == []
