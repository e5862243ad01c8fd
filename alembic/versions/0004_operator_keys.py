"""operator_keys (console keys that see every fleet, hashed like fleet keys)

Revision ID: 0004_operator_keys
Revises: 0003_one_call_append
Create Date: 2026-05-12
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_operator_keys"
down_revision: str | Sequence[str] | None = "0003_one_call_append"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "operator_keys",
        sa.Column("key_id", sa.String(16), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("key_id", name="pk_operator_keys"),
    )


def downgrade() -> None:
    op.drop_table("operator_keys")
