"""Collections and dataflows: ids, names, frontiers and drops, over an explicit session.

Rules:
- Ids come from `allocate_id` only (`u1`, `u2`, ...; collections and dataflows share the
  sequence) and are never reused: a dropped collection keeps its row, marked dropped with
  an empty `since`.
- Dataflow names are unique per instance. A dataflow `N` exports an index named `N`, a
  materialized view named `N`, or both; so index names ('compute' namespace) are unique
  per instance only, and two instances may each have an index `totals`. An index is
  therefore found through its instance's dataflow (`dataflow_by_name`), never by name
  alone. Live 'storage' names (sources and materialized views, shared by all instances)
  are unique across the catalog.
- Nothing is dropped while a live dataflow imports it. A storage collection that is
  dropped loses its batches and holds in the same transaction, and a dropped dataflow
  the holds it owns on its inputs (released by the caller, `_manifest`); their files are retired
  (see `RetiredBlob`) for `Storage.collect_garbage`.
- Functions neither commit nor roll back; they check everything before they write.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import delete, insert, select
from sqlalchemy.orm import Session

from catalog._checks import check_frontier, check_int, check_name, check_text
from catalog._errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from catalog._models import (
    Batch,
    Collection,
    Dataflow,
    IdAllocator,
    Instance,
    ReadHold,
    Replica,
    RetiredBlob,
    frontier_from_db,
)
from catalog._records import (
    CollectionInfo,
    DataflowInfo,
    Namespace,
    collection_info,
    dataflow_info,
)
from history import Frontier, Import

STORAGE: Namespace = "storage"
COMPUTE: Namespace = "compute"


def allocate_id(session: Session) -> str:
    """The next id, `u<n>`; the allocator row is locked until the transaction ends."""
    row = session.scalars(select(IdAllocator).where(IdAllocator.id == 1).with_for_update()).one()
    number = row.next_id
    row.next_id = number + 1
    return f"u{number}"


def id_number(id: str) -> int:
    """The number of an id, for ordering: `u10` sorts after `u9`."""
    return int(id[1:])


def collection_row(
    session: Session, id: str, *, live: bool = True, lock: bool = False
) -> Collection:
    """The row of collection `id`; with `live`, a dropped one is NotFound."""
    query = select(Collection).where(Collection.id == id)
    row = session.scalars(query.with_for_update() if lock else query).one_or_none()
    check_collection_found(id, None if row is None else row.name, live and row is not None and row.dropped)
    return row


def check_collection_found(id: str, name: str | None, dropped: bool) -> None:
    """NotFound for collection `id` when it has no row (`name` None) or is `dropped`."""
    if name is None:
        raise NotFound(f"collection {id!r} does not exist")
    if dropped:
        raise NotFound(f"collection {id} ({name}) was dropped")


def _check_storage_name_free(session: Session, name: str) -> None:
    taken = session.scalars(
        select(Collection.id).where(
            Collection.namespace == STORAGE,
            Collection.name == name,
            Collection.dropped.is_(False),
        )
    ).first()
    if taken is not None:
        raise AlreadyExists(
            f"a source or materialized view named {name!r} already exists ({taken})"
        )


def create_source(session: Session, name: str, *, schema: str, since: Frontier) -> CollectionInfo:
    """A source with `since = upper = since`: readable once its upper passes since."""
    check_name("source", name)
    check_text("schema", schema, max_length=1_000_000)
    check_frontier("since", since, allow_empty=False)
    _check_storage_name_free(session, name)
    row = Collection(
        id=allocate_id(session),
        name=name,
        namespace=STORAGE,
        kind="source",
        schema=schema,
        since=since.time,
        upper=since.time,
        dropped=False,
        dataflow_id=None,
    )
    session.add(row)
    session.flush()
    return collection_info(row)


def get_collection(session: Session, id: str) -> CollectionInfo:
    return collection_info(collection_row(session, id, live=False))


def collection_by_name(session: Session, name: str) -> CollectionInfo:
    """The live source or materialized view named `name`. Indexes are not found by name
    alone: their names are unique per instance only (see `dataflow_by_name`)."""
    row = session.scalars(
        select(Collection).where(
            Collection.namespace == STORAGE,
            Collection.name == name,
            Collection.dropped.is_(False),
        )
    ).one_or_none()
    if row is None:
        raise NotFound(f"there is no source or materialized view named {name!r}")
    return collection_info(row)


def list_collections(session: Session, *, include_dropped: bool) -> list[CollectionInfo]:
    query = select(Collection)
    if not include_dropped:
        query = query.where(Collection.dropped.is_(False))
    rows = sorted(session.scalars(query), key=lambda row: id_number(row.id))
    return [collection_info(row) for row in rows]


def uppers(session: Session, ids: Sequence[str]) -> dict[str, Frontier]:
    rows = session.execute(select(Collection.id, Collection.upper).where(Collection.id.in_(ids)))
    return {id: frontier_from_db(upper) for id, upper in rows}


def record_frontiers(
    session: Session, id: str, *, since: Frontier | None, upper: Frontier | None
) -> CollectionInfo:
    """Record the since and upper of an index, as the controller learns them. Both only
    advance: a value below the recorded one is ignored (replica reports race)."""
    if since is not None:
        check_frontier("since", since, allow_empty=False)
    if upper is not None:
        check_frontier("upper", upper, allow_empty=True)
    row = collection_row(session, id, lock=True)
    if row.namespace != COMPUTE:
        raise InvalidArgument(
            f"{id} ({row.name}) is a {row.kind.replace('_', ' ')}: its upper moves by "
            f"compare_and_append and its since by read holds"
        )
    if since is not None:
        row.since = since.join(frontier_from_db(row.since)).time
    if upper is not None:
        row.upper = upper.join(frontier_from_db(row.upper)).time
    session.flush()
    return collection_info(row)


# --- Dataflows ------------------------------------------------------------------------


def _check_imports(
    session: Session, instance: str, imports: Sequence[Import], as_of: Frontier
) -> list[dict[str, str]]:
    result: list[dict[str, str]] = []
    seen: set[str] = set()
    for item in imports:
        if not isinstance(item, Import):
            raise InvalidArgument(f"imports must be history.Import values, not {item!r}")
        check_name("import", item.name)
        if item.name in seen:
            raise InvalidArgument(f"the import name {item.name!r} is used twice")
        seen.add(item.name)
        row = collection_row(session, item.id)
        if item.kind == "storage" and row.namespace != STORAGE:
            raise InvalidArgument(
                f"import {item.name!r}: {item.id} ({row.name}) is an index; import it "
                f"with kind 'index'"
            )
        if item.kind == "index":
            if row.namespace != COMPUTE:
                raise InvalidArgument(
                    f"import {item.name!r}: {item.id} ({row.name}) is not an index; import "
                    f"it with kind 'storage'"
                )
            owner = session.get(Dataflow, row.dataflow_id) if row.dataflow_id else None
            if owner is None or owner.instance_name != instance:
                raise InvalidArgument(
                    f"import {item.name!r}: index {item.id} ({row.name}) lives on another "
                    f"instance; a dataflow imports only indexes of its own instance "
                    f"({instance!r})"
                )
        elif item.kind != "storage":
            raise InvalidArgument(f"import {item.name!r}: kind must be 'storage' or 'index'")
        if as_of < frontier_from_db(row.since):
            raise InvalidArgument(
                f"import {item.name!r}: {item.id} ({row.name}) cannot be read at as_of "
                f"{as_of.time}: its since is {row.since}"
            )
        result.append({"name": item.name, "id": item.id, "kind": item.kind})
    return result


def create_dataflow(
    session: Session,
    instance: str,
    name: str,
    *,
    sql: str,
    imports: Sequence[Import],
    schema: str,
    index_key: Sequence[str] | None,
    materialized: bool,
    as_of: Frontier,
    until: Frontier,
    compaction_window_ms: int | None,
    strategy: str,
) -> DataflowInfo:
    """Record a dataflow and its exports: an index named `name` keyed by `index_key`
    (unless None), a materialized view named `name` (if `materialized`), or both. Ids are
    allocated in that order: dataflow, index, materialized view. The exports start with
    `since = upper = as_of`. `strategy` is "incremental" or "recompute: <reason>"."""
    check_name("dataflow", name)
    check_text("sql", sql, max_length=1_000_000)
    check_text("schema", schema, max_length=1_000_000)
    check_frontier("as_of", as_of, allow_empty=False)
    check_frontier("until", until, allow_empty=True)
    if until <= as_of:
        raise InvalidArgument(f"until ({until.time}) must be beyond as_of ({as_of.time})")
    if compaction_window_ms is not None:
        check_int("compaction_window_ms", compaction_window_ms, minimum=0)
    check_text("strategy", strategy, max_length=10_000)
    if strategy != "incremental" and not strategy.startswith("recompute: "):
        raise InvalidArgument(f"a strategy is 'incremental' or 'recompute: <reason>', not {strategy!r}")
    if index_key is None and not materialized:
        raise InvalidArgument(f"dataflow {name!r} needs an index, a materialized view or both")
    key = None if index_key is None else tuple(index_key)
    if key is not None and (
        any(not isinstance(c, str) or not c for c in key) or len(set(key)) != len(key)
    ):
        raise InvalidArgument(f"index key {key!r} must be distinct, non-empty column names")
    if session.get(Instance, instance) is None:
        raise NotFound(f"instance {instance!r} does not exist")
    imported = _check_imports(session, instance, imports, as_of)
    # The dataflow name is the index name too, so this also keeps index names unique
    # per instance (uq_dataflows_instance_name_name backs it).
    if session.scalars(
        select(Dataflow.id).where(Dataflow.instance_name == instance, Dataflow.name == name)
    ).first():
        raise AlreadyExists(f"instance {instance!r} already has a dataflow named {name!r}")
    if materialized:
        _check_storage_name_free(session, name)

    dataflow_id = allocate_id(session)
    index_id = None if key is None else allocate_id(session)
    sink_id = allocate_id(session) if materialized else None
    row = Dataflow(
        id=dataflow_id,
        instance_name=instance,
        name=name,
        sql=sql,
        imports=imported,
        index_exports=[] if key is None else [{"id": index_id, "key": list(key)}],
        sink_id=sink_id,
        schema=schema,
        as_of=as_of.time,
        until=until.time,
        compaction_window_ms=compaction_window_ms,
        strategy=strategy,
    )
    session.add(row)
    session.flush()
    for export_id, namespace, kind in (
        (index_id, COMPUTE, "index"),
        (sink_id, STORAGE, "materialized_view"),
    ):
        if export_id is not None:
            session.add(
                Collection(
                    id=export_id,
                    name=name,
                    namespace=namespace,
                    kind=kind,
                    schema=schema,
                    since=as_of.time,
                    upper=as_of.time,
                    dropped=False,
                    dataflow_id=dataflow_id,
                )
            )
    session.flush()
    return dataflow_info(row)


def _dataflow_row(session: Session, id: str) -> Dataflow:
    row = session.get(Dataflow, id)
    if row is None:
        raise NotFound(f"dataflow {id!r} does not exist (or was dropped)")
    return row


def get_dataflow(session: Session, id: str) -> DataflowInfo:
    return dataflow_info(_dataflow_row(session, id))


def dataflow_by_name(session: Session, instance: str, name: str) -> DataflowInfo:
    row = session.scalars(
        select(Dataflow).where(Dataflow.instance_name == instance, Dataflow.name == name)
    ).one_or_none()
    if row is None:
        raise NotFound(f"instance {instance!r} has no dataflow named {name!r}")
    return dataflow_info(row)


def list_dataflows(session: Session, instance: str | None) -> list[DataflowInfo]:
    query = select(Dataflow)
    if instance is not None:
        if session.get(Instance, instance) is None:
            raise NotFound(f"instance {instance!r} does not exist")
        query = query.where(Dataflow.instance_name == instance)
    rows = sorted(session.scalars(query), key=lambda row: id_number(row.id))
    return [dataflow_info(row) for row in rows]


# --- Drops ----------------------------------------------------------------------------


def _refuse_if_imported(
    session: Session, ids: set[str], what: str, *, excluding: set[str] | None = None
) -> None:
    users = [
        row
        for row in session.scalars(select(Dataflow))
        if row.id not in (excluding or ()) and any(i["id"] in ids for i in row.imports)
    ]
    if users:
        names = ", ".join(f"{row.name} ({row.id}) on {row.instance_name!r}" for row in users)
        raise FailedPrecondition(f"{what} is imported by dataflow {names}: drop those first")


def _drop_collection_rows(session: Session, ids: Sequence[str], now_ms: int) -> None:
    """Mark collections dropped; retire their batches' files and forget their holds."""
    for id in ids:
        row = collection_row(session, id, lock=True)
        row.dropped = True
        row.since = None
        row.dataflow_id = None
    retired = session.scalars(select(Batch.path).where(Batch.collection_id.in_(ids))).all()
    if retired:
        session.execute(
            insert(RetiredBlob), [{"path": p, "retired_at_ms": now_ms} for p in retired]
        )
    session.execute(delete(Batch).where(Batch.collection_id.in_(ids)))
    session.execute(delete(ReadHold).where(ReadHold.collection_id.in_(ids)))
    session.flush()


def drop_source(session: Session, id: str, now_ms: int) -> None:
    row = collection_row(session, id)
    if row.kind != "source":
        raise InvalidArgument(
            f"{id} ({row.name}) is {'an index' if row.kind == 'index' else 'a materialized view'}"
            f" of dataflow {row.dataflow_id}: drop that dataflow instead"
        )
    _refuse_if_imported(session, {id}, f"source {row.name} ({id})")
    _drop_collection_rows(session, [id], now_ms)


def _drop_dataflow_rows(session: Session, rows: Sequence[Dataflow], now_ms: int) -> list[str]:
    """Drop the dataflows `rows` and their exports; the export ids, whose holds on other
    collections the caller releases (`_manifest.release_owned_holds`)."""
    exports = [e for row in rows for e in dataflow_info(row).export_ids]
    _drop_collection_rows(session, exports, now_ms)
    for row in rows:
        session.delete(row)
    session.flush()
    return exports


def drop_dataflow(session: Session, id: str, now_ms: int) -> list[str]:
    """Drop a dataflow; its export ids (see `_drop_dataflow_rows`)."""
    row = _dataflow_row(session, id)
    info = dataflow_info(row)
    _refuse_if_imported(session, set(info.export_ids), f"dataflow {row.name} ({id})")
    return _drop_dataflow_rows(session, [row], now_ms)


def drop_instance(session: Session, name: str, now_ms: int) -> list[str]:
    """Drop an instance with its replicas and dataflows; their export ids (see
    `_drop_dataflow_rows`). Refused while a dataflow of another instance imports one of
    its materialized views."""
    if session.get(Instance, name) is None:
        raise NotFound(f"instance {name!r} does not exist")
    rows = list(session.scalars(select(Dataflow).where(Dataflow.instance_name == name)))
    exports = {e for row in rows for e in dataflow_info(row).export_ids}
    _refuse_if_imported(session, exports, f"instance {name!r}", excluding={row.id for row in rows})
    exports = _drop_dataflow_rows(session, rows, now_ms)
    session.execute(delete(Replica).where(Replica.instance_name == name))
    session.execute(delete(Instance).where(Instance.name == name))
    session.flush()
    return exports
