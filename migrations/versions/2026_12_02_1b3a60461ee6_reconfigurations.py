"""A table `reconfigurations`: an instance resize in progress, recorded before any of it
is done and deleted once it ended (committed or rolled back).

Why: a resize was a sequence of calls with no record. One that timed out left the new
replicas running beside the old ones, and one interrupted by a controller restart was
never finished or undone: the instance kept both sets for good. A recorded resize is
carried on by the next controller (or, with issue 51, a new leader): finished when its
new replicas get in sync in time, else rolled back (the default) or committed, as it
asked.

Revision ID: 1b3a60461ee6
Revises: 58e69b8e9a58
Create Date: 2026-12-02 01:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "1b3a60461ee6"
down_revision: str | None = "58e69b8e9a58"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "reconfigurations",
        sa.Column("instance_name", sa.String(length=255), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("size", sa.String(length=64), nullable=False),
        sa.Column("old", sa.JSON(), nullable=False),
        sa.Column("new", sa.JSON(), nullable=False),
        sa.Column("started_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("deadline_ms", sa.BigInteger(), nullable=False),
        sa.Column("on_timeout", sa.String(length=16), nullable=False),
        sa.CheckConstraint("kind = 'resize'", name=op.f("ck_reconfigurations_kind_known")),
        sa.CheckConstraint("on_timeout IN ('rollback', 'commit')", name=op.f("ck_reconfigurations_on_timeout_known")),
        sa.ForeignKeyConstraint(
            ["instance_name"],
            ["instances.name"],
            name=op.f("fk_reconfigurations_instance_name_instances"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("instance_name", name=op.f("pk_reconfigurations")),
    )


def downgrade() -> None:
    op.drop_table("reconfigurations")
