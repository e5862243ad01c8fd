"""fleet_policy_events (each fleet's policy, one append-only row per change: who and when)

Revision ID: 0007_fleet_policies
Revises: 0006_lean_append
Create Date: 2026-12-01

A fleet's policy is its row of highest ``version``; ``policy`` NULL means "the server's
policy" (never set, or reset). Rows are only ever inserted (``tracker fleet policy NAME
--history`` lists them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0007_fleet_policies"
down_revision: str | Sequence[str] | None = "0006_lean_append"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "fleet_policy_events",
        sa.Column("fleet_id", sa.String(16), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column(
            "policy",
            sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql"),
            nullable=True,
        ),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("fleet_id", "version", name="pk_fleet_policy_events"),
        sa.ForeignKeyConstraint(["fleet_id"], ["fleets.fleet_id"], name="fk_fleet_policy_events_fleet_id_fleets"),
        sa.CheckConstraint("version >= 1", name="ck_fleet_policy_events_version_positive"),
    )


def downgrade() -> None:
    op.drop_table("fleet_policy_events")
