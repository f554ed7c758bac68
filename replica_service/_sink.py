"""Materialized views: a dataflow's versions written to a storage collection.

Every replica of an instance computes the same versions and races to write them with
compare-and-append. The first writer of a time range wins; a loser sees the upper moved
past its range and moves on, so each range is written exactly once and no batch is ever
duplicated.

Invariant: after `write(time, rows, upper)` returns, the collection's upper is at least
`upper` and its contents at every time in [time, upper) equal `rows`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from history import Frontier
from storage import DIFF, TIME, Storage, UpperMismatch, consolidate


@dataclass(slots=True)
class SinkWriter:
    id: str
    storage: Storage
    # The latest version this writer wrote or saw written: the collection holds
    # `_rows` at every time in [_time, _upper).
    _time: int = -1
    _rows: pa.Table | None = None
    _upper: int = -1
    batches_written: int = 0

    def write(self, version: tuple[int, pa.Table] | None, upper: int) -> Frontier:
        """Make the collection hold `version`'s rows from its time up to `upper`, or with
        None, the last version's rows; return the collection's upper (blocking)."""
        time, rows = version if version is not None else (self._time, self._rows)
        rows = rows.cast(self.storage.schema(self.id))
        current = self.storage.upper(self.id)
        while not current.is_empty and current.time < upper:
            if current.time > time:
                # Another replica wrote this version already; only the upper is behind.
                updates = None
            else:
                updates = difference(self._contents_below(current.time, rows.schema), rows, time)
            try:
                self.storage.compare_and_append(self.id, current, Frontier(upper), updates)
                self.batches_written += updates is not None and updates.num_rows > 0
                current = Frontier(upper)
            except UpperMismatch as lost:
                current = lost.current
        self._time, self._rows, self._upper = time, rows, upper
        return current

    def _contents_below(self, upper: int, schema: pa.Schema) -> pa.Table:
        if upper == self._upper and self._rows is not None:
            return self._rows
        if upper == 0:
            return schema.empty_table()
        return self.storage.read_snapshot(self.id, upper - 1)


def difference(old: pa.Table, new: pa.Table, time: int) -> pa.Table:
    """The updates at `time` that turn `old` into `new`: retractions and insertions,
    consolidated, so rows in both cancel out."""
    signed = pa.concat_tables(
        [
            old.append_column(DIFF, pa.array([-1] * old.num_rows, pa.int64())),
            new.append_column(DIFF, pa.array([1] * new.num_rows, pa.int64())),
        ]
    )
    updates = consolidate(signed, new.schema.names)
    return updates.append_column(TIME, pa.array([time] * updates.num_rows, pa.int64()))
