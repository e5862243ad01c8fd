"""idempotency keys indexed only where there is one; the two-call append functions dropped

Revision ID: 0006_lean_append
Revises: 0005_events_by_type
Create Date: 2026-11-30

* ``uq_events_session_id_idempotency_key`` becomes a partial unique index
  (``WHERE idempotency_key IS NOT NULL``). Most events carry no key, and a NULL never
  collides, so the old constraint held one index entry per event for nothing: every append
  wrote it. What it enforces is unchanged (one use of a key per session), and the lookup
  ``session_id = … AND idempotency_key = …`` reads the partial index.
* ``ct_append_events`` and ``ct_put_session`` (PostgreSQL, migration 0001) are dropped:
  appends go through ``ct_append`` (migration 0003) since then.

On PostgreSQL the new index is built from the events that have a key (few), under the
table's write lock. On SQLite the events table is rebuilt (SQLite cannot drop a table
constraint in place): a few seconds per million events.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from tracker.store.migrate import migration_module

revision: str = "0006_lean_append"
down_revision: str | Sequence[str] | None = "0005_events_by_type"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = "uq_events_session_id_idempotency_key"
COLUMNS = ["session_id", "idempotency_key"]
HAS_KEY = sa.text("idempotency_key IS NOT NULL")


def _is_pg() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def upgrade() -> None:
    if _is_pg():
        op.drop_constraint(NAME, "events", type_="unique")
        op.execute("DROP FUNCTION IF EXISTS ct_put_session(text, integer, integer, text, text, integer, integer, integer)")
        op.execute("DROP FUNCTION IF EXISTS ct_append_events(text, integer, text, text, text)")
    else:
        with op.batch_alter_table("events", recreate="always", table_kwargs={"sqlite_autoincrement": True}) as batch:
            batch.drop_constraint(NAME, type_="unique")
    op.create_index(NAME, "events", COLUMNS, unique=True, postgresql_where=HAS_KEY, sqlite_where=HAS_KEY)


def downgrade() -> None:
    op.drop_index(NAME, table_name="events")
    if _is_pg():
        op.create_unique_constraint(NAME, "events", COLUMNS)
        # the functions as migration 0001 wrote them (read from it: one text, one place)
        first = migration_module("0001_event_store.py")
        op.execute(first.CREATE_APPEND_FUNCTION)
        op.execute(first.CREATE_PUT_SESSION_FUNCTION)
    else:
        with op.batch_alter_table("events", recreate="always", table_kwargs={"sqlite_autoincrement": True}) as batch:
            batch.create_unique_constraint(NAME, COLUMNS)
