"""Dataflows record how they are maintained: `strategy`.

Why: the planner classifies every dataflow as incremental (each change costs what
changed) or as recomputed at every change, with the reason it cannot be maintained, and
the user may force either. Replicas must be told which after a controller restart too,
so it is part of what rebuilds a dataflow's description. The column holds "incremental"
or "recompute: <reason>".

Dataflows created before this revision were all recomputed: they upgrade to
"recompute: created before incremental maintenance" and keep computing the same way.

Revision ID: 5c1d2e7a9b30
Revises: ed8674a1e99b
Create Date: 2026-11-23 23:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "5c1d2e7a9b30"
down_revision: str | None = "ed8674a1e99b"
branch_labels: str | None = None
depends_on: str | None = None

EXISTING = "recompute: created before incremental maintenance"


def upgrade() -> None:
    with op.batch_alter_table("dataflows") as batch:
        batch.add_column(sa.Column("strategy", sa.Text(), nullable=False, server_default=EXISTING))
    with op.batch_alter_table("dataflows") as batch:
        batch.alter_column("strategy", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("dataflows") as batch:
        batch.drop_column("strategy")
