"""events partitioned by month of recorded_at (PostgreSQL); a no-op on SQLite

Revision ID: 0011_partitioned_events
Revises: 0010_hash_chain
Create Date: 2026-12-06

PostgreSQL only (SQLite keeps its one table; this revision changes nothing there):

* ``events`` becomes ``PARTITION BY RANGE (recorded_at)``: one partition per calendar month
  (UTC), named ``events_yYYYYmMM``, and ``events_default`` (the DEFAULT partition: an insert
  never fails for want of a partition). The columns, the identity sequence
  ``events_position_seq`` and every index keep their names and columns, except what a
  partitioned table cannot have: a unique index must hold the partition key. So the primary
  key is ``(position, recorded_at)`` and ``(session_id, version)`` and ``(session_id,
  idempotency_key)`` are plain indexes (``ix_events_session_id_version``,
  ``ix_events_session_id_idempotency_key``). Their uniqueness -- and that of ``position`` -- is
  kept by ``ct_events_unique``, two statement-level triggers (INSERT, UPDATE) on ``events``:
  every statement that writes events locks the sessions it writes (transaction-scoped advisory
  locks, in session-id order; more than ``BULK_SESSIONS`` sessions take one exclusive lock
  instead) and then counts, over all partitions, the rows holding each written
  ``(session_id, version)``, ``(session_id, idempotency_key)`` and ``position``; a count above
  one raises ``unique_violation`` (SQLSTATE 23505) naming the old constraint. Why that is sound
  under concurrency: docs/operations.md "The partitioned log". ``ct_append`` (the store's
  append) keeps its logic -- it already serialises each stream on its ``sessions`` row -- and
  only draws its positions from the sequence looked up by name at each call (``append_by_name``).
* ``ct_events_ensure_partitions(from, to, parent)`` creates the months from ``from`` to ``to``
  that have no partition yet (as a plain table attached with ``ATTACH PARTITION``: appends go
  on), moving any rows of that month out of the DEFAULT partition first. The store calls it for
  the current month and ``PARTITION_MONTHS_AHEAD`` months ahead at its first append in each
  process and calendar month (``tracker.store.postgres``); an operator may call it too.

The conversion (online: appends and reads go on except during the short final step):

0. (committed on its own, before the rest) ``ct_append`` as ``append_by_name`` makes it;
1. create the partitioned table ``events_partitioned`` with one partition per month from the
   oldest event's month to three months ahead, and the DEFAULT partition;
2. copy the events in position order in batches of ``BATCH``, reading only the committed prefix
   the event feed reads (``FEED_WATERMARK``); then ANALYZE and build the indexes (nothing locks
   the old table meanwhile but the reads' ACCESS SHARE);
3. the swap, in a savepoint: take ``ct_append``'s append lock, ``LOCK TABLE events IN ACCESS
   EXCLUSIVE MODE`` and the sequence's lock, each waiting ``SWAP_LOCK_TIMEOUT`` at most (on a
   timeout: roll back to the savepoint, pause, try again, up to ``SWAP_ATTEMPTS`` times); reads
   and appends wait from here to the commit. Copy the events appended since step 2 (after the
   last copied position), check the counts (and copy any event a writer outside ``ct_append``
   slipped in below it), move the sequence on, drop the old table, rename the new one (and its
   sequence and indexes) into place, create the triggers. Commit.

Measured figures and what the lock costs: docs/operations.md "The partitioned log".
Downgrade is the same conversion the other way (into one table with 0010's constraints), then
0010's ``ct_append``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from alembic import op

from tracker.store.migrate import migration_module

revision: str = "0011_partitioned_events"
down_revision: str | Sequence[str] | None = "0010_hash_chain"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

log = logging.getLogger("alembic.runtime.migration")

#: events copied per statement of the conversion
BATCH = 50_000
#: a statement writing events of more sessions than this takes one exclusive lock instead of one per session
BULK_SESSIONS = 64
#: months created ahead of the current one by the conversion
MONTHS_AHEAD = 3
#: the swap (step 3): how long each of its locks is waited for, how often it is tried, the pause between tries
SWAP_LOCK_TIMEOUT = "200ms"
SWAP_ATTEMPTS = 100
SWAP_PAUSE_S = 0.05
LOCK_NOT_AVAILABLE = "55P03"
#: ct_append's lock around drawing positions (tracker.store.schema.APPEND_LOCK_KEY, as in 0003, 0008, 0010)
APPEND_LOCK_KEY = 0x63745F617070

# Advisory-lock keys (beside tracker.store.schema's APPEND_LOCK_KEY and MIGRATE_LOCK_KEY).
PARTITION_LOCK_KEY = 0x63745F707274  # "ct_prt": serialises ct_events_ensure_partitions
UNIQUE_ALL_KEY = 0x63745F756E71  # "ct_unq": shared by every writing statement, exclusive for a bulk one
UNIQUE_SESSION_CLASS = 0x63745F75  # "ct_u": classid of the per-session locks (key: hashtext(session_id))
#: the event feed's committed prefix (tracker.store.postgres.FEED_WATERMARK, the same text)
FEED_WATERMARK = "txid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint"

COLUMNS = "position, session_id, version, type, data, recorded_at, idempotency_key, batch_size, txid, fleet, hash"
_COLUMN_DDL = """
    "position" bigint NOT NULL GENERATED BY DEFAULT AS IDENTITY (SEQUENCE NAME events_position_seq_new CACHE 1),
    session_id varchar(200) NOT NULL,
    version integer NOT NULL,
    type varchar(100) NOT NULL,
    data jsonb NOT NULL,
    recorded_at timestamptz NOT NULL,
    idempotency_key varchar(200),
    batch_size integer,
    txid bigint,
    fleet varchar(200) NOT NULL DEFAULT '',
    hash bytea,
    CONSTRAINT ck_events_ck_events_version_positive CHECK (version >= 1)
"""
_PROVIDER_REPORTS = "WHERE type IN ('ProviderRejected', 'UsageReported')"

ENSURE_PARTITIONS = f"""
CREATE FUNCTION ct_events_ensure_partitions(p_from timestamptz, p_to timestamptz, p_parent text DEFAULT 'events')
RETURNS integer
LANGUAGE plpgsql AS $fn$
DECLARE
    v_month timestamp := date_trunc('month', p_from AT TIME ZONE 'UTC');
    v_start timestamptz;
    v_end timestamptz;
    v_name text;
    v_default text;
    v_made integer := 0;
BEGIN
    PERFORM pg_advisory_xact_lock({PARTITION_LOCK_KEY});
    SELECT c.oid::regclass::text INTO v_default FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
    WHERE i.inhparent = p_parent::regclass AND pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT';
    WHILE v_month <= p_to AT TIME ZONE 'UTC' LOOP
        v_start := v_month AT TIME ZONE 'UTC';
        v_end := (v_month + interval '1 month') AT TIME ZONE 'UTC';
        v_name := 'events_' || to_char(v_month, '"y"YYYY"m"MM');
        v_month := v_month + interval '1 month';
        CONTINUE WHEN to_regclass(v_name) IS NOT NULL;  -- there (or kept detached by an operator)
        -- a plain table attached afterwards: ATTACH takes SHARE UPDATE EXCLUSIVE on the parent
        -- (appends and reads go on), CREATE TABLE ... PARTITION OF would take ACCESS EXCLUSIVE
        EXECUTE format('CREATE TABLE %I (LIKE %I INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', v_name, p_parent);
        EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I CHECK (recorded_at >= %L AND recorded_at < %L)',
                       v_name, v_name || '_range', v_start, v_end);
        IF v_default IS NOT NULL THEN  -- that month's events written meanwhile move to their partition
            EXECUTE format('WITH moved AS (DELETE FROM %s WHERE recorded_at >= %L AND recorded_at < %L RETURNING *) '
                           'INSERT INTO %I SELECT * FROM moved', v_default, v_start, v_end, v_name);
        END IF;
        EXECUTE format('ALTER TABLE %I ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                       p_parent, v_name, v_start, v_end);
        EXECUTE format('ALTER TABLE %I DROP CONSTRAINT %I', v_name, v_name || '_range');
        v_made := v_made + 1;
    END LOOP;
    RETURN v_made;
END
$fn$;
"""


def _check(what: str, join: str, where: str = "") -> str:
    """One uniqueness check of ``ct_events_unique``: raise 23505 if a written key is held twice."""
    keys = {
        "session_id, version": ("n.session_id, n.version", "uq_events_session_id_version"),
        "session_id, idempotency_key": ("n.session_id, n.idempotency_key", "uq_events_session_id_idempotency_key"),
        "position": ("n.position", "pk_events"),
    }
    cols, name = keys[what]
    return f"""
    SELECT format('(%s)', concat_ws(', ', {cols})) INTO v_dup
    FROM new_rows n JOIN events e ON {join} {where}
    GROUP BY {cols} HAVING count(*) > 1 LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'duplicate key value violates unique constraint "{name}"'
            USING ERRCODE = '23505', CONSTRAINT = '{name}', TABLE = 'events',
                  DETAIL = format('Key ({what})=%s already exists.', v_dup);
    END IF;"""


UNIQUE_FUNCTION = f"""
CREATE FUNCTION ct_events_unique() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    v_sessions text[];
    v_session text;
    v_dup text;
BEGIN
    IF current_setting('transaction_isolation') = 'repeatable read' THEN
        -- the counts below must see every transaction that held these locks before: a snapshot
        -- per statement (READ COMMITTED) does; SERIALIZABLE relies on its own conflict detection
        RAISE EXCEPTION 'events are written at READ COMMITTED or SERIALIZABLE, not REPEATABLE READ'
            USING ERRCODE = '0A000';
    END IF;
    SELECT array_agg(DISTINCT n.session_id ORDER BY n.session_id) INTO v_sessions FROM new_rows n;
    IF v_sessions IS NULL THEN
        RETURN NULL;
    END IF;
    IF array_length(v_sessions, 1) <= {BULK_SESSIONS} THEN
        PERFORM pg_advisory_xact_lock_shared({UNIQUE_ALL_KEY});
        FOREACH v_session IN ARRAY v_sessions LOOP  -- in id order: two writers never wait for each other in a cycle
            PERFORM pg_advisory_xact_lock({UNIQUE_SESSION_CLASS}, hashtext(v_session));
        END LOOP;
    ELSE
        PERFORM pg_advisory_xact_lock({UNIQUE_ALL_KEY});
    END IF;
    {_check("session_id, version", "e.session_id = n.session_id AND e.version = n.version")}
    {_check("position", "e.position = n.position")}
    {
    _check(
        "session_id, idempotency_key",
        "e.session_id = n.session_id AND e.idempotency_key = n.idempotency_key",
        "WHERE n.idempotency_key IS NOT NULL",
    )
}
    RETURN NULL;
END
$fn$;
"""
TRIGGERS = (
    "CREATE TRIGGER ct_events_unique_insert AFTER INSERT ON events REFERENCING NEW TABLE AS new_rows "
    "FOR EACH STATEMENT EXECUTE FUNCTION ct_events_unique()",
    "CREATE TRIGGER ct_events_unique_update AFTER UPDATE ON events REFERENCING NEW TABLE AS new_rows "
    "FOR EACH STATEMENT EXECUTE FUNCTION ct_events_unique()",
)
DROP_FUNCTIONS = (
    "DROP FUNCTION IF EXISTS ct_events_unique()",
    "DROP FUNCTION IF EXISTS ct_events_ensure_partitions(timestamptz, timestamptz, text)",
)

# -- the two shapes: (create statements on the staging name, indexes, renames after the swap) -------

PARTITIONED = "events_partitioned"
PARTITIONED_CREATE = (f"CREATE TABLE {PARTITIONED} ({_COLUMN_DDL}) PARTITION BY RANGE (recorded_at)",)
PARTITIONED_INDEXES = (
    f"ALTER TABLE {PARTITIONED} ADD CONSTRAINT pk_events_new PRIMARY KEY (position, recorded_at)",
    f"CREATE INDEX ix_events_session_id_version ON {PARTITIONED} (session_id, version)",
    f"CREATE INDEX ix_events_session_id_idempotency_key ON {PARTITIONED} (session_id, idempotency_key) "
    "WHERE idempotency_key IS NOT NULL",
    f"CREATE INDEX ix_events_fleet_position_new ON {PARTITIONED} (fleet, position)",
    f"CREATE INDEX ix_events_session_id_type_version_new ON {PARTITIONED} (session_id, type, version)",
    f"CREATE INDEX ix_events_provider_reports_new ON {PARTITIONED} (position) {_PROVIDER_REPORTS}",
)
_RENAMES = (
    "ALTER TABLE events RENAME CONSTRAINT pk_events_new TO pk_events",
    "ALTER INDEX ix_events_fleet_position_new RENAME TO ix_events_fleet_position",
    "ALTER INDEX ix_events_session_id_type_version_new RENAME TO ix_events_session_id_type_version",
    "ALTER INDEX ix_events_provider_reports_new RENAME TO ix_events_provider_reports",
    "ALTER SEQUENCE events_position_seq_new RENAME TO events_position_seq",
)

SINGLE = "events_unpartitioned"
SINGLE_CREATE = (f"CREATE TABLE {SINGLE} ({_COLUMN_DDL})",)
SINGLE_INDEXES = (  # 0010's
    f"ALTER TABLE {SINGLE} ADD CONSTRAINT pk_events_new PRIMARY KEY (position)",
    f"ALTER TABLE {SINGLE} ADD CONSTRAINT uq_events_session_id_version UNIQUE (session_id, version)",
    f"CREATE UNIQUE INDEX uq_events_session_id_idempotency_key ON {SINGLE} (session_id, idempotency_key) "
    "WHERE idempotency_key IS NOT NULL",
    f"CREATE INDEX ix_events_fleet_position_new ON {SINGLE} (fleet, position)",
    f"CREATE INDEX ix_events_session_id_type_version_new ON {SINGLE} (session_id, type, version)",
    f"CREATE INDEX ix_events_provider_reports_new ON {SINGLE} (position) {_PROVIDER_REPORTS}",
)


def _sql(conn: Any, stmt: str, params: dict[str, Any] | None = None) -> Any:
    """One statement on the migration's connection, in its transaction (psycopg's cursor: the
    function bodies' ``%`` are not placeholders without parameters)."""
    cur = conn.connection.driver_connection.cursor()
    cur.execute(stmt, params)
    return cur


def _months(conn: Any) -> tuple[str, str]:
    """(from, to) of the partitions the conversion makes: the oldest event's month to MONTHS_AHEAD ahead."""
    row = _sql(
        conn,
        "SELECT coalesce(min(recorded_at), now())::text, "
        f"(greatest(max(recorded_at), now()) + interval '{MONTHS_AHEAD} months')::text FROM events",
    ).fetchone()
    return row[0], row[1]


def _copy_prefix(conn: Any, target: str) -> tuple[int, int]:
    """Copy the committed prefix of ``events`` (the feed's) into ``target`` in position order, in
    batches. Returns (events copied, last position copied)."""
    done, last = 0, 0
    while True:
        n, top = _sql(
            conn,
            f"WITH batch AS (SELECT {COLUMNS} FROM events WHERE position > %(p)s AND {FEED_WATERMARK} "
            "ORDER BY position LIMIT %(n)s), "
            f"ins AS (INSERT INTO {target} ({COLUMNS}) SELECT {COLUMNS} FROM batch) "
            "SELECT count(*), max(position) FROM batch",
            {"p": last, "n": BATCH},
        ).fetchone()
        if n:
            done, last = done + n, top
        if n < BATCH:
            return done, last


def _convert(conn: Any, target: str, create: Sequence[str], indexes: Sequence[str], after_swap: Sequence[str]) -> None:
    """The conversion of the module doc: ``events`` -> ``target`` (created by ``create``), swapped in."""
    t0 = time.monotonic()
    for stmt in create:
        _sql(conn, stmt)
    copied, last = _copy_prefix(conn, target)
    _sql(conn, f"ANALYZE {target}")
    for stmt in indexes:
        _sql(conn, stmt)
    t1 = time.monotonic()
    for attempt in range(1, SWAP_ATTEMPTS + 1):
        _sql(conn, "SAVEPOINT ct_swap")
        try:
            tail = _swap(conn, target, last, after_swap)
        except Exception as exc:  # noqa: BLE001 - only a lock timeout is tried again
            if getattr(getattr(exc, "diag", None), "sqlstate", None) != LOCK_NOT_AVAILABLE or attempt == SWAP_ATTEMPTS:
                raise
            _sql(conn, "ROLLBACK TO SAVEPOINT ct_swap")  # releases every lock the attempt took
            time.sleep(min(1.0, SWAP_PAUSE_S * attempt))
            continue
        _sql(conn, "RELEASE SAVEPOINT ct_swap")
        _sql(conn, "SET LOCAL lock_timeout TO DEFAULT")
        break
    log.info(
        "events converted: %d copied in %.1f s (indexes included), then %d more and the swap in %.2f s (%d attempts)",
        copied,
        t1 - t0,
        tail,
        time.monotonic() - t1,
        attempt,
    )


def _swap(conn: Any, target: str, last: int, after_swap: Sequence[str]) -> int:
    """Step 3 of the module doc, once (in a savepoint): the locks, the tail, the swap. Each lock
    waits ``SWAP_LOCK_TIMEOUT`` at most: less than the server's ``deadlock_timeout``, so a running
    append (its locks are taken in another order) never sees a deadlock error -- this side gives up
    first. Returns how many events the tail held."""
    _sql(conn, f"SET LOCAL lock_timeout = '{SWAP_LOCK_TIMEOUT}'")
    # the append lock first: no ct_append draws a position any more (it waits in its short locked
    # section, before it touches the events); then the table (in-flight appends finish first)
    _sql(conn, f"SELECT pg_advisory_xact_lock({APPEND_LOCK_KEY})")
    _sql(conn, "LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
    _sql(conn, "ALTER SEQUENCE events_position_seq CACHE 1")  # its lock: the sequence is dropped below
    tail = _sql(
        conn, f"INSERT INTO {target} ({COLUMNS}) SELECT {COLUMNS} FROM events WHERE position > %(p)s", {"p": last}
    ).rowcount
    old, new = _sql(conn, f"SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM {target})").fetchone()
    if old != new:  # rows written below the copied prefix outside ct_append (no txid, or a late commit)
        _sql(
            conn,
            f"INSERT INTO {target} ({COLUMNS}) SELECT {COLUMNS} FROM events o "
            f"WHERE NOT EXISTS (SELECT 1 FROM {target} t WHERE t.position = o.position)",
        )
    _sql(conn, "SELECT setval('events_position_seq_new', last_value, is_called) FROM events_position_seq")
    _sql(conn, "DROP TABLE events")
    _sql(conn, f"ALTER TABLE {target} RENAME TO events")
    for stmt in after_swap:
        _sql(conn, stmt)
    return int(tail)


def _previous() -> ModuleType:
    """Migration 0010 (read from its file: its function's text has one place)."""
    return migration_module("0010_hash_chain.py")


def append_by_name() -> str:
    """0010's ``ct_append`` drawing positions from the sequence *named* ``events_position_seq`` at
    each call (``'…'::text::regclass``: a stable cast, not folded into the cached plan, after a
    statement that locks the sequence and so makes the backend read the catalog's changes): an
    append that waits at its locked section while the conversion swaps the tables draws, once it
    goes on, from the new table's sequence, not the dropped one's (0010's text failed there with
    "could not open relation with OID")."""
    old = _previous().CREATE_APPEND
    static = "nextval('events_position_seq')"
    assert old.count(static) == 2 and old.count("CREATE FUNCTION ct_append(") == 1
    text = old.replace(static, "nextval('events_position_seq'::text::regclass)")
    # ... and a statement on the sequence first: locking it makes a waiter that went on after the
    # swap take in the catalog's news (the name then resolves to the new sequence)
    txid = "        v_txid := pg_current_xact_id()"
    assert text.count(txid) == 1
    text = text.replace(txid, "        PERFORM 1 FROM events_position_seq;\n" + txid, 1)
    return text.replace("CREATE FUNCTION ct_append(", "CREATE OR REPLACE FUNCTION ct_append(", 1)


def _is_pg() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def upgrade() -> None:
    if not _is_pg():
        return  # SQLite keeps one table
    conn = op.get_bind()
    with op.get_context().autocommit_block():  # committed before the swap: see append_by_name
        _sql(conn, append_by_name())
    _sql(conn, ENSURE_PARTITIONS)
    _sql(conn, UNIQUE_FUNCTION)
    first, last = _months(conn)

    def create() -> list[str]:
        return [
            *PARTITIONED_CREATE,
            f"CREATE TABLE events_default PARTITION OF {PARTITIONED} DEFAULT",
            f"SELECT ct_events_ensure_partitions('{first}', '{last}', '{PARTITIONED}')",
        ]

    _convert(conn, PARTITIONED, create(), PARTITIONED_INDEXES, (*_RENAMES, *TRIGGERS))


def downgrade() -> None:
    if not _is_pg():
        return
    conn = op.get_bind()
    _convert(conn, SINGLE, SINGLE_CREATE, SINGLE_INDEXES, _RENAMES)
    _sql(conn, _previous().CREATE_APPEND.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
    for stmt in DROP_FUNCTIONS:
        _sql(conn, stmt)
