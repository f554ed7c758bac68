"""Directory batches written and read by a real local Spark: what a replica's Spark
executors will do with `reserve_batch`, `commit_batch` and `ReadPlan.uris`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from catalog import InvalidArgument
from history import Frontier
from replica_service import _spark
from storage import Storage

pytestmark = pytest.mark.spark

F = Frontier
SCHEMA = "id BIGINT NOT NULL, region STRING, at TIMESTAMP, amount DECIMAL(10, 2)"
ROWS = """SELECT id, CAST(id % 2 AS STRING) AS region, TIMESTAMP'2024-01-01 00:00:00' AS at,
    CAST(id AS DECIMAL(10, 2)) AS amount, CAST({time} AS BIGINT) AS _time,
    CAST(1 AS BIGINT) AS _diff FROM range({start}, {end})"""


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    conf = {
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        "spark.sql.session.timeZone": "UTC",
    }
    session = _spark.start_session(
        _spark.SparkSettings("local[1]"), tmp_path_factory.mktemp("spark"), conf
    )
    yield session
    session.stop()  # the process's one SparkContext: later modules get their own settings


@pytest.fixture
def storage(controller, tmp_path: Path) -> Storage:  # type: ignore[no-untyped-def]
    return Storage(controller, (tmp_path / "blobs").as_uri())


def write(spark: SparkSession, storage: Storage, id: str, time: int, start: int, end: int) -> str:
    relative, uri = storage.reserve_batch(id)
    spark.sql(ROWS.format(time=time, start=start, end=end)).repartition(2).write.parquet(uri)
    return relative


@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_spark_writes_commits_and_reads_directory_batches(
    spark: SparkSession, storage: Storage
) -> None:
    id = storage.create_source("sales", SCHEMA).id
    first = write(spark, storage, id, 0, 0, 10)
    storage.commit_batch(id, F(0), F(1), first)
    empty = write(spark, storage, id, 1, 0, 0)  # an empty result: the upper moves alone
    storage.commit_batch(id, F(1), F(2), empty)
    # A file batch among them, large enough for compaction to merge the first into it.
    storage.append(id, [{"id": 100 + i, "region": "x"} for i in range(5)], ts=2)
    (batch, _) = storage.catalog.manifest(id).batches
    assert (batch.path, batch.rows) == (first, 10)

    plan = storage.snapshot(id, 2)
    frame = spark.read.schema(plan.file_ddl).parquet(*plan.uris).where(plan.time_filter)
    assert sorted(r.id for r in frame.collect()) == [*range(10), *range(100, 105)]
    assert sorted(storage.read_snapshot(id, 2)["id"].to_pylist()) == [*range(10), *range(100, 105)]

    storage.acquire_read_hold(id, "h", F(3))
    storage.compare_and_append(id, F(3), F(4))
    assert storage.compact(id) == 2
    compacted = storage.snapshot(id, 3)
    assert spark.read.schema(compacted.file_ddl).parquet(*compacted.uris).count() == 15


@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_int96_timestamps_are_refused_with_the_setting_to_change(
    spark: SparkSession, storage: Storage
) -> None:
    id = storage.create_source("sales", SCHEMA).id
    spark.conf.set("spark.sql.parquet.outputTimestampType", "INT96")  # Spark's default
    try:
        relative = write(spark, storage, id, 0, 0, 3)
    finally:
        spark.conf.set("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
    with pytest.raises(InvalidArgument, match="outputTimestampType is TIMESTAMP_MICROS"):
        storage.commit_batch(id, F(0), F(1), relative)
    assert storage.upper(id) == F(0) and not Path(storage.fs_path(relative)).exists()
