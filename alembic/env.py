"""Alembic environment for the Context Tracker event store.

The database URL comes from (first found): ``config.attributes["connection"]``
(an open SQLAlchemy connection, used by tests), ``config.attributes["url"]``
(set by ``tracker.store.migrate``), the ``sqlalchemy.url`` option, or the
tracker's settings (``TRACKER_DATABASE_URL``, read by ``tracker.settings``).

On PostgreSQL all pending migrations run in one transaction (0011 commits its first
step on its own) under a session-level advisory lock, so concurrent ``tracker db
upgrade`` runs queue up instead of racing each other.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import create_engine, pool, text

from tracker.settings import Settings, normalize_database_url
from tracker.store.schema import MIGRATE_LOCK_KEY, include_object, metadata

config = context.config
target_metadata = metadata

if config.config_file_name is not None:  # the `alembic` CLI with alembic.ini (not tracker db upgrade)
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if not url:  # the plain `alembic` CLI: the same database the tracker would use
        url = Settings.load().store.database_url
    return normalize_database_url(url)


def run_migrations_offline() -> None:
    url = _url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        include_object=include_object(connection.dialect.name),
    )
    if connection.dialect.name != "postgresql":
        with context.begin_transaction():
            context.run_migrations()
        return
    # a session-level lock: held across a migration's own commit (0011 commits one step first)
    connection.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATE_LOCK_KEY})
    connection.commit()
    try:
        with context.begin_transaction():
            context.run_migrations()
    finally:
        if not connection.closed and not connection.invalidated:
            connection.rollback()
            connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATE_LOCK_KEY})
            connection.commit()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
