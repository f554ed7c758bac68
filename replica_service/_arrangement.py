"""Arrangements: the versions of an index, held in replica memory as Arrow tables.

A version is the whole collection as of one time. Its rows are kept sorted by the key
columns and then by every other column, which gives three things at once: a canonical
row order (so replicas answer identically), a digest that compares replicas, and key
lookups as slices: equal keys are contiguous, so the hash index maps a key to
`(offset, count)` instead of holding a list of row numbers.

An arrangement keeps each version as its changes from the one before, and only a few
whole (`Arrangement`): a step that computes a thousand times leaves a thousand small
changes, not a thousand copies of the index.

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
from storage import DIFF, TIME, snapshot_of


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


def difference(before: pa.Table | None, after: pa.Table) -> pa.Table:
    """What changed from `before` (None: nothing) to `after`: each distinct row once,
    with its `_diff` (never 0), in canonical order, so replicas with the same versions
    produce the same bytes. Raises ValueError for a column Arrow cannot group by (nested
    types)."""
    signed = [after.append_column(DIFF, pa.nulls(after.num_rows, pa.int64()).fill_null(1))]
    if before is not None and before.num_rows:
        signed.append(before.cast(after.schema).append_column(DIFF, pa.nulls(before.num_rows, pa.int64()).fill_null(-1)))
    return canonical_sort(_summed(pa.concat_tables(signed), after.column_names))


def changes_by_time(updates: pa.Table) -> list[tuple[int, pa.Table]]:
    """`updates` (user columns, `_diff`, `_time`, in any order and unconsolidated) as
    each time's changes, ascending: per time, each distinct row once with its summed
    `_diff` (never 0), in canonical order, as `difference` gives them. A time whose
    updates cancel out has no entry."""
    columns = [n for n in updates.column_names if n not in (DIFF, TIME)]
    summed = _summed(updates.select([*columns, TIME, DIFF]), [*columns, TIME])
    if not summed.num_rows:
        return []
    ordered = canonical_sort(summed, (TIME,))  # each time's rows as `difference` orders them
    times = ordered.column(TIME).combine_chunks()
    starts = pc.indices_nonzero(pa.concat_arrays([pa.array([True]), pc.not_equal(times.slice(1), times.slice(0, len(times) - 1))])).to_pylist()
    ends = [*starts[1:], ordered.num_rows]
    rows = ordered.select([*columns, DIFF])
    return [(times[start].as_py(), rows.slice(start, end - start)) for start, end in zip(starts, ends)]


def timed_changes(rows: pa.Table, time: int) -> pa.Table:
    """Changes (user columns, `_diff`) with their `_time` before the `_diff`: the form a
    subscription reports and a dataflow reads an index's changes in."""
    return rows.add_column(rows.num_columns - 1, TIME, pa.nulls(rows.num_rows, pa.int64()).fill_null(time))


def changes(before: pa.Table | None, after: pa.Table, time: int) -> pa.Table:
    """What changed from `before` to `after` (`difference`), at `time`."""
    return timed_changes(difference(before, after), time)


def _summed(signed: pa.Table, columns: list[str]) -> pa.Table:
    """`signed` updates' `_diff` summed per distinct row of `columns`, zeros gone."""
    try:
        summed = signed.group_by(columns, use_threads=False).aggregate([(DIFF, "sum")])
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise ValueError(f"cannot compute the changes of rows with columns {signed.schema}: {e}") from None
    summed = summed.rename_columns([DIFF if n == f"{DIFF}_sum" else n for n in summed.column_names]).select([*columns, DIFF])
    return summed.filter(pc.not_equal(summed.column(DIFF), 0))


@dataclass(slots=True)
class Version:
    """One arranged version: rows sorted by (key, rest), a key index, and a digest
    (computed when first asked for, unless `build` is told to compute it at once).

    Built off the event loop (sorting, hashing and indexing a large version takes tens of
    milliseconds); lookups are then a dict access and a slice.
    """

    time: int
    table: pa.Table
    key: tuple[str, ...]
    index: dict[tuple, tuple[int, int]] = field(repr=False)  # key values -> (offset, count)
    _digest: str | None = field(default=None, repr=False)

    @staticmethod
    def build(time: int, table: pa.Table, key: Sequence[str], *, digested: bool = True) -> Version:
        table = canonical_sort(table, key)
        return Version(time, table, tuple(key), _key_runs(table, key), digest(table) if digested else None)

    @property
    def digest(self) -> str:
        if self._digest is None:
            self._digest = digest(self.table)
        return self._digest

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


CACHED_VERSIONS = 2
"""Versions between an arrangement's first and latest that a read made whole and that
it keeps so (the latest made whole first goes first): a read at an earlier time pays for
rebuilding that version once, not at every read."""


@dataclass(slots=True, eq=False)
class _Entry:
    """One version of an arrangement: its time, its changes from the version before
    (`difference`'s form; None for the first retained), and its rows once whole."""

    time: int
    changes: pa.Table | None
    version: Version | None


class Arrangement:
    """The retained versions of one index.

    `upper` is the write frontier: every version with time < upper is final. `since` is
    the compaction frontier from `AllowCompaction`: reads at t < since are refused.

    Each version is kept as its changes from the one before; the first retained and the
    latest are also kept whole, and up to CACHED_VERSIONS others a read made whole. So
    memory follows the changes, not the number of versions times their rows. Only the
    event loop changes an arrangement; step workers read it (`version_at`,
    `changes_between`), and see a copy of its versions list taken at once.
    """

    def __init__(self, id: str, key: tuple[str, ...], since: Frontier, upper: Frontier, versions: Sequence[Version] = ()) -> None:
        self.id, self.key, self.since, self.upper = id, key, since, upper
        self._entries: list[_Entry] = []
        self._cached: list[_Entry] = []  # entries a read made whole, oldest first
        for version in versions:
            self.insert(version)

    @property
    def times(self) -> list[int]:
        """The times of the retained versions, ascending."""
        return [entry.time for entry in self._entries]

    @property
    def latest(self) -> Version | None:
        entries = self._entries
        return entries[-1].version if entries else None

    def insert(self, version: Version, changes: pa.Table | None = None) -> None:
        """Append a whole version; `changes` are its changes from the latest (computed
        here when not given and there is a version before)."""
        self.extend([], version, changes)

    def extend(self, earlier: Sequence[tuple[int, pa.Table]], last: Version, changes: pa.Table | None = None) -> None:
        """Append the versions a step computed: those before its last time as their
        changes (`earlier`, ascending), and the last whole, with its `changes` from the
        one before (computed here when not given)."""
        times = [time for time, _ in earlier] + [last.time]
        previous = self._entries[-1].time if self._entries else None
        if any(b <= a for a, b in zip([previous, *times], times) if a is not None):
            raise ValueError(f"versions at {times} are not after {previous} in ascending order")
        if not self._entries:
            if earlier:
                raise ValueError(f"index {self.id}'s first version must be whole")
            self._entries.append(_Entry(last.time, None, last))
            return
        if changes is None:
            before = self.version_at(earlier[-1][0]) if earlier else self._entries[-1].version
            changes = difference(before.table, last.table)
        latest = self._entries[-1]
        if latest is not self._entries[0] and latest not in self._cached:
            latest.version = None  # no longer the latest: its changes stay
        self._entries.extend(_Entry(time, rows, None) for time, rows in earlier)
        self._entries.append(_Entry(last.time, changes, last))

    def version_at(self, time: int) -> Version | None:
        """The latest version at or before `time`, or None if there is none; made whole
        if it is not, and not kept (thread-safe: a step worker may ask). A read on the
        event loop asks `whole_at` first (making a large version whole takes tens of
        milliseconds: do it on a worker), then `keep`s what it made."""
        entries = list(self._entries)
        position = bisect.bisect_right(entries, time, key=lambda e: e.time)
        if not position:
            return None
        entry = entries[position - 1]
        return entry.version if entry.version is not None else self._materialize(entries, position - 1)

    def keep(self, version: Version) -> None:
        """Keep `version` (made whole by `version_at`) whole for later reads, if it is
        still retained; at most CACHED_VERSIONS such, the oldest kept going first."""
        entry = next((e for e in self._entries if e.time == version.time), None)
        if entry is None or entry.version is not None:
            return
        entry.version = version
        self._cached.append(entry)
        while len(self._cached) > CACHED_VERSIONS:
            evicted = self._cached.pop(0)
            if evicted is not self._entries[0] and evicted is not self._entries[-1]:
                evicted.version = None

    def whole_at(self, time: int) -> bool:
        """Whether the version a read at `time` finds is kept whole (or there is none)."""
        entries = self._entries
        position = bisect.bisect_right(entries, time, key=lambda e: e.time)
        return not position or entries[position - 1].version is not None

    def changes_between(self, after: int, through: int, before: Version | None = None) -> list[tuple[int, pa.Table]]:
        """The changes of the versions in `(after, through]`, each at its time (thread-safe).
        Where the versions right after `after` were compacted away, the first is the
        difference from `before` (the version at `after`, which this arrangement no
        longer holds whole, or none at all) to the first retained version."""
        entries = list(self._entries)
        later = [entry for entry in entries if after < entry.time <= through]
        if not later:
            return []
        if later[0].changes is None:  # the first retained: those before it are gone
            if before is None:
                raise ValueError(f"index {self.id} holds no version at {after} any more (since {self.since})")
            first = later.pop(0)
            position = next(i for i, entry in enumerate(entries) if entry is first)
            return [(first.time, difference(before.table, self._materialize(entries, position).table))] + [(e.time, e.changes) for e in later]
        return [(entry.time, entry.changes) for entry in later]

    def change_rows(self, after: int, through: int) -> int:
        """The rows of the changes of the versions in `(after, through]` (a version whose
        changes are not kept counts its rows)."""
        total = 0
        for entry in list(self._entries):
            if after < entry.time <= through:
                rows = entry.changes if entry.changes is not None else entry.version.table
                total += rows.num_rows
        return total

    def compact(self, since: Frontier) -> None:
        """Advance `since` and drop versions no read at or after it can need: the one a
        read at `since` finds becomes the first, whole."""
        self.since = self.since.join(since)
        if self.since.is_empty:
            self._entries.clear()
            self._cached.clear()
            return
        position = bisect.bisect_right(self._entries, self.since.time, key=lambda e: e.time)
        if position > 1:
            first = self._entries[position - 1]
            if first.version is None:
                first.version = self._materialize(self._entries, position - 1)
            first.changes = None
            del self._entries[: position - 1]
            self._cached = [entry for entry in self._cached if entry in self._entries]

    def _materialize(self, entries: list[_Entry], position: int) -> Version:
        """The whole version of `entries[position]`: the nearest whole one before it with
        the changes after it applied (one consolidation of all of them)."""
        start = position
        while entries[start].version is None:
            start -= 1
        base = entries[start].version
        if start == position:
            return base
        parts = [base.table.append_column(DIFF, pa.nulls(base.table.num_rows, pa.int64()).fill_null(1))]
        parts += [entry.changes.cast(parts[0].schema) for entry in entries[start + 1 : position + 1]]
        rows = snapshot_of(pa.concat_tables(parts), base.table.column_names, f"index {self.id} at {entries[position].time}")
        return Version.build(entries[position].time, rows, self.key, digested=False)


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
