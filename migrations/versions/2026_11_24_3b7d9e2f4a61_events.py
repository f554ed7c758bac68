"""An `events` table: what happened to instances (replica failures and rehydrations,
reconciliations, divergences, slow replicas, dataflow errors, controller take-overs),
kept for `tandem events` and the status page.

Why: these were only log lines and a short in-memory list per controller, lost with it.
The table is bounded by the catalog (the latest `EVENTS_RETAINED` rows).

Revision ID: 3b7d9e2f4a61
Revises: 8e3f4a1b2c5d
Create Date: 2026-11-24 12:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "3b7d9e2f4a61"
down_revision: str | None = "8e3f4a1b2c5d"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("at_ms", sa.BigInteger(), nullable=False),
        sa.Column("instance", sa.String(length=255), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("replica", sa.String(length=255), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    op.create_index(op.f("ix_events_instance"), "events", ["instance"])


def downgrade() -> None:
    op.drop_index(op.f("ix_events_instance"), table_name="events")
    op.drop_table("events")
