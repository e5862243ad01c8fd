"""event store: events log, sessions projection, ct_append_events(), ct_put_session()

Revision ID: 0001_event_store
Revises:
Create Date: 2026-05-09
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001_event_store"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Same value as tracker.store.schema.APPEND_LOCK_KEY (a migration must not depend on
# code that may change later, so it is repeated here).
APPEND_LOCK_KEY = 0x63745F617070


def _json() -> sa.types.TypeEngine:
    return sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")


# PostgreSQL: the only way events are written. Inside a session-level advisory lock it
# only assigns this transaction its id and draws the events' positions from the
# identity sequence, then releases the lock and inserts (so the lock is held for
# microseconds, never across an insert that could fail or the commit). Hence, across
# all appends, "transaction id order" == "position order"; read_all relies on that
# (see tracker/store/sql.py). A version or idempotency key already taken fails the
# insert with unique_violation (23505), after the lock is released.
# p_types / p_data: JSON arrays (event types; event data objects), same length.
CREATE_APPEND_FUNCTION = f"""
CREATE FUNCTION ct_append_events(
    p_session_id text,
    p_expected integer,
    p_types text,
    p_data text,
    p_idempotency_key text
) RETURNS TABLE (out_position bigint, out_version integer, out_recorded_at timestamptz)
LANGUAGE plpgsql AS $fn$
DECLARE
    v_types jsonb := p_types::jsonb;
    v_data jsonb := p_data::jsonb;
    n integer := jsonb_array_length(v_types);
    v_txid bigint;
    v_positions bigint[];
BEGIN
    IF n IS DISTINCT FROM jsonb_array_length(v_data) OR n < 1 THEN
        RAISE EXCEPTION 'p_types and p_data must be JSON arrays of the same, non-zero length'
            USING ERRCODE = '22023';
    END IF;
    PERFORM pg_advisory_lock({APPEND_LOCK_KEY});
    v_txid := pg_current_xact_id()::text::bigint;  -- assigns the transaction id, inside the lock
    SELECT array_agg(nextval('events_position_seq') ORDER BY i) INTO v_positions FROM generate_series(1, n) AS i;
    PERFORM pg_advisory_unlock({APPEND_LOCK_KEY});
    RETURN QUERY
        INSERT INTO events AS e (position, session_id, version, type, data, recorded_at, idempotency_key, batch_size, txid)
        SELECT v_positions[t.ord], p_session_id, p_expected + t.ord::integer, t.type, d.data, now(),
               CASE WHEN t.ord = 1 THEN p_idempotency_key END,
               CASE WHEN t.ord = 1 THEN n END,
               v_txid
        FROM jsonb_array_elements_text(v_types) WITH ORDINALITY AS t(type, ord)
        JOIN jsonb_array_elements(v_data) WITH ORDINALITY AS d(data, ord) USING (ord)
        RETURNING e.position, e.version, e.recorded_at;
END
$fn$;
"""

# PostgreSQL: writes the session's projection row in the append's transaction, as a
# compare-and-set on the version (a new session: expected 0 and no row yet). A
# mismatch raises CT409, so the caller can send this and COMMIT in one round trip:
# on a conflict the COMMIT turns into a rollback. p_state NULL = appended without a
# projector (the listing columns are then left as they were).
CREATE_PUT_SESSION_FUNCTION = """
CREATE FUNCTION ct_put_session(
    p_session_id text,
    p_expected integer,
    p_version integer,
    p_state text,
    p_pressure text,
    p_revision integer,
    p_occupancy_bp integer,
    p_open_attempts integer
) RETURNS void
LANGUAGE plpgsql AS $fn$
BEGIN
    IF p_expected = 0 THEN
        INSERT INTO sessions (session_id, version, state, pressure, revision, occupancy_bp, open_attempts,
                              created_at, updated_at)
        VALUES (p_session_id, p_version, p_state::jsonb, p_pressure, p_revision, p_occupancy_bp,
                coalesce(p_open_attempts, 0), now(), now())
        ON CONFLICT (session_id) DO NOTHING;
    ELSIF p_state IS NULL THEN
        UPDATE sessions SET version = p_version, state = NULL, updated_at = now()
        WHERE session_id = p_session_id AND version = p_expected;
    ELSE
        UPDATE sessions SET version = p_version, state = p_state::jsonb, pressure = p_pressure,
                            revision = p_revision, occupancy_bp = p_occupancy_bp,
                            open_attempts = coalesce(p_open_attempts, 0), updated_at = now()
        WHERE session_id = p_session_id AND version = p_expected;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'session % is not at version %', p_session_id, p_expected
            USING ERRCODE = 'CT409';
    END IF;
END
$fn$;
"""


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column(
            "position",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(),
            primary_key=True,
        ),
        sa.Column("session_id", sa.String(200), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("type", sa.String(100), nullable=False),
        sa.Column("data", _json(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("idempotency_key", sa.String(200), nullable=True),
        sa.Column("batch_size", sa.Integer(), nullable=True),
        sa.Column("txid", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("position", name="pk_events"),
        sa.UniqueConstraint("session_id", "version", name="uq_events_session_id_version"),
        sa.UniqueConstraint("session_id", "idempotency_key", name="uq_events_session_id_idempotency_key"),
        sa.CheckConstraint("version >= 1", name="ck_events_version_positive"),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "sessions",
        sa.Column("session_id", sa.String(200), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("state", _json(), nullable=True),
        sa.Column("pressure", sa.String(32), nullable=True),
        sa.Column("revision", sa.Integer(), nullable=True),
        sa.Column("occupancy_bp", sa.Integer(), nullable=True),
        sa.Column("open_attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("session_id", name="pk_sessions"),
    )
    op.create_index("ix_sessions_pressure", "sessions", ["pressure"])
    op.create_index("ix_sessions_updated_at", "sessions", ["updated_at"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CREATE_APPEND_FUNCTION)
        op.execute(CREATE_PUT_SESSION_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS ct_put_session(text, integer, integer, text, text, integer, integer, integer)")
        op.execute("DROP FUNCTION IF EXISTS ct_append_events(text, integer, text, text, text)")
    op.drop_index("ix_sessions_updated_at", table_name="sessions")
    op.drop_index("ix_sessions_pressure", table_name="sessions")
    op.drop_table("sessions")
    op.drop_table("events")
