"""one-call append (ct_append), events.fleet with (fleet, position), sessions (pressure, updated_at DESC, session_id)

Revision ID: 0003_one_call_append
Revises: 0002_fleets
Create Date: 2026-05-11

* ``ct_append()`` (PostgreSQL): the whole append in one statement -- projection
  compare-and-set, positions drawn under the append lock, events inserted -- that
  *returns* the session's current version and state when the caller's version is
  stale (and the original version when the idempotency key was used), instead of
  failing. Nothing in normal operation logs an ERROR any more.
* ``events.fleet``: the text before the first ``:`` of the session id (the HTTP API
  stores a fleet's sessions as ``<fleet_id>:<session_id>``; '' for other ids),
  backfilled here, with an index on ``(fleet, position)`` for the per-fleet feed.
* ``ix_sessions_pressure_updated_at`` on ``(pressure, updated_at DESC, session_id)``
  replaces ``ix_sessions_pressure``: a pressure filter reads exactly its page.

The backfill rewrites every event row once (not timed here: try it on a copy; expect minutes
per 10M events on a small server) and holds the table's write lock while it runs: schedule it
with the upgrade.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_one_call_append"
down_revision: str | Sequence[str] | None = "0002_fleets"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Same value as tracker.store.schema.APPEND_LOCK_KEY (repeated: a migration must not
# depend on code that may change later).
APPEND_LOCK_KEY = 0x63745F617070

# One append in one statement (autocommit: one round trip, one transaction).
#
# 1. An idempotency key already used: return ('replay', its first version).
# 2. Under the append lock L, only assign the transaction id and draw the positions
#    (the commit-order argument of tracker/store/sql.py needs exactly this: the
#    transaction's first write happens after its id was taken inside L).
# 3. Compare-and-set on the projection row (insert for version 0). It waits for a
#    concurrent writer of the same session and then sees its committed row, so a
#    stale version is found here: return ('conflict', current version, current state)
#    -- or ('replay', …) if that writer used the same idempotency key. Nothing is written.
# 4. Insert the events, return ('ok', last version, NULL, positions, recorded_at).
#
# p_types / p_data: JSON arrays (event types; event data objects), same length.
# p_state NULL: appended without a projector (the listing columns keep their values).
CREATE_APPEND = f"""
CREATE FUNCTION ct_append(
    p_session_id text,
    p_expected integer,
    p_types text,
    p_data text,
    p_idempotency_key text,
    p_state text,
    p_pressure text,
    p_revision integer,
    p_occupancy_bp integer,
    p_open_attempts integer
) RETURNS TABLE (out_status text, out_version integer, out_state text, out_positions bigint[],
                 out_recorded_at timestamptz)
LANGUAGE plpgsql AS $fn$
DECLARE
    v_types jsonb := p_types::jsonb;
    v_data jsonb := p_data::jsonb;
    n integer := jsonb_array_length(v_types);
    v_found integer;
    v_txid bigint;
    v_positions bigint[];
    v_fleet text := CASE WHEN strpos(p_session_id, ':') > 0 THEN split_part(p_session_id, ':', 1) ELSE '' END;
BEGIN
    IF n IS DISTINCT FROM jsonb_array_length(v_data) OR n < 1 THEN
        RAISE EXCEPTION 'p_types and p_data must be JSON arrays of the same, non-zero length'
            USING ERRCODE = '22023';
    END IF;
    IF p_idempotency_key IS NOT NULL THEN
        SELECT e.version INTO v_found FROM events e
        WHERE e.session_id = p_session_id AND e.idempotency_key = p_idempotency_key;
        IF FOUND THEN
            RETURN QUERY SELECT 'replay'::text, v_found, NULL::text, NULL::bigint[], NULL::timestamptz;
            RETURN;
        END IF;
    END IF;
    PERFORM pg_advisory_lock({APPEND_LOCK_KEY});
    v_txid := pg_current_xact_id()::text::bigint;  -- assigns the transaction id, inside the lock
    IF n = 1 THEN
        v_positions := ARRAY[nextval('events_position_seq')];
    ELSE
        SELECT array_agg(nextval('events_position_seq') ORDER BY i) INTO v_positions FROM generate_series(1, n) AS i;
    END IF;
    PERFORM pg_advisory_unlock({APPEND_LOCK_KEY});
    IF p_expected = 0 THEN
        INSERT INTO sessions (session_id, version, state, pressure, revision, occupancy_bp, open_attempts,
                              created_at, updated_at)
        VALUES (p_session_id, n, p_state::jsonb, p_pressure, p_revision, p_occupancy_bp,
                coalesce(p_open_attempts, 0), now(), now())
        ON CONFLICT (session_id) DO NOTHING;
    ELSIF p_state IS NULL THEN
        UPDATE sessions SET version = p_expected + n, state = NULL, updated_at = now()
        WHERE session_id = p_session_id AND version = p_expected;
    ELSE
        UPDATE sessions SET version = p_expected + n, state = p_state::jsonb, pressure = p_pressure,
                            revision = p_revision, occupancy_bp = p_occupancy_bp,
                            open_attempts = coalesce(p_open_attempts, 0), updated_at = now()
        WHERE session_id = p_session_id AND version = p_expected;
    END IF;
    IF NOT FOUND THEN
        IF p_idempotency_key IS NOT NULL THEN
            SELECT e.version INTO v_found FROM events e
            WHERE e.session_id = p_session_id AND e.idempotency_key = p_idempotency_key;
            IF FOUND THEN
                RETURN QUERY SELECT 'replay'::text, v_found, NULL::text, NULL::bigint[], NULL::timestamptz;
                RETURN;
            END IF;
        END IF;
        RETURN QUERY SELECT 'conflict'::text, coalesce(max(s.version), 0), max(s.state::text), NULL::bigint[],
                            NULL::timestamptz
                     FROM sessions s WHERE s.session_id = p_session_id;
        RETURN;
    END IF;
    IF n = 1 THEN
        INSERT INTO events (position, session_id, version, type, data, recorded_at, idempotency_key, batch_size,
                            txid, fleet)
        VALUES (v_positions[1], p_session_id, p_expected + 1, v_types->>0, v_data->0, now(), p_idempotency_key,
                1, v_txid, v_fleet);
    ELSE
        INSERT INTO events (position, session_id, version, type, data, recorded_at, idempotency_key, batch_size,
                            txid, fleet)
        SELECT v_positions[t.ord], p_session_id, p_expected + t.ord::integer, t.type, d.data, now(),
               CASE WHEN t.ord = 1 THEN p_idempotency_key END,
               CASE WHEN t.ord = 1 THEN n END,
               v_txid, v_fleet
        FROM jsonb_array_elements_text(v_types) WITH ORDINALITY AS t(type, ord)
        JOIN jsonb_array_elements(v_data) WITH ORDINALITY AS d(data, ord) USING (ord);
    END IF;
    RETURN QUERY SELECT 'ok'::text, p_expected + n, NULL::text, v_positions, now();
END
$fn$;
"""
DROP_APPEND = (
    "DROP FUNCTION IF EXISTS ct_append(text, integer, text, text, text, text, text, integer, integer, integer)"
)

_FLEET_PG = "CASE WHEN strpos(session_id, ':') > 0 THEN split_part(session_id, ':', 1) ELSE '' END"
_FLEET_SQLITE = (
    "CASE WHEN instr(session_id, ':') > 0 THEN substr(session_id, 1, instr(session_id, ':') - 1) ELSE '' END"
)


def upgrade() -> None:
    pg = op.get_bind().dialect.name == "postgresql"
    op.add_column("events", sa.Column("fleet", sa.String(200), server_default="", nullable=False))
    if pg:
        op.execute(f"UPDATE events SET fleet = {_FLEET_PG} WHERE strpos(session_id, ':') > 0")
    else:
        op.execute(f"UPDATE events SET fleet = {_FLEET_SQLITE} WHERE instr(session_id, ':') > 0")
    op.create_index("ix_events_fleet_position", "events", ["fleet", "position"])
    op.drop_index("ix_sessions_pressure", table_name="sessions")
    op.create_index(
        "ix_sessions_pressure_updated_at", "sessions", ["pressure", sa.text("updated_at DESC"), "session_id"]
    )
    if pg:
        op.execute(CREATE_APPEND)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(DROP_APPEND)
    op.drop_index("ix_sessions_pressure_updated_at", table_name="sessions")
    op.create_index("ix_sessions_pressure", "sessions", ["pressure"])
    op.drop_index("ix_events_fleet_position", table_name="events")
    with op.batch_alter_table("events") as batch:
        batch.drop_column("fleet")
