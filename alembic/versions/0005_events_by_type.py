"""events (session_id, type, version): one session's events of a type, without reading the others

Revision ID: 0005_events_by_type
Revises: 0004_operator_keys
Create Date: 2026-05-13

The session page of the console (and ``tracker replay --html``) reads a session's attempt
lifecycle events, count failures, a sample of its measurements and its counts by type
(``SqlEventStore.count_by_type``, ``read_types``, ``last_of_types``, ``sample_of_type``,
``find_by_data``) through this index, so a 100k-event page costs what a 10k-event one does.
Building it reads the events table once and blocks writes to it while it runs (a few seconds
per million events): schedule it with the upgrade. Each append then writes one more index entry
per event.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005_events_by_type"
down_revision: str | Sequence[str] | None = "0004_operator_keys"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_events_session_id_type_version", "events", ["session_id", "type", "version"])


def downgrade() -> None:
    op.drop_index("ix_events_session_id_type_version", table_name="events")
