"""Every read hold names its owner: `owner` ('dataflow', 'feed', 'retention' or
'caller'), with the dataflow's export (`owner_collection`) or the feed's controller
epoch (`owner_epoch`).

Why: a hold whose owner was gone stayed for good, and its collection's since froze, so
compaction and garbage collection stopped and batches and manifest rows grew with every
append. A dropped instance left its dataflows' holds on their inputs; so did a
controller that died between a dataflow's drop and its release, and every storage feed
of a controller that crashed or was fenced. The holder's name alone could not tell
whether its owner lived (a feed's said no epoch), so the controller could not find them.

Existing holds are classified by their names: `tandem/retention` is the retention
window's; `subscribe:<uuid>` a feed, given the current epoch (the next controller to
start, a newer epoch, removes it: its feed went with the controller that opened it);
`<dataflow id>/sink` the hold of a dataflow on its view; `<instance>/<export id>` a
dataflow's input hold, owned by that export (one whose export was dropped already is
one of the leaked holds above, which the controller then removes); anything else the
caller's. The downgrade drops the owners.

Revision ID: 58e69b8e9a58
Revises: 4f2a6c8d1e3b
Create Date: 2026-12-02 00:10:00
"""

from __future__ import annotations

import re

import sqlalchemy as sa
from alembic import op

revision: str = "58e69b8e9a58"
down_revision: str | None = "4f2a6c8d1e3b"
branch_labels: str | None = None
depends_on: str | None = None

_OWNED = (
    "(owner = 'dataflow' AND owner_collection IS NOT NULL AND owner_epoch IS NULL) OR "
    "(owner = 'feed' AND owner_epoch IS NOT NULL AND owner_collection IS NULL) OR "
    "(owner IN ('retention', 'caller') AND owner_collection IS NULL AND owner_epoch IS NULL)"
)
_INPUT_HOLDER = re.compile(r"^.+/(u[0-9]+)$")
_SINK_HOLDER = re.compile(r"^u[0-9]+/sink$")


def upgrade() -> None:
    with op.batch_alter_table("read_holds") as batch:
        batch.add_column(sa.Column("owner", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("owner_collection", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("owner_epoch", sa.BigInteger(), nullable=True))
    connection = op.get_bind()
    holds = sa.table(
        "read_holds",
        sa.column("collection_id", sa.String),
        sa.column("holder", sa.String),
        sa.column("owner", sa.String),
        sa.column("owner_collection", sa.String),
        sa.column("owner_epoch", sa.BigInteger),
    )
    epoch = connection.execute(sa.text("SELECT epoch FROM controller_epoch WHERE id = 1")).scalar_one()
    collections = set(connection.execute(sa.text("SELECT id FROM collections")).scalars())
    for collection_id, holder in connection.execute(sa.select(holds.c.collection_id, holds.c.holder)).all():
        owner: dict[str, object] = {"owner": "caller", "owner_collection": None, "owner_epoch": None}
        input_key = _INPUT_HOLDER.match(holder)
        if holder == "tandem/retention":
            owner["owner"] = "retention"
        elif holder.startswith("subscribe:"):
            owner.update(owner="feed", owner_epoch=epoch)
        elif _SINK_HOLDER.match(holder):
            owner.update(owner="dataflow", owner_collection=collection_id)
        elif input_key and input_key.group(1) in collections:
            owner.update(owner="dataflow", owner_collection=input_key.group(1))
        connection.execute(
            holds.update()
            .where(holds.c.collection_id == collection_id, holds.c.holder == holder)
            .values(**owner)
        )
    with op.batch_alter_table("read_holds") as batch:
        batch.alter_column("owner", existing_type=sa.String(length=16), nullable=False)
        batch.create_foreign_key(
            op.f("fk_read_holds_owner_collection_collections"), "collections", ["owner_collection"], ["id"]
        )
        batch.create_check_constraint(op.f("ck_read_holds_owner_named"), _OWNED)


def downgrade() -> None:
    with op.batch_alter_table("read_holds") as batch:
        batch.drop_constraint(op.f("ck_read_holds_owner_named"), type_="check")
        batch.drop_constraint(op.f("fk_read_holds_owner_collection_collections"), type_="foreignkey")
        batch.drop_column("owner_epoch")
        batch.drop_column("owner_collection")
        batch.drop_column("owner")
