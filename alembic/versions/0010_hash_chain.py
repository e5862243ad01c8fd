"""events.hash: each event chained to the previous event of its session (the tamper-evident log)

Revision ID: 0010_hash_chain
Revises: 0009_provider_reports
Create Date: 2026-12-04

* ``events.hash`` (BYTEA / BLOB, 32 bytes): ``sha256(previous hash || canonical bytes)``, the
  rule and its genesis value in ``tracker.store.chain`` (imported here, not repeated: the rule
  must never change, and one definition is what keeps Python and PostgreSQL in step). NULL only
  on a row written behind the store's back; ``tracker verify`` calls it "unchained".
* ``ct_append`` (PostgreSQL) takes the events as their canonical texts (``p_events``: one
  ``[session_id, version, type, data]`` JSON text per event, joined by newlines -- compact JSON
  has no raw newline), checks that each names this session and its version, stores its type and
  data from that very text, and chains ``sha256(previous || convert_to(text, 'UTF8'))`` server
  side with the built-in ``sha256(bytea)`` (no pgcrypto), the previous hash read from the
  session's event at ``p_expected`` once the projection's compare-and-set holds the session.
  Everything else -- results, the lock section of 0008 -- is as before. The old signature is
  dropped (a client older than this schema is refused by ``check_schema`` anyway).
* Backfill: every existing event gets its chain, read in (session_id, version) order in
  batches of ``BATCH`` events (keyset pagination on the unique index), hashed in Python, written
  back by position (PostgreSQL: COPY into a temporary table, one UPDATE … FROM per batch;
  SQLite: executemany). Measured on the development machine (2 cores, local server):
  see docs/operations.md "The tamper-evident log" for the figures per million events. It runs in
  the upgrade's transaction and rewrites every event row once (PostgreSQL: the table's size
  doubles until VACUUM); schedule it with the upgrade.

Downgrade drops the column and restores 0008's ``ct_append`` (read from that file).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import sqlalchemy as sa
from alembic import op

from tracker.store import chain
from tracker.store.migrate import migration_module

revision: str = "0010_hash_chain"
down_revision: str | Sequence[str] | None = "0009_provider_reports"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: events read, hashed and written back per batch of the backfill
BATCH = 20_000

# Same value as tracker.store.schema.APPEND_LOCK_KEY (as in 0003 and 0008).
APPEND_LOCK_KEY = 0x63745F617070
_HIGH, _LOW = APPEND_LOCK_KEY >> 32, APPEND_LOCK_KEY & 0xFFFFFFFF
_GENESIS_SQL = f"'\\x{chain.GENESIS.hex()}'::bytea"

DROP_OLD = "DROP FUNCTION IF EXISTS ct_append(text, integer, text, text, text, text, text, integer, integer, integer)"
DROP_NEW = "DROP FUNCTION IF EXISTS ct_append(text, integer, text, text, text, text, integer, integer, integer)"

# The steps of 0003 (idempotency key, lock section as 0008 made it, compare-and-set, insert), and:
# 0. parse each canonical text, check it is [p_session_id, p_expected + i, <type>, <object>];
# 3b. the previous hash: GENESIS at version 0, else the hash of the event at p_expected (read
#     after the compare-and-set, which waited for any concurrent writer of this session and so
#     sees its committed row); NULL if there is none (a deleted event: the chain stays broken);
# 4. insert with the chained hashes.
CREATE_APPEND = f"""
CREATE FUNCTION ct_append(
    p_session_id text,
    p_expected integer,
    p_events text,
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
    v_texts text[] := string_to_array(p_events, E'\\n');
    n integer := coalesce(array_length(v_texts, 1), 0);
    v_events jsonb[];
    v_hashes bytea[];
    v_prev bytea;
    v_ev jsonb;
    v_found integer;
    v_txid bigint;
    v_positions bigint[];
    v_fleet text := CASE WHEN strpos(p_session_id, ':') > 0 THEN split_part(p_session_id, ':', 1) ELSE '' END;
BEGIN
    IF n < 1 THEN
        RAISE EXCEPTION 'p_events must hold at least one event' USING ERRCODE = '22023';
    END IF;
    FOR i IN 1..n LOOP
        v_ev := v_texts[i]::jsonb;
        IF jsonb_typeof(v_ev) IS DISTINCT FROM 'array' OR jsonb_array_length(v_ev) <> 4
           OR v_ev->>0 IS DISTINCT FROM p_session_id OR v_ev->1 IS DISTINCT FROM to_jsonb(p_expected + i)
           OR jsonb_typeof(v_ev->2) IS DISTINCT FROM 'string' OR jsonb_typeof(v_ev->3) IS DISTINCT FROM 'object' THEN
            RAISE EXCEPTION 'p_events[%] is not [session_id, version, type, data] of this append', i
                USING ERRCODE = '22023';
        END IF;
        v_events[i] := v_ev;
    END LOOP;
    IF p_idempotency_key IS NOT NULL THEN
        SELECT e.version INTO v_found FROM events e
        WHERE e.session_id = p_session_id AND e.idempotency_key = p_idempotency_key;
        IF FOUND THEN
            RETURN QUERY SELECT 'replay'::text, v_found, NULL::text, NULL::bigint[], NULL::timestamptz;
            RETURN;
        END IF;
    END IF;
    BEGIN
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
    IF p_expected = 0 THEN
        v_prev := {_GENESIS_SQL};
    ELSE
        SELECT e.hash INTO v_prev FROM events e WHERE e.session_id = p_session_id AND e.version = p_expected;
    END IF;
    FOR i IN 1..n LOOP
        v_prev := sha256(v_prev || convert_to(v_texts[i], 'UTF8'));
        v_hashes[i] := v_prev;
    END LOOP;
    IF n = 1 THEN
        INSERT INTO events (position, session_id, version, type, data, recorded_at, idempotency_key, batch_size,
                            txid, fleet, hash)
        VALUES (v_positions[1], p_session_id, p_expected + 1, v_events[1]->>2, v_events[1]->3, now(),
                p_idempotency_key, 1, v_txid, v_fleet, v_hashes[1]);
    ELSE
        INSERT INTO events (position, session_id, version, type, data, recorded_at, idempotency_key, batch_size,
                            txid, fleet, hash)
        SELECT v_positions[i], p_session_id, p_expected + i, v_events[i]->>2, v_events[i]->3, now(),
               CASE WHEN i = 1 THEN p_idempotency_key END,
               CASE WHEN i = 1 THEN n END,
               v_txid, v_fleet, v_hashes[i]
        FROM generate_series(1, n) AS i;
    END IF;
    RETURN QUERY SELECT 'ok'::text, p_expected + n, NULL::text, v_positions, now();
END
$fn$;
"""


def _previous() -> ModuleType:
    """Migration 0008 (read from its file: its function's text has one place)."""
    return migration_module("0008_append_lock_released_on_error.py")


def _is_pg() -> bool:
    return op.get_bind().dialect.name == "postgresql"


_READ_FIRST = "SELECT position, session_id, version, type, data FROM events ORDER BY session_id, version LIMIT :n"
_READ_NEXT = (
    "SELECT position, session_id, version, type, data FROM events "
    "WHERE (session_id, version) > (:s, :v) ORDER BY session_id, version LIMIT :n"
)


def backfill(conn: Any, batch: int = BATCH) -> int:
    """Chain every event (in (session_id, version) order, ``batch`` at a time); returns how many."""
    pg = conn.dialect.name == "postgresql"
    if pg:
        conn.exec_driver_sql("CREATE TEMPORARY TABLE ct_hash_backfill (position bigint PRIMARY KEY, hash bytea)")
    done = 0
    sid: str | None = None
    version = 0
    prev: bytes | None = chain.GENESIS
    while True:
        if sid is None:
            rows = conn.execute(sa.text(_READ_FIRST), {"n": batch}).all()
        else:
            rows = conn.execute(sa.text(_READ_NEXT), {"s": sid, "v": version, "n": batch}).all()
        if not rows:
            break
        out: list[tuple[int, bytes | None]] = []
        for position, row_sid, row_version, type_, data in rows:
            if row_sid != sid:
                sid, version, prev = row_sid, 0, chain.GENESIS
            if row_version != version + 1:
                prev = None  # a gap in the stored stream: what follows stays unchained
            if isinstance(data, str):
                data = json.loads(data)
            if prev is not None:
                prev = chain.link(prev, chain.canonical(row_sid, row_version, type_, data))
            version = row_version
            out.append((position, prev))
        if pg:
            raw = conn.connection.driver_connection
            with raw.cursor() as cur:
                with cur.copy("COPY ct_hash_backfill (position, hash) FROM STDIN") as copy:
                    for item in out:
                        copy.write_row(item)
            conn.exec_driver_sql(
                "UPDATE events e SET hash = t.hash FROM ct_hash_backfill t WHERE e.position = t.position"
            )
            conn.exec_driver_sql("TRUNCATE ct_hash_backfill")
        else:
            conn.execute(
                sa.text("UPDATE events SET hash = :h WHERE position = :p"), [{"h": h, "p": p} for p, h in out]
            )
        done += len(out)
        if len(rows) < batch:
            break
    if pg:
        conn.exec_driver_sql("DROP TABLE ct_hash_backfill")
    return done


def upgrade() -> None:
    op.add_column("events", sa.Column("hash", sa.LargeBinary(), nullable=True))
    if _is_pg():
        op.execute(DROP_OLD)
        op.execute(CREATE_APPEND)
    backfill(op.get_bind())


def downgrade() -> None:
    if _is_pg():
        op.execute(DROP_NEW)
        op.execute(_previous().create_append().replace("CREATE OR REPLACE FUNCTION", "CREATE FUNCTION", 1))
    op.drop_column("events", "hash")  # (SQLite >= 3.35 drops a column in place)
