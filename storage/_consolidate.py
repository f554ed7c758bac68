"""Consolidation: summing the diffs of equal rows.

A collection's contents at time t are its updates with `_time <= t`, consolidated: each
distinct row appears as often as the sum of its diffs (DESIGN section 3). A negative sum
means more retractions than insertions, which no valid history produces, so it is an
error, never silently dropped. Outputs are sorted on all columns, so equal contents
always give equal tables.

Pure functions over Arrow tables; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from catalog import FailedPrecondition
from storage._rows import DIFF, TIME


class NegativeCount(FailedPrecondition):
    """A row's diffs sum to less than zero at the time read: the stored updates retract
    rows that were never inserted."""


def consolidate(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """Columns `keys` and `_diff`: one row per distinct value of `keys` (nulls equal;
    floats equal as SQL compares them, see `_normalized`), `_diff` the sum of its diffs;
    rows whose diffs sum to zero are gone. Sorted by `keys`."""
    keys = list(keys)
    table = _normalized(table, keys)
    grouped = table.group_by(keys, use_threads=False).aggregate([(DIFF, "sum")])
    grouped = grouped.select([*keys, f"{DIFF}_sum"]).rename_columns([*keys, DIFF])
    grouped = grouped.filter(pc.not_equal(grouped[DIFF], 0))
    schema = pa.schema([*(table.schema.field(k) for k in keys), table.schema.field(DIFF)])
    return grouped.cast(schema).sort_by([(k, "ascending") for k in keys])


def _normalized(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """`table` with each float column of `keys` as Spark groups it: -0.0 as 0.0 and every
    NaN as the one NaN. Arrow groups floats by their bits, so a row inserted with 0.0 and
    retracted with -0.0 stayed, and a compacted batch then held both, +1 and -1, which a
    snapshot read here refused as a negative count while Spark's readers cancelled them."""
    for name in keys:
        column = table[name]
        if not pa.types.is_floating(column.type):
            continue
        zero, nan = pa.scalar(0.0, column.type), pa.scalar(float("nan"), column.type)
        column = pc.if_else(pc.equal(column, zero), zero, column)
        column = pc.if_else(pc.is_nan(column), nan, column)
        table = table.set_column(table.schema.get_field_index(name), name, column)
    return table


def expand(table: pa.Table, keys: Sequence[str], what: str) -> pa.Table:
    """Columns `keys` of a consolidated table, each row repeated `_diff` times.
    Raises NegativeCount (naming `what` and the row) if a `_diff` is negative."""
    counts = table[DIFF]
    negative = pc.less(counts, 0)
    if pc.any(negative).as_py():
        index = pc.index(negative, True).as_py()
        row = {k: table[k][index].as_py() for k in keys}
        raise NegativeCount(f"{what}: row {row} has net count {counts[index].as_py()}")
    rows = table.select(list(keys))
    if pc.all(pc.equal(counts, 1)).as_py() is not False:
        return rows
    offsets = pa.concat_arrays(
        [pa.array([0], pa.int64()), pc.cumulative_sum(counts.combine_chunks())]
    )
    total = offsets[-1].as_py()
    parents = pc.list_parent_indices(pa.LargeListArray.from_arrays(offsets, pa.nulls(total)))
    return rows.take(parents)


def snapshot_of(table: pa.Table, keys: Sequence[str], what: str) -> pa.Table:
    """The contents described by the updates in `table` (already filtered by time)."""
    return expand(consolidate(table, keys), keys, what)


def changes_of(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """The updates in `table` consolidated per row and time, sorted by time, then row."""
    consolidated = consolidate(table, [*keys, TIME])
    return consolidated.sort_by([(TIME, "ascending"), *((k, "ascending") for k in keys)])
