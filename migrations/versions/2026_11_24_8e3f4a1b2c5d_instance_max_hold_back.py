"""Instances record `max_hold_back_ms`, how far behind W a replica may hold compaction,
and `replace_slow`, whether a replica found slow (a gray failure) is rehydrated.

Why: a replica that is alive but stuck (or that never reports a dataflow it was given)
held its dataflows' inputs at its own frontier forever, so storage could never compact
them. Beyond this bound it is evicted from the hold computation and rehydrated. A replica
that loses every read race by far is only reported unless the instance asks for more.

Instances created before this revision get the defaults: 300000 ms (5 minutes), and
slow replicas only reported.

Revision ID: 8e3f4a1b2c5d
Revises: 5c1d2e7a9b30
Create Date: 2026-11-24 07:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "8e3f4a1b2c5d"
down_revision: str | None = "5c1d2e7a9b30"
branch_labels: str | None = None
depends_on: str | None = None

DEFAULT_MAX_HOLD_BACK_MS = 300_000  # catalog.DEFAULT_MAX_HOLD_BACK_MS when this was written


def upgrade() -> None:
    with op.batch_alter_table("instances") as batch:
        batch.add_column(
            sa.Column("max_hold_back_ms", sa.BigInteger(), nullable=False, server_default=str(DEFAULT_MAX_HOLD_BACK_MS))
        )
        batch.create_check_constraint(op.f("ck_instances_max_hold_back_ms_positive"), "max_hold_back_ms > 0")
        batch.add_column(sa.Column("replace_slow", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("instances") as batch:
        batch.alter_column("max_hold_back_ms", server_default=None)
        batch.alter_column("replace_slow", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("instances") as batch:
        batch.drop_column("replace_slow")
        batch.drop_constraint(op.f("ck_instances_max_hold_back_ms_positive"), type_="check")
        batch.drop_column("max_hold_back_ms")
