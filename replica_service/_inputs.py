"""Storage inputs of a dataflow, loaded incrementally into replica memory.

A `StorageTrace` holds the updates of one storage collection from the dataflow's `as_of`
on: first the snapshot at `as_of`, then the changes batch by batch as the collection's
upper advances, so each step reads only new batch files. Snapshots are consolidated and
sorted on all columns (by `storage.snapshot_of`), so Spark sees the same rows in the same
order on every replica.

Invariants: `times` is sorted and holds every distinct update time loaded; `compact`
merges the updates below `since` into one table stamped with the latest of their times,
which changes no snapshot at `t >= since` and adds no change time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from history import Frontier
from storage import DIFF, TIME, Storage, consolidate, file_schema, snapshot_of


_CLOSED = 2**63 - 1  # `loaded_through` of a collection whose upper is empty


@dataclass(slots=True)
class StorageTrace:
    id: str
    schema: pa.Schema  # user columns only
    as_of: int
    loaded_through: int | None = None  # every update at a time <= this is loaded
    updates: list[pa.Table] = field(default_factory=list)  # user columns + _time, _diff
    times: list[int] = field(default_factory=list)

    @property
    def upper(self) -> Frontier:
        """Times below this are loaded and complete."""
        if self.loaded_through is None:
            return Frontier.minimum()
        return Frontier.empty() if self.loaded_through == _CLOSED else Frontier(self.loaded_through + 1)

    def load(self, storage: Storage, upper: Frontier) -> None:
        """Read what the collection completed below `upper` since the last load
        (blocking)."""
        through = _CLOSED if upper.is_empty else upper.time - 1
        if self.loaded_through is None:
            if through < self.as_of:
                return
            rows = storage.read_snapshot(self.id, self.as_of)
            self._add(_stamped(rows, self.as_of), self.as_of)
        elif through > self.loaded_through:
            self._add(storage.read_changes(self.id, self.loaded_through, through), through)

    def _add(self, updates: pa.Table, through: int) -> None:
        if updates.num_rows:
            self.updates.append(updates.select([*self.schema.names, TIME, DIFF]).cast(file_schema(self.schema)))
            for time in pc.unique(updates[TIME]).to_pylist():
                if not self.times or time > self.times[-1]:
                    self.times.append(time)
            self.times.sort()
        self.loaded_through = through

    def change_times(self, after: int, before: int | float) -> list[int]:
        """The distinct update times t with after < t < before."""
        return self.times[bisect.bisect_right(self.times, after) : bisect.bisect_left(self.times, before)]

    def snapshot(self, time: int) -> pa.Table:
        """The collection at `time`: one row per unit of net count, sorted on all columns."""
        if not self.updates:
            return self.schema.empty_table()
        updates = pa.concat_tables(self.updates)
        current = updates.filter(pc.less_equal(updates[TIME], time))
        return snapshot_of(current, self.schema.names, f"{self.id} at {time}").cast(self.schema)

    def compact(self, since: int) -> None:
        """Merge the updates below `since`; snapshots at or after `since` are unchanged."""
        position = bisect.bisect_left(self.times, since)
        if position < 2:
            return
        updates = pa.concat_tables(self.updates)
        old = pc.less(updates[TIME], since)
        merged = consolidate(updates.filter(old), self.schema.names)
        merged_time = pa.array([self.times[position - 1]] * merged.num_rows, pa.int64())
        merged = merged.append_column(TIME, merged_time).select([*self.schema.names, TIME, DIFF]).cast(file_schema(self.schema))
        self.updates = [merged, updates.filter(pc.invert(old))]
        self.times = self.times[position - 1 :]


def _stamped(rows: pa.Table, time: int) -> pa.Table:
    """Rows as updates at `time`, each with diff +1."""
    return rows.append_column(TIME, pa.array([time] * rows.num_rows, pa.int64())).append_column(
        DIFF, pa.array([1] * rows.num_rows, pa.int64())
    )
