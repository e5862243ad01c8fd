"""Every table of the tracker's database (SQLAlchemy 2 Core metadata).

The schema is created and changed only by the Alembic migrations in ``alembic/``
at the repository root (shipped in the wheel as ``tracker/alembic``);
``tests/integration/test_migrations.py`` checks that these models and the migrations agree on
both backends. Change both together.

``events``    the append-only log: global ``position``, per-session ``version``; on PostgreSQL
              partitioned by month of ``recorded_at`` (migration 0011: the keys below).
``sessions``  the per-session projection, written in the same transaction as
              the events it was folded from.
``fleets``    the HTTP API's tenants: ``fleet_id`` (10 characters ``f`` + 9 hex:
              short, because it prefixes every internal session id), unique ``name``.
``api_keys``  ``key_id``, ``fleet_id`` → fleets, ``token_hash`` (hex SHA-256),
              ``created_at``, ``revoked_at`` (NULL while the key is valid).
``operator_keys``  console keys that see every fleet (``tracker key create --operator``):
              ``key_id``, ``token_hash``, ``created_at``, ``revoked_at`` (migration 0004).
``fleet_policy_events``  each fleet's policy, append-only: ``(fleet_id, version)``, ``policy`` (JSON;
              NULL: the server's), ``actor``, ``at``; the newest version is in force (migration 0007).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.types import TypeDecorator

from tracker.store.base import StoredEvent

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

#: Advisory-lock key held (session-level, for microseconds) around "assign the
#: transaction id + draw positions" in ``ct_append`` on PostgreSQL.
APPEND_LOCK_KEY = 0x63745F617070  # "ct_app"
#: Advisory-lock key serialising concurrent ``tracker db upgrade`` runs on PostgreSQL.
MIGRATE_LOCK_KEY = 0x63745F6D6967  # "ct_mig"


class UTCDateTime(TypeDecorator):
    """A timestamp stored as UTC and always returned tz-aware (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def json_type() -> JSON:
    """JSONB on PostgreSQL, JSON (text) on SQLite; Python None is stored as SQL NULL."""
    return JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")


def only(dialect: str) -> dict[str, str]:
    """``info`` of a constraint or index that exists on one backend only (see ``include_object``)."""
    return {"dialect": dialect}


#: the partitions of ``events`` on PostgreSQL (migration 0011): one per month, and the DEFAULT one
EVENTS_PARTITION = re.compile(r"events_(y[0-9]{4}m[0-9]{2}|default)")


def include_object(dialect: str) -> Callable[..., bool]:
    """Alembic's ``include_object`` for comparing this metadata with a database of ``dialect``:
    leaves out what exists on the other backend only (``only``) and the partitions of ``events``
    (the database's own tables, made by ``ct_events_ensure_partitions``, not models)."""

    def include(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        if reflected:
            return not (type_ == "table" and name is not None and EVENTS_PARTITION.fullmatch(name))
        return getattr(obj, "info", {}).get("dialect", dialect) == dialect

    return include


# BIGINT identity on PostgreSQL; on SQLite the INTEGER PRIMARY KEY AUTOINCREMENT rowid
# (a BIGINT primary key would not alias the rowid there).
PositionType = BigInteger().with_variant(Integer(), "sqlite")

#: the partial index's predicate: the types of ``tracker.core.events.PROVIDER_REPORTS``, sorted
PROVIDER_REPORTS_WHERE = "type IN ('ProviderRejected', 'UsageReported')"

events = Table(
    "events",
    metadata,
    Column("position", PositionType, Identity(), primary_key=True),
    Column("session_id", String(200), nullable=False),
    Column("version", Integer, nullable=False),
    Column("type", String(100), nullable=False),
    Column("data", json_type(), nullable=False),
    Column("recorded_at", UTCDateTime(), nullable=False),
    Column("idempotency_key", String(200), nullable=True),
    # number of events appended together; set on the first event of each append
    # (so an idempotent retry can return the whole original result)
    Column("batch_size", Integer, nullable=True),
    # PostgreSQL only: the appending transaction's id (pg_current_xact_id() as
    # bigint), the commit-order watermark used by read_all. NULL on SQLite.
    Column("txid", BigInteger, nullable=True),
    # the text before the first ':' of session_id ('' without one): the HTTP API's fleet
    # (its sessions are "<fleet_id>:<session_id>"); the per-fleet feed reads (fleet, position)
    Column("fleet", String(200), nullable=False, server_default=""),
    # sha256(previous event's hash || the event's canonical bytes): tracker.store.chain (migration
    # 0010). NULL only on a row written behind the store's back ("unchained")
    Column("hash", LargeBinary(), nullable=True),
    # SQLite: one table, these two keys unique. PostgreSQL (migration 0011): partitioned by month of
    # recorded_at, where a unique index must hold the partition key: the same two as plain indexes,
    # their uniqueness (and that of position; its primary key is (position, recorded_at)) kept by
    # the ct_events_unique triggers (docs/operations.md "The partitioned log")
    UniqueConstraint("session_id", "version", info=only("sqlite")).ddl_if(dialect="sqlite"),
    Index("ix_events_session_id_version", "session_id", "version", info=only("postgresql")).ddl_if(
        dialect="postgresql"
    ),
    CheckConstraint("version >= 1", name="version_positive"),
    Index("ix_events_fleet_position", "fleet", "position"),
    # one use of an idempotency key per session; only the events that have one are indexed (migration 0006)
    Index(
        "uq_events_session_id_idempotency_key",
        "session_id",
        "idempotency_key",
        unique=True,
        sqlite_where=text("idempotency_key IS NOT NULL"),
        info=only("sqlite"),
    ).ddl_if(dialect="sqlite"),
    Index(
        "ix_events_session_id_idempotency_key",
        "session_id",
        "idempotency_key",
        postgresql_where=text("idempotency_key IS NOT NULL"),
        info=only("postgresql"),
    ).ddl_if(dialect="postgresql"),
    # one session's events of a type (the session page's narrow reads; migration 0005)
    Index("ix_events_session_id_type_version", "session_id", "type", "version"),
    # the provider reports in log order, and nothing else (calibration's catch-up read; migration 0009)
    Index(
        "ix_events_provider_reports",
        "position",
        postgresql_where=text(PROVIDER_REPORTS_WHERE),
        sqlite_where=text(PROVIDER_REPORTS_WHERE),
    ),
    sqlite_autoincrement=True,
)

sessions = Table(
    "sessions",
    metadata,
    Column("session_id", String(200), primary_key=True),
    Column("version", Integer, nullable=False),
    Column("state", json_type(), nullable=True),  # NULL: appended without a projector; rebuilt from the log
    Column("pressure", String(32), nullable=True),
    Column("revision", Integer, nullable=True),
    Column("occupancy_bp", Integer, nullable=True),
    Column("open_attempts", Integer, nullable=False, server_default="0"),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("updated_at", UTCDateTime(), nullable=False),
    Index(None, "updated_at"),
)
# a pressure filter reads exactly its page, newest first (replaces an index on pressure alone)
Index("ix_sessions_pressure_updated_at", sessions.c.pressure, sessions.c.updated_at.desc(), sessions.c.session_id)

#: the columns of a ``StoredEvent``, in its fields' order (``stored_event`` makes one of a row of them)
EVENT_COLUMNS = (
    events.c.position,
    events.c.session_id,
    events.c.version,
    events.c.type,
    events.c.data,
    events.c.recorded_at,
    events.c.idempotency_key,
)


def stored_event(row: Any) -> StoredEvent:
    """The ``StoredEvent`` of a row selected as ``EVENT_COLUMNS``."""
    return StoredEvent(row[0], row[1], row[2], row[3], row[4], row[5], row[6])


# -- tenancy: the HTTP API's fleets and their keys (tracker.store.fleets, migration 0002) ----------

fleets = Table(
    "fleets",
    metadata,
    Column("fleet_id", String(16), primary_key=True),
    Column("name", String(100), nullable=False, unique=True),
    Column("created_at", UTCDateTime(), nullable=False),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("key_id", String(16), primary_key=True),
    Column("fleet_id", String(16), ForeignKey("fleets.fleet_id"), nullable=False),
    Column("token_hash", String(64), nullable=False),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("revoked_at", UTCDateTime(), nullable=True),
    Index(None, "fleet_id"),
)

operator_keys = Table(
    "operator_keys",
    metadata,
    Column("key_id", String(16), primary_key=True),
    Column("token_hash", String(64), nullable=False),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("revoked_at", UTCDateTime(), nullable=True),
)

fleet_policy_events = Table(
    "fleet_policy_events",
    metadata,
    Column("fleet_id", String(16), ForeignKey("fleets.fleet_id"), primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("policy", json_type(), nullable=True),  # NULL: the server's policy (never set, or reset)
    Column("actor", String(200), nullable=False),
    Column("at", UTCDateTime(), nullable=False),
    CheckConstraint("version >= 1", name="version_positive"),
)
