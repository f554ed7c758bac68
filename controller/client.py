"""A synchronous Python client of a running controller (`tandem.v1.Controller`).

    with Client.connect("127.0.0.1:6875") as client:
        client.create_source("orders", "id BIGINT NOT NULL, amount DOUBLE")
        client.append("orders", [{"id": 1, "amount": 9.5}])
        result = client.peek("prod", "totals", where={"region": "eu"}, order_by=["-amount"])
        print(result.rows)

Rules:
- Every failure is one exception type, `TandemError(code, message)` with a
  `grpc.StatusCode`. A refusal keeps the controller's status and message. A controller
  that cannot be reached is UNAVAILABLE and a call that outlives its deadline is
  DEADLINE_EXCEEDED, both naming the address. An argument the client cannot convert is
  INVALID_ARGUMENT, raised before anything is sent.
- Deadlines: every call gets `deadline` seconds (120 by default); a peek, a query, a
  resize or a waiting `add_replica` gets its own `timeout_ms` plus a margin, so the
  controller's timeout, with its clearer message, fires first.
- Views are the dataclasses of `controller._api`, rebuilt from the messages.
- Several addresses (`"a:6875,b:6875"`, a leader and its standbys) make the client
  follow the leader: a standby's refusal names it, and the call goes there. A call is
  sent again after a failover only when nothing of it can have been done (refused by a
  standby, or no connection at all), when it only reads, or when it is an append: each
  append carries an idempotency key (a fresh one unless the caller gives its own), so
  one cut off in flight by the leader's death and sent again is applied once.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from time import monotonic, sleep
from typing import Any, Self

import grpc
import pyarrow as pa
from google.protobuf.message import Message

from controller._api import (
    CollectionView,
    ControllerView,
    DataflowStatusView,
    DataflowView,
    EventView,
    HandoverView,
    HoldView,
    InstanceView,
    LeadershipView,
    ReplicaView,
    SourceView,
    StorageView,
    SubscribeBatch,
)
from history import OrderBy, Predicate, Scalar
from protocol import ProtocolError, ipc_to_schema, ipc_to_table
from protocol import controller_codec as codec
from protocol import controller_pb2 as pb
from protocol import controller_pb2_grpc as pb_grpc
from protocol.security import Tls, token_metadata

DEFAULT_ADDRESS = "127.0.0.1:6875"
DEFAULT_SIZE = "xsmall"
_MARGIN_S = 10.0  # beyond a call's own timeout_ms, for the controller to answer that it fired
# A resize starts its new replicas' processes before its deadline can fire (a cold JVM
# on a loaded machine: up to the orchestrator's ready timeout), then stops them again.
_REPLICA_START_MS = 180_000

# The forms `peek` accepts (see its docstring).
Key = Scalar | dt.date | Sequence[Scalar | dt.date]
Where = Mapping[str, Any] | Sequence[Predicate | tuple[Any, ...]]
Order = str | tuple[str, str] | OrderBy


class TandemError(Exception):
    """A call that failed: `code` is the `grpc.StatusCode`, `message` says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class QueryResult:
    """The rows of a peek or query, the time they are correct at, and the replica that
    answered first."""

    table: pa.Table
    timestamp: int
    replica: str | None

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.table.to_pylist()


class Client:
    """Calls on the controller at `address`, or on whichever of several leads:
    `"host:a,host:b"` (see the module's rules). `Client(address)` connects lazily;
    `Client.connect` waits until a controller answers. Close it, or use it as a
    context manager."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        deadline: float = 120.0,
        failover: float = 30.0,
        token: str | None = None,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
    ) -> None:
        """`token`: the bearer token a controller run with `--auth-token-file` requires.
        With `tls_ca` the channel is TLS, checking the controller's certificate against
        that CA (PEM file); `tls_cert` and `tls_key` add a client certificate (for a
        controller run with `--tls-client-ca`). With several addresses, a call that
        finds no leader keeps looking for one for up to `failover` seconds."""
        self.addresses = [a.strip() for a in address.split(",") if a.strip()] or [DEFAULT_ADDRESS]
        self._deadline = deadline
        self._failover = failover
        self._metadata = token_metadata(token)
        self._tls = None if tls_ca is None and tls_cert is None else Tls(_path(tls_cert), _path(tls_key), _path(tls_ca))
        self._channels: dict[str, grpc.Channel] = {}
        self._use(self.addresses[0])

    def _use(self, address: str) -> None:
        """Send calls to `address` from now on (its channel is kept for a return)."""
        if address not in self.addresses:
            self.addresses.append(address)
        channel = self._channels.get(address)
        if channel is None:
            if self._tls is None:
                channel = grpc.insecure_channel(address, options=codec.CLIENT_CHANNEL_OPTIONS)
            else:
                channel = grpc.secure_channel(address, self._tls.channel_credentials(), options=codec.CLIENT_CHANNEL_OPTIONS)
            self._channels[address] = channel
        self.address, self._channel, self._stub = address, channel, pb_grpc.ControllerStub(channel)

    @classmethod
    def connect(
        cls, address: str = DEFAULT_ADDRESS, *, timeout: float = 10.0, deadline: float = 120.0, **security: Any
    ) -> Client:
        """A client of a controller that answered (with several addresses, the leader
        if one answers as such within `timeout`); UNAVAILABLE after `timeout` seconds
        without an answer, with the last connection error when there is one (a refused
        connection, a failed TLS handshake). `security`: `token`, `tls_ca`, `tls_cert`,
        `tls_key` (see `Client`)."""
        client = cls(address, deadline=deadline, **security)
        # A GetVersion that waits for the channel, rather than channel_ready_future: it
        # proves a controller answers, and leaves no polling thread that slows close().
        request = pb.GetVersionRequest()
        ends = monotonic() + timeout
        try:
            while True:
                standby = None  # one that answered this round, not leading
                for candidate in list(client.addresses):
                    client._use(candidate)
                    wait = timeout if len(client.addresses) == 1 else max(0.05, min(1.0, ends - monotonic()))
                    try:
                        version = client._stub.GetVersion(request, timeout=wait, wait_for_ready=True, metadata=client._metadata)
                    except grpc.RpcError as error:
                        if error.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                            raise client._error(error, "GetVersion", timeout) from None
                        continue
                    if version.controller_epoch > 0:  # the leader: a standby answers epoch 0
                        return client
                    standby = standby or candidate
                if standby is not None:  # calls follow it to the leader it names
                    client._use(standby)
                    return client
                if monotonic() >= ends:
                    raise TandemError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"cannot reach the controller at {address} (no answer within {timeout:g} s){client._connection_error()}",
                    )
        except BaseException:
            client.close()
            raise

    def _connection_error(self) -> str:
        """`: <why the channel does not connect>`, or "" when gRPC does not say. A call
        that waits for the channel only ever times out; one that does not fails at once
        with the last connection error, e.g. a TLS handshake that failed."""
        try:
            self._stub.GetVersion(pb.GetVersionRequest(), timeout=1.0, metadata=self._metadata)
        except grpc.RpcError as error:
            if error.code() is grpc.StatusCode.UNAVAILABLE:
                return f": {error.details()}"
        return ""

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- Instances and replicas --------------------------------------------------------

    def create_instance(
        self,
        name: str,
        *,
        min_in_sync: int = 1,
        max_lag_ms: int | None = None,
        replica_timeout_ms: int | None = None,
        spark_conf: Mapping[str, str] | None = None,
        max_hold_back_ms: int | None = None,
        replace_slow: bool | None = None,
    ) -> InstanceView:
        response = self._call(
            "CreateInstance",
            pb.CreateInstanceRequest,
            name=name,
            min_in_sync=min_in_sync,
            max_lag_ms=max_lag_ms,
            replica_timeout_ms=replica_timeout_ms,
            spark_conf=codec.string_map_to_proto(spark_conf),
            max_hold_back_ms=max_hold_back_ms,
            replace_slow=replace_slow,
        )
        return _instance(response)

    def drop_instance(self, name: str) -> None:
        self._call("DropInstance", pb.DropInstanceRequest, name=name)

    def list_instances(self) -> list[InstanceView]:
        response = self._call("ListInstances", pb.ListInstancesRequest)
        return [_instance(m) for m in response.instances]

    def add_replica(
        self,
        instance: str,
        name: str,
        *,
        size: str | None = None,
        spark_master: str | None = None,
        spark_conf: Mapping[str, str] | None = None,
        address: str | None = None,
        driver_host: str | None = None,
        driver_bind_address: str | None = None,
        wait: bool = False,
        timeout_ms: int | None = None,
    ) -> ReplicaView:
        """A managed replica of `size`, or of an explicit `spark_master` and `spark_conf`,
        or an external one already running at `address`.

        Size rule: a size passed is always sent. Without one, a plain managed replica
        (no `spark_master`, no `address`) is `DEFAULT_SIZE` ("xsmall"); with either, no
        size is sent, and the master, conf or running process decides its resources.

        On a cluster, `driver_host` is an address of the controller's host that the
        executors reach (`driver_bind_address`, the interface, defaults to it). `wait`
        returns only once the replica is in sync, within `timeout_ms` (default: the
        instance's replica timeout; the call's deadline is then the client's); if it
        does not, or cannot start, the controller drops it again and raises.
        """
        if size is None and spark_master is None and address is None:
            size = DEFAULT_SIZE
        response = self._call(
            "AddReplica",
            pb.AddReplicaRequest,
            wait_ms=timeout_ms if wait else None,
            instance=instance,
            name=name,
            size=size,
            spark_master=spark_master,
            spark_conf=codec.string_map_to_proto(spark_conf),
            address=address,
            driver_host=driver_host,
            driver_bind_address=driver_bind_address,
            wait=wait,
            timeout_ms=timeout_ms,
        )
        return _replica(response)

    def drop_replica(self, instance: str, name: str, *, force: bool = False) -> None:
        """`force` drops it even below the instance's `min_in_sync`."""
        self._call("DropReplica", pb.DropReplicaRequest, instance=instance, name=name, force=force)

    def resize(self, instance: str, size: str, *, timeout_ms: int = 600_000, on_timeout: str = "rollback") -> list[ReplicaView]:
        """Replace the instance's replicas by ones of `size` without downtime: the new
        ones must get in sync within `timeout_ms`, or else they are dropped
        (`on_timeout="rollback"`, DEADLINE_EXCEEDED) or replace the old ones all the
        same (`"commit"`). Returns the replicas after."""
        with _arguments():
            request = pb.ResizeRequest(instance=instance, size=size, timeout_ms=timeout_ms, on_timeout=on_timeout)
        # The new replicas' processes start before the timeout for getting in sync begins.
        response = self._send("Resize", request, wait_ms=request.timeout_ms + _REPLICA_START_MS)
        return [_replica(m) for m in response.replicas]

    # --- Sources -----------------------------------------------------------------------

    def create_source(self, name: str, schema: str) -> SourceView:
        """A source of `schema`, a Spark DDL column list ("id BIGINT NOT NULL, x STRING")."""
        return _source(self._call("CreateSource", pb.CreateSourceRequest, name=name, schema=schema))

    def append(self, source: str, rows: pa.Table | Sequence[Mapping[str, Any]], *, idempotency_key: str | None = None) -> int:
        """Append `rows` (a table or a list of mappings; an optional `_diff` column of -1
        retracts) at one new timestamp, returned. Mappings are checked by the controller
        against the source's schema, column and row named in the refusal; they may hold
        `datetime.date`, `datetime.datetime`, `decimal.Decimal` and `bytes` values.
        The append is applied once per `idempotency_key` (a fresh one by default), so
        it is sent again after a failover; a caller that repeats an append itself
        passes the key it gave the first time, and gets that one's timestamp."""
        with _arguments():
            request = codec.append_to_proto(source, rows, idempotency_key or uuid.uuid4().hex)
        return self._send("Append", request).timestamp

    def drop_source(self, name: str) -> None:
        self._call("DropSource", pb.DropSourceRequest, name=name)

    def list_sources(self) -> list[SourceView]:
        return [_source(m) for m in self._call("ListSources", pb.ListSourcesRequest).sources]

    def source_schema(self, name: str) -> pa.Schema:
        """The columns of source `name` as an Arrow schema: names, types, nullability,
        and each field's Spark type in its metadata (`protocol.arrow.SPARK_TYPE`).
        NOT_FOUND if there is no such source."""
        for message in self._call("ListSources", pb.ListSourcesRequest).sources:
            if message.name == name:
                try:
                    return ipc_to_schema(message.arrow_schema)
                except ProtocolError as error:  # a broken controller
                    raise TandemError(grpc.StatusCode.INTERNAL, f"unreadable schema of {name!r}: {error}") from None
        raise TandemError(grpc.StatusCode.NOT_FOUND, f"no source named {name!r}")

    # --- Dataflows ---------------------------------------------------------------------

    def create_dataflow(
        self,
        instance: str,
        name: str,
        sql: str,
        *,
        index_key: Sequence[str] | None = None,
        materialize: bool = False,
        compaction_window_ms: int = 0,
        strategy: str = "auto",
    ) -> DataflowView:
        """A dataflow computing `sql`, indexed on `index_key` (() for the whole row) when
        given, and written to storage as a materialized view when `materialize`.

        `strategy`: "auto" maintains it incrementally where the query allows, else
        recomputes it at every change; "recompute" forces the latter; "incremental"
        refuses (INVALID_ARGUMENT, naming the part that cannot be maintained) a query that
        cannot be. The view's `strategy` says what was chosen and why."""
        with _arguments():
            index = codec.strings_to_proto(_names(index_key, "index_key"))
        response = self._call(
            "CreateDataflow",
            pb.CreateDataflowRequest,
            instance=instance,
            name=name,
            sql=sql,
            index_key=index,
            materialize=materialize,
            compaction_window_ms=compaction_window_ms,
            strategy=strategy,
        )
        return _dataflow(response)

    def drop_dataflow(self, instance: str, name: str) -> None:
        self._call("DropDataflow", pb.DropDataflowRequest, instance=instance, name=name)

    def list_dataflows(self, instance: str | None = None) -> list[DataflowView]:
        response = self._call("ListDataflows", pb.ListDataflowsRequest, instance=instance)
        return [_dataflow(m) for m in response.dataflows]

    # --- Reads -------------------------------------------------------------------------

    def peek(
        self,
        instance: str,
        name: str,
        *,
        key: Key | None = None,
        where: Where | None = None,
        order_by: Order | Sequence[Order] | None = None,
        limit: int | None = None,
        offset: int = 0,
        columns: Sequence[str] | None = None,
        timestamp: int | None = None,
        consistency: str = "serializable",
        timeout_ms: int = 30_000,
    ) -> QueryResult:
        """Read the index of dataflow `name`.

        - `key`: the index key to look up, a scalar for a one-column key or a tuple.
        - `where`: `{column: value}` (equality; a list or tuple value means `in`, None
          means `is_null`), or a list of `(column, op, value)` tuples (`(column, op)` for
          `is_null`/`is_not_null`) or `history.Predicate`s.
        - `order_by`: column names, `"-column"` for descending, `(column, "asc"|"desc")`
          tuples or `history.OrderBy`s; without it rows come sorted on every column.
        - `consistency`: "serializable" (what can be served now) or "strict" (the latest
          write, waiting for it).
        Dates and datetimes in `key` and `where` travel as ISO strings.
        """
        with _arguments():
            request = codec.peek_to_proto(
                instance,
                name,
                key=_key(key),
                where=_predicates(where),
                order_by=_orders(order_by),
                limit=limit,
                offset=offset,
                columns=_names(columns, "columns"),
                timestamp=timestamp,
                consistency=consistency,
                timeout_ms=timeout_ms,
            )
        return _result(self._send("Peek", request, wait_ms=timeout_ms))

    def query(
        self,
        instance: str,
        sql: str,
        *,
        timestamp: int | None = None,
        consistency: str = "serializable",
        timeout_ms: int = 30_000,
    ) -> QueryResult:
        """Run `sql` over the instance's indexes at one time."""
        with _arguments():
            wire_consistency = codec.consistency_to_proto(consistency)
        response = self._call(
            "Query",
            pb.QueryRequest,
            wait_ms=timeout_ms,
            instance=instance,
            sql=sql,
            timestamp=timestamp,
            consistency=wire_consistency,
            timeout_ms=timeout_ms,
        )
        return _result(response)

    def status(self, instance: str | None = None) -> list[InstanceView]:
        """Every instance, or the one named, with its replicas and collections."""
        response = self._call("Status", pb.StatusRequest, instance=instance)
        return [_instance(m) for m in response.instances]

    def subscribe(
        self,
        instance: str | None,
        name: str,
        *,
        as_of: int | None = None,
        up_to: int | None = None,
        snapshot: bool = True,
        progress: bool = False,
    ) -> Iterator[SubscribeBatch]:
        """The change feed of `name`: a dataflow of `instance` with a materialized view,
        or a source or materialized view (`instance` may then be None). First, with
        `snapshot`, the contents at `as_of` (default: the latest complete time), all
        diffs +1; then every change in time order, each time once. Each batch's
        `progress` P promises every update at or before P was delivered: to resume a
        lost stream, subscribe again with `as_of=P, snapshot=False`. With `up_to`, the
        feed ends once every update before it is delivered; without, it runs until the
        iterator is closed. `progress=True` also sends progress when nothing changed.

        Refusals (NOT_FOUND, FAILED_PRECONDITION below the since, INVALID_ARGUMENT) are
        raised by the first `next()`; a client too slow to read is dropped with
        RESOURCE_EXHAUSTED naming where to resume. With several addresses a feed cut by
        a failover or a handover goes on at the new leader, from its last progress (or
        from the start, if nothing was delivered yet): each time still comes once. One
        cut after some of its snapshot but before any progress is UNAVAILABLE."""
        with _arguments():
            request = pb.SubscribeRequest(instance=instance, name=name, as_of=as_of, up_to=up_to, snapshot=snapshot, progress=progress)
        delivered = False  # anything, since the last progress
        gives_up = None  # after a failover that finds no leader for `failover` seconds
        while True:
            stream = self._stub.Subscribe(request, metadata=self._metadata)
            try:
                for message in stream:
                    batch = SubscribeBatch(ipc_to_table(message.arrow_ipc), codec.optional_field(message, "progress"))
                    gives_up = None  # a stream answers: a later failover has its own `failover` seconds
                    if batch.progress is not None:
                        request.as_of, request.snapshot, delivered = batch.progress, False, False
                    else:
                        delivered = delivered or batch.updates.num_rows > 0
                    yield batch
                    if batch.progress is not None and up_to is not None and batch.progress >= up_to - 1:
                        return  # complete: a cut now has nothing left to resume
                return
            except grpc.RpcError as error:
                gives_up = gives_up or monotonic() + self._failover
                if delivered or monotonic() >= gives_up or not self._follow(error, "Subscribe"):
                    raise self._error(error, "Subscribe", 0) from None
            finally:
                stream.cancel()

    def leadership(self) -> LeadershipView:
        """Which controller leads, its epoch and lease, and the standbys: answered by
        whichever controller this client is at, leader or standby."""
        response = self._call("GetLeadership", pb.GetLeadershipRequest)

        def view(message: pb.ControllerView) -> ControllerView:
            return ControllerView(**codec.plain_fields(message))

        return LeadershipView(
            response.epoch,
            view(response.leader) if response.HasField("leader") else None,
            codec.optional_field(response, "lease_remaining_ms"),
            response.lease_renewals,
            tuple(view(s) for s in response.standbys),
        )

    def handover(self, to: str | None = None) -> HandoverView:
        """Move the lead to the standby at address `to` (None: the one the catalog heard
        from last), e.g. before upgrading the leader; answered once the standby serves,
        and calls go there from then on. NOT_FOUND for no standby at `to`,
        FAILED_PRECONDITION with no standby (or a handover already under way)."""
        view = HandoverView(**codec.plain_fields(self._call("Handover", pb.HandoverRequest, to=to)))
        self._use(view.leader)
        return view

    def events(self, instance: str | None = None, *, after: int | None = None, limit: int = 100) -> list[EventView]:
        """Events oldest first, of `instance` or of all: those recorded after id `after`,
        or (no `after`) the latest `limit`. Follow by passing the last id seen."""
        response = self._call("ListEvents", pb.ListEventsRequest, instance=instance, after=after, limit=limit)
        return [EventView(**codec.plain_fields(m)) for m in response.events]

    def storage_holds(self) -> list[StorageView]:
        """Every live storage collection with the read holds that pin its since."""
        response = self._call("ListStorage", pb.ListStorageRequest)
        return [
            StorageView(**codec.plain_fields(m), holds=tuple(HoldView(**codec.plain_fields(h)) for h in m.holds))
            for m in response.collections
        ]

    # --- Calls -------------------------------------------------------------------------

    def _call(
        self, method: str, request_type: type[Message], *, wait_ms: int | None = None, **fields: Any
    ) -> Any:
        """Call `method` with a `request_type` of `fields`; INVALID_ARGUMENT, before
        sending, for a field of the wrong type."""
        with _arguments():
            request = request_type(**fields)
        return self._send(method, request, wait_ms=wait_ms)

    def _send(self, method: str, request: Message, *, wait_ms: int | None = None) -> Any:
        """The response to `request`. A call that waits up to `wait_ms` on the controller
        gets that plus a margin as its deadline, other calls the client's deadline. With
        several addresses, a call that finds no leader is sent again where `_follow`
        says, for up to `failover` seconds."""
        timeout = self._deadline if wait_ms is None else wait_ms / 1000 + _MARGIN_S
        gives_up = monotonic() + self._failover
        while True:
            try:
                return getattr(self._stub, method)(request, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as error:
                if monotonic() >= gives_up or not self._follow(error, method):
                    raise self._error(error, method, timeout) from None

    def _follow(self, error: grpc.RpcError, method: str) -> bool:
        """Whether a call that failed with `error` may be sent again, after moving to
        the controller that should answer it: the leader a standby named, or the next
        address. Only when nothing of it can have been done (a standby refused it, or no
        controller took the connection), or when it only reads."""
        if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return False
        trailing = dict(error.trailing_metadata() or ())
        leader = trailing.get(codec.LEADER_METADATA_KEY)
        if leader and leader != self.address:  # a standby's refusal: nothing was done
            self._use(leader)
            sleep(_FAILOVER_POLL_S / 4)  # the leader it names may be the one just gone
            return True
        refused = codec.STATUS_METADATA_KEY in trailing  # a controller answered: it does not lead
        if len(self.addresses) == 1 or not (refused or method in _RETRIED or _never_sent(error)):
            return False  # it may have been done: the caller decides
        at = self.addresses.index(self.address)
        self._use(self.addresses[(at + 1) % len(self.addresses)])
        if self.address == self.addresses[0]:  # round the whole list: wait for a takeover
            sleep(_FAILOVER_POLL_S)
        return True

    def _error(self, error: grpc.RpcError, method: str, timeout: float) -> TandemError:
        """The failure of a call; the controller's own statuses are marked (_service)."""
        code, details = error.code(), error.details() or ""
        if any(key == codec.STATUS_METADATA_KEY for key, _ in error.trailing_metadata() or ()):
            return TandemError(code, details)
        where = f"the controller at {self.address}"
        if code is grpc.StatusCode.CANCELLED:
            # This client never cancels a call it waits on, so the server's gRPC stack did:
            # a controller shutting down (fenced, stopped) cancels calls that reach it
            # after its server began to stop. For the caller that is UNAVAILABLE, as a
            # call cut off at the end of the stop's grace already is.
            return TandemError(grpc.StatusCode.UNAVAILABLE, f"{where} went away before answering {method} ({details})")
        messages = {
            grpc.StatusCode.UNAVAILABLE: f"cannot reach {where}: {details}",
            grpc.StatusCode.DEADLINE_EXCEEDED: (
                f"no answer from {where} to {method} within {timeout:g} s"
            ),
        }
        return TandemError(code, messages.get(code, f"{method} at {self.address}: {details}"))


# Calls sent again after a failover whatever became of the first try: those that only
# read (a feed from its last progress), and appends (applied once per idempotency key).
_RETRIED = frozenset(
    {"GetVersion", "GetLeadership", "ListInstances", "ListSources", "ListDataflows", "Peek", "Query", "Status", "ListEvents", "ListStorage", "Append", "Subscribe"}
)
_FAILOVER_POLL_S = 0.2


def _never_sent(error: grpc.RpcError) -> bool:
    """Whether gRPC failed the call before any controller received it (no connection)."""
    details = (error.details() or "").lower()
    return "failed to connect" in details or "connection refused" in details


# --- Arguments -------------------------------------------------------------------------


@contextmanager
def _arguments() -> Iterator[None]:
    """Turn an argument that does not convert (ProtocolError is a ValueError) into
    INVALID_ARGUMENT."""
    try:
        yield
    except (ValueError, TypeError) as error:
        raise TandemError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None


def _scalar(value: Any) -> Scalar:
    # Temporal literals travel as ISO strings (history.Scalar); the replica casts them.
    return value.isoformat() if isinstance(value, (dt.date, dt.datetime)) else value


def _key(key: Any) -> tuple[Scalar, ...] | None:
    if key is None:
        return None
    values = key if isinstance(key, (tuple, list)) else (key,)
    return tuple(_scalar(v) for v in values)


def _equality(column: str, value: Any) -> Predicate:
    if value is None:
        return Predicate(column, "is_null")
    if isinstance(value, (tuple, list)):
        return Predicate(column, "in", tuple(_scalar(v) for v in value))
    return Predicate(column, "=", _scalar(value))


def _predicate(item: Any) -> Predicate:
    if isinstance(item, Predicate):
        return item
    if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
        raise ValueError(
            f"a where item is (column, op, value), (column, op) or a Predicate, not {item!r}"
        )
    column, op, *rest = item
    value = rest[0] if rest else None
    if isinstance(value, (tuple, list)):
        return Predicate(column, op, tuple(_scalar(v) for v in value))
    return Predicate(column, op, _scalar(value))


def _predicates(where: Any) -> tuple[Predicate, ...]:
    if where is None:
        return ()
    if isinstance(where, Mapping):
        return tuple(_equality(column, value) for column, value in where.items())
    return tuple(_predicate(item) for item in where)


_DIRECTIONS = {"asc": False, "desc": True}


def _order(item: Any) -> OrderBy:
    if isinstance(item, OrderBy):
        return item
    if isinstance(item, str):
        return OrderBy(item[1:], descending=True) if item.startswith("-") else OrderBy(item)
    if isinstance(item, (tuple, list)) and len(item) == 2 and str(item[1]).lower() in _DIRECTIONS:
        return OrderBy(item[0], descending=_DIRECTIONS[str(item[1]).lower()])
    raise ValueError(
        f"an order_by item is a column, '-column', (column, 'asc'|'desc') or an OrderBy, "
        f"not {item!r}"
    )


def _orders(order_by: Any) -> tuple[OrderBy, ...]:
    if order_by is None:
        return ()
    return tuple(_order(item) for item in ([order_by] if isinstance(order_by, str) else order_by))


def _names(names: Sequence[str] | None, what: str) -> tuple[str, ...] | None:
    # A bare string is a sequence of one-letter names: surely a mistake.
    if isinstance(names, str):
        raise TypeError(f"{what} must be a list of column names, not the string {names!r}")
    return None if names is None else tuple(names)


# --- Views -----------------------------------------------------------------------------


def _statuses(messages: Mapping[str, pb.DataflowStatusView]) -> dict[str, DataflowStatusView]:
    # Sorted: a protobuf map keeps no order, and views should print alike every time.
    return {name: DataflowStatusView(**codec.plain_fields(m)) for name, m in sorted(messages.items())}


def _replica(message: pb.ReplicaView) -> ReplicaView:
    return ReplicaView(
        **codec.plain_fields(message),
        errors=tuple(message.errors),
        dataflows=_statuses(message.dataflows),
    )


def _instance(message: pb.InstanceView) -> InstanceView:
    return InstanceView(
        **codec.plain_fields(message),
        replicas=tuple(_replica(m) for m in message.replicas),
        collections=tuple(CollectionView(**codec.plain_fields(m)) for m in message.collections),
        unavailable_dataflows=dict(sorted(message.unavailable_dataflows.items())),
        events=tuple(message.events),
    )


def _source(message: pb.SourceView) -> SourceView:
    fields = codec.plain_fields(message)
    del fields["arrow_schema"]  # the columns as Arrow: `Client.source_schema`
    return SourceView(**fields)


def _dataflow(message: pb.DataflowView) -> DataflowView:
    return DataflowView(
        **codec.plain_fields(message),
        index_key=codec.strings_from_proto(message, "index_key"),
        replicas=_statuses(message.replicas),
    )


def _result(message: pb.ReadResult) -> QueryResult:
    try:
        return QueryResult(*codec.read_result_from_proto(message))
    except ProtocolError as error:  # rows that are not Arrow IPC: a broken controller
        raise TandemError(grpc.StatusCode.INTERNAL, f"unreadable result: {error}") from None


def _path(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)
