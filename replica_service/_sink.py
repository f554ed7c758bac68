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
    # The latest version handed to `write`: the dataflow's result from its time until
    # the next version's time.
    _latest: tuple[int, pa.Table] | None = None
    batches_written: int = 0

    def write(self, version: tuple[int, pa.Table] | None, upper: int) -> Frontier:
        """Make the collection hold `version`'s rows from its time up to `upper`, or with
        None, the latest version's rows; return the collection's upper (blocking).

        Versions come in increasing time order, and the dataflow's result does not
        change between two of them: that is what lets a writer that finds the upper at
        U know the contents at U - 1 without reading them back.
        """
        before = self._latest
        if version is not None:
            self._latest = (version[0], version[1].cast(self.storage.schema(self.id)))
        time, rows = self._latest
        current = self.storage.upper(self.id)
        while not current.is_empty and current.time < upper:
            if current.time > time:
                # Another replica wrote this version already; only the upper is behind.
                updates = None
            else:
                updates = difference(self._contents_before(current.time, before, rows.schema), rows, time)
            try:
                self.storage.compare_and_append(self.id, current, Frontier(upper), updates)
                self.batches_written += updates is not None and updates.num_rows > 0
                current = Frontier(upper)
            except UpperMismatch as lost:
                current = lost.current
        return current

    def _contents_before(self, upper: int, before: tuple[int, pa.Table] | None, schema: pa.Schema) -> pa.Table:
        """The collection's contents at `upper - 1`."""
        if before is not None and before[0] < upper:
            return before[1]
        if upper == 0 or not self.storage.catalog.manifest(self.id).batches:
            return schema.empty_table()  # nothing was ever written
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
