"""The pure command model of Tandem: timestamps and frontiers, the commands and responses
of the compute protocol, `CommandHistory` and its reduction, and a reference model of
replica state.

Dependency rule: this package imports only the standard library. It knows nothing of
gRPC, Spark, SQL databases, asyncio or any other package of ours (enforced by
tests/test_layering.py).
"""

from history._commands import (
    AllowCompaction,
    CancelPeek,
    ComputeCommand,
    ComputeParameters,
    CreateDataflow,
    CreateInstance,
    DataflowDescription,
    Hello,
    Resume,
    Import,
    IndexExport,
    IndexTarget,
    InitializationComplete,
    InstanceConfig,
    OrderBy,
    Peek,
    PeekTarget,
    Predicate,
    RowSetFinishing,
    Scalar,
    Schedule,
    SinkExport,
    SqlTarget,
    UpdateConfiguration,
)
from history._frontier import Frontier, Timestamp, join_all, meet_all
from history._history import RECENT_COMMANDS, CommandHistory, reduce_commands
from history._model import LiveDataflow, ReplicaModel, ReplicaState, apply
from history._responses import (
    ComputeResponse,
    DataflowStatus,
    FrontiersResponse,
    PeekCanceled,
    PeekError,
    PeekResponse,
    PeekResult,
    PeekRows,
    StatusResponse,
)

__all__ = [
    "AllowCompaction",
    "CancelPeek",
    "CommandHistory",
    "ComputeCommand",
    "ComputeParameters",
    "ComputeResponse",
    "CreateDataflow",
    "CreateInstance",
    "DataflowDescription",
    "DataflowStatus",
    "Frontier",
    "FrontiersResponse",
    "Hello",
    "Resume",
    "Import",
    "IndexExport",
    "IndexTarget",
    "InitializationComplete",
    "InstanceConfig",
    "LiveDataflow",
    "OrderBy",
    "Peek",
    "PeekCanceled",
    "PeekError",
    "PeekResponse",
    "PeekResult",
    "PeekRows",
    "PeekTarget",
    "Predicate",
    "ReplicaModel",
    "ReplicaState",
    "RowSetFinishing",
    "Scalar",
    "Schedule",
    "SinkExport",
    "SqlTarget",
    "StatusResponse",
    "Timestamp",
    "UpdateConfiguration",
    "apply",
    "join_all",
    "meet_all",
    "RECENT_COMMANDS",
    "reduce_commands",
]
