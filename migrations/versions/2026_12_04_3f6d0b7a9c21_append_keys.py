"""Append keys: a table `append_keys` of the idempotency keys of committed appends, each
with the source and the timestamp it was committed at.

Why: a client whose append was cut off by the leader's death cannot know whether it was
committed; sent again with the same key to the new leader, it is applied once (the retry
gets the original timestamp), so appends can be retried after a failover.

Revision ID: 3f6d0b7a9c21
Revises: 7c41d2e9f0a5
Create Date: 2026-12-04 19:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "3f6d0b7a9c21"
down_revision: str | None = "7c41d2e9f0a5"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "append_keys",
        sa.Column("key", sa.String(length=128), nullable=False),
        sa.Column("collection_id", sa.String(length=32), nullable=False),
        sa.Column("ts", sa.BigInteger(), nullable=False),
        sa.Column("committed_ms", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["collection_id"], ["collections.id"], name=op.f("fk_append_keys_collection_id_collections")),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_append_keys")),
    )
    op.create_index(op.f("ix_append_keys_committed_ms"), "append_keys", ["committed_ms"])


def downgrade() -> None:
    op.drop_index(op.f("ix_append_keys_committed_ms"), table_name="append_keys")
    op.drop_table("append_keys")
