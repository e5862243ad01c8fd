"""ct_append releases the append lock on every exit (an error or a cancel between lock and unlock too)

Revision ID: 0008_append_lock_on_error
Revises: 0007_fleet_policies
Create Date: 2026-12-01

``ct_append`` (PostgreSQL, migration 0003) takes the session-level advisory lock
``APPEND_LOCK_KEY`` around "assign the transaction id + draw the positions" and releases it
in the same statement. An error landing between the two (a ``statement_timeout``, a
``pg_cancel_backend``, a lock timeout on the sequence) left the lock held by that server
connection: harmless directly connected (the store discards a connection after an error),
but a transaction pooler (PgBouncer, ``pool_mode = transaction``) hands that server
connection to the next client with the lock still held, and every append then waits on it.

Here the locked section is one PL/pgSQL block whose handler
(``EXCEPTION WHEN OTHERS OR query_canceled``: ``OTHERS`` does not catch a cancel)
releases the lock if this backend holds it and re-raises the error unchanged. Everything
else -- signature, results, the order "lock, transaction id, positions, unlock, then the
writes" -- is as in 0003. The block is a subtransaction that writes nothing (the
transaction id it assigns is the top-level one), so it gets no xid of its own.

A transaction-scoped lock (``pg_advisory_xact_lock``) would be released on every exit too,
but only at COMMIT: appends would then commit one at a time. SQLite: nothing changes.
Downgrade restores 0003's definition (read from that file).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

from alembic import op

from tracker.store.migrate import migration_module

revision: str = "0008_append_lock_on_error"
down_revision: str | Sequence[str] | None = "0007_fleet_policies"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Same value as tracker.store.schema.APPEND_LOCK_KEY (repeated: a migration must not
# depend on code that may change later). pg_locks shows a bigint key as
# (classid, objid) = (high 32 bits, low 32 bits), objsubid 1.
APPEND_LOCK_KEY = 0x63745F617070
_HIGH, _LOW = APPEND_LOCK_KEY >> 32, APPEND_LOCK_KEY & 0xFFFFFFFF

# Migration 0003's text with the locked section replaced (steps as described there):
#
#   BEGIN
#       lock; transaction id; positions; unlock
#   EXCEPTION WHEN OTHERS OR query_canceled THEN
#       unlock if this backend holds the lock; RAISE (the same error)
#   END
#
# The lock is taken inside the block, so a cancel that lands at any point after it was
# granted (even before the next statement starts) reaches the handler. The handler asks
# pg_locks rather than unlocking blindly: a cancel while *waiting* for the lock, or after
# the unlock, leaves nothing to release, and pg_advisory_unlock of a lock not held would
# log a WARNING. Session-level advisory locks are not released by the block's rollback
# (they are not transactional), hence the explicit unlock.
OLD_SECTION = f"""    PERFORM pg_advisory_lock({APPEND_LOCK_KEY});
    v_txid := pg_current_xact_id()::text::bigint;  -- assigns the transaction id, inside the lock
    IF n = 1 THEN
        v_positions := ARRAY[nextval('events_position_seq')];
    ELSE
        SELECT array_agg(nextval('events_position_seq') ORDER BY i) INTO v_positions FROM generate_series(1, n) AS i;
    END IF;
    PERFORM pg_advisory_unlock({APPEND_LOCK_KEY});
"""
NEW_SECTION = f"""    BEGIN
        PERFORM pg_advisory_lock({APPEND_LOCK_KEY});
        v_txid := pg_current_xact_id()::text::bigint;  -- assigns the transaction id, inside the lock
        IF n = 1 THEN
            v_positions := ARRAY[nextval('events_position_seq')];
        ELSE
            SELECT array_agg(nextval('events_position_seq') ORDER BY i) INTO v_positions
            FROM generate_series(1, n) AS i;
        END IF;
        PERFORM pg_advisory_unlock({APPEND_LOCK_KEY});
    EXCEPTION WHEN OTHERS OR query_canceled THEN
        -- released on every exit: a session-level lock outlives the statement (and, through a
        -- transaction pooler, reaches the next client) unless it is released here
        IF EXISTS (SELECT 1 FROM pg_locks
                   WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted
                     AND classid = {_HIGH} AND objid = {_LOW} AND objsubid = 1) THEN
            PERFORM pg_advisory_unlock({APPEND_LOCK_KEY});
        END IF;
        RAISE;
    END;
"""


def _first() -> ModuleType:
    """Migration 0003 (read from its file: the function's text has one place)."""
    return migration_module("0003_one_call_append.py")


def _replace(create: str) -> str:
    """``CREATE FUNCTION`` -> ``CREATE OR REPLACE FUNCTION`` (same signature: the function keeps
    its identity, owner and grants)."""
    assert create.count("CREATE FUNCTION ct_append(") == 1
    return create.replace("CREATE FUNCTION ct_append(", "CREATE OR REPLACE FUNCTION ct_append(", 1)


def create_append() -> str:
    """This revision's ``CREATE OR REPLACE FUNCTION ct_append``."""
    old = _first().CREATE_APPEND
    assert old.count(OLD_SECTION) == 1, "migration 0003's ct_append is not the text this revision rewrites"
    return _replace(old.replace(OLD_SECTION, NEW_SECTION, 1))


def _is_pg() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def upgrade() -> None:
    if _is_pg():
        op.execute(create_append())


def downgrade() -> None:
    if _is_pg():
        op.execute(_replace(_first().CREATE_APPEND))
