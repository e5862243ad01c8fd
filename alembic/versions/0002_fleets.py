"""fleets and api_keys (HTTP API tenants and their hashed keys)

Revision ID: 0002_fleets
Revises: 0001_event_store
Create Date: 2026-05-10
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_fleets"
down_revision: str | Sequence[str] | None = "0001_event_store"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "fleets",
        sa.Column("fleet_id", sa.String(16), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("fleet_id", name="pk_fleets"),
        sa.UniqueConstraint("name", name="uq_fleets_name"),
    )
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.String(16), nullable=False),
        sa.Column("fleet_id", sa.String(16), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("key_id", name="pk_api_keys"),
        sa.ForeignKeyConstraint(["fleet_id"], ["fleets.fleet_id"], name="fk_api_keys_fleet_id_fleets"),
    )
    op.create_index("ix_api_keys_fleet_id", "api_keys", ["fleet_id"])


def downgrade() -> None:
    op.drop_index("ix_api_keys_fleet_id", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("fleets")
