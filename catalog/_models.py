"""SQLAlchemy models of the catalog: the one description of its tables.

Rules of this module:
- Models are typed (`Mapped[...]`) and named by `NAMING_CONVENTION`, so every constraint
  has a stable name Alembic can find again. The schema itself is only ever created or
  changed by the migrations in `migrations/`; a test checks that they agree with these
  models.
- Rows never leave the catalog package: `_records.py` converts them to frozen
  dataclasses at the edge. No relationships are declared, so no query hides behind an
  attribute; every read is an explicit `select`.
- A frontier is stored as a nullable BIGINT: a timestamp, or NULL for the empty
  (closed) frontier. `frontier_to_db` and `frontier_from_db` are the only conversions.
- Ids (`u1`, `u2`, ...) come from the single `id_allocator` row and are never reused:
  dropped collections keep their row with `dropped` set. Names are unique among live
  objects only (partial unique indexes).
"""

from __future__ import annotations

from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from history import Frontier

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

NAME_LENGTH = 255
ID_LENGTH = 32
PATH_LENGTH = 1024

# An autoincrementing 64-bit key; on SQLite only INTEGER PRIMARY KEY autoincrements.
_SERIAL = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        int: BigInteger(),
        str: String(NAME_LENGTH),
        dict[str, Any]: JSON(),
        list[Any]: JSON(),
    }


def frontier_to_db(frontier: Frontier) -> int | None:
    return frontier.time


def frontier_from_db(value: int | None) -> Frontier:
    return Frontier(None if value is None else int(value))


# --- Singletons: one row each, created by the initial migration -------------------------


class ControllerEpoch(Base):
    """The epoch of the current controller. Bumped by `become_controller`; every fenced
    transaction reads it (FOR SHARE on PostgreSQL) before it writes anything.

    The leader's lease lives on the same row, so that taking the lead and bumping the
    epoch are one locked update: `leader_id` (a `controllers` row; None for a
    controller that took the epoch without a lease), `lease_expires_ms` (the catalog's
    clock) and `lease_renewals`, which counts the renewals of the leader's lease: a
    standby may take over a lapsed lease only once a renewal came after it registered,
    so the leader knew of it and stops serving on its own clock before the lease ends
    (`controller/_leadership.py`)."""

    __tablename__ = "controller_epoch"
    __table_args__ = (CheckConstraint("id = 1", name="singleton"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    epoch: Mapped[int]
    leader_id: Mapped[str | None] = mapped_column(String(64))
    lease_expires_ms: Mapped[int | None]
    lease_renewals: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))


class ControllerProcess(Base):
    """A `tandem serve` process taking part in leadership: the leader (named by
    `controller_epoch.leader_id`) or a standby. `address` is where it serves gRPC
    (clients are sent to the leader's), `host`, `pid` and `process_start` tell a
    standby on the same host that the leader's process is gone; `heard_ms` is its
    latest renewal or heartbeat, `seen_renewal` the lease's renewal count when it
    registered (see `ControllerEpoch`). A row is deleted by its process as it stops, or
    by the next leader once not heard from for long."""

    __tablename__ = "controllers"
    __table_args__ = (CheckConstraint("role IN ('leader', 'standby')", name="role_known"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    address: Mapped[str] = mapped_column(String(255))
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    process_start: Mapped[str | None] = mapped_column(String(64))
    started_ms: Mapped[int]
    heard_ms: Mapped[int]
    seen_renewal: Mapped[int]


class IdAllocator(Base):
    """`next_id` is the number of the next id handed out (`u<next_id>`); only grows."""

    __tablename__ = "id_allocator"
    __table_args__ = (CheckConstraint("id = 1", name="singleton"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    next_id: Mapped[int]


class TimestampOracle(Base):
    """`last_ts` is the latest write timestamp handed out; only grows."""

    __tablename__ = "timestamp_oracle"
    __table_args__ = (CheckConstraint("id = 1", name="singleton"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    last_ts: Mapped[int]


# --- Instances and replicas ---------------------------------------------------------------


class Instance(Base):
    """A compute instance. `spark_conf` is the full, effective result-deciding Spark
    configuration (defaults merged with overrides at creation); `parameters` holds the
    set fields of `history.ComputeParameters`, merged on every update."""

    __tablename__ = "instances"
    __table_args__ = (
        CheckConstraint("min_in_sync >= 1", name="min_in_sync_positive"),
        CheckConstraint("max_lag_ms >= 0", name="max_lag_ms_non_negative"),
        CheckConstraint("replica_timeout_ms > 0", name="replica_timeout_ms_positive"),
        CheckConstraint("max_hold_back_ms > 0", name="max_hold_back_ms_positive"),
    )

    name: Mapped[str] = mapped_column(primary_key=True)
    spark_conf: Mapped[dict[str, Any]]
    min_in_sync: Mapped[int] = mapped_column(Integer)
    max_lag_ms: Mapped[int]
    replica_timeout_ms: Mapped[int]
    max_hold_back_ms: Mapped[int]
    replace_slow: Mapped[bool]
    parameters: Mapped[dict[str, Any]]


class Replica(Base):
    """A replica of an instance. `managed` replicas are spawned by the orchestrator (their
    `pid` is recorded once started, with its `process_start` where the system tells it,
    and their `address` once ready); external ones have a fixed `address`.
    `incarnation` counts rehydrations and never regresses."""

    __tablename__ = "replicas"
    __table_args__ = (
        CheckConstraint("incarnation >= 0", name="incarnation_non_negative"),
        CheckConstraint("managed OR address IS NOT NULL", name="external_has_address"),
    )

    instance_name: Mapped[str] = mapped_column(
        ForeignKey("instances.name", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(primary_key=True)
    size: Mapped[str] = mapped_column(String(64))
    spark_master: Mapped[str]
    spark_conf: Mapped[dict[str, Any]]
    managed: Mapped[bool] = mapped_column(Boolean)
    address: Mapped[str | None]
    pid: Mapped[int | None] = mapped_column(Integer)
    process_start: Mapped[str | None] = mapped_column(String(64))
    incarnation: Mapped[int]


class Reconfiguration(Base):
    """An instance's reconfiguration in progress (DESIGN section 13: reconfigurations
    are durable records), at most one per instance: a resize to `size` that adds the
    replicas `new` and then drops `old` (JSON lists of names). By `deadline_ms` (the
    catalog's clock) the new ones must be in sync; otherwise `on_timeout` says whether
    to roll back (drop the new ones) or commit (drop the old ones all the same). The row
    is deleted once the reconfiguration ended either way; a controller that finds one
    at start, or a new leader, carries it on (`controller._reconfigure`)."""

    __tablename__ = "reconfigurations"
    __table_args__ = (
        CheckConstraint("kind = 'resize'", name="kind_known"),
        CheckConstraint("on_timeout IN ('rollback', 'commit')", name="on_timeout_known"),
    )

    instance_name: Mapped[str] = mapped_column(
        ForeignKey("instances.name", ondelete="CASCADE"), primary_key=True
    )
    kind: Mapped[str] = mapped_column(String(16))
    size: Mapped[str] = mapped_column(String(64))
    old: Mapped[list[Any]]
    new: Mapped[list[Any]]
    started_at_ms: Mapped[int]
    deadline_ms: Mapped[int]
    on_timeout: Mapped[str] = mapped_column(String(16))


# --- Collections and dataflows --------------------------------------------------------


class Collection(Base):
    """A timestamped collection. `namespace` is 'storage' for sources and materialized
    views (durable, shared by all instances) and 'compute' for indexes (replica memory of
    one instance). Live storage names are unique (`uq_collections_live_storage_name`);
    an index is named after its dataflow, so index names are unique per instance through
    the dataflows' (instance_name, name) constraint, and two instances may each have an
    index named `totals`. A dropped collection keeps its row, with `since` set to the
    empty frontier. `dataflow_id` names the dataflow that exports it (NULL for sources,
    and once that dataflow is dropped)."""

    __tablename__ = "collections"
    __table_args__ = (
        CheckConstraint(
            "(kind = 'index' AND namespace = 'compute') OR "
            "(kind IN ('source', 'materialized_view') AND namespace = 'storage')",
            name="kind_matches_namespace",
        ),
        Index(
            "uq_collections_live_storage_name",
            "name",
            unique=True,
            sqlite_where=text("namespace = 'storage' AND NOT dropped"),
            postgresql_where=text("namespace = 'storage' AND NOT dropped"),
        ),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    name: Mapped[str]
    namespace: Mapped[str] = mapped_column(String(16))
    kind: Mapped[str] = mapped_column(String(32))
    schema: Mapped[str] = mapped_column(Text)
    since: Mapped[int | None]
    upper: Mapped[int | None]
    dropped: Mapped[bool] = mapped_column(Boolean)
    dataflow_id: Mapped[str | None] = mapped_column(
        ForeignKey("dataflows.id", ondelete="SET NULL"), index=True
    )


class Dataflow(Base):
    """Everything needed to rebuild a dataflow's `DataflowDescription` exactly.

    `imports` is a JSON list of {"name", "id", "kind"}; `index_exports` a JSON list of
    {"id", "key": [column, ...]}; `sink_id` the materialized view's collection, if any.
    `as_of` is the as_of at creation; the recovered as_of joins it with the recorded
    sinces of the exports. `strategy` is "incremental" or "recompute: <reason>". Rows
    are deleted when the dataflow is dropped (its collections stay, marked dropped).
    """

    __tablename__ = "dataflows"
    __table_args__ = (
        UniqueConstraint("instance_name", "name"),
        CheckConstraint("compaction_window_ms >= 0", name="compaction_window_non_negative"),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    instance_name: Mapped[str] = mapped_column(ForeignKey("instances.name"), index=True)
    name: Mapped[str]
    sql: Mapped[str] = mapped_column(Text)
    imports: Mapped[list[Any]]
    index_exports: Mapped[list[Any]]
    sink_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    schema: Mapped[str] = mapped_column(Text)
    as_of: Mapped[int]
    until: Mapped[int | None]
    compaction_window_ms: Mapped[int | None]
    strategy: Mapped[str] = mapped_column(Text)


# --- Storage manifest -----------------------------------------------------------------


class Batch(Base):
    """One batch of a storage collection, holding its updates at times in `[lower,
    upper)` (`upper` NULL: the append that closed the collection). Batches of a
    collection are disjoint; a gap between two means no updates there. `path` is
    relative to the blob location: a Parquet file, or (ending in `/`) a directory of part
    files written by Spark."""

    __tablename__ = "batches"
    __table_args__ = (
        UniqueConstraint("collection_id", "lower"),
        CheckConstraint("upper IS NULL OR lower < upper", name="lower_below_upper"),
        CheckConstraint("rows > 0 AND bytes > 0", name="not_empty"),
    )

    id: Mapped[int] = mapped_column(_SERIAL, primary_key=True, autoincrement=True)
    collection_id: Mapped[str] = mapped_column(ForeignKey("collections.id"))
    lower: Mapped[int]
    upper: Mapped[int | None]
    path: Mapped[str] = mapped_column(String(PATH_LENGTH), unique=True)
    rows: Mapped[int]
    bytes: Mapped[int]


APPEND_KEY_LENGTH = 128
APPEND_KEYS_RETAINED_MS = 10 * 60_000


class AppendKey(Base):
    """The idempotency key of a committed append: the same key sent again (a client's
    retry after a failover) gets `ts`, the timestamp the append was committed at, and
    appends nothing. Written in the append's own group commit; kept
    `APPEND_KEYS_RETAINED_MS` after it (`committed_ms`), so a retry must come within it."""

    __tablename__ = "append_keys"

    key: Mapped[str] = mapped_column(String(APPEND_KEY_LENGTH), primary_key=True)
    collection_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("collections.id"))
    ts: Mapped[int]
    committed_ms: Mapped[int] = mapped_column(index=True)


HOLD_OWNERS = ("dataflow", "feed", "retention", "caller")


class ReadHold(Base):
    """A named hold on a storage collection: `holder` may still read at `frontier` and
    later. A collection's `since` is never beyond the least of its holds.

    Every hold has an `owner` the catalog can check (DESIGN section 3), so that one
    whose owner is gone can be found and removed (`_manifest.orphaned_holds`):
    - 'dataflow': a dataflow's hold on an input or on its materialized view;
      `owner_collection` is the dataflow's export it belongs to (its first export for
      input holds, the view for the view's own). Gone once that collection is dropped.
    - 'feed': a storage subscription feed of the controller of epoch `owner_epoch`.
      Gone once a newer controller runs, or when that controller no longer has it open.
    - 'retention': the storage upkeep's retention window; goes with its collection.
    - 'caller': taken through the storage API by its own caller (tools, tests), who
      releases it; the controller takes none.
    """

    __tablename__ = "read_holds"
    __table_args__ = (
        CheckConstraint(
            "(owner = 'dataflow' AND owner_collection IS NOT NULL AND owner_epoch IS NULL) OR "
            "(owner = 'feed' AND owner_epoch IS NOT NULL AND owner_collection IS NULL) OR "
            "(owner IN ('retention', 'caller') AND owner_collection IS NULL AND owner_epoch IS NULL)",
            name="owner_named",
        ),
    )

    collection_id: Mapped[str] = mapped_column(ForeignKey("collections.id"), primary_key=True)
    holder: Mapped[str] = mapped_column(primary_key=True)
    frontier: Mapped[int]
    owner: Mapped[str] = mapped_column(String(16))
    owner_collection: Mapped[str | None] = mapped_column(String(ID_LENGTH), ForeignKey("collections.id"))
    owner_epoch: Mapped[int | None]


class RetiredBlob(Base):
    """A batch (file or directory) no manifest row names any more (replaced by
    compaction, or its collection was dropped). It stays for a grace period, so readers
    holding an older read plan can finish; `Storage.collect_garbage` deletes it
    afterwards."""

    __tablename__ = "retired_blobs"

    path: Mapped[str] = mapped_column(String(PATH_LENGTH), primary_key=True)
    retired_at_ms: Mapped[int]


# --- Events ---------------------------------------------------------------------------


class Event(Base):
    """Something an operator should see happened to an instance: a replica failed or
    came back, a dataflow failed, replicas disagreed, a controller took over; or to
    storage, which belongs to no instance (`instance` "": an orphaned hold removed).
    `replica` is "" when none is concerned. Only the latest `EVENTS_RETAINED` rows are kept; an
    instance's events outlive it (its drop is one of them)."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(_SERIAL, primary_key=True, autoincrement=True)
    at_ms: Mapped[int]
    instance: Mapped[str] = mapped_column(index=True)
    kind: Mapped[str] = mapped_column(String(32))
    replica: Mapped[str]
    message: Mapped[str] = mapped_column(Text)
