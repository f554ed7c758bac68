"""Conversion between the pure model in `history` and the messages of `compute.proto`.

Laws (tested with hypothesis in tests/test_protocol_codec.py):
- `command_from_proto(command_to_proto(c)) == c` for every command, `Hello` included, and
  `response_from_proto(response_to_proto(r, nonce)) == (nonce, r)` for every response,
  also after serializing to bytes and parsing again.
- The codec raises `ProtocolError` and nothing else, saying what is wrong and in which
  command or response. Decoding refuses a malformed message: a missing oneof, an unknown
  enum value, a negative time or count, a predicate whose value does not fit its op. Encoding
  refuses the same values, so it never builds a message that decoding would refuse, and
  also what the wire cannot hold (an int outside int64, a literal that is not a `Scalar`).
- Only the wire shape and the model's own invariants are checked here. What only the
  receiver can know (that a dataflow's imports exist, that a peek's target is readable) is
  the receiver's to check.

Every oneof is dispatched through a table: keyed by model type to encode, by oneof member
name to decode. The two tables of each oneof sit side by side.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, TypeVar, Union

from google.protobuf.message import Message

import history as h
from protocol import compute_pb2 as pb
from protocol._errors import ProtocolError

RefusalCode = Literal["stale_epoch", "protocol_violation"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """The replica refuses the connection: its last response before it ends the stream.

    `stale_epoch`: `Hello` carried an epoch below the highest the replica has seen, so the
    sender is a controller that has been replaced. `protocol_violation`: a command that
    does not decode, or that the connection's state does not allow (anything before
    `Hello`, a second `CreateInstance`). A wire-level answer, not part of `history`: it
    changes no replica state.
    """

    code: RefusalCode
    message: str


@dataclass(frozen=True, slots=True)
class HelloAck:
    """The replica's first response on a connection it accepted.

    `resumed`: it continues the session `Hello.resume` named (its dataflows, pending peeks
    and buffered commands kept); `applied` is then the number of commands that session
    has received since its opening `Hello`, so the controller sends the commands after
    those. Not resumed: a new session (`applied` = 0), which expects `CreateInstance`
    and the replayed history. A wire-level answer, not part of `history`.
    """

    resumed: bool
    applied: int


WireCommand = Union[h.Hello, h.ComputeCommand]
"""What the controller sends: `Hello`, then the commands a history holds."""

WireResponse = Union[h.ComputeResponse, Refusal, HelloAck]
"""What a replica sends."""


def command_to_proto(command: WireCommand) -> pb.ComputeCommand:
    """The envelope carrying `command`."""
    with _refusing(f"cannot encode {type(command).__name__}"):
        return pb.ComputeCommand(**_encode_oneof(_COMMAND_ENCODERS, command, "command type"))


def command_from_proto(message: pb.ComputeCommand) -> WireCommand:
    """The command `message` carries."""
    member = _which(message, "kind")
    with _refusing(f"malformed ComputeCommand.{member}"):
        return _COMMAND_DECODERS[member](getattr(message, member))


def response_to_proto(response: WireResponse, nonce: str) -> pb.ComputeResponse:
    """The envelope carrying `response`, tagged with the connection's `nonce`."""
    with _refusing(f"cannot encode {type(response).__name__}"):
        return pb.ComputeResponse(
            nonce=nonce, **_encode_oneof(_RESPONSE_ENCODERS, response, "response type")
        )


def response_from_proto(message: pb.ComputeResponse) -> tuple[str, WireResponse]:
    """The nonce `message` is tagged with, and the response it carries."""
    member = _which(message, "kind")
    with _refusing(f"malformed ComputeResponse.{member}"):
        return message.nonce, _RESPONSE_DECODERS[member](getattr(message, member))


# --- Machinery -------------------------------------------------------------------------

_K = TypeVar("_K")
_V = TypeVar("_V")
_Encoders = Mapping[type, tuple[str, Callable[[Any], Message]]]
_Decoders = Mapping[str, Callable[[Any], Any]]


@contextmanager
def _refusing(context: str) -> Iterator[None]:
    """Re-raise a bad value or message, whether we or protobuf found it, as one
    `ProtocolError` that starts with `context`."""
    try:
        yield
    except (ValueError, TypeError) as error:
        raise ProtocolError(f"{context}: {error}") from error


def _lookup(table: Mapping[_K, _V], key: _K, what: str) -> _V:
    try:
        return table[key]
    except KeyError:
        raise ProtocolError(f"unknown {what} {key!r}") from None


def _which(message: Message, oneof: str) -> str:
    member = message.WhichOneof(oneof)
    if member is None:
        # A member added by a newer peer arrives as an unknown field and looks the same.
        raise ProtocolError(f"{message.DESCRIPTOR.name}.{oneof} is not set")
    return member


def _encode_oneof(table: _Encoders, value: object, what: str) -> dict[str, Message]:
    """`{member: message}`, to pass as keyword arguments to the message with the oneof."""
    member, encode = _lookup(table, type(value), what)
    return {member: encode(value)}


def _decode_oneof(table: _Decoders, message: Message, oneof: str) -> Any:
    member = _which(message, oneof)
    return table[member](getattr(message, member))


def _optional(message: Message, field: str) -> Any:
    """The value of a field with presence, or None when it is absent."""
    return getattr(message, field) if message.HasField(field) else None


def _time(time: int) -> int:
    if time < 0:
        raise ProtocolError(f"a time must not be negative, got {time}")
    return time


def _count(count: int, name: str) -> int:
    if count < 0:
        raise ProtocolError(f"{name} must not be negative, got {count}")
    return count


# --- Values ----------------------------------------------------------------------------


def _frontier_to_proto(frontier: h.Frontier) -> pb.Frontier:
    if frontier.time is None:
        return pb.Frontier(empty=pb.Empty())
    return pb.Frontier(time=frontier.time)


def _frontier_from_proto(message: pb.Frontier) -> h.Frontier:
    if _which(message, "kind") == "empty":
        return h.Frontier.empty()
    return h.Frontier(_time(message.time))


# By exact type: bool is a subclass of int but must stay a bool.
_SCALAR_MEMBERS = {
    type(None): "null_value",
    bool: "bool_value",
    int: "int_value",
    float: "double_value",
    str: "string_value",
}


def _scalar_to_proto(value: h.Scalar) -> pb.Scalar:
    member = _lookup(_SCALAR_MEMBERS, type(value), "scalar type")
    return pb.Scalar(**{member: pb.Empty() if value is None else value})


def _scalar_from_proto(message: pb.Scalar) -> h.Scalar:
    member = _which(message, "kind")
    return None if member == "null_value" else getattr(message, member)


def _scalars_to_proto(values: Iterable[h.Scalar]) -> pb.ScalarList:
    return pb.ScalarList(values=[_scalar_to_proto(value) for value in values])


def _scalars_from_proto(message: pb.ScalarList) -> tuple[h.Scalar, ...]:
    return tuple(_scalar_from_proto(value) for value in message.values)


# --- Descriptions ----------------------------------------------------------------------

_IMPORT_KINDS = {"storage": pb.IMPORT_KIND_STORAGE, "index": pb.IMPORT_KIND_INDEX}
_IMPORT_KINDS_FROM_PROTO = {wire: kind for kind, wire in _IMPORT_KINDS.items()}


def _imports_to_proto(imports: Iterable[h.Import]) -> list[pb.Import]:
    return [
        pb.Import(name=i.name, id=i.id, kind=_lookup(_IMPORT_KINDS, i.kind, "import kind"))
        for i in imports
    ]


def _imports_from_proto(messages: Iterable[pb.Import]) -> tuple[h.Import, ...]:
    return tuple(
        h.Import(m.name, m.id, _lookup(_IMPORT_KINDS_FROM_PROTO, m.kind, "ImportKind"))
        for m in messages
    )


def _dataflow_to_proto(desc: h.DataflowDescription) -> pb.DataflowDescription:
    return pb.DataflowDescription(
        name=desc.name,
        sql=desc.sql,
        imports=_imports_to_proto(desc.imports),
        index_exports=[pb.IndexExport(id=e.id, key=e.key) for e in desc.index_exports],
        sink_exports=[pb.SinkExport(id=e.id) for e in desc.sink_exports],
        as_of=_frontier_to_proto(desc.as_of),
        until=_frontier_to_proto(desc.until),
        schema=desc.schema,
        strategy=_lookup(_STRATEGIES, desc.strategy, "dataflow strategy"),
    )


def _dataflow_from_proto(message: pb.DataflowDescription) -> h.DataflowDescription:
    return h.DataflowDescription(
        name=message.name,
        sql=message.sql,
        imports=_imports_from_proto(message.imports),
        index_exports=tuple(h.IndexExport(e.id, tuple(e.key)) for e in message.index_exports),
        sink_exports=tuple(h.SinkExport(e.id) for e in message.sink_exports),
        as_of=_frontier_from_proto(message.as_of),
        until=_frontier_from_proto(message.until),
        schema=message.schema,
        strategy=_lookup(_STRATEGY_NAMES, message.strategy, "DataflowStrategy"),
    )


_STRATEGIES = {
    "recompute": pb.DATAFLOW_STRATEGY_RECOMPUTE,
    "incremental": pb.DATAFLOW_STRATEGY_INCREMENTAL,
}
_STRATEGY_NAMES = {v: k for k, v in _STRATEGIES.items()}


# The fields of both sides match by name; a field added to one side only fails every
# round trip of a non-default value.
_PARAMETERS = tuple(f.name for f in fields(h.ComputeParameters))


def _parameters_to_proto(params: h.ComputeParameters) -> pb.ComputeParameters:
    return pb.ComputeParameters(**{name: getattr(params, name) for name in _PARAMETERS})


def _parameters_from_proto(message: pb.ComputeParameters) -> h.ComputeParameters:
    return h.ComputeParameters(**{name: _optional(message, name) for name in _PARAMETERS})


# op -> (wire enum, the `value` member that carries its operand, or None for no operand)
_PREDICATE_OPS: dict[str, tuple[int, str | None]] = {
    "=": (pb.PREDICATE_OP_EQ, "scalar"),
    "!=": (pb.PREDICATE_OP_NE, "scalar"),
    "<": (pb.PREDICATE_OP_LT, "scalar"),
    "<=": (pb.PREDICATE_OP_LE, "scalar"),
    ">": (pb.PREDICATE_OP_GT, "scalar"),
    ">=": (pb.PREDICATE_OP_GE, "scalar"),
    "in": (pb.PREDICATE_OP_IN, "values"),
    "is_null": (pb.PREDICATE_OP_IS_NULL, None),
    "is_not_null": (pb.PREDICATE_OP_IS_NOT_NULL, None),
}
_PREDICATE_OPS_FROM_PROTO = {wire: (op, member) for op, (wire, member) in _PREDICATE_OPS.items()}
_OPERAND_ENCODERS = {"scalar": _scalar_to_proto, "values": _scalars_to_proto}
_OPERAND_DECODERS = {"scalar": _scalar_from_proto, "values": _scalars_from_proto}


def _predicate_to_proto(predicate: h.Predicate) -> pb.Predicate:
    wire, member = _lookup(_PREDICATE_OPS, predicate.op, "predicate op")
    value = predicate.value
    if member is None and value is None:
        return pb.Predicate(column=predicate.column, op=wire)
    if member != ("values" if isinstance(value, tuple) else "scalar"):
        raise ProtocolError(f"predicate {predicate.op!r} cannot take the value {value!r}")
    operand = {member: _OPERAND_ENCODERS[member](value)}
    return pb.Predicate(column=predicate.column, op=wire, **operand)


def _predicate_from_proto(message: pb.Predicate) -> h.Predicate:
    op, member = _lookup(_PREDICATE_OPS_FROM_PROTO, message.op, "PredicateOp")
    carried = message.WhichOneof("value")
    if carried != member:
        raise ProtocolError(
            f"predicate {op!r} takes {member or 'no value'}, not {carried or 'no value'}"
        )
    value = None if member is None else _OPERAND_DECODERS[member](getattr(message, member))
    return h.Predicate(message.column, op, value)


def _finishing_to_proto(finishing: h.RowSetFinishing) -> pb.RowSetFinishing:
    key, projection = finishing.key, finishing.projection
    return pb.RowSetFinishing(
        key=None if key is None else _scalars_to_proto(key),
        filter=[_predicate_to_proto(p) for p in finishing.filter],
        order_by=[
            pb.OrderBy(column=o.column, descending=o.descending, nulls_last=o.nulls_last)
            for o in finishing.order_by
        ],
        offset=finishing.offset,
        limit=finishing.limit,
        projection=None if projection is None else pb.StringList(values=projection),
    )


def _finishing_from_proto(message: pb.RowSetFinishing) -> h.RowSetFinishing:
    return h.RowSetFinishing(
        key=_scalars_from_proto(message.key) if message.HasField("key") else None,
        filter=tuple(_predicate_from_proto(p) for p in message.filter),
        order_by=tuple(h.OrderBy(o.column, o.descending, o.nulls_last) for o in message.order_by),
        offset=message.offset,
        limit=_optional(message, "limit"),
        projection=tuple(message.projection.values) if message.HasField("projection") else None,
    )


_TARGET_ENCODERS: _Encoders = {
    h.IndexTarget: ("index", lambda t: pb.IndexTarget(id=t.id)),
    h.SqlTarget: ("sql", lambda t: pb.SqlTarget(sql=t.sql, imports=_imports_to_proto(t.imports))),
}
_TARGET_DECODERS: _Decoders = {
    "index": lambda m: h.IndexTarget(m.id),
    "sql": lambda m: h.SqlTarget(m.sql, _imports_from_proto(m.imports)),
}


# --- Commands --------------------------------------------------------------------------


def _config_to_proto(config: h.InstanceConfig) -> pb.InstanceConfig:
    return pb.InstanceConfig(name=config.name, spark_conf=dict(config.spark_conf))


def _config_from_proto(message: pb.InstanceConfig) -> h.InstanceConfig:
    # `of` restores the canonical form: pairs sorted by key (a map has no order).
    return h.InstanceConfig.of(message.name, message.spark_conf)


def _peek_to_proto(peek: h.Peek) -> pb.Peek:
    return pb.Peek(
        uuid=peek.uuid,
        timestamp=_time(peek.timestamp),
        finishing=_finishing_to_proto(peek.finishing),
        timeout_ms=peek.timeout_ms,
        **_encode_oneof(_TARGET_ENCODERS, peek.target, "peek target type"),
    )


def _peek_from_proto(message: pb.Peek) -> h.Peek:
    return h.Peek(
        uuid=message.uuid,
        target=_decode_oneof(_TARGET_DECODERS, message, "target"),
        timestamp=_time(message.timestamp),
        finishing=_finishing_from_proto(message.finishing),
        timeout_ms=message.timeout_ms,
    )


def _hello_to_proto(hello: h.Hello) -> pb.Hello:
    resume = hello.resume
    return pb.Hello(
        controller_epoch=hello.controller_epoch,
        nonce=hello.nonce,
        resume=None
        if resume is None
        else pb.Resume(nonce=resume.nonce, min_applied=_count(resume.min_applied, "min_applied")),
        costliest_first=hello.costliest_first,
    )


def _hello_from_proto(message: pb.Hello) -> h.Hello:
    resume = None
    if message.HasField("resume"):
        m = message.resume
        resume = h.Resume(m.nonce, _count(m.min_applied, "min_applied"))
    return h.Hello(message.controller_epoch, message.nonce, resume, message.costliest_first)


_COMMAND_ENCODERS: _Encoders = {
    h.Hello: ("hello", _hello_to_proto),
    h.CreateInstance: (
        "create_instance",
        lambda c: pb.CreateInstance(config=_config_to_proto(c.config)),
    ),
    h.InitializationComplete: ("initialization_complete", lambda c: pb.InitializationComplete()),
    h.UpdateConfiguration: (
        "update_configuration",
        lambda c: pb.UpdateConfiguration(params=_parameters_to_proto(c.params)),
    ),
    h.CreateDataflow: (
        "create_dataflow",
        lambda c: pb.CreateDataflow(desc=_dataflow_to_proto(c.desc)),
    ),
    h.Schedule: ("schedule", lambda c: pb.Schedule(id=c.id)),
    h.AllowCompaction: (
        "allow_compaction",
        lambda c: pb.AllowCompaction(id=c.id, frontier=_frontier_to_proto(c.frontier)),
    ),
    h.Peek: ("peek", _peek_to_proto),
    h.CancelPeek: ("cancel_peek", lambda c: pb.CancelPeek(uuid=c.uuid)),
    h.Subscribe: (
        "subscribe",
        lambda c: pb.Subscribe(uuid=c.uuid, id=c.id, as_of=_time(c.as_of), snapshot=c.snapshot),
    ),
    h.CancelSubscribe: ("cancel_subscribe", lambda c: pb.CancelSubscribe(uuid=c.uuid)),
}
_COMMAND_DECODERS: _Decoders = {
    "hello": _hello_from_proto,
    "create_instance": lambda m: h.CreateInstance(_config_from_proto(m.config)),
    "initialization_complete": lambda m: h.InitializationComplete(),
    "update_configuration": lambda m: h.UpdateConfiguration(_parameters_from_proto(m.params)),
    "create_dataflow": lambda m: h.CreateDataflow(_dataflow_from_proto(m.desc)),
    "schedule": lambda m: h.Schedule(m.id),
    "allow_compaction": lambda m: h.AllowCompaction(m.id, _frontier_from_proto(m.frontier)),
    "peek": _peek_from_proto,
    "cancel_peek": lambda m: h.CancelPeek(m.uuid),
    "subscribe": lambda m: h.Subscribe(m.uuid, m.id, _time(m.as_of), m.snapshot),
    "cancel_subscribe": lambda m: h.CancelSubscribe(m.uuid),
}


# --- Responses -------------------------------------------------------------------------

_RESULT_ENCODERS: _Encoders = {
    h.PeekRows: (
        "rows",
        lambda r: pb.PeekRows(arrow_ipc=r.arrow_ipc, row_count=r.row_count, digest=r.digest),
    ),
    h.PeekError: ("error", lambda r: pb.PeekError(message=r.message)),
    h.PeekCanceled: ("canceled", lambda r: pb.PeekCanceled()),
}
_RESULT_DECODERS: _Decoders = {
    "rows": lambda m: h.PeekRows(m.arrow_ipc, m.row_count, m.digest),
    "error": lambda m: h.PeekError(m.message),
    "canceled": lambda m: h.PeekCanceled(),
}


def _status_to_proto(status: h.StatusResponse) -> pb.StatusResponse:
    return pb.StatusResponse(
        heartbeat=status.heartbeat,
        dataflows=[
            pb.DataflowStatus(
                id=d.id,
                hydrated=d.hydrated,
                error=d.error,
                digest=d.digest,
                last_step_ms=d.last_step_ms,
                rows_changed=d.rows_changed,
                steps=d.steps,
                digest_time=d.digest_time,
                hydration_tasks_done=d.hydration_tasks_done,
                hydration_tasks_total=d.hydration_tasks_total,
                pending_times=d.pending_times,
                pending_rows=d.pending_rows,
                last_step_times=d.last_step_times,
                retries=d.retries,
                retry_error=d.retry_error,
                needs_new_session=d.needs_new_session,
            )
            for d in status.dataflows
        ],
        dataflows_kept=status.dataflows_kept,
        dataflows_built=status.dataflows_built,
        pid=status.pid,
        errors=status.errors,
        metrics_address=status.metrics_address,
    )


def _status_from_proto(message: pb.StatusResponse) -> h.StatusResponse:
    return h.StatusResponse(
        heartbeat=message.heartbeat,
        dataflows=tuple(
            h.DataflowStatus(
                d.id,
                d.hydrated,
                _optional(d, "error"),
                d.digest,
                d.last_step_ms,
                d.rows_changed,
                d.steps,
                _optional(d, "digest_time"),
                d.hydration_tasks_done,
                d.hydration_tasks_total,
                d.pending_times,
                d.pending_rows,
                d.last_step_times,
                d.retries,
                _optional(d, "retry_error"),
                _optional(d, "needs_new_session"),
            )
            for d in message.dataflows
        ),
        dataflows_kept=message.dataflows_kept,
        dataflows_built=message.dataflows_built,
        pid=message.pid,
        errors=tuple(message.errors),
        metrics_address=message.metrics_address,
    )


def _subscribe_response_to_proto(r: h.SubscribeResponse) -> pb.SubscribeResponse:
    return pb.SubscribeResponse(
        uuid=r.uuid,
        lower=_time(r.lower),
        upper=_time(r.upper),
        changes=[
            pb.SubscribeChanges(time=_time(c.time), arrow_ipc=c.arrow_ipc, row_count=_count(c.row_count, "row_count"))
            for c in r.changes
        ],
        error=r.error,
    )


def _subscribe_response_from_proto(m: pb.SubscribeResponse) -> h.SubscribeResponse:
    return h.SubscribeResponse(
        m.uuid,
        _time(m.lower),
        _time(m.upper),
        tuple(h.SubscribeChanges(_time(c.time), c.arrow_ipc, _count(c.row_count, "row_count")) for c in m.changes),
        _optional(m, "error"),
    )


_REFUSAL_CODES = {
    "stale_epoch": pb.REFUSAL_CODE_STALE_EPOCH,
    "protocol_violation": pb.REFUSAL_CODE_PROTOCOL_VIOLATION,
}
_REFUSAL_CODES_FROM_PROTO = {wire: code for code, wire in _REFUSAL_CODES.items()}

_RESPONSE_ENCODERS: _Encoders = {
    h.FrontiersResponse: (
        "frontiers",
        lambda r: pb.FrontiersResponse(
            id=r.id, write_frontier=_frontier_to_proto(r.write_frontier)
        ),
    ),
    h.PeekResponse: (
        "peek",
        lambda r: pb.PeekResponse(
            uuid=r.uuid, **_encode_oneof(_RESULT_ENCODERS, r.result, "peek result type")
        ),
    ),
    h.StatusResponse: ("status", _status_to_proto),
    h.SubscribeResponse: ("subscribe", _subscribe_response_to_proto),
    Refusal: (
        "refusal",
        lambda r: pb.Refusal(
            code=_lookup(_REFUSAL_CODES, r.code, "refusal code"), message=r.message
        ),
    ),
    HelloAck: (
        "hello_ack",
        lambda r: pb.HelloAck(resumed=r.resumed, applied=_count(r.applied, "applied")),
    ),
}
_RESPONSE_DECODERS: _Decoders = {
    "frontiers": lambda m: h.FrontiersResponse(m.id, _frontier_from_proto(m.write_frontier)),
    "peek": lambda m: h.PeekResponse(m.uuid, _decode_oneof(_RESULT_DECODERS, m, "result")),
    "status": _status_from_proto,
    "subscribe": _subscribe_response_from_proto,
    "refusal": lambda m: Refusal(
        _lookup(_REFUSAL_CODES_FROM_PROTO, m.code, "RefusalCode"), m.message
    ),
    "hello_ack": lambda m: HelloAck(m.resumed, _count(m.applied, "applied")),
}
