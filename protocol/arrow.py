"""Rows on the wire: a `pyarrow.Table` as Arrow IPC *stream* bytes, and back.

The stream format (a schema message, then record batches) rather than the file format:
it has no footer, so it is written and read front to back in one pass. The schema, with
its metadata, travels with the bytes, so a table without rows keeps its columns and types.
"""

from __future__ import annotations

import pyarrow as pa

from protocol._errors import ProtocolError


def table_to_ipc(table: pa.Table) -> bytes:
    """`table` as Arrow IPC stream bytes. `ipc_to_table` gives back an equal table, schema
    and schema metadata included (chunking may differ)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def ipc_to_table(data: bytes) -> pa.Table:
    """The table that Arrow IPC stream bytes hold; `ProtocolError` if they hold none."""
    try:
        return pa.ipc.open_stream(data).read_all()
    # Reading from memory, an OSError can only mean bytes that end mid-message.
    except (pa.ArrowException, OSError) as error:
        raise ProtocolError(f"not an Arrow IPC stream: {error}") from error


# The field metadata key of a column's Spark type in a source's `arrow_schema`
# (controller.proto's SourceView).
SPARK_TYPE = b"spark_type"


def schema_to_ipc(schema: pa.Schema) -> bytes:
    """`schema` (field metadata included) as an Arrow IPC schema message."""
    return schema.serialize().to_pybytes()


def ipc_to_schema(data: bytes) -> pa.Schema:
    """The schema an Arrow IPC schema message holds; `ProtocolError` if it holds none."""
    try:
        return pa.ipc.read_schema(pa.py_buffer(data))
    except (pa.ArrowException, OSError) as error:
        raise ProtocolError(f"not an Arrow IPC schema: {error}") from error
