"""The gRPC face of the controller: `ControllerServicer` serves `tandem.v1.Controller` over
a `ControllerApi`, and `ControllerServer` hosts it.

Rules:
- The servicer only converts messages and delegates; every rpc is one API call.
- It never chooses a status code. `status_of` maps every failure to one, in one place: a
  `ControllerError` to the status it names, a request that does not decode to
  INVALID_ARGUMENT, anything else (a `ProtocolError` from deeper down included) to
  INTERNAL with a short message, the traceback going to the log, not to the client.
- Every status it sends carries the trailing metadata `tandem-status`, so a client can
  tell a status the controller chose from one its own gRPC stack made up.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, fields
from importlib import metadata
from typing import Any, get_args

import grpc
import pyarrow as pa
import sqlalchemy.exc
from google.protobuf.message import Message

from controller._api import (
    CollectionView,
    ControllerApi,
    ControllerError,
    DataflowStatusView,
    DataflowView,
    InstanceView,
    LeadershipView,
    ReplicaView,
    SourceView,
    StatusCode,
)
from protocol import ProtocolError, schema_to_ipc, table_to_ipc
from protocol.arrow import SPARK_TYPE
from protocol import controller_codec as codec
from protocol import controller_pb2 as pb
from protocol.security import ServerSecurity
from storage import parse_schema
from storage._schema import type_ddl
from protocol import controller_pb2_grpc as pb_grpc

_log = logging.getLogger(__name__)

_STATUS = {name: grpc.StatusCode[name] for name in get_args(StatusCode)}

try:
    _VERSION = metadata.version("tandem")
except metadata.PackageNotFoundError:  # run from a source tree that is not installed
    _VERSION = "0+unknown"


class _BadRequest(Exception):
    """A request that does not decode; the message says what is wrong."""


@contextmanager
def _decoding() -> Iterator[None]:
    try:
        yield
    except ProtocolError as error:
        raise _BadRequest(str(error)) from None


def status_of(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and message that answer a request which raised `error`."""
    if isinstance(error, ControllerError) and error.code in _STATUS:
        return _STATUS[error.code], error.message
    if isinstance(error, _BadRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError)):
        # The catalog is out of reach (a cut, a restart): another controller may take
        # over, and a client with several addresses tries the next one.
        return grpc.StatusCode.UNAVAILABLE, f"the catalog cannot be reached ({type(error.orig or error).__name__}); try again or another controller"
    return (
        grpc.StatusCode.INTERNAL,
        f"internal error ({type(error).__name__}); see the controller log",
    )


_Handler = Callable[[Any, Any], Awaitable[Message]]
_Method = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Message]]


def _rpc(handler: _Handler) -> _Method:
    """A servicer method from `handler(self, request)`: its failures become statuses."""

    @functools.wraps(handler)
    async def method(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Message:
        try:
            return await handler(self, request)
        except Exception as error:  # every failure answers the client; none kills the server
            await _abort(context, handler.__name__, error)
            raise

    return method


async def _abort(context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
    """End the call with `error`'s status (abort raises)."""
    code, message = status_of(error)
    if code is grpc.StatusCode.INTERNAL:
        _log.error("%s failed", method, exc_info=error)
    metadata = [(codec.STATUS_METADATA_KEY, code.name)]
    leader = getattr(error, "leader", None)  # a standby's refusal names the leader (`NotLeader`)
    if leader:
        metadata.append((codec.LEADER_METADATA_KEY, leader))
    await context.abort(code, message, trailing_metadata=tuple(metadata))


# --- Views -----------------------------------------------------------------------------


def _fields(view: Any, *nested: str) -> dict[str, Any]:
    """A view's fields by name (they match the message's), less the `nested` ones."""
    return {f.name: getattr(view, f.name) for f in fields(view) if f.name not in nested}


def _collection_to_proto(view: CollectionView) -> pb.CollectionView:
    return pb.CollectionView(**_fields(view))


def _statuses_to_proto(statuses: Mapping[str, DataflowStatusView]) -> dict[str, pb.DataflowStatusView]:
    return {name: pb.DataflowStatusView(**_fields(status)) for name, status in statuses.items()}


def _replica_to_proto(view: ReplicaView) -> pb.ReplicaView:
    return pb.ReplicaView(**_fields(view, "dataflows"), dataflows=_statuses_to_proto(view.dataflows))


def _instance_to_proto(view: InstanceView) -> pb.InstanceView:
    return pb.InstanceView(
        **_fields(view, "replicas", "collections"),
        replicas=[_replica_to_proto(r) for r in view.replicas],
        collections=[_collection_to_proto(c) for c in view.collections],
    )


def _source_to_proto(view: SourceView) -> pb.SourceView:
    return pb.SourceView(**_fields(view), arrow_schema=schema_to_ipc(_columns(view.schema)))


def _columns(ddl: str) -> pa.Schema:
    """A source's columns as Arrow, each field's Spark type in its metadata, so that a
    client converts values and names types without parsing DDL (and without loading
    storage, which brings the catalog's SQLAlchemy)."""
    return pa.schema(f.with_metadata({SPARK_TYPE: type_ddl(f).encode()}) for f in parse_schema(ddl))


def _dataflow_to_proto(view: DataflowView) -> pb.DataflowView:
    return pb.DataflowView(
        **_fields(view, "index_key", "replicas"),
        index_key=codec.strings_to_proto(view.index_key),
        replicas=_statuses_to_proto(view.replicas),
    )


def _leadership_to_proto(view: LeadershipView) -> pb.LeadershipView:
    leader = None if view.leader is None else pb.ControllerView(**asdict(view.leader))
    return pb.LeadershipView(
        epoch=view.epoch,
        leader=leader,
        lease_remaining_ms=view.lease_remaining_ms,
        lease_renewals=view.lease_renewals,
        standbys=[pb.ControllerView(**asdict(s)) for s in view.standbys],
    )


# --- Servicer --------------------------------------------------------------------------


class ControllerServicer(pb_grpc.ControllerServicer):
    """`tandem.v1.Controller` over `api`: converts, delegates, converts back."""

    def __init__(self, api: ControllerApi) -> None:
        self._api = api

    @_rpc
    async def GetVersion(self, request: pb.GetVersionRequest) -> pb.GetVersionResponse:
        return pb.GetVersionResponse(server_version=_VERSION, controller_epoch=self._api.epoch)

    @_rpc
    async def GetLeadership(self, request: pb.GetLeadershipRequest) -> pb.LeadershipView:
        return _leadership_to_proto(await self._api.leadership())

    @_rpc
    async def Handover(self, request: pb.HandoverRequest) -> pb.HandoverResponse:
        return pb.HandoverResponse(**asdict(await self._api.handover(codec.optional_field(request, "to"))))

    @_rpc
    async def TakeLead(self, request: pb.TakeLeadRequest) -> pb.LeadershipView:
        return _leadership_to_proto(await self._api.take_lead(request.epoch))

    @_rpc
    async def CreateInstance(self, request: pb.CreateInstanceRequest) -> pb.InstanceView:
        view = await self._api.create_instance(
            request.name,
            **codec.present_fields(request, "min_in_sync", "max_lag_ms", "replica_timeout_ms", "max_hold_back_ms", "replace_slow"),
            spark_conf=codec.string_map_from_proto(request, "spark_conf"),
        )
        return _instance_to_proto(view)

    @_rpc
    async def DropInstance(self, request: pb.DropInstanceRequest) -> pb.DropInstanceResponse:
        await self._api.drop_instance(request.name)
        return pb.DropInstanceResponse()

    @_rpc
    async def ListInstances(self, request: pb.ListInstancesRequest) -> pb.ListInstancesResponse:
        views = await self._api.list_instances()
        return pb.ListInstancesResponse(instances=[_instance_to_proto(v) for v in views])

    @_rpc
    async def AddReplica(self, request: pb.AddReplicaRequest) -> pb.ReplicaView:
        view = await self._api.add_replica(
            request.instance,
            request.name,
            **codec.present_fields(
                request, "size", "spark_master", "address", "driver_host", "driver_bind_address", "timeout_ms"
            ),
            spark_conf=codec.string_map_from_proto(request, "spark_conf"),
            wait=request.wait,
        )
        return _replica_to_proto(view)

    @_rpc
    async def DropReplica(self, request: pb.DropReplicaRequest) -> pb.DropReplicaResponse:
        await self._api.drop_replica(request.instance, request.name, force=request.force)
        return pb.DropReplicaResponse()

    @_rpc
    async def Resize(self, request: pb.ResizeRequest) -> pb.ResizeResponse:
        views = await self._api.resize(
            request.instance, request.size, **codec.present_fields(request, "timeout_ms", "on_timeout")
        )
        return pb.ResizeResponse(replicas=[_replica_to_proto(v) for v in views])

    @_rpc
    async def CreateSource(self, request: pb.CreateSourceRequest) -> pb.SourceView:
        return _source_to_proto(await self._api.create_source(request.name, request.schema))

    @_rpc
    async def Append(self, request: pb.AppendRequest) -> pb.AppendResponse:
        with _decoding():
            source, rows, key = codec.append_from_proto(request)
        return pb.AppendResponse(timestamp=await self._api.append(source, rows, idempotency_key=key))

    @_rpc
    async def DropSource(self, request: pb.DropSourceRequest) -> pb.DropSourceResponse:
        await self._api.drop_source(request.name)
        return pb.DropSourceResponse()

    @_rpc
    async def ListSources(self, request: pb.ListSourcesRequest) -> pb.ListSourcesResponse:
        views = await self._api.list_sources()
        return pb.ListSourcesResponse(sources=[_source_to_proto(v) for v in views])

    @_rpc
    async def CreateDataflow(self, request: pb.CreateDataflowRequest) -> pb.DataflowView:
        view = await self._api.create_dataflow(
            request.instance,
            request.name,
            request.sql,
            index_key=codec.strings_from_proto(request, "index_key"),
            materialize=request.materialize,
            compaction_window_ms=request.compaction_window_ms,
            strategy=request.strategy or "auto",
        )
        return _dataflow_to_proto(view)

    @_rpc
    async def DropDataflow(self, request: pb.DropDataflowRequest) -> pb.DropDataflowResponse:
        await self._api.drop_dataflow(request.instance, request.name)
        return pb.DropDataflowResponse()

    @_rpc
    async def ListDataflows(self, request: pb.ListDataflowsRequest) -> pb.ListDataflowsResponse:
        views = await self._api.list_dataflows(codec.optional_field(request, "instance"))
        return pb.ListDataflowsResponse(dataflows=[_dataflow_to_proto(v) for v in views])

    @_rpc
    async def Peek(self, request: pb.PeekRequest) -> pb.ReadResult:
        with _decoding():
            instance, name, options = codec.peek_from_proto(request)
        result = await self._api.peek(instance, name, **options)
        return codec.read_result_to_proto(result.arrow_ipc, result.timestamp, result.replica)

    @_rpc
    async def Query(self, request: pb.QueryRequest) -> pb.ReadResult:
        with _decoding():
            consistency = codec.consistency_from_proto(request.consistency)
        result = await self._api.query(
            request.instance,
            request.sql,
            timestamp=codec.optional_field(request, "timestamp"),
            consistency=consistency,
            **codec.present_fields(request, "timeout_ms"),
        )
        return codec.read_result_to_proto(result.arrow_ipc, result.timestamp, result.replica)

    @_rpc
    async def Status(self, request: pb.StatusRequest) -> pb.StatusResponse:
        views = await self._api.status(codec.optional_field(request, "instance"))
        return pb.StatusResponse(instances=[_instance_to_proto(v) for v in views])

    async def Subscribe(self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.SubscribeBatch]:
        """A server stream, so not `_rpc`: a refusal or a failure mid-feed ends the call
        with its status the same way; the feed is closed however the call ends."""
        try:
            feed = await self._api.subscribe(
                codec.optional_field(request, "instance"),
                request.name,
                as_of=codec.optional_field(request, "as_of"),
                up_to=codec.optional_field(request, "up_to"),
                snapshot=codec.optional_field(request, "snapshot") is not False,
                progress=request.progress,
            )
        except Exception as error:
            await _abort(context, "Subscribe", error)
            raise
        try:
            async for batch in feed:
                yield pb.SubscribeBatch(arrow_ipc=table_to_ipc(batch.updates), progress=batch.progress)
        except Exception as error:
            await _abort(context, "Subscribe", error)
            raise
        finally:
            await feed.close()

    @_rpc
    async def ListEvents(self, request: pb.ListEventsRequest) -> pb.ListEventsResponse:
        views = await self._api.events(
            codec.optional_field(request, "instance"), after=codec.optional_field(request, "after"), limit=request.limit or 100
        )
        return pb.ListEventsResponse(events=[pb.EventView(**_fields(v)) for v in views])


    @_rpc
    async def ListStorage(self, request: pb.ListStorageRequest) -> pb.ListStorageResponse:
        views = await self._api.storage_holds()
        return pb.ListStorageResponse(
            collections=[pb.StorageView(**_fields(v, "holds"), holds=[pb.HoldView(**_fields(h)) for h in v.holds]) for v in views]
        )


# --- Server ----------------------------------------------------------------------------


class ControllerServer:
    """A `grpc.aio` server of `ControllerServicer(api)` listening on `listen`
    ("host:port"; port 0 picks a free one; no host means 127.0.0.1, so a controller is
    reachable from other machines only when told so), secured by `security` (TLS, a
    bearer token; none by default). Construct it inside the event loop that will run
    it; `address` is the bound "host:port" from construction on."""

    def __init__(self, api: ControllerApi, listen: str = "127.0.0.1:6875", security: ServerSecurity = ServerSecurity()) -> None:
        host, _, port = listen.rpartition(":")
        host = host or "127.0.0.1"
        if not port.isdigit() or int(port) > 65535:  # grpc would bind some other port
            raise OSError(f"cannot listen on {listen!r}: expected host:port")
        # Not gRPC's default SO_REUSEPORT: a second controller on a taken port would
        # share it, each taking some of the connections.
        options = (*codec.SERVER_OPTIONS, ("grpc.so_reuseport", 0))
        self._server = grpc.aio.server(options=options, interceptors=security.interceptors())
        pb_grpc.add_ControllerServicer_to_server(ControllerServicer(api), self._server)
        try:
            bound = security.add_port(self._server, f"{host}:{port}")
        except RuntimeError as error:  # grpc's way of saying the address is taken or bad
            raise OSError(f"cannot listen on {listen!r}: {error}") from None
        self.address = f"{host}:{bound}"

    async def start(self) -> None:
        await self._server.start()

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new calls; let calls in flight finish for `grace` seconds, then cancel
        them (None: wait for them all)."""
        await self._server.stop(grace)


async def ask_leadership(address: str, security: ServerSecurity, timeout_s: float) -> None:
    """Ask the controller at `address` who leads, to see that it answers within
    `timeout_s`; a `ConnectionError` naming gRPC's status if not."""
    async with security.channel(address, list(codec.CLIENT_CHANNEL_OPTIONS)) as channel:
        try:
            await pb_grpc.ControllerStub(channel).GetLeadership(pb.GetLeadershipRequest(), timeout=timeout_s, metadata=security.metadata)
        except grpc.RpcError as error:
            raise ConnectionError(f"{error.code().name}: {error.details()}") from None


async def ask_to_take_lead(address: str, epoch: int, security: ServerSecurity, timeout_s: float) -> None:
    """Tell the standby at `address` that a handover gave it the lead as `epoch`, and
    wait (up to `timeout_s`) until it answers that it serves; a `grpc.RpcError` if not."""
    async with security.channel(address, list(codec.CLIENT_CHANNEL_OPTIONS)) as channel:
        await pb_grpc.ControllerStub(channel).TakeLead(pb.TakeLeadRequest(epoch=epoch), timeout=timeout_s, metadata=security.metadata)
