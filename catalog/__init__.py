"""The Tandem catalog: the durable record a controller is rebuilt from.

It records instances, replicas, collections, dataflows, the storage manifest (batches,
read holds, retired files), the id allocator, the timestamp oracle and the controller
epoch, in SQLite (default, `Catalog.default_url(data_dir)`) or PostgreSQL. The schema is
created and upgraded only by the Alembic migrations in `migrations/`.

Dependency rule: this package imports `history` and nothing else of ours (no storage,
no protocol, no pyspark, grpc or asyncio). Private modules are re-exported here.
"""

from catalog._catalog import Catalog, wall_clock_ms
from catalog._engine import default_url, make_engine
from catalog._errors import (
    AlreadyExists,
    CatalogError,
    CompactedAway,
    FailedPrecondition,
    Fenced,
    InvalidArgument,
    NotFound,
    UpperMismatch,
)
from catalog._leadership import ControllerInfo, ControllerSpec, Leadership
from catalog._instances import (
    DEFAULT_MAX_HOLD_BACK_MS,
    DEFAULT_MAX_LAG_MS,
    DEFAULT_MIN_IN_SYNC,
    DEFAULT_REPLICA_TIMEOUT_MS,
    DETERMINISTIC_SPARK_CONF,
    RESOURCE_SPARK_CONF,
)
from catalog._manifest import check_append_frontiers
from catalog._models import APPEND_KEY_LENGTH
from catalog._records import (
    BatchInfo,
    CollectionInfo,
    CollectionKind,
    DataflowInfo,
    EventInfo,
    HoldInfo,
    HoldOwner,
    InstanceInfo,
    ManifestState,
    ManifestTail,
    Namespace,
    NewBatch,
    NewEvent,
    ReconfigurationInfo,
    ReplicaInfo,
)
from catalog._recovery import dataflow_holder, dependency_order, sink_holder

__all__ = [
    "DEFAULT_MAX_HOLD_BACK_MS",
    "DEFAULT_MAX_LAG_MS",
    "APPEND_KEY_LENGTH",
    "DEFAULT_MIN_IN_SYNC",
    "DEFAULT_REPLICA_TIMEOUT_MS",
    "DETERMINISTIC_SPARK_CONF",
    "RESOURCE_SPARK_CONF",
    "AlreadyExists",
    "BatchInfo",
    "Catalog",
    "CatalogError",
    "CollectionInfo",
    "CollectionKind",
    "CompactedAway",
    "ControllerInfo",
    "ControllerSpec",
    "DataflowInfo",
    "EventInfo",
    "FailedPrecondition",
    "Fenced",
    "HoldInfo",
    "HoldOwner",
    "InstanceInfo",
    "InvalidArgument",
    "Leadership",
    "ManifestState",
    "ManifestTail",
    "Namespace",
    "NewBatch",
    "NewEvent",
    "NotFound",
    "ReconfigurationInfo",
    "ReplicaInfo",
    "UpperMismatch",
    "check_append_frontiers",
    "dataflow_holder",
    "default_url",
    "dependency_order",
    "make_engine",
    "sink_holder",
    "wall_clock_ms",
]
