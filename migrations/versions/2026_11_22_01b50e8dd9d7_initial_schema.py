"""Initial schema of the Tandem catalog.

Why: the controller must rebuild every instance's history after a crash (DESIGN section
6), and storage needs a transactional manifest for compare-and-append (section 3). This
creates the tables for both, and seeds the three singleton rows: the controller epoch
(0: no controller yet), the id allocator (next id u1) and the timestamp oracle (0).

Revision ID: 01b50e8dd9d7
Revises:
Create Date: 2026-11-22 07:19:52
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "01b50e8dd9d7"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def _singleton(name: str, column: str) -> sa.Table:
    return op.create_table(
        name,
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column(column, sa.BigInteger(), nullable=False),
        sa.CheckConstraint("id = 1", name=op.f(f"ck_{name}_singleton")),
        sa.PrimaryKeyConstraint("id", name=op.f(f"pk_{name}")),
    )


def upgrade() -> None:
    op.bulk_insert(_singleton("controller_epoch", "epoch"), [{"id": 1, "epoch": 0}])
    op.bulk_insert(_singleton("id_allocator", "next_id"), [{"id": 1, "next_id": 1}])
    op.bulk_insert(_singleton("timestamp_oracle", "last_ts"), [{"id": 1, "last_ts": 0}])

    op.create_table(
        "instances",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("spark_conf", sa.JSON(), nullable=False),
        sa.Column("min_in_sync", sa.Integer(), nullable=False),
        sa.Column("max_lag_ms", sa.BigInteger(), nullable=False),
        sa.Column("replica_timeout_ms", sa.BigInteger(), nullable=False),
        sa.Column("parameters", sa.JSON(), nullable=False),
        sa.CheckConstraint("max_lag_ms >= 0", name=op.f("ck_instances_max_lag_ms_non_negative")),
        sa.CheckConstraint("min_in_sync >= 1", name=op.f("ck_instances_min_in_sync_positive")),
        sa.CheckConstraint(
            "replica_timeout_ms > 0", name=op.f("ck_instances_replica_timeout_ms_positive")
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_instances")),
    )
    op.create_table(
        "replicas",
        sa.Column("instance_name", sa.String(length=255), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("size", sa.String(length=64), nullable=False),
        sa.Column("spark_master", sa.String(length=255), nullable=False),
        sa.Column("spark_conf", sa.JSON(), nullable=False),
        sa.Column("managed", sa.Boolean(), nullable=False),
        sa.Column("address", sa.String(length=255), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("incarnation", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("incarnation >= 0", name=op.f("ck_replicas_incarnation_non_negative")),
        sa.CheckConstraint(
            "managed OR address IS NOT NULL", name=op.f("ck_replicas_external_has_address")
        ),
        sa.ForeignKeyConstraint(
            ["instance_name"],
            ["instances.name"],
            name=op.f("fk_replicas_instance_name_instances"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("instance_name", "name", name=op.f("pk_replicas")),
    )
    op.create_table(
        "dataflows",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("instance_name", sa.String(length=255), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("sql", sa.Text(), nullable=False),
        sa.Column("imports", sa.JSON(), nullable=False),
        sa.Column("index_exports", sa.JSON(), nullable=False),
        sa.Column("sink_id", sa.String(length=32), nullable=True),
        sa.Column("schema", sa.Text(), nullable=False),
        sa.Column("as_of", sa.BigInteger(), nullable=False),
        sa.Column("until", sa.BigInteger(), nullable=True),
        sa.Column("compaction_window_ms", sa.BigInteger(), nullable=True),
        sa.CheckConstraint(
            "compaction_window_ms >= 0", name=op.f("ck_dataflows_compaction_window_non_negative")
        ),
        sa.ForeignKeyConstraint(
            ["instance_name"],
            ["instances.name"],
            name=op.f("fk_dataflows_instance_name_instances"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dataflows")),
        sa.UniqueConstraint("instance_name", "name", name=op.f("uq_dataflows_instance_name_name")),
    )
    op.create_index(op.f("ix_dataflows_instance_name"), "dataflows", ["instance_name"])
    op.create_table(
        "collections",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("namespace", sa.String(length=16), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("schema", sa.Text(), nullable=False),
        sa.Column("since", sa.BigInteger(), nullable=True),
        sa.Column("upper", sa.BigInteger(), nullable=True),
        sa.Column("dropped", sa.Boolean(), nullable=False),
        sa.Column("dataflow_id", sa.String(length=32), nullable=True),
        sa.CheckConstraint(
            "(kind = 'index' AND namespace = 'compute') OR "
            "(kind IN ('source', 'materialized_view') AND namespace = 'storage')",
            name=op.f("ck_collections_kind_matches_namespace"),
        ),
        sa.ForeignKeyConstraint(
            ["dataflow_id"],
            ["dataflows.id"],
            name=op.f("fk_collections_dataflow_id_dataflows"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_collections")),
    )
    op.create_index(op.f("ix_collections_dataflow_id"), "collections", ["dataflow_id"])
    op.create_index(
        "uq_collections_live_name",
        "collections",
        ["namespace", "name"],
        unique=True,
        sqlite_where=sa.text("NOT dropped"),
        postgresql_where=sa.text("NOT dropped"),
    )
    op.create_table(
        "batches",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("collection_id", sa.String(length=32), nullable=False),
        sa.Column("lower", sa.BigInteger(), nullable=False),
        sa.Column("upper", sa.BigInteger(), nullable=True),
        sa.Column("path", sa.String(length=1024), nullable=False),
        sa.Column("rows", sa.BigInteger(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("rows > 0 AND bytes > 0", name=op.f("ck_batches_not_empty")),
        sa.CheckConstraint(
            "upper IS NULL OR lower < upper", name=op.f("ck_batches_lower_below_upper")
        ),
        sa.ForeignKeyConstraint(
            ["collection_id"],
            ["collections.id"],
            name=op.f("fk_batches_collection_id_collections"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
        sa.UniqueConstraint("collection_id", "lower", name=op.f("uq_batches_collection_id_lower")),
        sa.UniqueConstraint("path", name=op.f("uq_batches_path")),
    )
    op.create_table(
        "read_holds",
        sa.Column("collection_id", sa.String(length=32), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("frontier", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["collection_id"],
            ["collections.id"],
            name=op.f("fk_read_holds_collection_id_collections"),
        ),
        sa.PrimaryKeyConstraint("collection_id", "holder", name=op.f("pk_read_holds")),
    )
    op.create_table(
        "retired_blobs",
        sa.Column("path", sa.String(length=1024), nullable=False),
        sa.Column("retired_at_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("path", name=op.f("pk_retired_blobs")),
    )


def downgrade() -> None:
    op.drop_table("retired_blobs")
    op.drop_table("read_holds")
    op.drop_table("batches")
    op.drop_index("uq_collections_live_name", table_name="collections")
    op.drop_index(op.f("ix_collections_dataflow_id"), table_name="collections")
    op.drop_table("collections")
    op.drop_index(op.f("ix_dataflows_instance_name"), table_name="dataflows")
    op.drop_table("dataflows")
    op.drop_table("replicas")
    op.drop_table("instances")
    op.drop_table("timestamp_oracle")
    op.drop_table("id_allocator")
    op.drop_table("controller_epoch")
