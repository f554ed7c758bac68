"""The replica's data plane: reading storage into Spark, computing a dataflow's versions
(incrementally or by recompute), writing materialized views, and the state incremental
dataflows keep. The command loop (`replica_service._replica`) only decides when to call
it.

Rules of this package:
- **No input row passes through the replica's Python process.** Storage inputs reach
  Spark as DataFrames over the batch files (`StorageReader`), which the executors read;
  materialized-view batches are written by the executors (`SinkWriter`). What this
  process holds is bounded by the outputs it serves: index versions, collected from
  Spark, and the changes of index inputs handed back to Spark.
- **One reader per storage collection per replica**, shared by every dataflow that
  imports it.
- **State lives on Spark**: accumulators and value counts of incremental dataflows are
  checkpointed DataFrames on the executors' local disks; the inputs other sides of a
  join read whole come from a base per collection persisted there too. Nothing of
  them takes executor memory between steps, which joins and aggregations need.
- **The same bits on every replica.** Incremental aggregates are exact sums, so a
  version does not depend on the path that led to it; a recomputed order-sensitive
  aggregate reads its inputs in a canonical layout, and a recomputed LIMIT cuts an order
  completed by every column. Outputs are multisets: order never matters until an index
  sorts a version canonically.
- **Every call blocks** on Spark (py4j): run it on a step thread, never on the event loop.
  Nothing here awaits.
"""

from replica_service.dataplane._incremental import IncrementalDataflow
from replica_service.dataplane._maintain import Maintainer, StepOutput, maintainer, order_sensitive
from replica_service.dataplane._orders import unordered_limit
from replica_service.dataplane._plan import DeltaPlan, NotIncremental, delta_plan
from replica_service.dataplane._reader import Lease, StorageReader
from replica_service.dataplane._rows import spark_ddl, spark_type
from replica_service.dataplane._sink import SinkWriter

__all__ = [
    "DeltaPlan",
    "IncrementalDataflow",
    "Lease",
    "Maintainer",
    "NotIncremental",
    "SinkWriter",
    "StepOutput",
    "StorageReader",
    "delta_plan",
    "maintainer",
    "order_sensitive",
    "spark_ddl",
    "spark_type",
    "unordered_limit",
]
