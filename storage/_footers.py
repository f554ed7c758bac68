"""The Parquet footers of a directory batch written by Spark: what `commit_batch` checks.

Rules of this module:
- Only footers are read, never rows: they give the row and byte counts of the batch.
- A directory batch is acceptable when every entry that is not hidden is a `*.parquet`
  file (so every reader, Spark included, reads the same files), and every file has the
  collection's file schema: the same column names and types in the same order.
  Nullability and metadata are not compared, since Spark writes every column nullable;
  instead the footer statistics must show no null in a NOT NULL column and every
  `_time` within the batch's range. A file whose footer has no statistics is taken on
  trust for those two.
- A directory whose files hold no rows (Spark's output of an empty result) describes
  no batch. A directory that does not exist is refused: a commit of nothing written is
  a writer's mistake, not an empty result.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from catalog import InvalidArgument, NewBatch
from history import Frontier
from storage._location import BlobLocation
from storage._rows import TIME


@dataclass(frozen=True, slots=True)
class DirectoryBatch:
    """A checked directory batch: its manifest description and its data files."""

    new_batch: NewBatch
    files: list[str]


def describe_directory_batch(
    location: BlobLocation, relative: str, schema: pa.Schema, lower: Frontier, upper: Frontier
) -> DirectoryBatch | None:
    """Check directory batch `relative` against file schema `schema` and the time range
    `[lower, upper)`; None if it holds no rows. InvalidArgument naming the first problem."""
    path = location.fs_path(relative)
    if location.filesystem.get_file_info(path.rstrip("/")).type != pafs.FileType.Directory:
        raise InvalidArgument(f"no batch was written at {location.spark_uri(relative)}")
    entries = location.directory_entries(path)
    rows = size = 0
    for entry in entries:
        where = f"{relative}{entry.base_name}"
        if entry.type != pafs.FileType.File or not entry.base_name.endswith(".parquet"):
            raise InvalidArgument(
                f"{where}: a directory batch holds only *.parquet data files, besides "
                f"hidden ones (named _* or .*)"
            )
        metadata = _footer(location, entry.path, where)
        _check_columns(metadata, schema, where)
        _check_statistics(metadata, schema, lower, upper, where)
        rows += metadata.num_rows
        size += entry.size
    if rows == 0:
        return None
    return DirectoryBatch(NewBatch(relative, rows, size), [e.path for e in entries])


_INT96_HINT = (
    "Spark writes timestamps as INT96 (read as nanoseconds) unless "
    "spark.sql.parquet.outputTimestampType is TIMESTAMP_MICROS"
)


def _footer(location: BlobLocation, path: str, where: str) -> pq.FileMetaData:
    try:
        with location.filesystem.open_input_file(path) as file:
            return pq.read_metadata(file)
    except pa.ArrowInvalid as error:  # not Parquet, or truncated: I/O errors propagate
        raise InvalidArgument(f"{where} is not a readable Parquet file: {error}") from None


def _describe(schema: pa.Schema) -> str:
    return ", ".join(f"{field.name} {field.type}" for field in schema)


def _check_columns(metadata: pq.FileMetaData, schema: pa.Schema, where: str) -> None:
    found = metadata.schema.to_arrow_schema()
    if found.names != schema.names or any(f.type != e.type for f, e in zip(found, schema)):
        int96 = any(pa.types.is_timestamp(f.type) and f.type.unit == "ns" for f in found)
        hint = f"; {_INT96_HINT}" if int96 else ""
        raise InvalidArgument(
            f"{where} has the columns ({_describe(found)}), not the collection's file "
            f"schema ({_describe(schema)}){hint}"
        )


def _check_statistics(
    metadata: pq.FileMetaData, schema: pa.Schema, lower: Frontier, upper: Frontier, where: str
) -> None:
    """Columns of a flat schema are the Parquet leaf columns, in the same order."""
    time_column = schema.get_field_index(TIME)
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for index, field in enumerate(schema):
            statistics = row_group.column(index).statistics
            if statistics is None:
                continue
            if not field.nullable and statistics.has_null_count and statistics.null_count:
                raise InvalidArgument(f"{where}: the NOT NULL column {field.name!r} holds nulls")
            if index == time_column and statistics.has_min_max:
                low, high = statistics.min, statistics.max
                if low < lower.time or (not upper.is_empty and high >= upper.time):
                    bound = "..." if upper.is_empty else str(upper.time)
                    raise InvalidArgument(
                        f"{where}: _time from {low} to {high} lies outside the batch's range "
                        f"[{lower.time}, {bound})"
                    )
