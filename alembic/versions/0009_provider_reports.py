"""events: a partial index of the provider reports (usage and context-length rejections)

Revision ID: 0009_provider_reports
Revises: 0008_append_lock_on_error
Create Date: 2026-12-01

Calibration folds the log's ``UsageReported`` and ``ProviderRejected`` events, and every
tracker process catches up on new ones every few seconds with
``read_all(after_position, types=PROVIDER_REPORTS)``. This index holds just those events'
positions, so that read costs the reports it returns, not a scan of every measurement since;
appends of the other event types write no entry in it. Building it reads the events table once.

The events themselves need no change of schema: ``ContextMeasured`` gains optional fields
(``input_tokens``, ``input_limit``, ``calibration``, ``rejected``) in its JSON data, and events
written before fold as they always did (uncalibrated, at the measurement's own limit).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_provider_reports"
down_revision: str | Sequence[str] | None = "0008_append_lock_on_error"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# the same text as tracker.store.schema.PROVIDER_REPORTS_WHERE (repeated: a migration must not
# depend on code that may change later)
WHERE = "type IN ('ProviderRejected', 'UsageReported')"


def upgrade() -> None:
    op.create_index(
        "ix_events_provider_reports",
        "events",
        ["position"],
        postgresql_where=sa.text(WHERE),
        sqlite_where=sa.text(WHERE),
    )


def downgrade() -> None:
    op.drop_index("ix_events_provider_reports", table_name="events")
