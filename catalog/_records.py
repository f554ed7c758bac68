"""Frozen domain records the catalog returns, and their conversion from rows.

Rules: readers of the catalog only ever see these dataclasses, never ORM rows, so no
session or lazy load escapes a transaction. Frontiers are `history.Frontier` here; the
conversion to and from the nullable-BIGINT encoding happens in this module and in
`_models.py`, nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import Row

from catalog._models import Batch, Collection, Dataflow, Event, Instance, ReadHold, Reconfiguration, Replica, frontier_from_db
from history import (
    ComputeParameters,
    DataflowDescription,
    Frontier,
    Import,
    IndexExport,
    InstanceConfig,
    SinkExport,
)

CollectionKind = Literal["source", "index", "materialized_view"]
Namespace = Literal["storage", "compute"]


def _pairs(mapping: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in mapping.items()))


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """An instance: its `config` (what `CreateInstance` carries), the controller's options
    for it, and the merged tunable `parameters`."""

    name: str
    config: InstanceConfig
    min_in_sync: int
    max_lag_ms: int
    replica_timeout_ms: int
    max_hold_back_ms: int
    replace_slow: bool
    parameters: ComputeParameters


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """A replica. `managed` replicas are spawned by the orchestrator; `address`, `pid` and
    `process_start` (what tells that process from a later one given the same pid, when
    the system told) are what was last recorded. `spark_conf` holds resource settings
    only, sorted."""

    instance: str
    name: str
    size: str
    spark_master: str
    spark_conf: tuple[tuple[str, str], ...]
    managed: bool
    address: str | None
    pid: int | None
    process_start: str | None
    incarnation: int

    def conf(self) -> dict[str, str]:
        return dict(self.spark_conf)


@dataclass(frozen=True, slots=True)
class ReconfigurationInfo:
    """A recorded reconfiguration in progress (see `_models.Reconfiguration`)."""

    instance: str
    kind: Literal["resize"]
    size: str
    old: tuple[str, ...]
    new: tuple[str, ...]
    started_at_ms: int
    deadline_ms: int
    on_timeout: Literal["rollback", "commit"]


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event to record: `at_ms` is when it happened (the controller's clock);
    `replica` is "" when none is concerned."""

    at_ms: int
    instance: str
    kind: str
    message: str
    replica: str = ""


@dataclass(frozen=True, slots=True)
class EventInfo:
    """A recorded event; `id`s increase in the order events were recorded."""

    id: int
    at_ms: int
    instance: str
    kind: str
    replica: str
    message: str


@dataclass(frozen=True, slots=True)
class CollectionInfo:
    """A collection as last recorded. Invariant: a live collection has a non-empty
    `since`; a dropped one has `since` empty."""

    id: str
    name: str
    kind: CollectionKind
    namespace: Namespace
    schema: str
    since: Frontier
    upper: Frontier
    dropped: bool
    dataflow_id: str | None


@dataclass(frozen=True, slots=True)
class DataflowInfo:
    """A live dataflow: everything its `DataflowDescription` is rebuilt from."""

    id: str
    instance: str
    name: str
    sql: str
    imports: tuple[Import, ...]
    index_exports: tuple[IndexExport, ...]
    sink_id: str | None
    schema: str
    as_of: Frontier
    until: Frontier
    compaction_window_ms: int | None
    strategy: str  # "incremental", or "recompute: <why>"

    @property
    def export_ids(self) -> tuple[str, ...]:
        sinks = () if self.sink_id is None else (self.sink_id,)
        return tuple(e.id for e in self.index_exports) + sinks

    @property
    def index_id(self) -> str | None:
        return self.index_exports[0].id if self.index_exports else None

    def description(self, as_of: Frontier | None = None) -> DataflowDescription:
        """The description a replica builds, at `as_of` (default: the creation as_of)."""
        return DataflowDescription(
            name=self.name,
            sql=self.sql,
            imports=self.imports,
            index_exports=self.index_exports,
            sink_exports=() if self.sink_id is None else (SinkExport(self.sink_id),),
            as_of=self.as_of if as_of is None else as_of,
            until=self.until,
            schema=self.schema,
            strategy="incremental" if self.strategy == "incremental" else "recompute",
        )


@dataclass(frozen=True, slots=True)
class BatchInfo:
    """A manifest row: `path` (relative to the blob directory) holds the collection's
    updates at times in `[lower, upper)`."""

    id: int
    collection_id: str
    lower: int
    upper: Frontier
    path: str
    rows: int
    bytes: int

    def overlaps(self, after: int | None, through: int) -> bool:
        """True iff the batch may hold a time `t` with `after < t <= through`."""
        below_end = self.lower <= through
        past_start = after is None or self.upper.is_empty or self.upper.time - 1 > after
        return below_end and past_start


@dataclass(frozen=True, slots=True)
class NewBatch:
    """A written (not yet committed) batch file, as `compare_and_append` records it."""

    path: str
    rows: int
    bytes: int


HoldOwnerKind = Literal["dataflow", "feed", "retention", "caller"]


@dataclass(frozen=True, slots=True)
class HoldOwner:
    """Who a read hold belongs to (see `_models.ReadHold`): a dataflow, by the export
    it belongs to (`collection`); a storage feed, by its controller's `epoch`; the
    retention window; or the caller of the storage API. Build one with the class
    methods."""

    kind: HoldOwnerKind
    collection: str | None = None
    epoch: int | None = None

    @classmethod
    def dataflow(cls, export_id: str) -> HoldOwner:
        return cls("dataflow", collection=export_id)

    @classmethod
    def feed(cls, epoch: int) -> HoldOwner:
        return cls("feed", epoch=epoch)

    @classmethod
    def retention(cls) -> HoldOwner:
        return cls("retention")

    @classmethod
    def caller(cls) -> HoldOwner:
        return cls("caller")

    def __str__(self) -> str:
        if self.kind == "dataflow":
            return f"dataflow of {self.collection}"
        if self.kind == "feed":
            return f"feed of controller epoch {self.epoch}"
        return self.kind


@dataclass(frozen=True, slots=True)
class HoldInfo:
    """One read hold: `holder` holds storage collection `collection_id` readable at
    `frontier` and later, on behalf of `owner`."""

    collection_id: str
    holder: str
    frontier: Frontier
    owner: HoldOwner


@dataclass(frozen=True, slots=True)
class ManifestState:
    """One consistent view of a storage collection: frontiers, batches (by `lower`)
    and read holds, all read in a single transaction."""

    collection: CollectionInfo
    batches: tuple[BatchInfo, ...]
    holds: tuple[tuple[str, Frontier], ...]


@dataclass(frozen=True, slots=True)
class ManifestTail:
    """What changed in a storage collection's manifest since a reader read it with
    upper `known_upper` and `known_batches` batches (`Catalog.manifest_tail`), in one
    snapshot: its frontiers, and either the batches appended since (`whole` False:
    those at or past `known_upper`; the earlier ones are as read) or, when an earlier one
    changed (a compaction replaced some), all of them (`whole` True)."""

    collection: CollectionInfo
    batches: tuple[BatchInfo, ...]
    whole: bool


def instance_info(row: Instance) -> InstanceInfo:
    return InstanceInfo(
        name=row.name,
        config=InstanceConfig.of(row.name, row.spark_conf),
        min_in_sync=row.min_in_sync,
        max_lag_ms=row.max_lag_ms,
        replica_timeout_ms=row.replica_timeout_ms,
        max_hold_back_ms=row.max_hold_back_ms,
        replace_slow=row.replace_slow,
        # A parameter no longer known (arrangement_max_versions, never read) is ignored.
        parameters=ComputeParameters(**{k: v for k, v in row.parameters.items() if k in ComputeParameters.__dataclass_fields__}),
    )


def replica_info(row: Replica) -> ReplicaInfo:
    return ReplicaInfo(
        instance=row.instance_name,
        name=row.name,
        size=row.size,
        spark_master=row.spark_master,
        spark_conf=_pairs(row.spark_conf),
        managed=row.managed,
        address=row.address,
        pid=row.pid,
        process_start=row.process_start,
        incarnation=row.incarnation,
    )


def collection_info(row: Collection) -> CollectionInfo:
    return CollectionInfo(
        id=row.id,
        name=row.name,
        kind=row.kind,  # type: ignore[arg-type]
        namespace=row.namespace,  # type: ignore[arg-type]
        schema=row.schema,
        since=frontier_from_db(row.since),
        upper=frontier_from_db(row.upper),
        dropped=row.dropped,
        dataflow_id=row.dataflow_id,
    )


def dataflow_info(row: Dataflow) -> DataflowInfo:
    return DataflowInfo(
        id=row.id,
        instance=row.instance_name,
        name=row.name,
        sql=row.sql,
        imports=tuple(Import(i["name"], i["id"], i["kind"]) for i in row.imports),
        index_exports=tuple(IndexExport(e["id"], tuple(e["key"])) for e in row.index_exports),
        sink_id=row.sink_id,
        schema=row.schema,
        as_of=frontier_from_db(row.as_of),
        until=frontier_from_db(row.until),
        compaction_window_ms=row.compaction_window_ms,
        strategy=row.strategy,
    )


def batch_info(row: Batch | Row) -> BatchInfo:
    """From an ORM object or a Core row of the `batches` table (same attributes)."""
    return BatchInfo(
        id=row.id,
        collection_id=row.collection_id,
        lower=row.lower,
        upper=frontier_from_db(row.upper),
        path=row.path,
        rows=row.rows,
        bytes=row.bytes,
    )


def event_info(row: Event) -> EventInfo:
    return EventInfo(id=row.id, at_ms=row.at_ms, instance=row.instance, kind=row.kind, replica=row.replica, message=row.message)


def hold_info(row: ReadHold) -> HoldInfo:
    owner = HoldOwner(row.owner, collection=row.owner_collection, epoch=row.owner_epoch)  # type: ignore[arg-type]
    return HoldInfo(row.collection_id, row.holder, frontier_from_db(row.frontier), owner)


def reconfiguration_info(row: Reconfiguration) -> ReconfigurationInfo:
    return ReconfigurationInfo(
        row.instance_name, row.kind, row.size, tuple(row.old), tuple(row.new), row.started_at_ms, row.deadline_ms, row.on_timeout  # type: ignore[arg-type]
    )
