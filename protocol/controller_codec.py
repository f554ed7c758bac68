"""Conversions of `controller.proto` that the client and the servicer share.

Each pair here round-trips: `x_from_proto(x_to_proto(v)) == v` for every value the
controller API accepts, so what a client sends is what the API receives. Decoding raises
`ProtocolError` and nothing else (the servicer answers INVALID_ARGUMENT); so does encoding
a value the wire cannot carry. Views are converted next to their dataclasses, in
`controller/`: this module may import `history` and nothing else of ours.

Rows appended as mappings travel as one JSON object per row (`rows_to_json`), so that
storage, not this codec, checks them against the source's schema and names the bad column
and row. Values JSON cannot hold are tagged objects `{"$type": tag, "value": text}`. Only
a row's values are untagged, never the row itself, so a column may be named `$type`; and
a storage column never takes an object, so a tag cannot be mistaken for a value.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import pyarrow as pa
from google.protobuf.message import Message

import history as h
from protocol import compute_pb2 as cpb
from protocol import controller_pb2 as pb
from protocol._errors import ProtocolError
from protocol.arrow import ipc_to_table, table_to_ipc

# Shared with the compute codec, so a predicate or an order means the same on both wires.
from protocol.codec import (
    _predicate_from_proto,
    _predicate_to_proto,
    _refusing,
    _scalars_from_proto,
    _scalars_to_proto,
)

# Results and appends carry whole tables; gRPC's default limit of 4 MiB is too small.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
# A client pings its connection every 2 s and gives up on it after 3 s more without an
# answer, so a call to a controller that hangs (SIGSTOP: its socket stays open) fails as
# UNAVAILABLE, and the client moves to the next address, instead of waiting out the
# call's deadline. The server lets pings come that often, data or not. A channel whose
# controller was gone retries the connection within 1 s: with gRPC's backoff (1 s,
# growing to 2 min) every call to a controller restarted on that address (a standby
# that took the lead) failed "failed to connect" for seconds after it listened again.
CLIENT_CHANNEL_OPTIONS = (
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 3_000),
    ("grpc.http2.ping_timeout_ms", 3_000),  # else a ping's answer is awaited 60 s
    ("grpc.http2.max_pings_without_data", 0),
)
SERVER_OPTIONS = (
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
)

# Trailing metadata on every status the controller chose (see controller.proto).
STATUS_METADATA_KEY = "tandem-status"
# Beside an UNAVAILABLE from a controller that does not lead: the leader's address.
LEADER_METADATA_KEY = "tandem-leader"

Consistency = Literal["serializable", "strict"]


# --- Optional values -------------------------------------------------------------------


def optional_field(message: Message, field: str) -> Any:
    """The value of a field with presence, or None when it is absent."""
    return getattr(message, field) if message.HasField(field) else None


def present_fields(message: Message, *names: str) -> dict[str, Any]:
    """The named `optional` fields that are present, by name: keyword arguments that let
    the API's own defaults stand for the absent ones."""
    return {name: getattr(message, name) for name in names if message.HasField(name)}


def plain_fields(message: Message) -> dict[str, Any]:
    """Every singular non-message field of `message` by name, None for an absent
    `optional` one: the keyword arguments of the view a message mirrors, before its
    nested fields are added."""
    return {
        field.name: (
            optional_field(message, field.name)
            if field.has_presence
            else getattr(message, field.name)
        )
        for field in message.DESCRIPTOR.fields
        if field.message_type is None and not field.is_repeated
    }


def string_map_to_proto(mapping: Mapping[str, str] | None) -> pb.StringMap | None:
    if mapping is None:
        return None
    return pb.StringMap(entries={str(k): str(v) for k, v in mapping.items()})


def string_map_from_proto(message: Message, field: str) -> dict[str, str] | None:
    return dict(getattr(message, field).entries) if message.HasField(field) else None


def strings_to_proto(values: Sequence[str] | None) -> cpb.StringList | None:
    return None if values is None else cpb.StringList(values=values)


def strings_from_proto(message: Message, field: str) -> tuple[str, ...] | None:
    return tuple(getattr(message, field).values) if message.HasField(field) else None


_CONSISTENCY = {"serializable": pb.CONSISTENCY_SERIALIZABLE, "strict": pb.CONSISTENCY_STRICT}
# UNSPECIFIED is the documented default, not an error: a hand-written request may omit it.
_CONSISTENCY_FROM_PROTO = {
    pb.CONSISTENCY_UNSPECIFIED: "serializable",
    **{wire: name for name, wire in _CONSISTENCY.items()},
}


def consistency_to_proto(consistency: str) -> int:
    if consistency not in _CONSISTENCY:
        raise ProtocolError(
            f"consistency must be one of {', '.join(_CONSISTENCY)}, not {consistency!r}"
        )
    return _CONSISTENCY[consistency]


def consistency_from_proto(wire: int) -> Consistency:
    if wire not in _CONSISTENCY_FROM_PROTO:
        raise ProtocolError(f"unknown Consistency {wire}")
    return _CONSISTENCY_FROM_PROTO[wire]  # type: ignore[return-value]


# --- Rows ------------------------------------------------------------------------------


def _b64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


# (type, tag, encode, decode); datetime before date, as a datetime is also a date.
_Tagged = tuple[type | tuple[type, ...], str, Callable[[Any], str], Callable[[str], Any]]
_TAGGED: tuple[_Tagged, ...] = (
    (dt.datetime, "datetime", dt.datetime.isoformat, dt.datetime.fromisoformat),
    (dt.date, "date", dt.date.isoformat, dt.date.fromisoformat),
    (decimal.Decimal, "decimal", str, decimal.Decimal),
    ((bytes, bytearray, memoryview), "bytes", lambda b: base64.b64encode(b).decode(), _b64),
)
_UNTAG = {tag: decode for _, tag, _, decode in _TAGGED}


def _tag(value: Any) -> dict[str, str]:
    for kind, tag, encode, _ in _TAGGED:
        if isinstance(value, kind):
            return {"$type": tag, "value": encode(value)}
    raise TypeError(f"a row value of type {type(value).__name__} cannot be sent: {value!r}")


def _untag(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    tag = value.get("$type")
    if tag not in _UNTAG or set(value) != {"$type", "value"}:
        raise ProtocolError(f"not a tagged value: {value!r}")
    try:
        return _UNTAG[tag](value["value"])
    except (ValueError, TypeError, decimal.InvalidOperation) as error:
        raise ProtocolError(f"bad {tag} {value['value']!r}: {error}") from None


def rows_to_json(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One JSON object per row; dates, datetimes, decimals and bytes tagged."""
    with _refusing("cannot encode rows"):
        return [json.dumps(dict(row), default=_tag) for row in rows]


def rows_from_json(lines: Sequence[str]) -> list[dict[str, Any]]:
    """The rows `rows_to_json` encoded; `ProtocolError` naming the row index of one that
    is not a JSON object or holds a bad tag."""
    rows = []
    for index, line in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError as error:
            raise ProtocolError(f"row index {index}: not JSON: {error}") from None
        if not isinstance(row, dict):
            raise ProtocolError(f"row index {index}: expected a JSON object, got {line[:60]!r}")
        decoded = {}
        for column, value in row.items():
            try:
                decoded[column] = _untag(value)
            except ProtocolError as error:
                raise ProtocolError(f"row index {index}: column {column!r}: {error}") from None
        rows.append(decoded)
    return rows


def append_to_proto(source: str, rows: pa.Table | Sequence[Mapping[str, Any]], idempotency_key: str = "") -> pb.AppendRequest:
    if isinstance(rows, pa.Table):
        return pb.AppendRequest(source=source, rows_arrow=table_to_ipc(rows), idempotency_key=idempotency_key)
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence):
        raise ProtocolError("rows must be a pyarrow.Table or a list of row mappings")
    return pb.AppendRequest(source=source, rows_json=pb.JsonRows(rows=rows_to_json(rows)), idempotency_key=idempotency_key)


def append_from_proto(request: pb.AppendRequest) -> tuple[str, pa.Table | list[dict[str, Any]], str | None]:
    """The source name, its rows (a table, or a list of mappings) and the idempotency
    key (None: none)."""
    member = request.WhichOneof("rows")
    if member is None:
        raise ProtocolError("AppendRequest.rows is not set")
    key = request.idempotency_key or None
    if member == "rows_arrow":
        return request.source, ipc_to_table(request.rows_arrow), key
    return request.source, rows_from_json(request.rows_json.rows), key


# --- Reads -----------------------------------------------------------------------------


def peek_to_proto(
    instance: str,
    name: str,
    *,
    key: Sequence[h.Scalar] | None,
    where: Sequence[h.Predicate],
    order_by: Sequence[h.OrderBy],
    limit: int | None,
    offset: int,
    columns: Sequence[str] | None,
    timestamp: int | None,
    consistency: str,
    timeout_ms: int | None,
) -> pb.PeekRequest:
    """A peek of `ControllerApi.peek`'s arguments, already in their model types."""
    with _refusing("cannot encode a peek"):
        return pb.PeekRequest(
            instance=instance,
            name=name,
            key=None if key is None else _scalars_to_proto(key),
            where=[_predicate_to_proto(p) for p in where],
            order_by=[
                cpb.OrderBy(column=o.column, descending=o.descending, nulls_last=o.nulls_last)
                for o in order_by
            ],
            limit=limit,
            offset=offset,
            columns=strings_to_proto(columns),
            timestamp=timestamp,
            consistency=consistency_to_proto(consistency),
            timeout_ms=timeout_ms,
        )


def peek_from_proto(request: pb.PeekRequest) -> tuple[str, str, dict[str, Any]]:
    """The instance, the dataflow name and the keyword arguments of `ControllerApi.peek`;
    an absent `timeout_ms` is left out, so the API's default applies."""
    with _refusing("malformed PeekRequest"):
        options: dict[str, Any] = {
            "key": _scalars_from_proto(request.key) if request.HasField("key") else None,
            "where": tuple(_predicate_from_proto(p) for p in request.where),
            "order_by": tuple(
                h.OrderBy(o.column, o.descending, o.nulls_last) for o in request.order_by
            ),
            "limit": optional_field(request, "limit"),
            "offset": request.offset,
            "columns": strings_from_proto(request, "columns"),
            "timestamp": optional_field(request, "timestamp"),
            "consistency": consistency_from_proto(request.consistency),
            **present_fields(request, "timeout_ms"),
        }
    return request.instance, request.name, options


def read_result_to_proto(arrow_ipc: bytes, timestamp: int, replica: str | None) -> pb.ReadResult:
    """`arrow_ipc` is passed through as the replica encoded it: no decode, no re-encode."""
    return pb.ReadResult(rows_arrow=arrow_ipc, timestamp=timestamp, replica=replica)


def read_result_from_proto(message: pb.ReadResult) -> tuple[pa.Table, int, str | None]:
    return ipc_to_table(message.rows_arrow), message.timestamp, optional_field(message, "replica")
