"""Arrangements: the versions of an index, held in replica memory as Arrow tables.

A version is the whole collection as of one time. Its rows are kept sorted by the key
columns and then by every other column, which gives three things at once: a canonical
row order (so replicas answer identically), a digest that compares replicas, and key
lookups as slices: equal keys are contiguous, so the hash index maps a key to
`(offset, count)` instead of holding a list of row numbers.

Invariants: versions are ordered by strictly increasing time; the version that answers a
read at `t` is the latest one at or before `t`; `compact(since)` keeps that version for
every `t >= since`.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from history import Frontier, OrderBy, Predicate, RowSetFinishing, Scalar
from storage import DIFF, TIME


def canonical_sort(table: pa.Table, leading: Sequence[str] = ()) -> pa.Table:
    """`table` sorted by the `leading` columns, then by all other columns in schema order.

    Sorting on a complete key makes the order independent of how Spark partitioned the
    work, so two replicas of any size produce identical tables.
    """
    if table.num_rows <= 1:
        return table.combine_chunks()
    names = list(leading) + [n for n in table.column_names if n not in leading]
    sortable = [n for n in names if _is_sortable(table.schema.field(n).type)]
    indices = pc.sort_indices(table, sort_keys=[(n, "ascending", "at_end") for n in sortable])
    return table.take(indices).combine_chunks()


def _is_sortable(arrow_type: pa.DataType) -> bool:
    return not (pa.types.is_nested(arrow_type) or pa.types.is_map(arrow_type))


def digest(table: pa.Table) -> str:
    """A digest of the values and column types of a canonically sorted table, and of
    nothing else: not its chunks, validity buffers, bytes under nulls or nullability
    flags, which differ between a version computed at once and one maintained step by
    step (replicas compare these digests to catch a wrong answer). Parquet, one row
    group, no compression or dictionary: as fast as Arrow IPC, and it writes values only."""
    table = table.cast(pa.schema([field.with_nullable(True) for field in table.schema]))
    sink = pa.BufferOutputStream()
    pq.write_table(
        table, sink, compression="NONE", use_dictionary=False, write_statistics=False, row_group_size=max(1, table.num_rows), store_schema=False
    )
    return hashlib.sha256(sink.getvalue()).hexdigest()[:32]


def changes(before: pa.Table | None, after: pa.Table, time: int) -> pa.Table:
    """What changed from `before` (None: nothing) to `after`, at `time`: each distinct row
    once, with `_time` and its `_diff` (never 0), in canonical order, so replicas with the
    same versions produce the same bytes. Raises ValueError for a column Arrow cannot
    group by (nested types)."""
    columns = after.column_names
    signed = [after.append_column(DIFF, pa.nulls(after.num_rows, pa.int64()).fill_null(1))]
    if before is not None and before.num_rows:
        signed.append(before.cast(after.schema).append_column(DIFF, pa.nulls(before.num_rows, pa.int64()).fill_null(-1)))
    both = pa.concat_tables(signed)
    try:
        summed = both.group_by(columns, use_threads=False).aggregate([(DIFF, "sum")])
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise ValueError(f"cannot compute the changes of rows with columns {after.schema}: {e}") from None
    summed = summed.rename_columns([DIFF if n == f"{DIFF}_sum" else n for n in summed.column_names]).select([*columns, DIFF])
    changed = canonical_sort(summed.filter(pc.not_equal(summed.column(DIFF), 0)))
    return changed.add_column(len(columns), TIME, pa.nulls(changed.num_rows, pa.int64()).fill_null(time))


@dataclass(slots=True)
class Version:
    """One arranged version: rows sorted by (key, rest), a key index, and a digest.

    Built off the event loop (sorting, hashing and indexing a large version takes tens of
    milliseconds); lookups are then a dict access and a slice.
    """

    time: int
    table: pa.Table
    key: tuple[str, ...]
    digest: str
    index: dict[tuple, tuple[int, int]] = field(repr=False)  # key values -> (offset, count)

    @staticmethod
    def build(time: int, table: pa.Table, key: Sequence[str]) -> Version:
        table = canonical_sort(table, key)
        return Version(time, table, tuple(key), digest(table), _key_runs(table, key))

    def lookup(self, values: Sequence[Scalar]) -> pa.Table:
        """The rows whose key equals `values`."""
        if len(values) != len(self.key):
            raise ValueError(
                f"a key lookup needs {len(self.key)} value(s) for key ({', '.join(self.key)}), "
                f"got {len(values)}"
            )
        offset, count = self.index.get(self._normalize(values), (0, 0))
        return self.table.slice(offset, count)

    def _normalize(self, values: Sequence[Scalar]) -> tuple:
        """Literal key values as the index stores them: cast to the key columns' types,
        unless the Python type already is the column's."""
        normalized = []
        for name, value in zip(self.key, values):
            arrow_type = self.table.schema.field(name).type
            if value is None or type(value) is _PYTHON_TYPES.get(arrow_type.id):
                normalized.append(value)
                continue
            try:
                normalized.append(pa.scalar(value).cast(arrow_type).as_py())
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                raise ValueError(f"key value {value!r} does not fit column {name} ({arrow_type}): {e}") from None
        return tuple(normalized)


_PYTHON_TYPES = {
    **{t.id: int for t in (pa.int8(), pa.int16(), pa.int32(), pa.int64())},
    **{t.id: float for t in (pa.float32(), pa.float64())},
    **{t.id: str for t in (pa.string(), pa.large_string())},
    pa.bool_().id: bool,
}


def _key_runs(table: pa.Table, key: Sequence[str]) -> dict[tuple, tuple[int, int]]:
    """Map each distinct key to its run `(offset, count)` in a table sorted by the key.

    Run starts are found with vectorised comparisons of each row with the one before
    (two nulls compare equal); only one Python object per distinct key is made.
    """
    rows = table.num_rows
    if rows == 0:
        return {}
    if not key:
        return {(): (0, rows)}
    changed = None
    for name in key:
        column = table.column(name).combine_chunks()
        before, after = column.slice(0, rows - 1), column.slice(1)
        differs = pc.if_else(
            pc.and_(pc.is_valid(before), pc.is_valid(after)),
            pc.not_equal(before, after),
            pc.xor(pc.is_null(before), pc.is_null(after)),
        )
        changed = differs if changed is None else pc.or_(changed, differs)
    starts = pc.indices_nonzero(pa.concat_arrays([pa.array([True]), changed])).to_pylist()
    keys = zip(*(table.column(name).take(starts).to_pylist() for name in key))
    ends = starts[1:] + [rows]
    return {k: (start, end - start) for k, start, end in zip(keys, starts, ends)}


@dataclass(slots=True)
class Arrangement:
    """The retained versions of one index.

    `upper` is the write frontier: every version with time < upper is final. `since` is
    the compaction frontier from `AllowCompaction`: reads at t < since are refused.
    """

    id: str
    key: tuple[str, ...]
    since: Frontier
    upper: Frontier
    versions: list[Version] = field(default_factory=list)

    def insert(self, version: Version) -> None:
        if self.versions and version.time <= self.versions[-1].time:
            raise ValueError(f"version at {version.time} is not after {self.versions[-1].time}")
        self.versions.append(version)

    def version_at(self, time: int) -> Version | None:
        """The latest version at or before `time`, or None if there is none."""
        position = bisect.bisect_right(self.versions, time, key=lambda v: v.time)
        return self.versions[position - 1] if position else None

    def compact(self, since: Frontier) -> None:
        """Advance `since` and drop versions no read at or after it can need."""
        self.since = self.since.join(since)
        if self.since.is_empty:
            self.versions.clear()
            return
        position = bisect.bisect_right(self.versions, self.since.time, key=lambda v: v.time)
        if position > 1:
            del self.versions[: position - 1]


# --- Finishing -----------------------------------------------------------------------

_COMPARISONS = {
    "=": pc.equal,
    "!=": pc.not_equal,
    "<": pc.less,
    "<=": pc.less_equal,
    ">": pc.greater,
    ">=": pc.greater_equal,
}


def _predicate_mask(table: pa.Table, predicate: Predicate) -> pa.ChunkedArray:
    if predicate.column not in table.column_names:
        raise ValueError(f"unknown column {predicate.column!r} in filter; columns: {', '.join(table.column_names)}")
    column = table.column(predicate.column)
    if predicate.op == "is_null":
        return pc.is_null(column)
    if predicate.op == "is_not_null":
        return pc.is_valid(column)
    if predicate.op == "in":
        values = predicate.value if isinstance(predicate.value, tuple) else (predicate.value,)
        # As in SQL, a null never matches, not even a null in the list.
        return pc.is_in(column, value_set=pa.array(values).cast(column.type), skip_nulls=True)
    try:
        literal = pa.scalar(predicate.value).cast(column.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise ValueError(f"filter value {predicate.value!r} does not fit column {predicate.column}: {e}") from None
    return pc.fill_null(_COMPARISONS[predicate.op](column, literal), False)


def _order(table: pa.Table, order_by: Sequence[OrderBy]) -> pa.Table:
    for item in order_by:
        if item.column not in table.column_names:
            raise ValueError(f"unknown column {item.column!r} in order by")
    keys = [(o.column, "descending" if o.descending else "ascending", "at_end" if o.nulls_last else "at_start") for o in order_by]
    return table.take(pc.sort_indices(table, sort_keys=keys))


def finish(rows: pa.Table, finishing: RowSetFinishing, *, version: Version | None = None) -> pa.Table:
    """Apply `finishing` to rows: key lookup, filter, order by, offset, limit, projection.

    `rows` are the version's rows (an index peek, with `version` for the key lookup by
    hash) or a SQL peek's result; both come in canonical order, so every replica answers
    the same rows in the same order.
    """
    if finishing.key is not None:
        if version is None:
            raise ValueError("a key lookup needs an index")
        rows = version.lookup(finishing.key)
    if finishing.filter:
        mask = _predicate_mask(rows, finishing.filter[0])
        for predicate in finishing.filter[1:]:
            mask = pc.and_(mask, _predicate_mask(rows, predicate))
        rows = rows.filter(mask)
    if finishing.order_by:
        rows = _order(rows, finishing.order_by)
    if finishing.offset or finishing.limit is not None:
        rows = rows.slice(finishing.offset, finishing.limit)
    if finishing.projection is not None:
        missing = [c for c in finishing.projection if c not in rows.column_names]
        if missing:
            raise ValueError(f"unknown column(s) {', '.join(missing)} in projection")
        rows = rows.select(list(finishing.projection))
    return rows
