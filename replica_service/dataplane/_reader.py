"""Storage collections as this replica's Spark reads them.

One `StorageReader` per storage collection per replica, shared by every dataflow that
imports it. It knows the collection's batches from the manifest (paths and time ranges,
plus what the Parquet footers say of `_time` and `_diff`) and hands out DataFrames over
the batch files: Spark's executors read them; no row passes through this process, but
for one bounded exception. A change spread over many small batches (a stream of
appends, each a batch of its own) is read here, with pyarrow, and handed to Spark as
one in-memory relation (`DRIVER_READ_MIN_BATCHES`, `DRIVER_READ_MAX_ROWS`): Spark pays
for every file it reads (listing, a footer, a split), so a step's read of a change
would cost what the number of appends does, not its rows.

Rules:
- Updates are read unconsolidated (user columns, `_time`, `_diff`), filtered by time.
  Consolidation (summing `_diff` per row) happens in Spark where a step needs whole rows
  (`snapshot`); a negative count fails the Spark job with an error naming the collection,
  the time and the row. Only batches with retractions need it: rows that no retraction
  touches pass as they are (`snapshot`), so a few retractions in a large collection cost
  a broadcast of them, not a shuffle of the collection.
- A read at `t` needs `since <= t < upper` (the controller's holds guarantee it); a read
  of the changes in `(a, b]` needs `since <= a + 1`. A read below the since is
  `CompactedAway` (the times are gone: the reader's dataflow needs a new session); one
  at or past the upper a `FailedPrecondition` (the caller retries: it is a moment, not
  the data).
- A plan is used within seconds of its manifest read. The persisted base and a shared
  snapshot outlive steps, but only while the batches they read are the collection's
  current ones: their files are not collected.
- A step reads the base and shared snapshots under a `Lease`, released once its jobs
  have run. One of them retired meanwhile (displaced, compacted away, closed) is
  unpersisted only then: a query planned over persisted rows that are unpersisted
  before it runs builds their blocks again, owned by nothing, until the JVM happens to
  collect its RDD.
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from catalog import CompactedAway, FailedPrecondition, ManifestTail
from history import Frontier
from storage import DIFF, TIME, Storage, file_schema, merge_run
from replica_service.dataplane._jvm import in_session
from replica_service.dataplane._rows import arrow_frame, consolidate, expand, normalized, patch, spark_ddl

BASE_MAX_TAIL = 16
"""A persisted base is rebuilt when this many newer batches are read beside it."""

DRIVER_READ_MIN_BATCHES = 8
DRIVER_READ_MAX_ROWS = 100_000
"""A read of the changes after a time spread over more than `DRIVER_READ_MIN_BATCHES`
batches holding at most `DRIVER_READ_MAX_ROWS` updates in all is read by this process
(pyarrow) and given to Spark as one relation: Spark's read of 50 one-append files took
about 300 ms against 110 ms for one, 720 ms for 500 (local files, 2026-12-07), where
pyarrow reads one in a fraction of a millisecond. The rows are the same either way, and
the relation's partitions (`createDataFrame` cuts it by row count, an instance setting)
change no result (DESIGN section 10, path independence)."""

PATCH_MAX_ROWS = 200_000
"""A snapshot patches the rows of the batches without retractions with the others'
consolidated updates when those hold at most this many rows (they are broadcast to
every task) and fewer than the rows they patch; else it consolidates everything."""


@dataclass(frozen=True, slots=True)
class BatchFile:
    """A manifest batch as read: where Spark finds it, the distinct times it holds,
    whether every `_diff` in it is positive (no retraction, so rows need no
    consolidation), and how many updates it holds."""

    lower: int
    upper: Frontier
    uri: str
    times: tuple[int, ...]
    positive: bool
    rows: int
    path: str | None = None  # in storage (None: a made-up batch, `rehearsal_batch`)


@dataclass(slots=True)
class _Kept:
    """Persisted rows a reader keeps for many steps (a subclass's `frame`), and how many
    leases hold them. Once retired (no longer the reader's) they are unpersisted as soon
    as no lease holds them. Guarded by the reader's lock, under which they are also
    unpersisted: a lease taken after the retirement finds them unpersisted already, so
    nothing it plans can read them from Spark's cache."""

    holders: int = field(default=0, kw_only=True)
    retired: bool = field(default=False, kw_only=True)

    def retire(self) -> None:
        self.retired = True
        self._unpersist_if_free()

    def let_go(self) -> None:
        self.holders -= 1
        self._unpersist_if_free()

    def _unpersist_if_free(self) -> None:
        if self.retired and self.holders == 0 and self.frame is not None:
            self.frame.unpersist()


@dataclass(slots=True)
class _Base(_Kept):
    """A persisted DataFrame of every update through `through` (a cache: reads are
    correct without it)."""

    through: int
    frame: DataFrame
    batches: tuple[str, ...]  # the uris it covers


class _SnapshotKey(NamedTuple):
    """What a snapshot's rows depend on (`_snapshot_key`)."""

    uris: tuple[str, ...]
    cut: int | None


@dataclass(slots=True)
class _Shared(_Kept):
    """The newest snapshot asked for under a lease (`_snapshot_key`): the latest time it
    was asked at, how many asks it had, and its rows persisted once that is worth it (a
    cache: reads are correct without it). Retired when a newer snapshot displaces it,
    when its batches stop being the collection's (`refresh`: compacted), or at `close`."""

    key: _SnapshotKey
    newest: int
    asks: int = 1
    frame: DataFrame | None = None
    building: threading.Lock = field(default_factory=threading.Lock)


class Lease:
    """The persisted rows (bases, shared snapshots) one step's plans read. While it
    holds them, no reader unpersists them; `release` (once the step's jobs have run, or
    it was abandoned) lets go of them all, and unpersists those retired meanwhile.
    Thread-safe; releasing twice is harmless."""

    def __init__(self) -> None:
        self._held: list[tuple[StorageReader, _Kept]] = []
        self._lock = threading.Lock()

    def _hold(self, reader: StorageReader, kept: _Kept) -> None:
        """Called under `reader`'s lock, `kept` not retired."""
        kept.holders += 1
        with self._lock:
            self._held.append((reader, kept))

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        for reader, kept in held:
            reader._let_go(kept)


class StorageReader:
    """Thread-safe: dataflow steps read it concurrently; `refresh` replaces the batch list
    atomically."""

    def __init__(self, storage: Storage, id: str) -> None:
        self.storage = storage
        self.id = id
        self.schema = storage.schema(id)
        self.columns = tuple(self.schema.names)
        self.file_ddl = f"{spark_ddl(self.schema)}, {TIME} BIGINT, {DIFF} BIGINT"
        self.since = Frontier.minimum()
        self.upper = Frontier.minimum()
        self._batches: tuple[BatchFile, ...] = ()
        self._known: dict[str, BatchFile] = {}  # by uri: batch files never change
        self._lock = threading.Lock()
        self._refreshing = threading.Lock()  # taken before `_lock`, never under it
        self._base_planning = threading.Lock()  # likewise
        self._base: _Base | None = None
        self._shared: _Shared | None = None
        self._closed = False  # no base or shared snapshot is kept any more
        self.refreshed_at: float | None = None  # when its manifest was last read (monotonic)

    # --- The manifest --------------------------------------------------------------------

    def refresh(self, session: SparkSession) -> None:
        """Read the manifest again (blocking): new batches, compactions, the frontiers.
        Only what changed since the last read comes from the catalog (`manifest_tail`),
        so refreshes of one reader take turns."""
        with self._refreshing:
            read_at = time.monotonic()
            with self._lock:
                known, upper = self._batches, self.upper
            tail: ManifestTail = self.storage.catalog.manifest_tail(self.id, None if upper.is_empty else upper.time, len(known))
            read = tuple(self._batch(session, b.lower, b.upper, b.path, b.rows) for b in tail.batches)
            batches = read if tail.whole else known + read
            with self._lock:
                self._batches = batches
                self.since, self.upper = tail.collection.since, tail.collection.upper
                self.refreshed_at = read_at
                if not tail.whole:  # none went away
                    self._known.update((b.uri, b) for b in read)
                    return
                self._known = {b.uri: b for b in batches}
                if self._shared is not None and not self._known.keys() >= set(self._shared.key.uris):
                    self._shared.retire()  # its batches were compacted away
                    self._shared = None

    def _batch(self, session: SparkSession, lower: int, upper: Frontier, path: str, rows: int) -> BatchFile:
        uri = self.storage.spark_uri(path)
        known = self._known.get(uri)
        if known is not None:
            return known
        times, positive = _footer_summary(self.storage, path)
        if times is None:  # several times in one batch: ask Spark which
            distinct = session.read.schema(self.file_ddl).parquet(uri).select(TIME).distinct().collect()
            times = tuple(sorted(row[0] for row in distinct))
        return BatchFile(lower, upper, uri, times, positive, rows, path)

    def change_times(self, after: int, before: Frontier) -> list[int]:
        """The distinct update times t with `after < t < before`."""
        through = math.inf if before.is_empty else before.time - 1
        with self._lock:
            batches = self._batches
        return sorted({t for b in _overlapping(batches, after, through) for t in b.times if after < t <= through})

    def has_changes(self, after: int, through: int) -> bool:
        return bool(self.change_times(after, Frontier(through + 1)))

    def change_rows(self, after: int | None, through: int) -> int:
        """A bound on the updates in `(after, through]` (through `through` if `after` is
        None): all the updates of the batches that hold any (a batch may hold other
        times too)."""
        with self._lock:
            return sum(b.rows for b in _overlapping(self._batches, after, through))

    def empty_before(self, t: int) -> bool:
        """True when no batch holds an update below `t`: the collection has no rows there
        (a materialized view not written yet, whose since may be its first time)."""
        with self._lock:
            return not any(time < t for b in self._batches for time in b.times)

    # --- DataFrames ----------------------------------------------------------------------

    def updates(
        self, session: SparkSession, through: int, *, after: int | None = None, lease: Lease | None = None, made_up: BatchFile | None = None
    ) -> DataFrame:
        """The updates with `after < _time <= through` (user columns, `_time`, `_diff`),
        unconsolidated; and `made_up`'s, all of them, read with the newest stored ones
        (`rehearsal_batch`). Under a `lease` (for inputs read whole at every step: the
        other sides of a join), the updates through an earlier time come from a
        persisted base shared by every step that asks, held by the lease."""
        with self._lock:
            self._check_readable(after + 1 if after is not None else through, through)
            batches = _overlapping(self._batches, after, through)
            cache = lease is not None and after is None and not self._closed  # a step still running after the close
            base = self._base if cache else None
            rebuild = cache and (base is None or _stale(base, batches, through))
            if base is not None and not rebuild:
                lease._hold(self, base)
        if rebuild:
            base = self._rebuilt_base(session, batches, through, lease)
        extra = [made_up] if made_up is not None else []
        if base is not None:
            frame = in_session(base.frame, session)
            newer = self._read(session, _overlapping(batches, base.through, through) + extra, base.through, through)
            return frame.unionByName(newer) if newer is not None else frame
        frame = self._read(session, batches + extra, after, through)
        return frame if frame is not None else self.empty(session)

    def rehearsal_batch(self, session: SparkSession, directory: Path, rows: int) -> BatchFile | None:
        """A made-up batch for a rehearsal step (`Incremental.rehearse`), which `updates`
        reads beside the stored ones: `rows` rows the newest batch inserted, retracted,
        and as many more inserted again. Its file is written in `directory` once
        (blocking: a Spark job collects the rows); executors must see `directory`, as
        they do on the replica's own machine. None when no batch inserts anything."""
        path = directory / f"{self.id}.parquet"
        if not path.exists():
            with self._lock:
                batches = [b for b in self._batches if b.rows]
            inserted = None
            for batch in reversed(batches):
                read = session.read.schema(self.file_ddl).parquet(batch.uri)
                inserted = read.where(F.col(DIFF) > 0).limit(2 * rows).toArrow()
                if inserted.num_rows:
                    break
            if inserted is None or not inserted.num_rows:
                return None
            retracted = inserted.slice(0, rows)
            retracted = retracted.set_column(retracted.schema.get_field_index(DIFF), DIFF, pc.negate(retracted[DIFF]))
            made_up = pa.concat_tables([retracted, inserted.slice(rows)]).cast(file_schema(self.schema))
            directory.mkdir(parents=True, exist_ok=True)
            written = path.with_suffix(f".{threading.get_ident()}.tmp")  # two steps may write it at once
            pq.write_table(made_up, written)
            written.replace(path)
        # No times: read unfiltered, as a change's batch is (`_read`).
        return BatchFile(0, Frontier.minimum(), str(path), (), False, pq.read_metadata(path).num_rows)

    def empty(self, session: SparkSession) -> DataFrame:
        """No updates, in the files' schema (built in the JVM from an empty Arrow table:
        an empty Python list would start Python workers to read it)."""
        return arrow_frame(session, file_schema(self.schema).empty_table())

    def snapshot(self, session: SparkSession, t: int, *, lease: Lease | None = None) -> DataFrame:
        """The collection's rows at `t`: one row per unit of net count (user columns).
        The batches without retractions need no consolidation, their rows are just
        expanded; the others' updates, when few, patch them (`_rows.patch`: broadcast,
        no shuffle of the collection); else every update is consolidated. Whichever
        way, float columns are `normalized`: the same rows have the same bits.

        Under a `lease` (for dataflows recomputed over whole snapshots), rows asked for
        more than once are computed once: the second ask persists them on the
        executors' disks (the first ask does, when the snapshot before had several), and
        later asks read them, in any session: six TPC-H queries recomputed over one
        lineitem snapshot. The lease holds them. The rows are the same whether persisted
        or not."""
        with self._lock:
            self._check_readable(t, t)
            batches = _overlapping(self._batches, None, t)
            shared = self._ask(_snapshot_key(batches, t), t) if lease is not None and not self._closed else None
        if shared is None:
            return self._snapshot(session, batches, t)
        with shared.building:  # concurrent asks wait for this one's plan, not build a second copy
            if shared.frame is None:
                frame = self._snapshot(session, batches, t).persist(StorageLevel.DISK_ONLY)
                with self._lock:
                    kept = not shared.retired  # else a newer snapshot displaced it meanwhile
                    if kept:
                        shared.frame = frame
                if not kept:
                    frame.unpersist()  # nothing planned over it yet
                    return frame
            with self._lock:
                if not shared.retired:  # else unpersisted already: read as if never kept
                    lease._hold(self, shared)
        return in_session(shared.frame, session)

    def _ask(self, key: _SnapshotKey, t: int) -> _Shared | None:
        """Count an ask for the snapshot `key` at `t` (under the lock), retiring the
        snapshot it displaces. Returns the shared entry when the rows are worth
        persisting: at a second ask of the same rows, or at the first ask after a
        snapshot that had several (the snapshot several dataflows recompute over, at
        each change)."""
        shared = self._shared
        if shared is not None and shared.key == key:
            shared.asks += 1
            shared.newest = max(shared.newest, t)
            return shared
        if shared is not None and t < shared.newest:
            return None  # a step behind the others: read, do not displace the newest
        self._shared = _Shared(key, t)
        if shared is not None:
            shared.retire()
        worth = shared is not None and shared.asks > 1  # else wait for a second ask
        return self._shared if worth else None

    def _snapshot(self, session: SparkSession, batches: list[BatchFile], t: int) -> DataFrame:
        settled = [b for b in batches if b.positive]
        retracting = [b for b in batches if not b.positive]
        what = f"{self.id} at {t}"
        if not retracting:
            frame = self._read(session, settled, None, t)
            return normalized(expand(frame if frame is not None else self.empty(session), self.columns))
        changes = sum(b.rows for b in retracting)
        if settled and changes <= PATCH_MAX_ROWS and changes < sum(b.rows for b in settled):
            rows = patch(self._read(session, settled, None, t), self._read(session, retracting, None, t), self.columns, what)
        else:
            rows = consolidate(self._read(session, batches, None, t), self.columns, what)
        return normalized(expand(rows, self.columns))

    def _read(self, session: SparkSession, batches: list[BatchFile], after: int | None, through: int) -> DataFrame | None:
        if not batches:
            return None
        if after is not None and _read_in_driver(batches):
            return arrow_frame(session, self._changes_table(batches, after, through))
        frame = session.read.schema(self.file_ddl).parquet(*(b.uri for b in batches))
        if _all_within(batches, after, through):
            return frame  # no filter for Spark to evaluate on every row
        keep = F.col(TIME) <= through
        return frame.where(keep if after is None else keep & (F.col(TIME) > after))

    def _changes_table(self, batches: list[BatchFile], after: int, through: int) -> pa.Table:
        """The updates of `batches` with `after < _time <= through`, read here (see
        `DRIVER_READ_MIN_BATCHES`), in the files' schema, every column nullable as
        Spark reads them (a plan's nullability decides its generated code), batch after
        batch."""
        schema = pa.schema([f.with_nullable(True) for f in file_schema(self.schema)])
        files = [file for batch in batches for file in self.storage.batch_files(self.storage.fs_path(batch.path))]
        # One dataset: its files are read on pyarrow's threads, in the order given.
        table = ds.dataset(files, schema=schema, format="parquet", filesystem=self.storage.filesystem).to_table()
        if _all_within(batches, after, through):
            return table
        times = table[TIME]
        return table.filter(pc.and_(pc.greater(times, after), pc.less_equal(times, through)))

    def _rebuilt_base(self, session: SparkSession, batches: list[BatchFile], through: int, lease: Lease) -> _Base | None:
        """A new base for a read through `through` of `batches`, held by `lease`, in
        place of the stale one; None once the reader is closed (read without a base).
        Planned outside the reader lock, as a shared snapshot is: Spark lists the
        batches' files while it plans, which on an object store with many batches takes
        long, and the event loop takes that lock (`change_times`) for its heartbeats
        and peeks. One base is planned at a time; a step that waited for another's
        takes it when it serves its read too."""
        with self._base_planning:
            with self._lock:
                current = self._base
                if self._closed:
                    return None
                if current is not None and not _stale(current, batches, through):
                    lease._hold(self, current)
                    return current
            base = self._new_base(session, batches, through)
            with self._lock:
                if self._closed:
                    base.frame.unpersist()  # lazy: nothing was computed or planned over it
                    return None
                if self._base is not None:
                    self._base.retire()
                self._base = base
                lease._hold(self, base)
                return base

    def _new_base(self, session: SparkSession, batches: list[BatchFile], through: int) -> _Base:
        """A base of the batches compaction will not merge soon: those older than the
        newest ones it would merge together (`merge_run`), which are read beside it.
        Over all of them, a base was rebuilt after most compactions: TPC-H's `lineitem`
        (600,000 rows) every few changes, the q17 and q21 steps that did it taking
        12-18 s where they take 2-8 s. Over all of them still when that would leave
        none, or more than BASE_MAX_TAIL beside it."""
        run = merge_run(batches)
        settled = batches[: len(batches) - len(run)]
        if settled and len(run) <= BASE_MAX_TAIL:
            batches, through = settled, settled[-1].upper.time - 1
        frame = self._read(session, batches, None, through)
        if frame is None:
            frame = self.empty(session)
        frame = frame.persist(StorageLevel.DISK_ONLY)
        return _Base(through, frame, tuple(b.uri for b in batches))

    def _check_readable(self, first: int, last: int) -> None:
        if self.since.is_empty or first < self.since.time:
            since = "[] (closed)" if self.since.is_empty else self.since.time
            raise CompactedAway(f"cannot read {self.id} from time {first}: its since is {since} (compacted away)")
        if not self.upper.is_complete(last):
            raise FailedPrecondition(f"cannot read {self.id} at {last} yet: its upper is {self.upper}")

    def _let_go(self, kept: _Kept) -> None:
        """A lease no longer holds `kept` (`Lease.release`)."""
        with self._lock:
            kept.let_go()

    def close(self) -> None:
        """Retire the base and the shared snapshot (unpersisted once the steps still
        running over them release their leases); later steps keep neither."""
        with self._lock:
            self._closed = True
            for kept in (self._base, self._shared):
                if kept is not None:
                    kept.retire()
            self._base = self._shared = None


def _read_in_driver(batches: list[BatchFile]) -> bool:
    """Whether a change over `batches` is read by this process (`DRIVER_READ_MIN_BATCHES`)."""
    return (
        len(batches) > DRIVER_READ_MIN_BATCHES
        and sum(b.rows for b in batches) <= DRIVER_READ_MAX_ROWS
        and all(b.path is not None for b in batches)
    )


def _all_within(batches: list[BatchFile], after: int | None, through: int) -> bool:
    """Whether every update of `batches` is in `(after, through]`: no filter needed."""
    return all(_within(t, after, through) for b in batches for t in b.times)


def _within(t: int, after: int | None, through: int) -> bool:
    return (after is None or t > after) and t <= through


def _overlapping(batches: Sequence[BatchFile], after: int | None, through: float) -> list[BatchFile]:
    """The `batches` (disjoint, by `lower`, as the manifest orders them) holding an
    update in `(after, through]`: found by bisection on their bounds, then by their
    times. A replica's status asks this of every dataflow's inputs at each heartbeat,
    and a stream of appends leaves thousands of batches above since."""
    start = 0 if after is None else bisect_right(batches, after + 1, key=_upper_bound)  # upper <= after + 1: times <= after
    end = bisect_right(batches, through, key=_lower_bound)
    return [b for b in batches[start:end] if any(_within(t, after, through) for t in b.times)]


def _upper_bound(batch: BatchFile) -> float:
    return math.inf if batch.upper.is_empty else batch.upper.time


def _lower_bound(batch: BatchFile) -> int:
    return batch.lower


def _snapshot_key(batches: list[BatchFile], t: int) -> _SnapshotKey:
    """What a snapshot at `t` of `batches` (those with updates through `t`) depends on:
    their files, and, when one of them holds later updates too, the last update time
    through `t`. So the snapshots of a collection that did not change have one key
    whatever their time."""
    times = [time for b in batches for time in b.times]
    cut = max(time for time in times if time <= t) if any(time > t for time in times) else None
    return _SnapshotKey(tuple(b.uri for b in batches), cut)


def _stale(base: _Base, batches: list[BatchFile], through: int) -> bool:
    """Whether a read through `through` of `batches` (the collection's, through then)
    needs a new base: this one is ahead of it, reads batches compaction has replaced
    (their files will be collected), or has too many newer batches read beside it.
    (It was rebuilt every minute too: rebuilding TPC-H lineitem's base cost the step
    that did it 4.5 s, and an input that does not change needs none.)"""
    if base.through > through or not {b.uri for b in batches}.issuperset(base.batches):
        return True
    return sum(1 for b in batches if b.uri not in base.batches) > BASE_MAX_TAIL


def _footer_summary(storage: Storage, path: str) -> tuple[tuple[int, ...] | None, bool]:
    """From the Parquet footers of a batch (a file, or a directory of part files) alone:
    its one time (None when it holds several) and whether every `_diff` is positive."""
    low = high = None
    positive = True
    for file in storage.batch_files(storage.fs_path(path)):
        metadata = pq.read_metadata(file, filesystem=storage.filesystem)
        names = metadata.schema.names
        time_column, diff_column = names.index(TIME), names.index(DIFF)
        for group in range(metadata.num_row_groups):
            row_group = metadata.row_group(group)
            if row_group.num_rows == 0:
                continue
            times = row_group.column(time_column).statistics
            diffs = row_group.column(diff_column).statistics
            if times is None or not times.has_min_max or diffs is None or not diffs.has_min_max:
                return None, False
            low = times.min if low is None else min(low, times.min)
            high = times.max if high is None else max(high, times.max)
            positive = positive and diffs.min >= 1
    if low is None:
        return (), True
    return ((low,) if low == high else None), positive
