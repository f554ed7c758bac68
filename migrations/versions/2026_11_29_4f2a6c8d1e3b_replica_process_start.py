"""Replicas record `process_start` beside `pid`: the boot's id and the process's start
time, which tell the recorded process from a later one given the same pid.

Why: a controller trusted any live process with a replica's recorded pid as that
replica. After the replica died (or the machine rebooted) the pid may belong to an
unrelated process, which the controller would then take for the replica, and stop or
kill with its process group.

Replicas recorded before this revision have none: their pids are trusted as before,
until their next start records one.

Revision ID: 4f2a6c8d1e3b
Revises: 3b7d9e2f4a61
Create Date: 2026-11-29 00:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "4f2a6c8d1e3b"
down_revision: str | None = "3b7d9e2f4a61"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.add_column(sa.Column("process_start", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.drop_column("process_start")
