"""Live names unique among storage collections only; index names unique per instance.

Why: `uq_collections_live_name` made live (namespace, name) unique, so an index name
(one per dataflow, named after it) was unique across all instances, although dataflow
names are unique per instance only: two instances could not each have a dataflow
`totals` with an index. Sources and materialized views are shared by all instances and
keep globally unique live names; indexes get theirs from `uq_dataflows_instance_name_name`.

Upgrading cannot fail: the old index is stricter than the new one. Downgrading is
refused while two live indexes share a name (different instances), since the old index
cannot hold them; drop the extra dataflows first.

Revision ID: ed8674a1e99b
Revises: 01b50e8dd9d7
Create Date: 2026-11-22 10:05:21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision: str = "ed8674a1e99b"
down_revision: str | None = "01b50e8dd9d7"
branch_labels: str | None = None
depends_on: str | None = None

LIVE_STORAGE = "namespace = 'storage' AND NOT dropped"


def upgrade() -> None:
    with op.batch_alter_table("collections") as batch:
        batch.drop_index("uq_collections_live_name")
        batch.create_index(
            "uq_collections_live_storage_name",
            ["name"],
            unique=True,
            sqlite_where=sa.text(LIVE_STORAGE),
            postgresql_where=sa.text(LIVE_STORAGE),
        )


def _refuse_shared_index_names() -> None:
    """A clear error instead of the unique violation the old index would raise."""
    shared = op.get_bind().execute(
        sa.text(
            "SELECT name FROM collections WHERE namespace = 'compute' AND NOT dropped "
            "GROUP BY name HAVING count(*) > 1 ORDER BY name"
        )
    )
    names = [row.name for row in shared]
    if names:
        raise RuntimeError(
            f"cannot downgrade: live indexes named {names} exist on more than one instance, "
            f"and before this revision index names were unique across instances; drop the "
            f"extra dataflows first"
        )


def downgrade() -> None:
    # Offline (--sql) there is nothing to read: the CREATE UNIQUE INDEX fails instead.
    if not context.is_offline_mode():
        _refuse_shared_index_names()
    with op.batch_alter_table("collections") as batch:
        batch.drop_index("uq_collections_live_storage_name")
        batch.create_index(
            "uq_collections_live_name",
            ["namespace", "name"],
            unique=True,
            sqlite_where=sa.text("NOT dropped"),
            postgresql_where=sa.text("NOT dropped"),
        )
