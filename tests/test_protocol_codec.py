"""The codec between `history` and `compute.proto`, Arrow IPC, and one gRPC stream.

Laws: every command and response survives encoding, serializing, parsing and decoding
unchanged (types and the sign of zero included); every malformed message and every value
the wire cannot carry is refused with a `ProtocolError` that says what is wrong.
"""

from __future__ import annotations

import asyncio
import datetime
import decimal
from typing import get_args

import grpc
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import history as h
from protocol import (
    HelloAck,
    ProtocolError,
    Refusal,
    command_from_proto,
    command_to_proto,
    compute_pb2 as pb,
    compute_pb2_grpc,
    ipc_to_table,
    response_from_proto,
    response_to_proto,
    table_to_ipc,
)
from protocol_strategies import COMMANDS, RESPONSES, texts


def _over_the_wire(message):
    """`message` as the peer parses it from its bytes."""
    return type(message).FromString(message.SerializeToString())


def _assert_same(decoded, original) -> None:
    # `==` alone takes True for 1, 1 for 1.0 and -0.0 for 0.0; the reprs tell them apart.
    assert decoded == original
    assert repr(decoded) == repr(original)


def test_strategies_cover_every_type():
    assert set(COMMANDS) == {h.Hello, *get_args(h.ComputeCommand)}
    assert set(RESPONSES) == {Refusal, HelloAck, *get_args(h.ComputeResponse)}


@pytest.mark.parametrize("kind", COMMANDS, ids=lambda kind: kind.__name__)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_command_round_trip(kind, data):
    command = data.draw(COMMANDS[kind])
    _assert_same(command_from_proto(_over_the_wire(command_to_proto(command))), command)


@pytest.mark.parametrize("kind", RESPONSES, ids=lambda kind: kind.__name__)
@settings(max_examples=300, deadline=None)
@given(data=st.data(), nonce=texts)
def test_response_round_trip(kind, data, nonce):
    response = data.draw(RESPONSES[kind])
    decoded = response_from_proto(_over_the_wire(response_to_proto(response, nonce)))
    _assert_same(decoded, (nonce, response))


def test_absent_and_zero_stay_apart():
    finishing = h.RowSetFinishing(key=(), limit=0, projection=())
    peek = h.Peek("p", h.IndexTarget("u1"), 0, finishing)
    _assert_same(command_from_proto(_over_the_wire(command_to_proto(peek))), peek)
    bare = h.Peek("p", h.IndexTarget("u1"), 0, h.RowSetFinishing())
    _assert_same(command_from_proto(_over_the_wire(command_to_proto(bare))), bare)
    assert command_to_proto(peek) != command_to_proto(bare)


def test_hello_without_resume_and_with_an_empty_one_stay_apart():
    for resume in (None, h.Resume("", 0)):
        hello = h.Hello(1, "n", resume)
        _assert_same(command_from_proto(_over_the_wire(command_to_proto(hello))), hello)


def test_frontier_zero_and_empty_stay_apart():
    for frontier in (h.Frontier(0), h.Frontier.empty()):
        command = h.AllowCompaction("u1", frontier)
        assert command_from_proto(_over_the_wire(command_to_proto(command))) == command


# --- Malformed messages ----------------------------------------------------------------


def _peek(**fields) -> pb.ComputeCommand:
    fields = {"uuid": "p", "index": pb.IndexTarget(id="u1"), **fields}
    return pb.ComputeCommand(peek=pb.Peek(**fields))


def _filter(predicate: pb.Predicate) -> pb.ComputeCommand:
    return _peek(finishing=pb.RowSetFinishing(filter=[predicate]))


_SCALAR = pb.Scalar(int_value=1)
# ComputeCommand field 99, length 0: a command kind this side does not know.
_NEWER_KIND = b"\x9a\x06\x00"

MALFORMED_COMMANDS = {
    "empty envelope": (pb.ComputeCommand(), "ComputeCommand.kind is not set"),
    "unknown kind": (pb.ComputeCommand.FromString(_NEWER_KIND), "ComputeCommand.kind is not set"),
    "frontier missing": (
        pb.ComputeCommand(allow_compaction=pb.AllowCompaction(id="u1")),
        "allow_compaction: Frontier.kind is not set",
    ),
    "negative frontier": (
        pb.ComputeCommand(
            allow_compaction=pb.AllowCompaction(id="u1", frontier=pb.Frontier(time=-1))
        ),
        "time must not be negative, got -1",
    ),
    "negative as_of": (
        pb.ComputeCommand(
            create_dataflow=pb.CreateDataflow(
                desc=pb.DataflowDescription(
                    as_of=pb.Frontier(time=-5), until=pb.Frontier(empty=pb.Empty())
                )
            )
        ),
        "create_dataflow: a time must not be negative",
    ),
    "negative peek time": (_peek(timestamp=-1), "peek: a time must not be negative"),
    "negative min_applied": (
        pb.ComputeCommand(hello=pb.Hello(nonce="n", resume=pb.Resume(nonce="o", min_applied=-1))),
        "hello: min_applied must not be negative, got -1",
    ),
    "peek target missing": (_peek(index=None), "Peek.target is not set"),
    "unknown predicate op": (_filter(pb.Predicate(column="a", op=99)), "unknown PredicateOp 99"),
    "unspecified predicate op": (_filter(pb.Predicate(column="a")), "unknown PredicateOp 0"),
    "in with a scalar": (
        _filter(pb.Predicate(column="a", op=pb.PREDICATE_OP_IN, scalar=_SCALAR)),
        "predicate 'in' takes values, not scalar",
    ),
    "comparison without value": (
        _filter(pb.Predicate(column="a", op=pb.PREDICATE_OP_LT)),
        "predicate '<' takes scalar, not no value",
    ),
    "is_null with a value": (
        _filter(pb.Predicate(column="a", op=pb.PREDICATE_OP_IS_NULL, scalar=_SCALAR)),
        "predicate 'is_null' takes no value, not scalar",
    ),
    "scalar without kind": (
        _peek(finishing=pb.RowSetFinishing(key=pb.ScalarList(values=[pb.Scalar()]))),
        "Scalar.kind is not set",
    ),
    "unspecified import kind": (
        _peek(index=None, sql=pb.SqlTarget(sql="x", imports=[pb.Import(name="a", id="u1")])),
        "unknown ImportKind 0",
    ),
}

MALFORMED_RESPONSES = {
    "empty envelope": (pb.ComputeResponse(nonce="n"), "ComputeResponse.kind is not set"),
    "frontier missing": (
        pb.ComputeResponse(frontiers=pb.FrontiersResponse(id="u1")),
        "frontiers: Frontier.kind is not set",
    ),
    "negative frontier": (
        pb.ComputeResponse(
            frontiers=pb.FrontiersResponse(id="u1", write_frontier=pb.Frontier(time=-2))
        ),
        "time must not be negative",
    ),
    "peek result missing": (
        pb.ComputeResponse(peek=pb.PeekResponse(uuid="p")),
        "PeekResponse.result is not set",
    ),
    "unspecified refusal code": (
        pb.ComputeResponse(refusal=pb.Refusal(message="no")),
        "unknown RefusalCode 0",
    ),
    "negative applied": (
        pb.ComputeResponse(hello_ack=pb.HelloAck(resumed=True, applied=-3)),
        "hello_ack: applied must not be negative, got -3",
    ),
}


@pytest.mark.parametrize("message, expected", MALFORMED_COMMANDS.values(), ids=MALFORMED_COMMANDS)
def test_malformed_command_is_refused(message, expected):
    with pytest.raises(ProtocolError, match=expected):
        command_from_proto(_over_the_wire(message))


@pytest.mark.parametrize(
    "message, expected", MALFORMED_RESPONSES.values(), ids=MALFORMED_RESPONSES
)
def test_malformed_response_is_refused(message, expected):
    with pytest.raises(ProtocolError, match=expected):
        response_from_proto(_over_the_wire(message))


def _peek_finished(**fields) -> h.Peek:
    return h.Peek("p", h.IndexTarget("u1"), 0, h.RowSetFinishing(**fields))


UNENCODABLE_COMMANDS = {
    "int beyond int64": (_peek_finished(key=(2**63,)), "Value out of range"),
    "bytes literal": (_peek_finished(key=(b"x",)), "unknown scalar type <class 'bytes'>"),
    "unknown import kind": (
        h.Peek("p", h.SqlTarget("x", (h.Import("a", "u1", "file"),)), 0),
        "unknown import kind 'file'",
    ),
    "epoch beyond int64": (h.Hello(2**64, "n"), "cannot encode Hello"),
    "negative min_applied": (
        h.Hello(1, "n", h.Resume("o", -1)),
        "cannot encode Hello: min_applied must not be negative",
    ),
    "not a command": ("CreateInstance", "unknown command type <class 'str'>"),
}


@pytest.mark.parametrize(
    "command, expected", UNENCODABLE_COMMANDS.values(), ids=UNENCODABLE_COMMANDS
)
def test_unencodable_command_is_refused(command, expected):
    with pytest.raises(ProtocolError, match=expected):
        command_to_proto(command)


def test_unencodable_response_is_refused():
    with pytest.raises(ProtocolError, match="unknown response type .*Schedule"):
        response_to_proto(h.Schedule("u1"), "n")
    with pytest.raises(ProtocolError, match="unknown refusal code 'bored'"):
        response_to_proto(Refusal("bored", "no"), "n")  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="cannot encode HelloAck: applied must not be negative"):
        response_to_proto(HelloAck(False, -1), "n")


# --- Arrow IPC -------------------------------------------------------------------------

ROWS = pa.table(
    {
        "id": pa.array([1, None, -(2**63)], pa.int64()),
        "amount": pa.array([1.5, float("-inf"), None], pa.float64()),
        "region": pa.array(["eu", None, "日本"], pa.string()),
        "flag": pa.array([True, False, None], pa.bool_()),
        "at": pa.array([datetime.datetime(2024, 1, 1), None, None], pa.timestamp("ms", "UTC")),
        "day": pa.array([datetime.date(2024, 2, 29), None, None], pa.date32()),
        "price": pa.array([decimal.Decimal("12.34"), None, None], pa.decimal128(10, 2)),
        "tags": pa.array([[1, 2], [], None], pa.list_(pa.int64())),
        "blob": pa.array([b"\x00", None, b""], pa.binary()),
    }
).replace_schema_metadata({"tandem.digest": "abc"})


def _assert_arrow_round_trip(table: pa.Table) -> None:
    decoded = ipc_to_table(table_to_ipc(table))
    assert decoded.schema.equals(table.schema, check_metadata=True)
    assert decoded.equals(table, check_metadata=True)


def test_arrow_round_trip_with_types_and_nulls():
    _assert_arrow_round_trip(ROWS)


def test_arrow_round_trip_of_empty_table_keeps_schema():
    empty = ROWS.schema.empty_table()
    _assert_arrow_round_trip(empty)
    assert ipc_to_table(table_to_ipc(empty)).num_rows == 0


def test_arrow_round_trip_of_several_chunks():
    _assert_arrow_round_trip(pa.concat_tables([ROWS, ROWS.slice(1), ROWS.slice(0, 0)]))


@pytest.mark.parametrize("data", [b"", b"not arrow", table_to_ipc(ROWS)[:100]])
def test_bytes_that_are_not_arrow_are_refused(data):
    with pytest.raises(ProtocolError, match="not an Arrow IPC stream"):
        ipc_to_table(data)


# --- gRPC ------------------------------------------------------------------------------


class _EchoReplica(compute_pb2_grpc.ComputeReplicaServicer):
    """A replica reduced to its protocol: refuses a Hello below epoch 1 and acknowledges
    any other as a new session, answers a peek with `ROWS` and a compaction with its
    frontier, and tags every answer with the nonce."""

    async def CommandStream(self, request_iterator, context):
        nonce = ""
        async for message in request_iterator:
            command = command_from_proto(message)
            if isinstance(command, h.Hello):
                if command.controller_epoch < 1:
                    refusal = Refusal("stale_epoch", f"epoch {command.controller_epoch} < 1")
                    yield response_to_proto(refusal, command.nonce)
                    return
                nonce = command.nonce
                yield response_to_proto(HelloAck(False, 0), nonce)
            elif isinstance(command, h.Peek):
                rows = h.PeekRows(table_to_ipc(ROWS), ROWS.num_rows, "abc")
                yield response_to_proto(h.PeekResponse(command.uuid, rows), nonce)
            elif isinstance(command, h.AllowCompaction):
                frontiers = h.FrontiersResponse(command.id, command.frontier)
                yield response_to_proto(frontiers, nonce)


async def _converse(commands: list) -> list[tuple[str, object]]:
    """Send `commands` on one CommandStream to an in-process replica; its responses."""
    server = grpc.aio.server()
    compute_pb2_grpc.add_ComputeReplicaServicer_to_server(_EchoReplica(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = compute_pb2_grpc.ComputeReplicaStub(channel).CommandStream(timeout=30)
            for command in commands:
                await call.write(command_to_proto(command))
            await call.done_writing()
            responses = [response_from_proto(message) async for message in call]
            assert await call.code() == grpc.StatusCode.OK
            return responses
    finally:
        await server.stop(grace=None)


def test_compute_stream_end_to_end():
    commands = [
        h.Hello(controller_epoch=3, nonce="n-3", resume=h.Resume("n-2", 7)),
        h.CreateInstance(h.InstanceConfig.of("i", {"spark.sql.shuffle.partitions": "4"})),
        h.Peek("p1", h.IndexTarget("u1"), 5),
        h.AllowCompaction("u1", h.Frontier.empty()),
    ]
    (nonce_0, ack), (nonce_1, peek), (nonce_2, frontiers) = asyncio.run(_converse(commands))
    assert nonce_0 == nonce_1 == nonce_2 == "n-3"
    assert ack == HelloAck(resumed=False, applied=0)
    assert peek.uuid == "p1" and peek.result.row_count == ROWS.num_rows
    assert ipc_to_table(peek.result.arrow_ipc).equals(ROWS, check_metadata=True)
    assert frontiers == h.FrontiersResponse("u1", h.Frontier.empty())


def test_compute_stream_refuses_a_stale_epoch():
    commands = [h.Hello(controller_epoch=0, nonce="old"), h.Schedule("u1")]
    responses = asyncio.run(_converse(commands))
    assert responses == [("old", Refusal("stale_epoch", "epoch 0 < 1"))]
