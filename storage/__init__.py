"""Tandem storage: durable timestamped collections (DESIGN section 3).

A storage collection (a source, or the output of a materialized view) is a set of
updates `(row, _time, _diff)` kept as Parquet batches (files, or directories of part files
written by Spark) under a blob location (a local directory or an S3 prefix), with the
manifest (batches, upper, since, read holds) in the catalog. Writers race with
`compare_and_append` (or `commit_batch`); readers get a `ReadPlan` (batches plus `_time`
bounds) or, through pyarrow, consolidated snapshots and changes.

Dependency rule: this package imports `catalog` and `history` only (of ours); no
pyspark, grpc or asyncio. Private modules are re-exported here.
"""

from catalog import Fenced, InvalidArgument, NotFound, UpperMismatch
from storage._consolidate import NegativeCount, changes_of, consolidate, snapshot_of
from storage._rows import DIFF, SYSTEM_COLUMNS, TIME, file_schema, to_batch
from storage._schema import (
    RESERVED_COLUMNS,
    SPARK_TYPES,
    normalize_ddl,
    parse_schema,
    schema_to_ddl,
)
from storage._storage import DEFAULT_GRACE_MS, GarbageReport, ReadPlan, Storage, merge_run

__all__ = [
    "DEFAULT_GRACE_MS",
    "DIFF",
    "RESERVED_COLUMNS",
    "SPARK_TYPES",
    "SYSTEM_COLUMNS",
    "TIME",
    "Fenced",
    "GarbageReport",
    "InvalidArgument",
    "NegativeCount",
    "NotFound",
    "ReadPlan",
    "Storage",
    "UpperMismatch",
    "changes_of",
    "consolidate",
    "file_schema",
    "merge_run",
    "normalize_ddl",
    "parse_schema",
    "schema_to_ddl",
    "snapshot_of",
    "to_batch",
]
