"""Rows in Spark: the Spark schema of a storage collection, consolidation of updates,
the canonical layout that makes order-sensitive aggregates agree across replicas, and
times in plans.

A step's times never appear in a plan as BIGINT literals: Spark inlines such a literal's
value into the code it generates, so a plan holding them compiles new classes at every
step (14 for an extremes query's step, issue 48). A time is a row instead (`time_frame`,
cross joined), or a DECIMAL literal, whose value the generated code reads from a
reference (`at_least`, `is_time`): the code is the same at every time.

Pure DataFrame transformations: nothing here runs a job.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Sequence

import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql import functions as F
from pyspark.sql.types import DecimalType, DoubleType, FloatType

from storage import DIFF, TIME, schema_to_ddl

_TIME_DECIMAL = DecimalType(20, 0)  # every BIGINT


def quote(name: str) -> str:
    """`name` as a Spark identifier."""
    return "`" + name.replace("`", "``") + "`"


def spark_type(field: pa.Field) -> str:
    """The Spark type a storage column is read as. CHAR(n) and VARCHAR(n) are STRING (Spark
    refuses them in a DataFrame, and Arrow has only strings); a zoned timestamp is
    TIMESTAMP_LTZ whatever `spark.sql.timestampType` says."""
    if pa.types.is_string(field.type) or pa.types.is_large_string(field.type):
        return "STRING"
    if pa.types.is_timestamp(field.type) and field.type.tz is not None:
        return "TIMESTAMP_LTZ"
    return schema_to_ddl(pa.schema([pa.field("x", field.type)]))[2:]  # storage's spelling


def spark_ddl(schema: pa.Schema) -> str:
    """The Spark DDL of a storage schema's user columns."""
    return ", ".join(
        f"{quote(field.name)} {spark_type(field)}{'' if field.nullable else ' NOT NULL'}" for field in schema
    )


def arrow_frame(session: SparkSession, table: pa.Table) -> DataFrame:
    """A small Arrow table (an index version, its changes, an empty input) as a
    DataFrame, built in the JVM. The explicit schema keeps a zone-less timestamp a
    TIMESTAMP_NTZ. `createDataFrame` cuts a table into partitions by row count only, so
    a canonically sorted version gives every replica the same partitions."""
    return session.createDataFrame(table, schema=from_arrow_schema(table.schema, prefer_timestamp_ntz=True))


def time_frame(session: SparkSession, time: int) -> DataFrame:
    """One row, `_time` = `time`: cross joined where a plan needs a time as a value."""
    return arrow_frame(session, pa.table({TIME: pa.array([time], pa.int64())}))


def at_least(column: str, time: int) -> Column:
    """The time `column`, or `time` where that is later."""
    return F.greatest(F.col(column).cast(_TIME_DECIMAL), F.lit(Decimal(time)).cast(_TIME_DECIMAL)).cast("bigint")


def is_time(column: str, time: int) -> Column:
    """Whether the time `column` is `time`."""
    return F.col(column).cast(_TIME_DECIMAL) == F.lit(Decimal(time)).cast(_TIME_DECIMAL)


def consolidate(updates: DataFrame, columns: Sequence[str], what: str) -> DataFrame:
    """The user columns and `_diff`, one row per distinct row with the sum of its diffs;
    rows that sum to zero are gone. A negative sum fails the job (in the executor that
    finds it) with an error naming `what` (the collection and time) and the row."""
    keys = [F.col(quote(c)) for c in columns]
    summed = updates.groupBy(*keys).agg(F.sum(DIFF).alias(DIFF)).where(F.col(DIFF) != 0)
    message = F.concat(
        F.lit(f"negative count in {what}: row "),
        F.to_json(F.struct(*keys)),
        F.lit(" has net count "),
        F.col(DIFF).cast("string"),
    )
    checked = F.when(F.col(DIFF) < 0, F.raise_error(message)).otherwise(F.col(DIFF))
    return summed.select(*keys, checked.alias(DIFF))


def patch(settled: DataFrame, changes: DataFrame, columns: Sequence[str], what: str) -> DataFrame:
    """`consolidate` of the updates in `settled` and `changes`, where `settled` holds no
    retraction and `changes` few updates: the changes, summed per row, are broadcast;
    the rows of `settled` that none of them touches pass unconsolidated (a positive
    `_diff` each, which `expand` repeats), and only the touched ones are consolidated
    with the changes. No shuffle of `settled`: a few retractions in a large collection
    cost two scans of it, not a shuffle of all its columns (measured: 1.4x faster for
    TPC-H lineitem; bench/RESULTS.md "Snapshots with few retractions")."""
    keys = [quote(c) for c in columns]
    net = changes.groupBy(*keys).agg(F.sum(DIFF).alias(DIFF)).where(F.col(DIFF) != 0)
    touched = F.broadcast(net.select(*keys)).alias("__touched")
    rows = settled.select(*keys, DIFF).alias("__settled")
    # Null-safe, as grouping compares: a NULL matches a NULL.
    matching = [F.col(f"__settled.{k}").eqNullSafe(F.col(f"__touched.{k}")) for k in keys]
    untouched = rows.join(touched, matching, "left_anti")
    merged = consolidate(rows.join(touched, matching, "left_semi").unionByName(net), columns, what)
    return untouched.unionByName(merged)


def expand(updates: DataFrame, columns: Sequence[str]) -> DataFrame:
    """The rows of consolidated updates with positive diffs: each repeated `_diff` times."""
    repeats = F.explode(F.array_repeat(F.lit(0), F.col(DIFF).cast("int")))
    return updates.select(*(F.col(quote(c)) for c in columns), repeats.alias("__repeat")).drop("__repeat")


def normalized(rows: DataFrame) -> DataFrame:
    """`rows` with each float column's -0.0 as 0.0 and every NaN as one NaN, as Spark's
    grouping leaves them: a consolidated row has those bits, so a row that needed no
    consolidation is given them too. A snapshot's bits then do not depend on which of
    its batches held retractions, nor a linear dataflow's on whether its changes were
    consolidated (recompute) or not (incremental)."""
    floats = [f for f in rows.schema.fields if isinstance(f.dataType, (DoubleType, FloatType))]
    if not floats:  # no projection, and no call into the JVM per column (steps' hot path)
        return rows
    replaced = {}
    for field in floats:
        column = F.col(quote(field.name))
        zero, nan = F.lit(0.0).cast(field.dataType), F.lit(float("nan")).cast(field.dataType)
        replaced[field.name] = F.when(F.isnan(column), nan).when(column == 0, zero).otherwise(column)
    return rows.withColumns(replaced)


def canonical(rows: DataFrame, partitions: int) -> DataFrame:
    """`rows` laid out by their contents alone: hash-partitioned on every column into
    `partitions`, sorted within each. Whatever files and splits the rows came from, each
    partition then holds the same rows in the same order, so an order-sensitive
    aggregate (a floating-point sum) gives the same bits on every replica."""
    keys = [F.col(quote(c)) for c in rows.columns]
    return rows.repartition(partitions, *keys).sortWithinPartitions(*keys)
