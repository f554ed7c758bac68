"""Leadership: the leader's lease on the `controller_epoch` row (`leader_id`,
`lease_expires_ms`, `lease_renewals`) and a table `controllers` of the `tandem serve`
processes taking part, the leader and its standbys.

Why: a controller was one process; when it died, every read and append failed until
someone restarted it. Standbys on the same catalog take the lead when the leader's lease
lapses (or its process is gone), and taking the lead bumps the epoch in the same locked
update, so the old leader's every later write is fenced as before.

Revision ID: 7c41d2e9f0a5
Revises: 1b3a60461ee6
Create Date: 2026-12-03 13:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "7c41d2e9f0a5"
down_revision: str | None = "1b3a60461ee6"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("controller_epoch") as batch:
        batch.add_column(sa.Column("leader_id", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("lease_expires_ms", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("lease_renewals", sa.BigInteger(), server_default=sa.text("0"), nullable=False))
    op.create_table(
        "controllers",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("address", sa.String(length=255), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("process_start", sa.String(length=64), nullable=True),
        sa.Column("started_ms", sa.BigInteger(), nullable=False),
        sa.Column("heard_ms", sa.BigInteger(), nullable=False),
        sa.Column("seen_renewal", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("role IN ('leader', 'standby')", name=op.f("ck_controllers_role_known")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_controllers")),
    )


def downgrade() -> None:
    op.drop_table("controllers")
    with op.batch_alter_table("controller_epoch") as batch:
        batch.drop_column("lease_renewals")
        batch.drop_column("lease_expires_ms")
        batch.drop_column("leader_id")
