"""`Storage`: durable timestamped collections (DESIGN section 3).

Rules of this module:
- A batch is a Parquet file under the blob directory, named `<collection id>/<uuid>.parquet`
  and holding the user columns plus `_time` and `_diff`; its manifest row lives in the
  catalog, with the path relative to the blob directory.
- compare_and_append writes (and fsyncs) its file first, then commits the manifest row
  and the new upper in one transaction, only if the upper still equals the expected one.
  A definite refusal (a catalog error raised before commit) removes the file; any other
  failure leaves it for `collect_garbage`, because the commit may have happened. So no
  batch is ever lost or recorded twice.
- Data is checked against the schema before anything is written (`_rows.py`).
- Reads are planned from one consistent snapshot of the manifest: a `ReadPlan` lists the
  files and the `_time` bounds a reader (Spark, or the pyarrow helpers here) needs.
- Files are only ever deleted by the loser of an append (its own file) and by
  `collect_garbage`: retired files (compacted or dropped) and orphans (written, never
  committed), each only once older than a grace period, so in-flight appends and readers
  holding an older plan are safe.
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from catalog import (
    Catalog,
    CatalogError,
    CollectionInfo,
    FailedPrecondition,
    InvalidArgument,
    ManifestState,
    NewBatch,
    NotFound,
    UpperMismatch,
    check_append_frontiers,
)
from history import Frontier
from storage._consolidate import changes_of, consolidate, snapshot_of
from storage._rows import DIFF, TIME, Rows, file_schema, to_batch
from storage._schema import normalize_ddl, parse_schema

DEFAULT_GRACE_MS = 15 * 60 * 1000
"""How old an unreferenced file must be before `collect_garbage` deletes it. An append
must commit within this time of writing its file."""

_BLOB = re.compile(r"u\d+/[0-9a-f]{32}\.parquet\Z")


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """What a reader needs to read one collection: the Parquet files (absolute paths)
    and the updates to keep from them, `time_after < _time <= time_through`
    (`time_after` None: no lower bound). Reading the files, filtering on `_time` and
    summing `_diff` per row gives the snapshot or the changes.

    `since` and `upper` are the collection's frontiers when the plan was made.
    """

    collection_id: str
    schema: str
    paths: tuple[str, ...]
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
    """What `collect_garbage` deleted: retired files and orphans (relative paths)."""

    retired: tuple[str, ...]
    orphans: tuple[str, ...]


class Storage:
    """Storage collections over a catalog and a blob directory. Thread-safe.

    Through a controller's catalog every write is fenced by its epoch. Through a
    catalog that never became controller (a replica's), only compare_and_append and
    reads are possible, guarded by the upper check alone. `fsync=False` skips the
    fsyncs of batch files (for throwaway data only: a crash may then lose a committed
    batch's file).
    """

    def __init__(
        self, catalog: Catalog, blob_dir: str | os.PathLike[str], *, fsync: bool = True
    ) -> None:
        self._catalog = catalog
        self._blob_dir = Path(blob_dir).resolve()
        self._blob_dir.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._schemas: dict[str, pa.Schema] = {}
        self._lock = threading.Lock()

    @property
    def catalog(self) -> Catalog:
        return self._catalog

    @property
    def blob_dir(self) -> Path:
        return self._blob_dir

    # --- Collections ------------------------------------------------------------------

    def create_source(
        self, name: str, schema: str, *, since: Frontier = Frontier.minimum()
    ) -> CollectionInfo:
        """A new source; `schema` (Spark DDL) is checked and stored in normal form."""
        return self._catalog.create_source(name, normalize_ddl(schema), since=since)

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
        """Write `batch` to a new file (durably, with fsync) and describe it."""
        relative = f"{id}/{uuid.uuid4().hex}.parquet"
        path = self._blob_dir / relative
        if not path.parent.is_dir():
            path.parent.mkdir(exist_ok=True)
            self._sync_directory(self._blob_dir)
        with open(path, "xb") as file:
            pq.write_table(batch, file)
            if self._fsync:
                file.flush()
                os.fsync(file.fileno())
        self._sync_directory(path.parent)
        return NewBatch(relative, batch.num_rows, path.stat().st_size)

    def _sync_directory(self, directory: Path) -> None:
        """Make the entries of `directory` durable (a new file's name, not only its data)."""
        if self._fsync:
            descriptor = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)

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
            (self._blob_dir / written.path).unlink(missing_ok=True)

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
            raise InvalidArgument(
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
        return ReadPlan(
            collection_id=info.id,
            schema=info.schema,
            paths=tuple(
                str(self._blob_dir / b.path) for b in state.batches if b.overlaps(after, through)
            ),
            time_after=after,
            time_through=through,
            since=info.since,
            upper=info.upper,
        )

    def read_updates(self, plan: ReadPlan) -> pa.Table:
        """The raw updates a plan selects (user columns, `_time`, `_diff`)."""
        schema = file_schema(self.schema(plan.collection_id))
        tables = [pq.read_table(path, schema=schema) for path in plan.paths]
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

    def acquire_read_hold(self, id: str, holder: str, frontier: Frontier) -> Frontier:
        """Hold `id` readable at `frontier` and later for `holder`; returns the since."""
        return self._catalog.acquire_read_hold(id, holder, frontier).since

    def downgrade_read_hold(self, id: str, holder: str, frontier: Frontier) -> Frontier:
        """Move `holder`'s hold forward (empty: release); returns the since."""
        return self._catalog.downgrade_read_hold(id, holder, frontier).since

    def release_read_hold(self, id: str, holder: str) -> Frontier:
        return self._catalog.release_read_hold(id, holder).since

    def compact(self, id: str) -> int:
        """Rewrite the batches wholly below since as one consolidated batch, stamped at
        the last time it covers; returns how many batches it replaced (0: nothing to do
        or a concurrent compaction won). Reads at or above since see the same data.
        Needs the controller's catalog (fenced)."""
        self._catalog.check_epoch()
        state = self._catalog.manifest(id)
        since = state.collection.since
        old = [b for b in state.batches if b.upper <= since]
        if len(old) < 2:
            return 0
        schema = self.schema(id)
        last = old[-1].upper.time - 1
        updates = pa.concat_tables(
            pq.read_table(self._blob_dir / b.path, schema=file_schema(schema)) for b in old
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
        """Delete retired files retired more than `grace_ms` ago, and orphan files (named
        by no manifest row) last modified more than `grace_ms` ago. Needs the
        controller's catalog (fenced)."""
        if type(grace_ms) is not int or grace_ms < 0:
            raise InvalidArgument(f"grace_ms must be a non-negative int, not {grace_ms!r}")
        retired = self._catalog.retired_paths(self._catalog.now_ms() - grace_ms)
        self._catalog.forget_retired(retired)  # fenced; a crash after it leaves orphans
        for path in retired:
            (self._blob_dir / path).unlink(missing_ok=True)
        cutoff, gone = time.time() - grace_ms / 1000, set(retired)
        candidates = [
            relative
            for relative, mtime in self._blob_files()
            if mtime < cutoff and relative not in gone
        ]
        referenced = self._catalog.referenced_paths()
        orphans = [path for path in candidates if path not in referenced]
        for path in orphans:
            (self._blob_dir / path).unlink(missing_ok=True)
        return GarbageReport(tuple(retired), tuple(orphans))

    def _blob_files(self) -> list[tuple[str, float]]:
        """(relative path, mtime) of every batch file under the blob directory."""
        found = []
        for directory in self._blob_dir.iterdir():
            if not directory.is_dir():
                continue
            for entry in os.scandir(directory):
                relative = f"{directory.name}/{entry.name}"
                if _BLOB.match(relative):
                    try:
                        found.append((relative, entry.stat().st_mtime))
                    except FileNotFoundError:
                        continue
        return found
