"""What the benchmarks that step dataflows in this process share: a `small` replica's
Spark session, the generated `sales` source loaded into scratch storage, and a dataflow
maintained as a replica maintains it.

Kept apart from `_common` so that the benchmarks that drive a controller do not import
Spark."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pyarrow as pa
from pyspark.sql import SparkSession

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import GROUPS, LOAD_BATCH, SALES, sales_rows, scratch_storage  # noqa: E402

import history as h  # noqa: E402
from catalog._instances import DETERMINISTIC_SPARK_CONF  # noqa: E402
from replica_service import _spark  # noqa: E402
from replica_service.dataplane import StorageReader, maintainer  # noqa: E402
from storage import Storage  # noqa: E402

PARTITIONS = 4  # a `small` replica's shuffle partitions


def small_session(root: Path) -> SparkSession:
    """A `small` replica's session (local[2], 1 GB) with an instance's default settings."""
    return _spark.start_session(_spark.SparkSettings("local[2]", "1g"), root / "spark", DETERMINISTIC_SPARK_CONF)


def load_sales(storage: Storage, rows: int, *, groups: int = GROUPS) -> int:
    """A `sales` source of `rows` generated rows in `groups` regions, all inserted (each
    load batch with seed 1, the rows `_common.change` retracts from); its id."""
    sales = storage.create_source("sales", SALES).id
    for start in range(0, rows, LOAD_BATCH):
        loaded = sales_rows(start, min(LOAD_BATCH, rows - start), seed=1, groups=groups)
        storage.append(sales, loaded.append_column("_diff", pa.array([1] * loaded.num_rows, pa.int64())))
    return sales


def sales_in_session(root: Path, rows: int) -> tuple[Storage, SparkSession, int, StorageReader]:
    """Scratch storage under `root`, a `small` replica's session, a `sales` source of
    `rows` rows in it (`load_sales`) and a reader of `sales` refreshed in the session."""
    storage = scratch_storage(root)
    session = small_session(root)
    sales = load_sales(storage, rows)
    reader = StorageReader(storage, sales)
    reader.refresh(session)
    return storage, session, sales, reader


class SteppedFlow:
    """A dataflow indexed whole and maintained in a dataflow session of its own, as a
    replica maintains it. `version` is its index's version as of the last step."""

    def __init__(self, session: SparkSession, name: str, sql: str, inputs: dict[str, StorageReader], *, strategy: str = "incremental") -> None:
        desc = h.DataflowDescription(name, sql, (), (h.IndexExport(name, ()),), strategy=strategy)
        self.session = _spark.dataflow_session(session, DETERMINISTIC_SPARK_CONF)
        self.maintainer = maintainer(desc, self.session, inputs, {}, PARTITIONS)
        self.version: pa.Table | None = None

    def step(self, *times: int) -> float:
        """Step over `times` (ascending) in one step, as a replica behind by them does,
        and apply their changes to `version` (from `step` to `finish`, as a replica's step
        runs); the seconds it took."""
        started = time.perf_counter()
        output = self.maintainer.step(list(times))
        _, self.version = output.versions(self.version)
        output.finish()
        return time.perf_counter() - started

    def close(self) -> None:
        self.maintainer.close()
