"""The storage manifest: batches, read holds and retired files of storage collections.

Rules:
- `append_batch` is the commit step of compare-and-append: under a lock on the
  collection row, it checks that the upper still equals the expected one, then records
  the batch (if any) and the new upper together. Nothing else moves a storage upper.
- `since` = max(since, least read hold): it never regresses, and only advances as far
  as every hold allows. With no holds it stays where it is. A hold below since is
  refused.
- Every hold has an owner (`_models.ReadHold`). A dataflow's is taken with its record
  and deleted with its drop (`_collections`); a hold the controller moves is never taken
  again once it is missing unless its owner is named and live; `remove_orphaned_holds`
  deletes those whose owner is gone.
- `replace_batches` is the commit step of compaction: batches wholly below since are
  replaced by one, in one transaction, and their files retired (not deleted), so a
  reader holding an older plan can still open them during the grace period.
- Functions neither commit nor roll back, and check everything before they write.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Collection as Collection_

from sqlalchemy import bindparam, delete, func, insert, select, update
from sqlalchemy.orm import Session

from catalog._checks import check_frontier, check_text
from catalog._collections import STORAGE, check_collection_found, collection_row
from catalog._errors import AlreadyExists, InvalidArgument, NotFound, UpperMismatch
from catalog._models import APPEND_KEYS_RETAINED_MS, AppendKey, Batch, Collection, ReadHold, RetiredBlob, frontier_from_db
from catalog._records import (
    BatchInfo,
    CollectionInfo,
    HoldInfo,
    HoldOwner,
    ManifestState,
    ManifestTail,
    NewBatch,
    batch_info,
    collection_info,
    hold_info,
)
from history import Frontier


def storage_row(session: Session, id: str, *, lock: bool) -> Collection:
    row = collection_row(session, id, lock=lock)
    if row.namespace != STORAGE:
        raise _not_in_storage(id, row.name)
    return row


def _not_in_storage(id: str, name: str) -> InvalidArgument:
    return InvalidArgument(f"{id} ({name}) is an index: it lives in replica memory, not in storage")


def check_append_frontiers(id: str, expected_upper: Frontier, new_upper: Frontier) -> None:
    """InvalidArgument unless `[expected_upper, new_upper)` is a possible append: the
    expected upper is not closed, and the new one lies beyond it."""
    check_frontier("expected_upper", expected_upper, allow_empty=True)
    check_frontier("new_upper", new_upper, allow_empty=True)
    if expected_upper.is_empty:
        raise InvalidArgument(
            f"{id}: expected_upper is empty; a closed collection takes no appends"
        )
    if new_upper <= expected_upper:
        raise InvalidArgument(
            f"{id}: new_upper ({new_upper.time}) must be beyond "
            f"expected_upper ({expected_upper.time})"
        )


def manifest_state(session: Session, id: str) -> ManifestState:
    row = storage_row(session, id, lock=False)
    batches = session.scalars(select(Batch).where(Batch.collection_id == id).order_by(Batch.lower))
    holds = session.scalars(
        select(ReadHold).where(ReadHold.collection_id == id).order_by(ReadHold.holder)
    )
    return ManifestState(
        collection=collection_info(row),
        batches=tuple(batch_info(b) for b in batches),
        holds=tuple((h.holder, frontier_from_db(h.frontier)) for h in holds),
    )


def manifest_tail(session: Session, id: str, known_upper: int | None, known_batches: int) -> ManifestTail:
    """`Catalog.manifest_tail`. Batches are only ever added at the collection's upper,
    and a compaction replaces two or more batches below since by at most one, which
    may reach past `known_upper` (since moved on meanwhile): so the batches wholly below
    `known_upper` are those the reader holds exactly when they are still `known_batches`
    in number. Core statements: a replica reads this at every poll of every input, and
    loading each batch as an ORM object cost most of its Python's time under a stream
    of appends (thousands of batches above since)."""
    row = storage_row(session, id, lock=False)
    connection = session.connection()
    whole = known_upper is None or connection.execute(_BATCHES_BELOW, {"id": id, "upper": known_upper}).scalar_one() != known_batches
    query = _BATCH_ROWS if whole else _BATCH_ROWS.where(_BATCHES.c.lower >= known_upper)
    batches = tuple(batch_info(b) for b in connection.execute(query, {"id": id}))
    return ManifestTail(collection_info(row), batches, whole)


def append_batch(
    session: Session,
    id: str,
    expected_upper: Frontier,
    new_upper: Frontier,
    batch: NewBatch | None,
) -> CollectionInfo:
    check_append_frontiers(id, expected_upper, new_upper)
    row = storage_row(session, id, lock=True)
    current = frontier_from_db(row.upper)
    if current != expected_upper:
        raise UpperMismatch(id, expected_upper, current)
    if batch is not None:
        session.execute(
            insert(Batch).values(
                collection_id=id,
                lower=expected_upper.time,
                upper=new_upper.time,
                path=batch.path,
                rows=batch.rows,
                bytes=batch.bytes,
            )
        )
    row.upper = new_upper.time
    session.flush()
    return collection_info(row)


def append_group(session: Session, batches: Mapping[str, NewBatch | None], ts: int) -> None:
    """Record each source's batch of `batches` at `ts` (covering `[its upper, ts + 1)`)
    and move every live source's upper to `ts + 1` (`Catalog.append_group`). Sources
    are locked in id order, so two groups cannot deadlock; a source whose upper is past
    `ts` (closed, or another writer's) refuses the group. Core statements on the
    session's connection: this is the ingest's hot path, and the ORM's unit of work
    cost three times the database's own time here (no ORM object is loaded, so none
    goes stale)."""
    connection = session.connection()
    upper = Frontier(ts + 1)
    for id in sorted(batches):
        name, kind, dropped, current = connection.execute(_LOCK_SOURCE, {"id": id}).one_or_none() or (None, None, False, None)
        check_collection_found(id, name, dropped)
        if kind == "index":
            raise _not_in_storage(id, name)
        if kind != "source":
            raise InvalidArgument(f"{id} ({name}) is a materialized view; only sources take appends")
        if current is None or current > ts:
            raise InvalidArgument(f"cannot append to {id} at {ts}: its upper is already {'closed' if current is None else current}")
        batch = batches[id]
        if batch is not None:
            connection.execute(_BATCHES.insert(), {"collection_id": id, "lower": current, "upper": upper.time, "path": batch.path, "rows": batch.rows, "bytes": batch.bytes})
    advance_sources(session, upper)  # the appended sources' uppers too


def earlier_appends(session: Session, keys: Collection_[str], now_ms: int, *, prune: bool) -> dict[str, tuple[str, int]]:
    """The source and timestamp of each of `keys` committed within the retention
    (`AppendKey`). A key older than it is not earlier: it is forgotten, and with `prune`
    so is every such key (a range delete, not worth one statement on every commit)."""
    connection = session.connection()
    retained_from = now_ms - APPEND_KEYS_RETAINED_MS
    if prune:
        connection.execute(delete(_KEYS).where(_KEYS.c.committed_ms < retained_from))
    if not keys:
        return {}
    found = connection.execute(select(_KEYS.c.key, _KEYS.c.collection_id, _KEYS.c.ts, _KEYS.c.committed_ms).where(_KEYS.c.key.in_(sorted(keys)))).all()
    expired = [key for key, _, _, committed_ms in found if committed_ms < retained_from]
    if expired:  # given again after the retention: recorded anew
        connection.execute(delete(_KEYS).where(_KEYS.c.key.in_(expired)))
    return {key: (source, ts) for key, source, ts, committed_ms in found if committed_ms >= retained_from}


def record_append_keys(session: Session, keys: Mapping[str, str], ts: int, now_ms: int) -> None:
    """Record each key of `keys` (to its source) as committed at `ts`."""
    if keys:
        session.connection().execute(_KEYS.insert(), [{"key": key, "collection_id": source, "ts": ts, "committed_ms": now_ms} for key, source in keys.items()])


def advance_sources(session: Session, upper: Frontier) -> list[str]:
    """Move the upper of every live, open source that lies below `upper` to it (each
    takes an empty change at the times between, as `append_batch` without a batch
    would) in one statement; the ids moved. Sources only: a materialized view's upper
    is its writer's, the replicas'. A Core statement (see `append_group`): a
    `Collection` already loaded in `session` keeps its old upper."""
    check_frontier("upper", upper, allow_empty=False)
    return sorted(session.connection().execute(_ADVANCE_SOURCES, {"to": upper.time}).scalars())


_COLLECTIONS = Collection.__table__
_BATCHES = Batch.__table__
_KEYS = AppendKey.__table__
_BATCH_ROWS = (
    select(_BATCHES.c.id, _BATCHES.c.collection_id, _BATCHES.c.lower, _BATCHES.c.upper, _BATCHES.c.path, _BATCHES.c.rows, _BATCHES.c.bytes)
    .where(_BATCHES.c.collection_id == bindparam("id"))
    .order_by(_BATCHES.c.lower)
)
_BATCHES_BELOW = select(func.count()).select_from(_BATCHES).where(_BATCHES.c.collection_id == bindparam("id"), _BATCHES.c.upper <= bindparam("upper"))
_LOCK_SOURCE = (
    select(_COLLECTIONS.c.name, _COLLECTIONS.c.kind, _COLLECTIONS.c.dropped, _COLLECTIONS.c.upper)
    .where(_COLLECTIONS.c.id == bindparam("id"))
    .with_for_update()
)
_ADVANCE_SOURCES = (
    update(_COLLECTIONS)
    .where(
        _COLLECTIONS.c.kind == "source",
        _COLLECTIONS.c.dropped.is_(False),
        _COLLECTIONS.c.upper.is_not(None),
        _COLLECTIONS.c.upper < bindparam("to"),
    )
    .values(upper=bindparam("to"))
    .returning(_COLLECTIONS.c.id)
)


def replace_batches(
    session: Session,
    id: str,
    old: Sequence[BatchInfo],
    new: NewBatch | None,
    retired_at_ms: int,
) -> bool:
    """Replace batches `old` (wholly below since, contiguous in the manifest) by `new`,
    covering `[old[0].lower, old[-1].upper)`. False, changing nothing, if some batch of
    `old` is gone (a concurrent compaction won)."""
    row = storage_row(session, id, lock=True)
    since = frontier_from_db(row.since)
    ids = [b.id for b in old]
    found = session.scalars(select(Batch.id).where(Batch.collection_id == id, Batch.id.in_(ids)))
    if len(set(found)) != len(ids):
        return False
    if any(b.upper > since for b in old):
        raise InvalidArgument(
            f"{id}: only batches wholly below since ({since.time}) may be compacted"
        )
    session.execute(delete(Batch).where(Batch.id.in_(ids)))
    session.execute(
        insert(RetiredBlob), [{"path": b.path, "retired_at_ms": retired_at_ms} for b in old]
    )
    if new is not None:
        session.execute(
            insert(Batch).values(
                collection_id=id,
                lower=old[0].lower,
                upper=old[-1].upper.time,
                path=new.path,
                rows=new.rows,
                bytes=new.bytes,
            )
        )
    session.flush()
    return True


# --- Read holds -----------------------------------------------------------------------


def _hold_row(session: Session, id: str, holder: str) -> ReadHold:
    hold = session.get(ReadHold, (id, holder))
    if hold is None:
        raise NotFound(f"{holder!r} holds no read hold on {id}")
    return hold


def _advance_since(session: Session, row: Collection) -> CollectionInfo:
    least = session.scalar(
        select(func.min(ReadHold.frontier)).where(ReadHold.collection_id == row.id)
    )
    if least is not None and least > row.since:
        row.since = least
    session.flush()
    return collection_info(row)


def acquire_read_hold(
    session: Session, id: str, holder: str, frontier: Frontier, owner: HoldOwner = HoldOwner.caller()
) -> CollectionInfo:
    """A new hold by `holder` on behalf of `owner` (a dataflow's export must be live)."""
    check_text("holder", holder)
    check_frontier("frontier", frontier, allow_empty=False)
    if not isinstance(owner, HoldOwner):
        raise InvalidArgument(f"owner must be a HoldOwner, not {owner!r}")
    row = storage_row(session, id, lock=True)
    if frontier < frontier_from_db(row.since):
        raise InvalidArgument(
            f"cannot hold {id} ({row.name}) at {frontier.time}: its since is already {row.since}"
        )
    if session.get(ReadHold, (id, holder)) is not None:
        raise AlreadyExists(f"{holder!r} already holds {id}; downgrade or release that hold")
    if owner.kind == "dataflow":
        collection_row(session, owner.collection or "")  # NotFound once dropped: no hold for the gone
    session.add(
        ReadHold(
            collection_id=id,
            holder=holder,
            frontier=frontier.time,
            owner=owner.kind,
            owner_collection=owner.collection,
            owner_epoch=owner.epoch,
        )
    )
    session.flush()
    return _advance_since(session, row)


def downgrade_read_hold(
    session: Session, id: str, holder: str, frontier: Frontier
) -> CollectionInfo:
    """Move a hold forward (allowing more compaction); the empty frontier releases it."""
    check_frontier("frontier", frontier, allow_empty=True)
    row = storage_row(session, id, lock=True)
    hold = _hold_row(session, id, holder)
    if frontier < frontier_from_db(hold.frontier):
        raise InvalidArgument(
            f"a read hold only moves forward: {holder!r} holds {id} at {hold.frontier}, "
            f"not back to {frontier.time}"
        )
    if frontier.is_empty:
        session.delete(hold)
    else:
        hold.frontier = frontier.time
    session.flush()
    return _advance_since(session, row)


def move_read_hold(session: Session, id: str, holder: str, frontier: Frontier, owner: HoldOwner | None = None) -> None:
    """Bring `holder`'s hold on `id` to `frontier`: forward if it has one (a value behind
    it is ignored), released when `frontier` is empty. A missing hold is taken only for
    a live `owner` (at the since, if `frontier` is behind it: never a refusal that would
    fail the batch it is part of); without one it stays missing: a dataflow's input hold
    goes only with its dataflow's drop or as an orphan, and moving it must not bring it
    back. A dropped collection is left alone: its holds went with it."""
    row = collection_row(session, id, live=False, lock=True)
    if row.dropped:
        return
    hold = session.get(ReadHold, (id, holder))
    if hold is None:
        if not frontier.is_empty and owner is not None and _owner_live(session, owner):
            acquire_read_hold(session, id, holder, frontier.join(frontier_from_db(row.since)), owner)
    elif frontier.is_empty:
        release_read_hold(session, id, holder)
    elif frontier.time > hold.frontier:
        downgrade_read_hold(session, id, holder, frontier)


def release_read_hold(session: Session, id: str, holder: str) -> CollectionInfo:
    row = storage_row(session, id, lock=True)
    session.delete(_hold_row(session, id, holder))
    session.flush()
    return _advance_since(session, row)


def release_owned_holds(session: Session, owners: Sequence[str]) -> None:
    """Release the holds owned by the dataflow exports `owners` (dropped in this
    transaction), letting each held collection's since follow."""
    held = session.scalars(select(ReadHold.collection_id).where(ReadHold.owner_collection.in_(list(owners)))).all()
    for id in sorted(set(held)):
        row = storage_row(session, id, lock=True)
        session.execute(delete(ReadHold).where(ReadHold.collection_id == id, ReadHold.owner_collection.in_(list(owners))))
        session.flush()
        _advance_since(session, row)


def _owner_live(session: Session, owner: HoldOwner) -> bool:
    if owner.kind != "dataflow":
        return True
    found = session.get(Collection, owner.collection)
    return found is not None and not found.dropped


def list_holds(session: Session) -> list[HoldInfo]:
    """Every read hold, by collection and holder."""
    rows = session.scalars(select(ReadHold).order_by(ReadHold.collection_id, ReadHold.holder))
    return [hold_info(row) for row in rows]


def remove_orphaned_holds(session: Session, epoch: int, open_feeds: Callable[[], Collection_[str]]) -> list[HoldInfo]:
    """Delete the holds whose owner is gone, and let their collections' sinces follow;
    returns them. Gone: a dataflow's export dropped; a feed of an epoch before `epoch`
    (the current controller's), or of `epoch` and not among `open_feeds()`.

    `open_feeds` is asked after the holds are read, and a feed registers its holder
    before it takes its hold and forgets it only once done with it: so a hold read here
    whose feed is not among the open ones belongs to a feed already closed, never to
    one just opening."""
    dropped = select(Collection.id).where(Collection.dropped.is_(True))
    candidates = list(
        session.scalars(
            select(ReadHold).where(
                ((ReadHold.owner == "dataflow") & ReadHold.owner_collection.in_(dropped))
                | ((ReadHold.owner == "feed") & (ReadHold.owner_epoch <= epoch))
            )
        )
    )
    if not candidates:
        return []
    open_now = set(open_feeds())
    orphans = [
        hold for hold in candidates if hold.owner == "dataflow" or hold.owner_epoch < epoch or hold.holder not in open_now
    ]
    removed = [hold_info(hold) for hold in orphans]
    for id in sorted({hold.collection_id for hold in orphans}):
        row = storage_row(session, id, lock=True)
        for hold in orphans:
            if hold.collection_id == id:
                session.delete(hold)
        session.flush()
        _advance_since(session, row)
    return removed


# --- Garbage --------------------------------------------------------------------------


def referenced_paths(session: Session) -> set[str]:
    """Every path a manifest row or a retired-file row names."""
    live = session.scalars(select(Batch.path)).all()
    retired = session.scalars(select(RetiredBlob.path)).all()
    return set(live) | set(retired)


def is_referenced(session: Session, path: str) -> bool:
    """True iff a manifest row or a retired-file row names `path`."""
    live = session.scalars(select(Batch.id).where(Batch.path == path).limit(1)).first()
    return live is not None or session.get(RetiredBlob, path) is not None


def retired_paths(session: Session, retired_before_ms: int) -> list[str]:
    return list(
        session.scalars(
            select(RetiredBlob.path)
            .where(RetiredBlob.retired_at_ms < retired_before_ms)
            .order_by(RetiredBlob.path)
        )
    )


def forget_retired(session: Session, paths: Sequence[str]) -> None:
    if paths:
        session.execute(delete(RetiredBlob).where(RetiredBlob.path.in_(list(paths))))
