"""ct_events_unique checks each written row by index probes (PostgreSQL); a no-op on SQLite

Revision ID: 0012_unique_checks_by_index
Revises: 0011_partitioned_events
Create Date: 2026-12-06

PostgreSQL only: ``ct_events_unique`` (0011's statement-level uniqueness triggers) is redefined
with the same locks and the same errors, but each of its three checks is now a count, per
written row, of the events holding that row's key -- a subquery correlated with the row --
and the function runs its queries with ``enable_seqscan = off`` (``SET`` on the function: only
while it runs, where its queries are planned; nothing else in the session sees it). So every
check is a probe of each partition's ``(session_id, version)``, primary-key or ``(session_id,
idempotency_key)`` index with the row's values, whatever the statistics say: its cost grows with
the rows written, not with the partitions' size.

Why: PL/pgSQL plans each query of the function once per connection and keeps the plan until
something invalidates it (DDL, an ANALYZE). 0011's checks were joins of ``new_rows`` with
``events``; planned while a partition looks empty (a ``VACUUM`` or ``VACUUM FULL`` of a log an
archive emptied, a new month before its first ANALYZE) the plan reads that partition whole -- by
sequential scan, or with only ``enable_seqscan`` off by a full index scan under a nested loop --
and every later statement on that connection does the same while the partition fills.
``tracker restore`` of 30,000 events after ``VACUUM FULL events`` read 100 million tuples or more
that way (EXPLAIN of the check: ``Seq Scan on events_y2026m09 e_1 (cost=0.00..1.09 rows=1)``,
its ``Rows Removed by Filter`` growing with every session restored; figures in
docs/performance.md "Retention").

The function's text is 0011's (read from that file: one definition of the locks) with its checks
replaced. Downgrade: 0011's function as it was (``CREATE OR REPLACE`` without the ``SET``).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

from alembic import op

from tracker.store.migrate import migration_module

revision: str = "0012_unique_checks_by_index"
down_revision: str | Sequence[str] | None = "0011_partitioned_events"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: 0011's checks: (key, join condition, filter on the written rows)
CHECKS = (
    ("session_id, version", "e.session_id = n.session_id AND e.version = n.version", ""),
    ("position", "e.position = n.position", ""),
    (
        "session_id, idempotency_key",
        "e.session_id = n.session_id AND e.idempotency_key = n.idempotency_key",
        "WHERE n.idempotency_key IS NOT NULL",
    ),
)


def _previous() -> ModuleType:
    """Migration 0011 (read from its file: its function's text has one place)."""
    return migration_module("0011_partitioned_events.py")


def _probe(old_check: str, join: str, where: str) -> str:
    """0011's check with its join replaced by a count per written row (a correlated subquery:
    one index probe per partition and row, never a join that could read a partition whole)."""
    head = f"FROM new_rows n JOIN events e ON {join} {where}"
    assert old_check.count(head) == 1, "0011's check is not the expected text"
    start, end = old_check.index(head), old_check.index(" LIMIT 1;")
    count = f"(SELECT count(*) FROM events e WHERE {join}) > 1"
    cond = f"{where} AND {count}" if where else f"WHERE {count}"
    return old_check[:start] + f"FROM new_rows n {cond}" + old_check[end:]


def unique_function() -> str:
    """0011's ``ct_events_unique`` with its checks as probes, run with ``enable_seqscan = off``."""
    m = _previous()
    text = m.UNIQUE_FUNCTION
    for what, join, where in CHECKS:
        old = m._check(what, join, where)
        assert text.count(old) == 1, f"0011's check of ({what}) is not in its function"
        text = text.replace(old, _probe(old, join, where))
    header = "CREATE FUNCTION ct_events_unique() RETURNS trigger\nLANGUAGE plpgsql AS"
    assert text.count(header) == 1
    return text.replace(
        header,
        "CREATE OR REPLACE FUNCTION ct_events_unique() RETURNS trigger\nLANGUAGE plpgsql SET enable_seqscan = off AS",
    )


def _is_pg() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def _sql(stmt: str) -> None:
    # psycopg's cursor: the function body's ``%`` are not placeholders without parameters
    op.get_bind().connection.driver_connection.cursor().execute(stmt)


def upgrade() -> None:
    if _is_pg():
        _sql(unique_function())


def downgrade() -> None:
    if _is_pg():
        _sql(_previous().UNIQUE_FUNCTION.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
