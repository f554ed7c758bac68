"""The wire protocol of Tandem: the `.proto` files, the modules generated from them, the
codec between `history` values and protobuf messages, and Arrow IPC for rows.

Dependency rule: this package imports `history` and nothing else of ours (no catalog,
storage, replica_service or controller), so both ends of a connection share it and the
pure model stays free of gRPC.

The generated modules (`*_pb2.py`, `*_pb2.pyi`, `*_pb2_grpc.py`) are committed and never
edited by hand: `python -m protocol.codegen` regenerates them, `--check` names stale ones.
Import them directly: `from protocol import compute_pb2, compute_pb2_grpc`.
"""

from protocol._errors import ProtocolError
from protocol.arrow import ipc_to_schema, ipc_to_table, schema_to_ipc, table_to_ipc
from protocol.codec import (
    HelloAck,
    Refusal,
    RefusalCode,
    WireCommand,
    WireResponse,
    command_from_proto,
    command_to_proto,
    response_from_proto,
    response_to_proto,
)

__all__ = [
    "ProtocolError",
    "HelloAck",
    "Refusal",
    "RefusalCode",
    "WireCommand",
    "WireResponse",
    "command_from_proto",
    "command_to_proto",
    "ipc_to_schema",
    "ipc_to_table",
    "response_from_proto",
    "response_to_proto",
    "schema_to_ipc",
    "table_to_ipc",
]
