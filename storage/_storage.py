"""`Storage`: durable timestamped collections (DESIGN section 3).

Rules of this module:
- A batch holds the user columns plus `_time` and `_diff`, under the blob location
  (`_location.py`): a Parquet file `<collection id>/<uuid>.parquet` that storage writes,
  or a directory `<collection id>/<uuid>/` of part files that Spark writes
  (`reserve_batch`, then `commit_batch`). Its manifest row lives in the catalog, with the
  path relative to the blob location. Every reader (the pyarrow helpers here, compaction,
  Spark) reads a directory batch's data files and skips its hidden ones.
- compare_and_append writes (and fsyncs) its file first, then commits the manifest row
  and the new upper in one transaction, only if the upper still equals the expected one.
  `commit_batch` does the same for a directory already written, after checking its
  Parquet footers against the collection's file schema. A definite refusal (a catalog
  error raised before commit) removes the writer's own file or directory; any other
  failure leaves it for `collect_garbage`, because the commit may have happened. So no
  batch is ever lost or recorded twice.
- Data is checked against the schema before anything is written (`_rows.py`).
- Reads are planned from one consistent snapshot of the manifest: a `ReadPlan` lists the
  batches and the `_time` bounds a reader (Spark, or the pyarrow helpers here) needs.
- Files are only ever deleted by the loser of an append (its own batch), by
  `discard_batch` (a directory never committed) and by `collect_garbage`: retired batches
  (compacted or dropped) and orphans (written, never committed), each only once older
  than a grace period, so in-flight appends and readers holding an older plan are safe.
  Hence the invariant readers keep: **a reader must finish with a plan within the grace
  period** (replicas refresh their plans well within it); a plan older than that may
  name files that are gone.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from catalog import (
    Catalog,
    CatalogError,
    CollectionInfo,
    CompactedAway,
    FailedPrecondition,
    HoldOwner,
    InvalidArgument,
    ManifestState,
    NewBatch,
    NotFound,
    UpperMismatch,
    check_append_frontiers,
)
from history import Frontier
from storage._consolidate import changes_of, consolidate, snapshot_of
from storage._footers import describe_directory_batch
from storage._location import DIRECTORY_BATCH_PATH, BlobLocation
from storage._rows import DIFF, TIME, Rows, file_schema, to_batch
from storage._schema import normalize_ddl, parse_schema

DEFAULT_GRACE_MS = 15 * 60 * 1000
"""How old an unreferenced batch must be before `collect_garbage` deletes it, and how
long a retired one stays. An append must commit within this time of writing its file
(a directory batch, of its last write), and a reader must be done with a plan within it."""

COMPACTION_SIZE_RATIO = 2
"""Compaction merges an older batch into the newer ones below since only while it holds
at most this many times their rows: folding a few small batches into a large one would
rewrite the whole collection to merge what changed (TPC-H's 600,000-row lineitem was
rewritten at the second 1,000-row change and every seventh after, and every replica
rebuilt the persisted base its joins read). Batch sizes then fall geometrically from
the oldest to the newest, as in a log-structured merge tree: a collection of n rows
keeps O(log n) batches below since, and each row is rewritten O(log n) times."""


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """What a reader needs to read one collection: its batches and the updates to keep
    from them, `time_after < _time <= time_through` (`time_after` None: no lower bound).
    Reading the batches, filtering on `_time` and summing `_diff` per row gives the
    snapshot or the changes.

    `paths` are the batches as paths on `Storage.filesystem` (absolute paths for a local
    location) and `uris` the same batches as URIs for Spark (`spark.read.parquet(*uris)`).
    A batch ending in `/` is a directory of part files (see `Storage.batch_files`).
    `since` and `upper` are the collection's frontiers when the plan was made. A plan is
    good for the grace period of garbage collection (`DEFAULT_GRACE_MS`): later, files it
    names may be gone.
    """

    collection_id: str
    schema: str
    paths: tuple[str, ...]
    uris: tuple[str, ...]
    time_after: int | None
    time_through: int
    since: Frontier
    upper: Frontier

    @property
    def file_ddl(self) -> str:
        """The Spark DDL of the files: the schema plus `_time` and `_diff`."""
        return f"{self.schema}, {TIME} BIGINT NOT NULL, {DIFF} BIGINT NOT NULL"

    @property
    def time_filter(self) -> str:
        """The `_time` condition as Spark SQL."""
        through = f"{TIME} <= {self.time_through}"
        return through if self.time_after is None else f"{TIME} > {self.time_after} AND {through}"


@dataclass(frozen=True, slots=True)
class GarbageReport:
    """What `collect_garbage` deleted: retired batches and orphans (relative paths; a
    directory batch ends in `/`)."""

    retired: tuple[str, ...]
    orphans: tuple[str, ...]


class Storage:
    """Storage collections over a catalog and a blob location. Thread-safe.

    `blob_location` is a local directory (a path, or `file:///abs/dir`), created if
    missing, or `s3://bucket/prefix` (see `_location.py`); an unusable one raises
    `InvalidArgument` naming it. Through a controller's catalog every write is fenced by
    its epoch. Through a catalog that never became controller (a replica's), only
    compare_and_append, the directory batches' calls and reads are possible, guarded by
    the upper check alone. `fsync=False` skips the fsyncs of local batch files (for
    throwaway data only: a crash may then lose a committed batch's file).
    """

    def __init__(
        self, catalog: Catalog, blob_location: str | os.PathLike[str], *, fsync: bool = True
    ) -> None:
        self._catalog = catalog
        self._location = BlobLocation.open(blob_location)
        self._fsync = fsync
        self._schemas: dict[str, pa.Schema] = {}
        self._lock = threading.Lock()

    @property
    def catalog(self) -> Catalog:
        return self._catalog

    @property
    def blob_uri(self) -> str:
        """The blob location, normalized: `file:///abs/dir` or `s3://bucket/prefix`."""
        return self._location.uri

    @property
    def filesystem(self) -> pafs.FileSystem:
        """The pyarrow filesystem of the blob location (for Parquet footers, say)."""
        return self._location.filesystem

    def fs_path(self, relative_path: str) -> str:
        """A path relative to the blob location, as a path on `filesystem`."""
        return self._location.fs_path(relative_path)

    def spark_uri(self, relative_path: str) -> str:
        """A path relative to the blob location, as the URI Spark's Hadoop filesystem
        reads: `file:/abs/dir/u5/....parquet` locally, `s3a://bucket/prefix/...` for S3."""
        return self._location.spark_uri(relative_path)

    def batch_files(self, path: str) -> list[str]:
        """The Parquet files holding the batch at `path` (as in `ReadPlan.paths`): the
        file itself, or a directory batch's `*.parquet` files whose names start with
        neither `_` nor `.`."""
        return self._location.batch_files(path)

    # --- Collections ------------------------------------------------------------------

    def create_source(
        self, name: str, schema: str, *, since: Frontier = Frontier.minimum(), holders: Sequence[str] = ()
    ) -> CollectionInfo:
        """A new source, held at `since` by each of `holders` from its creation; `schema`
        (Spark DDL) is checked and stored in normal form."""
        return self._catalog.create_source(name, normalize_ddl(schema), since=since, holders=holders)

    def schema(self, id: str) -> pa.Schema:
        """The Arrow schema of storage collection `id` (schemas never change)."""
        with self._lock:
            cached = self._schemas.get(id)
        if cached is None:
            info = self._catalog.get_collection(id)
            if info.namespace != "storage":
                raise InvalidArgument(f"{id} ({info.name}) is an index, not a storage collection")
            cached = parse_schema(info.schema)
            with self._lock:
                self._schemas[id] = cached
        return cached

    def upper(self, id: str) -> Frontier:
        return self._live(id).upper

    def since(self, id: str) -> Frontier:
        return self._live(id).since

    def _live(self, id: str) -> CollectionInfo:
        info = self._catalog.get_collection(id)
        if info.dropped:
            raise NotFound(f"collection {id} ({info.name}) was dropped")
        if info.namespace != "storage":
            raise InvalidArgument(f"{id} ({info.name}) is an index, not a storage collection")
        return info

    # --- Writes -----------------------------------------------------------------------

    def compare_and_append(
        self,
        id: str,
        expected_upper: Frontier,
        new_upper: Frontier,
        data: pa.Table | Rows | None = None,
    ) -> CollectionInfo:
        """Append `data` at times in `[expected_upper, new_upper)` and move the upper to
        `new_upper`, if the upper is still `expected_upper`; else `UpperMismatch` with
        the current upper, and nothing is written. Without data (or with no rows) it
        only advances the upper.

        `data` holds the schema's columns, optionally `_time` (default: expected_upper;
        each must lie in `[expected_upper, new_upper)`) and `_diff` (default +1).
        """
        check_append_frontiers(id, expected_upper, new_upper)
        batch = None
        if data is not None:
            batch = to_batch(data, self.schema(id), default_time=expected_upper.time)
            self._check_times(id, batch, expected_upper, new_upper)
        current = self.upper(id)
        if current != expected_upper:  # lost already: do not write a file for nothing
            raise UpperMismatch(id, expected_upper, current)
        written = self._write(id, batch) if batch is not None and batch.num_rows else None
        return self._commit(id, expected_upper, new_upper, written)

    def append(self, id: str, data: pa.Table | Rows, ts: int | None = None) -> int:
        """Append `data` at timestamp `ts` (default: a new write timestamp from the
        oracle, which needs the controller's catalog) and return `ts`. Rows may carry
        `_diff` (default +1; -1 retracts) but not `_time`. Retries while other writers
        move the upper, as long as it stays at or below `ts`."""
        batch = to_batch(data, self.schema(id), default_time=0, allow_time=False)
        if ts is None:
            ts = self._catalog.write_ts()
        if type(ts) is not int or ts < 0:
            raise InvalidArgument(f"ts must be a non-negative int, not {ts!r}")
        batch = batch.set_column(
            batch.schema.get_field_index(TIME), TIME, pa.array([ts] * batch.num_rows, pa.int64())
        )
        written = self._write(id, batch) if batch.num_rows else None
        try:
            while True:
                current = self.upper(id)
                if current.is_empty or current.time > ts:
                    raise InvalidArgument(
                        f"cannot append to {id} at {ts}: its upper is already "
                        f"{'closed' if current.is_empty else current.time}"
                    )
                try:
                    self._catalog.append_batch(id, current, Frontier(ts + 1), written)
                    return ts
                except UpperMismatch:
                    continue
        except CatalogError:
            self._remove(written)
            raise

    def append_batch_of(self, id: str, data: pa.Table | Rows) -> pa.Table:
        """`data` checked against collection `id`'s schema and shaped as an append's
        batch, its time not set yet (`append_group` sets it); InvalidArgument naming
        what does not fit, and nothing written."""
        return to_batch(data, self.schema(id), default_time=0, allow_time=False)

    def append_group(
        self, appends: Sequence[tuple[str, pa.Table]], keys: Sequence[str | None] = ()
    ) -> tuple[int, dict[str, tuple[str, int]]]:
        """Append each of `appends` (batches from `append_batch_of`, several perhaps of
        one source) at one new write timestamp, which moves every other source's upper
        past it too; return the timestamp, and the idempotency keys (`keys[i]` is
        appends[i]'s, or None) committed before, with their sources and timestamps:
        those appends are not written again. One file per source and one catalog
        transaction (`Catalog.append_group`): all of them are appended or none is, and
        each source's rows share one time. A refused group removes its files; one cut
        short by a crash leaves them for garbage collection."""
        keyed = list(keys) or [None] * len(appends)
        if len(keyed) != len(appends):
            raise ValueError(f"{len(keyed)} keys for {len(appends)} appends")
        written: list[NewBatch] = []

        def write(ts: int, earlier: Collection[str]) -> dict[str, NewBatch | None]:
            grouped: dict[str, list[pa.Table]] = {}
            for i, (id, batch) in enumerate(appends):
                if keyed[i] not in earlier:
                    grouped.setdefault(id, []).append(batch)
            files: dict[str, NewBatch | None] = {}
            for id, batches in grouped.items():
                batch = pa.concat_tables(batches)
                files[id] = None
                if batch.num_rows:
                    batch = batch.set_column(batch.schema.get_field_index(TIME), TIME, pa.array([ts] * batch.num_rows, pa.int64()))
                    written.append(self._write(id, batch))
                    files[id] = written[-1]
            return files

        try:
            return self._catalog.append_group(write, {key: appends[i][0] for i, key in enumerate(keyed) if key is not None})
        except CatalogError:
            for batch in written:
                self._remove(batch)
            raise

    def _check_times(self, id: str, batch: pa.Table, lower: Frontier, upper: Frontier) -> None:
        times = batch[TIME]
        outside = pc.less(times, lower.time)
        if not upper.is_empty:
            outside = pc.or_(outside, pc.greater_equal(times, upper.time))
        if batch.num_rows and pc.any(outside).as_py():
            index = pc.index(outside, True).as_py()
            bound = "" if upper.is_empty else str(upper.time)
            raise InvalidArgument(
                f"row index {index}: _time {times[index].as_py()} of {id} lies outside "
                f"[{lower.time}, {bound or '...'})"
            )

    def _write(self, id: str, batch: pa.Table) -> NewBatch:
        """Write `batch` to a new file (durably) and describe it."""
        relative = f"{id}/{uuid.uuid4().hex}.parquet"
        size = self._location.write_file(relative, batch, fsync=self._fsync)
        return NewBatch(relative, batch.num_rows, size)

    def _commit(
        self, id: str, expected_upper: Frontier, new_upper: Frontier, written: NewBatch | None
    ) -> CollectionInfo:
        try:
            return self._catalog.append_batch(id, expected_upper, new_upper, written)
        except CatalogError:  # refused before commit: the file is ours alone
            self._remove(written)
            raise

    def _remove(self, written: NewBatch | None) -> None:
        if written is not None:
            self._location.remove(written.path)

    # --- Directory batches, written by Spark ---------------------------------------------

    def reserve_batch(self, id: str) -> tuple[str, str]:
        """A fresh location for a directory batch of storage collection `id`:
        `(relative path, Spark URI)`, e.g. `("u5/<uuid>/", "file:/blobs/u5/<uuid>/")`.
        Nothing is created: the writer (Spark) creates the directory, then calls
        `commit_batch`, or `discard_batch` if it gives up. It must commit within the
        grace period of its last write, or `collect_garbage` takes it for an orphan."""
        self._live(id)
        relative = f"{id}/{uuid.uuid4().hex}/"
        return relative, self._location.spark_uri(relative)

    def commit_batch(
        self, id: str, expected_upper: Frontier, new_upper: Frontier, relative_path: str
    ) -> CollectionInfo:
        """Compare-and-append of the directory batch `relative_path` (from
        `reserve_batch(id)`), already written: if the upper of `id` is still
        `expected_upper`, record the batch (covering `[expected_upper, new_upper)`) and
        move the upper to `new_upper`; else `UpperMismatch` with the current upper.

        Only the Parquet footers are read: they give the rows and bytes, and must show
        the collection's file schema (user columns, `_time`, `_diff`, nullability
        aside), `_time` within the range, no nulls in a NOT NULL column, and nothing but
        data files besides hidden ones; otherwise InvalidArgument. (Spark must write
        timestamps as TIMESTAMP_MICROS: `spark.sql.parquet.outputTimestampType`.) A
        directory without rows only moves the upper.

        Whenever the directory does not end up in the manifest (no rows, a bad batch, a
        definite refusal) it is removed before this returns or raises, so the loser of a
        race deletes only its own files; a directory some manifest row names (a retried
        commit that had gone through) is never removed. After any other failure the
        commit may have happened: the directory stays, for `collect_garbage` if not.
        """
        if not (
            isinstance(relative_path, str)
            and DIRECTORY_BATCH_PATH.match(relative_path)
            and relative_path.startswith(f"{id}/")
        ):
            raise InvalidArgument(
                f"{relative_path!r} is not a directory batch of {id}: commit a path from "
                f"reserve_batch({id!r})"
            )
        try:
            check_append_frontiers(id, expected_upper, new_upper)
            current = self.upper(id)
            if current != expected_upper:  # lost already: do not read the footers
                raise UpperMismatch(id, expected_upper, current)
            schema = file_schema(self.schema(id))
            batch = describe_directory_batch(
                self._location, relative_path, schema, expected_upper, new_upper
            )
            if batch is not None and self._fsync:
                self._location.sync_batch_directory(relative_path, batch.files)
            committed = self._catalog.append_batch(
                id, expected_upper, new_upper, None if batch is None else batch.new_batch
            )
        except CatalogError:  # refused before commit: the directory is the writer's alone
            self._discard_unless_referenced(relative_path)
            raise
        if batch is None:
            self._location.remove(relative_path)  # no rows: no manifest row names it
        return committed

    def discard_batch(self, relative_path: str) -> None:
        """Remove a directory batch that was reserved (and maybe written) but will not be
        committed. Idempotent. FailedPrecondition if a manifest row names it: a
        committed batch goes only through compaction or a drop, then garbage
        collection."""
        if not isinstance(relative_path, str) or not DIRECTORY_BATCH_PATH.match(relative_path):
            raise InvalidArgument(
                f"{relative_path!r} is not a directory batch path (u<n>/<uuid>/)"
            )
        if self._catalog.is_referenced(relative_path):
            raise FailedPrecondition(f"{relative_path} is a committed batch; it is not discarded")
        self._location.remove(relative_path)

    def _discard_unless_referenced(self, relative_path: str) -> None:
        if not self._catalog.is_referenced(relative_path):
            self._location.remove(relative_path)

    # --- Reads ------------------------------------------------------------------------

    def snapshot(self, id: str, t: int) -> ReadPlan:
        """The plan to read `id` as of time `t`: updates with `_time <= t`. Refused if
        `t < since` (compacted away) or `t >= upper` (not complete yet)."""
        state = self._catalog.manifest(id)
        self._check_readable(state, t, "read")
        return self._plan(state, None, t)

    def changes(self, id: str, a: int, b: int) -> ReadPlan:
        """The plan to read the updates of `id` in `(a, b]`. Needs `since <= a + 1` and
        `a <= b < upper`: compaction stamps merged updates below since at times below
        since, so the changes after `since - 1` are intact (a reader that has loaded
        everything below its own hold can go on)."""
        if type(a) is not int or type(b) is not int or a > b:
            raise InvalidArgument(f"changes of {id} need ints a <= b, not ({a!r}, {b!r})")
        state = self._catalog.manifest(id)
        self._check_readable(state, a + 1 if a < b else b, "read changes of")
        self._check_readable(state, b, "read changes of")
        return self._plan(state, a, b)

    def _check_readable(self, state: ManifestState, t: int, verb: str) -> None:
        info = state.collection
        if type(t) is not int or t < 0:
            raise InvalidArgument(f"a time must be a non-negative int, not {t!r}")
        if t < info.since.time:
            raise CompactedAway(
                f"cannot {verb} {info.id} ({info.name}) at {t}: its since is {info.since.time}, "
                f"so times before it were compacted away"
            )
        if not info.upper.is_complete(t):
            raise FailedPrecondition(
                f"cannot {verb} {info.id} ({info.name}) at {t} yet: its upper is "
                f"{info.upper.time} (only times below the upper are complete)"
            )

    def _plan(self, state: ManifestState, after: int | None, through: int) -> ReadPlan:
        info = state.collection
        batches = [b.path for b in state.batches if b.overlaps(after, through)]
        return ReadPlan(
            collection_id=info.id,
            schema=info.schema,
            paths=tuple(self._location.fs_path(path) for path in batches),
            uris=tuple(self._location.spark_uri(path) for path in batches),
            time_after=after,
            time_through=through,
            since=info.since,
            upper=info.upper,
        )

    def read_updates(self, plan: ReadPlan) -> pa.Table:
        """The raw updates a plan selects (user columns, `_time`, `_diff`)."""
        schema = file_schema(self.schema(plan.collection_id))
        tables = [self._location.read_batch(path, schema) for path in plan.paths]
        table = pa.concat_tables(tables) if tables else schema.empty_table()
        keep = pc.less_equal(table[TIME], plan.time_through)
        if plan.time_after is not None:
            keep = pc.and_(keep, pc.greater(table[TIME], plan.time_after))
        return table.filter(keep)

    def read_snapshot(self, id: str, t: int) -> pa.Table:
        """The contents of `id` at time `t`: one row per unit of net count, sorted on
        all columns. `NegativeCount` if some row's count is below zero."""
        plan = self.snapshot(id, t)
        keys = self.schema(id).names
        return snapshot_of(self.read_updates(plan), keys, f"{id} at {t}").cast(self.schema(id))

    def read_changes(self, id: str, a: int, b: int) -> pa.Table:
        """The updates of `id` in `(a, b]`, consolidated per row and time (zero sums
        dropped), sorted by `_time` then the row; columns: the schema, `_time`, `_diff`."""
        plan = self.changes(id, a, b)
        return changes_of(self.read_updates(plan), self.schema(id).names)

    # --- Read holds, compaction, garbage ----------------------------------------------

    def acquire_read_hold(
        self, id: str, holder: str, frontier: Frontier, owner: HoldOwner = HoldOwner.caller()
    ) -> Frontier:
        """Hold `id` readable at `frontier` and later for `holder`, on behalf of `owner`
        (by default the caller, who must release it: see `catalog.HoldOwner`); returns
        the since."""
        return self._catalog.acquire_read_hold(id, holder, frontier, owner).since

    def downgrade_read_hold(self, id: str, holder: str, frontier: Frontier) -> Frontier:
        """Move `holder`'s hold forward (empty: release); returns the since."""
        return self._catalog.downgrade_read_hold(id, holder, frontier).since

    def release_read_hold(self, id: str, holder: str) -> Frontier:
        return self._catalog.release_read_hold(id, holder).since

    def compact(self, id: str, *, min_batches: int = 2) -> int:
        """If at least `min_batches` (>= 2) batches lie wholly below since, rewrite the
        newest of them worth merging (`merge_run`: the newest, and each older one not
        much larger than those after it), when that is two or more, as one consolidated
        batch file stamped at the last time it covers. Returns how many batches it
        replaced (0: nothing to do or a concurrent compaction won). Reads at or above
        since see the same data. The replaced batches are retired, not deleted (see
        `collect_garbage`). Needs the controller's catalog (fenced)."""
        if type(min_batches) is not int or min_batches < 2:
            raise InvalidArgument(f"min_batches must be an int >= 2, not {min_batches!r}")
        self._catalog.check_epoch()
        state = self._catalog.manifest(id)
        since = state.collection.since
        below = [b for b in state.batches if b.upper <= since]
        if len(below) < min_batches:
            return 0
        old = merge_run(below)
        if len(old) < 2:
            return 0
        schema = self.schema(id)
        last = old[-1].upper.time - 1
        updates = pa.concat_tables(
            self._location.read_batch(self._location.fs_path(b.path), file_schema(schema))
            for b in old
        )
        merged = consolidate(updates, schema.names)
        merged = merged.append_column(TIME, pa.array([last] * merged.num_rows, pa.int64()))
        merged = merged.select([*schema.names, TIME, DIFF]).cast(file_schema(schema))
        written = self._write(id, merged) if merged.num_rows else None
        try:
            replaced = self._catalog.replace_batches(id, old, written)
        except CatalogError:
            self._remove(written)
            raise
        if not replaced:
            self._remove(written)
            return 0
        return len(old)

    def collect_garbage(self, grace_ms: int = DEFAULT_GRACE_MS) -> GarbageReport:
        """Delete the batches retired more than `grace_ms` ago, and orphan batches (named
        by no manifest row; a directory whole) last modified more than `grace_ms` ago.
        Nothing but batch-shaped paths is ever deleted (`_location.py`). Needs the
        controller's catalog (fenced)."""
        if type(grace_ms) is not int or grace_ms < 0:
            raise InvalidArgument(f"grace_ms must be a non-negative int, not {grace_ms!r}")
        retired = self._catalog.retired_paths(self._catalog.now_ms() - grace_ms)
        self._catalog.forget_retired(retired)  # fenced; a crash after it leaves orphans
        for path in retired:
            self._location.remove(path)
        gone = set(retired)
        candidates = [path for path in self._location.batch_paths() if path not in gone]
        # Read after the listing: a batch committed since is named here, so it stays.
        referenced = self._catalog.referenced_paths()
        cutoff_ns = time.time_ns() - grace_ms * 1_000_000
        orphans = []
        for path in candidates:
            if path in referenced:
                continue
            modified = self._location.modified_ns(path)
            if modified is not None and modified < cutoff_ns:
                self._location.remove(path)
                orphans.append(path)
        return GarbageReport(tuple(retired), tuple(orphans))


class _Counted(Protocol):
    rows: int


_Batch = TypeVar("_Batch", bound=_Counted)


def merge_run(batches: Sequence[_Batch]) -> list[_Batch]:
    """The newest of `batches` (contiguous, oldest first) worth merging: the newest one,
    then, walking back, each older batch holding at most COMPACTION_SIZE_RATIO times the
    rows of those taken so far (at least one row: empty batches do not stop it). Replicas
    keep the batches older than it in persisted bases (`dataplane._reader`)."""
    run = list(batches[-1:])
    rows = sum(b.rows for b in run)
    for batch in reversed(batches[:-1]):
        if batch.rows > COMPACTION_SIZE_RATIO * max(rows, 1):
            break
        run.insert(0, batch)
        rows += batch.rows
    return run
