"""Materialized views: a dataflow's changes written to a storage collection by Spark.

Every replica of an instance computes the same versions and races to write them. A
writer has Spark's executors write the changes at the times a step covered (each row
with its `_time`) as a new batch directory, then commits it with compare-and-append
over `[current upper, upper)`; the first writer of a range wins, and a loser removes
only its own directory (`Storage.commit_batch`) and moves on. Replicas may cover
different runs of times: a writer whose range another replica has written in part
writes the changes at the times from the current upper on; one whose every time is
below it writes nothing.

Invariant: after `write(times, changes, upper)` returns, the collection's upper is at
least `upper` and its contents at every time t in [times[0], upper) are the dataflow's
version at the latest of `times` at or before t, provided its contents at
`times[0] - 1` were the version before (every replica writes every version, so they
are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import pyarrow.parquet as pq
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from catalog import UpperMismatch
from history import Frontier
from storage import DIFF, TIME, Storage
from replica_service.dataplane._rows import quote, spark_type


@dataclass(slots=True)
class SinkWriter:
    id: str
    storage: Storage

    def upper(self) -> Frontier:
        return self.storage.upper(self.id)

    def write(self, times: Sequence[int], changes: Callable[[int], DataFrame] | None, upper: int) -> int:
        """Write the changes at `times` (ascending) and move the upper to `upper`; return
        how many rows of changes this writer wrote, whether it won the race or not (0
        when another replica had written the times already; blocking: a Spark job and a
        catalog transaction).

        `changes(current)` gives them (user columns, `_diff`, `_time`) at the times from
        `current` on, for a collection whose upper is `current`; it is called only when
        this writer has a range to write. None: nothing changed."""
        current = self.storage.upper(self.id)
        rows = 0
        while not current.is_empty and current.time < upper:
            if current.time > times[-1] or changes is None:
                # Written already by another replica (or nothing changed): only the upper moves.
                commit = lambda: self.storage.compare_and_append(self.id, current, Frontier(upper))  # noqa: E731
            else:
                relative, uri = self.storage.reserve_batch(self.id)
                self._frame(changes(current.time)).write.parquet(uri)
                rows = self._rows(relative)
                commit = lambda: self.storage.commit_batch(self.id, current, Frontier(upper), relative)  # noqa: E731
            try:
                info = commit()
            except UpperMismatch as lost:
                current = lost.current
                continue
            current = info.upper
        return rows

    def _rows(self, relative_path: str) -> int:
        """The rows of a written directory batch, from its Parquet footers."""
        files = self.storage.batch_files(self.storage.fs_path(relative_path))
        return sum(pq.read_metadata(file, filesystem=self.storage.filesystem).num_rows for file in files)

    def _frame(self, changes: DataFrame) -> DataFrame:
        """The changes as batch rows: the collection's columns in its order and types,
        then `_time` and `_diff`."""
        schema = self.storage.schema(self.id)
        columns = [F.col(quote(f.name)).cast(spark_type(f)).alias(f.name) for f in schema]
        return changes.select(*columns, F.col(TIME).cast("bigint").alias(TIME), F.col(DIFF).cast("bigint").alias(DIFF))
