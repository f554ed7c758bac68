"""The client API end to end over real gRPC: `Client` -> `ControllerServer` -> a fake
`ControllerApi`.

`FakeApi` is an in-memory stand-in for the runtime (it exists only for these tests and
tests/test_cli.py): it keeps instances, replicas, sources and dataflows in dicts, checks
rows with storage's own `to_batch`, answers peeks from the appended rows with the
finishing applied, and refuses with `ControllerError` the way the runtime does. It records
every call with the arguments it received, so tests can check what crossed the wire, and
raises `fail` (once) or sleeps `delay` seconds on request.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import decimal
import logging
import operator
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from importlib import metadata
from typing import Any

import grpc
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st
from protocol_strategies import predicates, scalar_tuples, texts

from controller._api import (
    CollectionView,
    ControllerError,
    ControllerView,
    DataflowStatusView,
    DataflowView,
    EventView,
    HandoverView,
    InstanceView,
    LeadershipView,
    ReadResult,
    ReplicaView,
    SourceView,
)
from controller._service import ControllerServer, status_of
from controller.client import Client, TandemError
from history import OrderBy, Predicate
from protocol import ProtocolError, table_to_ipc
from protocol import controller_codec as codec
from protocol import controller_pb2 as pb
from protocol import controller_pb2_grpc as pb_grpc
from protocol.security import ServerSecurity
from storage import InvalidArgument, parse_schema, schema_to_ddl, to_batch

# --- The fake --------------------------------------------------------------------------

_COMPARE = {
    "=": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "in": lambda value, values: value in values,
}


def _holds(predicate: Predicate, row: dict[str, Any]) -> bool:
    value = row[predicate.column]
    if predicate.op in ("is_null", "is_not_null"):
        return (value is None) == (predicate.op == "is_null")
    return value is not None and _COMPARE[predicate.op](value, predicate.value)


class FakeApi:
    """A `ControllerApi` in dicts (see the module docstring)."""

    epoch = 7

    def __init__(self) -> None:
        self.instances: dict[str, dict[str, Any]] = {}  # name -> create_instance's options
        self.replicas: dict[str, dict[str, ReplicaView]] = {}  # instance -> name -> view
        self.sources: dict[str, SourceView] = {}
        self.batches: dict[str, list[pa.Table]] = {}  # source -> appended batches
        self.dataflows: dict[tuple[str, str], DataflowView] = {}
        self.unavailable: dict[str, dict[str, str]] = {}  # instance -> dataflow -> why
        self.events_recorded: list[EventView] = []
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.fail: BaseException | None = None
        self.delay = 0.0
        self.clock = 1000
        self.append_keys: list[str | None] = []  # as each append came
        self.committed_keys: dict[str | None, int] = {}

    async def _enter(self, method: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append((method, args, kwargs))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error

    def last(self, method: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return next((a, k) for m, a, k in reversed(self.calls) if m == method)

    def _instance(self, name: str) -> dict[str, Any]:
        if name not in self.instances:
            raise ControllerError("NOT_FOUND", f"no instance named {name!r}")
        return self.instances[name]

    def _view(self, name: str) -> InstanceView:
        options, replicas = self.instances[name], tuple(self.replicas[name].values())
        in_sync = sum(r.in_sync for r in replicas)
        health = (
            "unavailable"
            if not in_sync
            else ("healthy" if in_sync >= options["min_in_sync"] else "degraded")
        )
        collections = []
        for d in (d for (i, _), d in self.dataflows.items() if i == name):
            if d.index_id is not None:
                collections.append(CollectionView(d.index_id, d.name, 0, self.clock))
            if d.sink_id is not None:
                collections.append(CollectionView(d.sink_id, f"{d.name} (sink)", None, None))
        return InstanceView(
            name,
            health,
            options["min_in_sync"],
            options["max_lag_ms"] or 1000,
            options["replica_timeout_ms"] or 5000,
            options.get("max_hold_back_ms") or 300_000,
            3 + len(collections),
            1,
            10,
            replicas,
            tuple(collections),
            self.unavailable.get(name, {}),
            replace_slow=bool(options.get("replace_slow")),
        )

    async def create_instance(
        self, name, *, min_in_sync=1, max_lag_ms=None, replica_timeout_ms=None, spark_conf=None, max_hold_back_ms=None, replace_slow=None
    ):
        await self._enter(
            "create_instance",
            name,
            min_in_sync=min_in_sync,
            max_lag_ms=max_lag_ms,
            replica_timeout_ms=replica_timeout_ms,
            spark_conf=spark_conf,
            max_hold_back_ms=max_hold_back_ms,
            replace_slow=replace_slow,
        )
        if name in self.instances:
            raise ControllerError("ALREADY_EXISTS", f"instance {name!r} already exists")
        if min_in_sync < 1:
            raise ControllerError(
                "INVALID_ARGUMENT", f"min_in_sync must be at least 1, not {min_in_sync}"
            )
        self.instances[name] = {
            "min_in_sync": min_in_sync,
            "max_lag_ms": max_lag_ms,
            "replica_timeout_ms": replica_timeout_ms,
            "max_hold_back_ms": max_hold_back_ms,
            "replace_slow": replace_slow,
        }
        self.replicas[name] = {}
        return self._view(name)

    async def drop_instance(self, name):
        await self._enter("drop_instance", name)
        self._instance(name)
        del self.instances[name], self.replicas[name]

    async def list_instances(self):
        await self._enter("list_instances")
        return [self._view(name) for name in sorted(self.instances)]

    async def add_replica(
        self,
        instance,
        name,
        *,
        size=None,
        spark_master=None,
        spark_conf=None,
        address=None,
        driver_host=None,
        driver_bind_address=None,
        wait=False,
        timeout_ms=None,
    ):
        await self._enter(
            "add_replica",
            instance,
            name,
            size=size,
            spark_master=spark_master,
            spark_conf=spark_conf,
            address=address,
            driver_host=driver_host,
            driver_bind_address=driver_bind_address,
            wait=wait,
            timeout_ms=timeout_ms,
        )
        self._instance(instance)
        if name in self.replicas[instance]:
            raise ControllerError("ALREADY_EXISTS", f"replica {name!r} already exists")
        managed = address is None
        view = ReplicaView(
            name,
            size or "custom",
            spark_master or "local[1]",
            address,
            managed,
            "active",
            1,
            4242 if managed else None,
            True,
            True,
            0 if managed else None,
            3,
            1,
            2,
            4,
            5,
        )
        self.replicas[instance][name] = view
        return view

    async def drop_replica(self, instance, name, *, force=False):
        await self._enter("drop_replica", instance, name, force=force)
        self._instance(instance)
        replicas = self.replicas[instance]
        if name not in replicas:
            raise ControllerError("NOT_FOUND", f"no replica named {name!r}")
        if len(replicas) - 1 < self.instances[instance]["min_in_sync"] and not force:
            raise ControllerError(
                "FAILED_PRECONDITION",
                "dropping it leaves fewer replicas than min_in_sync; use force",
            )
        del replicas[name]

    async def resize(self, instance, size, *, timeout_ms=600_000, on_timeout="rollback"):
        await self._enter("resize", instance, size, timeout_ms=timeout_ms, on_timeout=on_timeout)
        self._instance(instance)
        self.replicas[instance] = {
            f"{name}-{size}": ReplicaView(
                f"{name}-{size}",
                size,
                "local[2]",
                None,
                True,
                "active",
                1,
                5000,
                True,
                True,
                0,
                0,
                0,
                1,
                0,
                1,
            )
            for name in self.replicas[instance]
        }
        return list(self.replicas[instance].values())

    async def create_source(self, name, schema):
        await self._enter("create_source", name, schema)
        if name in self.sources:
            raise ControllerError("ALREADY_EXISTS", f"source {name!r} already exists")
        try:
            ddl = schema_to_ddl(parse_schema(schema))
        except InvalidArgument as error:
            raise ControllerError("INVALID_ARGUMENT", str(error)) from None
        self.sources[name] = SourceView(f"s{len(self.sources) + 1}", name, ddl, 0, 0)
        self.batches[name] = []
        return self.sources[name]

    def _source(self, name: str) -> SourceView:
        if name not in self.sources:
            raise ControllerError("NOT_FOUND", f"no source named {name!r}")
        return self.sources[name]

    async def append(self, source, rows, *, idempotency_key=None):
        await self._enter("append", source, rows)
        self.append_keys.append(idempotency_key)
        view = self._source(source)
        if idempotency_key in self.committed_keys:
            return self.committed_keys[idempotency_key]
        try:
            batch = to_batch(
                rows, parse_schema(view.schema), default_time=self.clock, allow_time=False
            )
        except InvalidArgument as error:
            raise ControllerError("INVALID_ARGUMENT", str(error)) from None
        self.batches[source].append(batch)
        self.clock += 1
        self.sources[source] = SourceView(view.id, view.name, view.schema, view.since, self.clock)
        self.committed_keys[idempotency_key] = self.clock - 1
        return self.clock - 1

    async def drop_source(self, name):
        await self._enter("drop_source", name)
        self._source(name)
        del self.sources[name], self.batches[name]

    async def list_sources(self):
        await self._enter("list_sources")
        return list(self.sources.values())

    async def create_dataflow(
        self, instance, name, sql, *, index_key=None, materialize=False, compaction_window_ms=0, strategy="auto"
    ):
        await self._enter(
            "create_dataflow",
            instance,
            name,
            sql,
            index_key=index_key,
            materialize=materialize,
            compaction_window_ms=compaction_window_ms,
            strategy=strategy,
        )
        self._instance(instance)
        prefix = "SELECT * FROM "
        if not sql.startswith(prefix):
            raise ControllerError(
                "INVALID_ARGUMENT", "the fake planner knows only SELECT * FROM <source>"
            )
        source = self._source(sql[len(prefix) :].strip())
        if (instance, name) in self.dataflows:
            raise ControllerError("ALREADY_EXISTS", f"dataflow {name!r} already exists")
        n = len(self.dataflows) + 1
        view = DataflowView(
            f"d{n}",
            instance,
            name,
            sql,
            source.schema,
            None if index_key is None else f"i{n}",
            None if index_key is None else tuple(index_key),
            f"m{n}" if materialize else None,
            compaction_window_ms,
            "incremental" if strategy != "recompute" else "recompute: asked for",
        )
        self.dataflows[instance, name] = view
        return view

    async def drop_dataflow(self, instance, name):
        await self._enter("drop_dataflow", instance, name)
        if (instance, name) not in self.dataflows:
            raise ControllerError("NOT_FOUND", f"no dataflow named {name!r} on {instance!r}")
        del self.dataflows[instance, name]

    async def list_dataflows(self, instance=None):
        await self._enter("list_dataflows", instance)
        return [
            replace(d, replicas=self._statuses(i, d.name))
            for (i, _), d in self.dataflows.items()
            if instance in (None, i)
        ]

    def _statuses(self, instance: str, dataflow: str) -> dict[str, DataflowStatusView]:
        """What each replica view says of `dataflow`, as the runtime gathers it."""
        replicas = self.replicas.get(instance, {}).values()
        return {r.name: r.dataflows[dataflow] for r in replicas if dataflow in r.dataflows}

    def _snapshot(self, source: str) -> list[dict[str, Any]]:
        counts: Counter[tuple[tuple[str, Any], ...]] = Counter()
        for batch in self.batches[source]:
            for row in batch.drop_columns(["_time"]).to_pylist():
                counts[tuple((k, v) for k, v in row.items() if k != "_diff")] += row["_diff"]
        return [dict(row) for row, count in counts.items() for _ in range(count)]

    def _answerer(self, instance: str) -> str:
        replica = next(iter(self.replicas[instance]), None)
        if replica is None:
            raise ControllerError("UNAVAILABLE", f"instance {instance!r} has no replica in sync")
        return replica

    async def peek(
        self,
        instance,
        name,
        *,
        key=None,
        where=(),
        order_by=(),
        limit=None,
        offset=0,
        columns=None,
        timestamp=None,
        consistency="serializable",
        timeout_ms=30_000,
    ):
        await self._enter(
            "peek",
            instance,
            name,
            key=key,
            where=where,
            order_by=order_by,
            limit=limit,
            offset=offset,
            columns=columns,
            timestamp=timestamp,
            consistency=consistency,
            timeout_ms=timeout_ms,
        )
        self._instance(instance)
        if (instance, name) not in self.dataflows:
            raise ControllerError("NOT_FOUND", f"no dataflow named {name!r} on {instance!r}")
        flow = self.dataflows[instance, name]
        if flow.index_key is None:
            raise ControllerError("FAILED_PRECONDITION", f"dataflow {name!r} has no index")
        replica = self._answerer(instance)
        schema = parse_schema(flow.schema)
        rows = self._snapshot(flow.sql.split()[-1])
        if key is not None:
            rows = [r for r in rows if tuple(r[c] for c in flow.index_key) == tuple(key)]
        rows = [r for r in rows if all(_holds(p, r) for p in where)]
        for order in reversed(order_by or [OrderBy(c) for c in schema.names]):
            rows.sort(
                key=lambda r: (r[order.column] is None, r[order.column]), reverse=order.descending
            )
        rows = rows[offset:][:limit]
        table = pa.Table.from_pylist(rows, schema=schema)
        table = table.select(list(columns)) if columns is not None else table
        return ReadResult(table_to_ipc(table), self.clock - 1 if timestamp is None else timestamp, replica)

    async def query(
        self, instance, sql, *, timestamp=None, consistency="serializable", timeout_ms=30_000
    ):
        await self._enter(
            "query",
            instance,
            sql,
            timestamp=timestamp,
            consistency=consistency,
            timeout_ms=timeout_ms,
        )
        self._instance(instance)
        table = pa.table({"sql": [sql], "consistency": [consistency]})
        return ReadResult(
            table_to_ipc(table), self.clock - 1 if timestamp is None else timestamp, self._answerer(instance)
        )

    async def status(self, instance=None):
        await self._enter("status", instance)
        if instance is not None:
            self._instance(instance)
        return [self._view(name) for name in sorted(self.instances) if instance in (None, name)]

    async def leadership(self):
        await self._enter("leadership")
        return LEADERSHIP

    async def handover(self, to=None):
        await self._enter("handover", to)
        if to not in (None, "10.0.0.6:6875"):
            raise ControllerError("NOT_FOUND", f"no standby at {to}: the standbys are at 10.0.0.6:6875")
        return HandoverView("10.0.0.5:6875", "10.0.0.6:6875", 8, 67)

    async def take_lead(self, epoch):
        await self._enter("take_lead", epoch)
        return LEADERSHIP

    async def events(self, instance=None, *, after=None, limit=100):
        await self._enter("events", instance, after=after, limit=limit)
        found = [e for e in self.events_recorded if instance in (None, e.instance) and (after is None or e.id > after)]
        return found[:limit] if after is not None else found[-limit:]


LEADERSHIP = LeadershipView(
    7,
    ControllerView("leader", "10.0.0.5:6875", "h1", 41, 120),
    3_880,
    52,
    (ControllerView("standby", "10.0.0.6:6875", "h2", 42, 480),),
)


def test_an_unreachable_catalog_is_unavailable_so_a_client_tries_another_controller():
    import sqlalchemy.exc

    cut = sqlalchemy.exc.OperationalError("SELECT 1", {}, ConnectionResetError("server closed the connection"))
    code, message = status_of(cut)
    assert code is grpc.StatusCode.UNAVAILABLE and "the catalog cannot be reached (ConnectionResetError)" in message
    assert status_of(RuntimeError("a bug"))[0] is grpc.StatusCode.INTERNAL


def test_leadership_comes_back_whole(client, api):
    assert client.leadership() == LEADERSHIP


def test_a_handover_comes_back_whole_and_the_client_moves_to_the_new_leader(client, api):
    with pytest.raises(TandemError, match="no standby at 10.0.0.9:1") as unknown:
        client.handover("10.0.0.9:1")
    assert unknown.value.code is grpc.StatusCode.NOT_FOUND
    assert client.handover() == HandoverView("10.0.0.5:6875", "10.0.0.6:6875", 8, 67)
    assert client.address == "10.0.0.6:6875" and api.calls[-1] == ("handover", (None,), {})


# --- The server ------------------------------------------------------------------------


class ServerThread:
    """A `ControllerServer` over `api` on 127.0.0.1:0, run by an event loop of its own in
    a daemon thread, so tests call it with the synchronous client."""

    def __init__(self, api: Any, security: ServerSecurity = ServerSecurity(), listen: str = "127.0.0.1:0") -> None:
        self.api = api
        self.security = security
        self.listen = listen
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server = self.run(self._start())
        self.address = self.server.address

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    async def _start(self) -> ControllerServer:
        server = ControllerServer(self.api, self.listen, self.security)
        await server.start()
        return server

    def close(self) -> None:
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


def test_a_client_reaches_a_controller_back_on_its_address_within_a_second(api):
    """gRPC's reconnect backoff grows from 1 s toward 2 min (with jitter): a client that
    kept calling an address while nothing listened there failed every call for seconds
    after a controller (a standby restarted there, then leading) listened on it again
    (9-12 s in three runs of this test without the client's backoff options)."""
    first = ServerThread(api)
    address = first.address
    answered: list[float] = []
    stop = threading.Event()

    def call(client: Client) -> None:
        while not stop.is_set():
            try:
                client.list_sources()
                answered.append(time.monotonic())
            except TandemError:
                pass
            time.sleep(0.05)

    with Client.connect(address, failover=0) as client:
        client.list_sources()
        first.close()
        caller = threading.Thread(target=call, args=(client,))
        caller.start()
        try:
            time.sleep(16)  # every call fails: the channel's backoff grows meanwhile
            again = ServerThread(api, listen=address)
            back = time.monotonic()
            deadline = back + 60
            while not answered and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stop.set()
            caller.join()
        again.close()
    assert answered and answered[0] - back < 1.5, f"answered {answered[0] - back:.1f} s after the controller was back" if answered else "never answered"


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


@pytest.fixture
def server(api: FakeApi):
    running = ServerThread(api)
    yield running
    running.close()


@pytest.fixture
def client(server: ServerThread):
    with Client.connect(server.address, timeout=10) as connected:
        yield connected


def free_address() -> str:
    """A 127.0.0.1 address nothing listens on (the port was free a moment ago)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def refusal(call: Any) -> TandemError:
    with pytest.raises(TandemError) as caught:
        call()
    return caught.value


def populated(client: Client) -> None:
    """An instance `prod` with one replica, a source `orders` with four rows and a
    dataflow `by_id` indexed on id."""
    client.create_instance("prod")
    client.add_replica("prod", "r1")
    client.create_source("orders", "id BIGINT NOT NULL, region STRING, amount DOUBLE")
    client.append(
        "orders",
        [
            {"id": 1, "region": "eu", "amount": 10.0},
            {"id": 2, "region": "us", "amount": 20.0},
            {"id": 3, "region": "eu", "amount": None},
            {"id": 4, "region": None, "amount": 40.0},
        ],
    )
    client.create_dataflow("prod", "by_id", "SELECT * FROM orders", index_key=["id"])


# --- Round trips -----------------------------------------------------------------------


def test_get_version_names_the_package_and_the_epoch(server):
    with grpc.insecure_channel(server.address) as channel:
        answer = pb_grpc.ControllerStub(channel).GetVersion(pb.GetVersionRequest(), timeout=10)
    assert answer.server_version == metadata.version("tandem")
    assert answer.controller_epoch == FakeApi.epoch


def test_instances_round_trip(client, api):
    view = client.create_instance(
        "prod",
        min_in_sync=2,
        max_lag_ms=500,
        replica_timeout_ms=3000,
        spark_conf={"spark.sql.shuffle.partitions": "4"},
        max_hold_back_ms=20_000,
        replace_slow=True,
    )
    assert view == api._view("prod") and (view.max_hold_back_ms, view.replace_slow) == (20_000, True)
    assert api.last("create_instance") == (
        ("prod",),
        {
            "min_in_sync": 2,
            "max_lag_ms": 500,
            "replica_timeout_ms": 3000,
            "spark_conf": {"spark.sql.shuffle.partitions": "4"},
            "max_hold_back_ms": 20_000,
            "replace_slow": True,
        },
    )
    client.create_instance("dev")
    assert api.last("create_instance")[1] == {
        "min_in_sync": 1,
        "max_lag_ms": None,
        "replica_timeout_ms": None,
        "spark_conf": None,
        "max_hold_back_ms": None,
        "replace_slow": None,
    }
    assert [v.name for v in client.list_instances()] == ["dev", "prod"]
    client.drop_instance("dev")
    assert client.list_instances() == [api._view("prod")]


def test_an_empty_spark_conf_differs_from_none(client, api):
    client.create_instance("prod", spark_conf={})
    assert api.last("create_instance")[1]["spark_conf"] == {}


def test_absent_optional_fields_leave_the_api_defaults(server, api):
    api.instances["prod"], api.replicas["prod"] = (
        {"min_in_sync": 1, "max_lag_ms": None, "replica_timeout_ms": None},
        {},
    )
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ControllerStub(channel)
        stub.CreateInstance(pb.CreateInstanceRequest(name="bare"), timeout=10)
        stub.Resize(pb.ResizeRequest(instance="prod", size="large"), timeout=10)
    assert api.last("create_instance")[1]["min_in_sync"] == 1
    assert api.last("resize")[1]["timeout_ms"] == 600_000


def test_replicas_round_trip_and_the_size_rule(client, api):
    client.create_instance("prod")
    assert client.add_replica("prod", "r1") == api.replicas["prod"]["r1"]
    assert api.last("add_replica")[1] == {
        "size": "xsmall",
        "spark_master": None,
        "spark_conf": None,
        "address": None,
        "driver_host": None,
        "driver_bind_address": None,
        "wait": False,
        "timeout_ms": None,
    }
    client.add_replica(
        "prod", "r2", spark_master="spark://h:7077", spark_conf={"spark.executor.cores": "4"}
    )
    assert api.last("add_replica")[1] == {
        "size": None,
        "spark_master": "spark://h:7077",
        "spark_conf": {"spark.executor.cores": "4"},
        "address": None,
        "driver_host": None,
        "driver_bind_address": None,
        "wait": False,
        "timeout_ms": None,
    }
    client.add_replica(
        "prod",
        "r3",
        size="large",
        spark_master="spark://h:7077",
        driver_host="10.0.0.2",
        driver_bind_address="0.0.0.0",
        wait=True,
        timeout_ms=45_000,
    )
    assert api.last("add_replica")[1] == {
        "size": "large",
        "spark_master": "spark://h:7077",
        "spark_conf": None,
        "address": None,
        "driver_host": "10.0.0.2",
        "driver_bind_address": "0.0.0.0",
        "wait": True,
        "timeout_ms": 45_000,
    }
    external = client.add_replica("prod", "r4", address="10.0.0.5:7000")
    assert (external.address, external.managed, external.pid, external.lag_ms) == (
        "10.0.0.5:7000",
        False,
        None,
        None,
    )
    assert api.last("add_replica")[1]["size"] is None

    client.drop_replica("prod", "r4", force=True)
    assert api.last("drop_replica") == (("prod", "r4"), {"force": True})
    after = client.resize("prod", "medium", timeout_ms=1234, on_timeout="commit")
    assert api.last("resize") == (("prod", "medium"), {"timeout_ms": 1234, "on_timeout": "commit"})
    assert [r.name for r in after] == ["r1-medium", "r2-medium", "r3-medium"]
    assert after == list(api.replicas["prod"].values())


def test_status_views_arrive_equal_to_the_api_views(client, api, server):
    populated(client)
    client.add_replica("prod", "ext", address="10.0.0.5:7000")
    client.create_dataflow("prod", "kept", "SELECT * FROM orders", index_key=(), materialize=True)
    client.create_instance("empty")
    expected = server.run(api.status())
    assert client.status() == expected
    assert client.status("prod") == expected[1:]
    # None fields (an external replica's pid, a closed frontier) survive the trip.
    collections = client.status("prod")[0].collections
    assert CollectionView("m2", "kept (sink)", None, None) in collections


def failing(view: ReplicaView) -> ReplicaView:
    """`view`, with every field a struggling replica fills."""
    return replace(
        view,
        errors=("no live executors", "disk full"),
        dataflows={
            "by_id": DataflowStatusView(True, None, "ab12", 340, 4, 12, pending_times=3, pending_rows=150, last_step_times=40),
            "kept": DataflowStatusView(False, "division by zero", "", 0, 0, 0),
            "late": DataflowStatusView(False, None, "", 0, 0, 0, hydration_tasks_done=3, hydration_tasks_total=8),
            "stalled": DataflowStatusView(True, None, "cd34", 80, 0, 5, retries=2, retry_error="storage failed: disk hiccup"),
        },
        metrics_address="127.0.0.1:9100",
        consecutive_failures=3,
        last_failure="refused (STALE_EPOCH): epoch 1 < 2",
        next_retry_ms=1_700_000_000_000,
    )


def fail_kept(api: FakeApi) -> None:
    """Replica r1 of `prod` reports `kept` failed, and nothing else serves it."""
    api.replicas["prod"]["r1"] = failing(api.replicas["prod"]["r1"])
    api.unavailable["prod"] = {"kept": "failed on r1: division by zero"}


def test_failures_errors_and_dataflow_statuses_arrive_complete(client, api, server):
    populated(client)
    client.create_dataflow("prod", "kept", "SELECT * FROM orders", materialize=True)
    client.add_replica("prod", "r2")
    fail_kept(api)

    (view,) = client.status("prod")

    assert [view] == server.run(api.status("prod"))
    assert view.unavailable_dataflows == {"kept": "failed on r1: division by zero"}
    r1, r2 = view.replicas
    assert r1.dataflows["kept"].error == "division by zero" and r1.next_retry_ms == 1_700_000_000_000
    assert (r1.dataflows["late"].hydration_tasks_done, r1.dataflows["late"].hydration_tasks_total) == (3, 8)
    assert (r1.dataflows["stalled"].retries, r1.dataflows["stalled"].retry_error) == (2, "storage failed: disk hiccup")
    assert (r1.metrics_address, r2.metrics_address) == ("127.0.0.1:9100", None)
    assert (r2.errors, r2.dataflows, r2.last_failure, r2.next_retry_ms) == ((), {}, None, None)
    dataflows = client.list_dataflows("prod")
    assert dataflows == server.run(api.list_dataflows("prod"))
    assert dataflows[1].replicas == {"r1": DataflowStatusView(False, "division by zero", "", 0, 0, 0)}
    assert dataflows[0].replicas["r1"].error is None  # absent, not ""


def test_events_round_trip_with_their_paging(client, api):
    api.events_recorded = [
        EventView(1, 1_000, "main", "replica_failed", "r1", "replica r1 (incarnation 1) failed: stream broke"),
        EventView(2, 1_001, "main", "took_over", "", "controller epoch 2 recovered the instance"),
        EventView(3, 1_002, "other", "slow", "r9", "replica r9 is slow"),
    ]
    assert client.events() == api.events_recorded
    assert api.last("events") == ((None,), {"after": None, "limit": 100})
    assert client.events("main", limit=1) == api.events_recorded[1:2]
    assert client.events(after=1, limit=5) == api.events_recorded[1:]
    assert api.last("events") == ((None,), {"after": 1, "limit": 5})


def test_sources_and_append_of_mappings_keep_python_types(client, api):
    view = client.create_source(
        "events",
        "id BIGINT NOT NULL, day DATE, at TIMESTAMP, price DECIMAL(10,2), raw BINARY, ok BOOLEAN",
    )
    assert view == api.sources["events"]
    rows = [
        {
            "id": 1,
            "day": dt.date(2024, 1, 31),
            "at": dt.datetime(2024, 1, 31, 12, 30, tzinfo=dt.UTC),
            "price": decimal.Decimal("9.99"),
            "raw": b"\x00\xff",
            "ok": True,
        },
        {"id": 1, "_diff": -1},
    ]
    timestamp = client.append("events", rows)
    assert timestamp == 1000
    assert api.last("append")[0] == ("events", rows)
    assert client.list_sources()[0].upper == 1001


def test_append_of_a_table_travels_as_arrow(client, api):
    client.create_source("events", "id BIGINT NOT NULL, name STRING")
    table = pa.table({"id": pa.array([1, 2], pa.int64()), "name": ["a", None], "_diff": [1, 1]})
    assert client.append("events", table) == 1000
    assert api.last("append")[0][1].equals(table)


def test_append_refusal_names_the_column_and_row(client):
    client.create_source("events", "id BIGINT NOT NULL, name STRING")
    error = refusal(lambda: client.append("events", [{"id": 1}, {"id": "two"}]))
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "row index 1" in error.message and "'id'" in error.message


@pytest.mark.parametrize("rows", ["id,name", {"id": 1}, [{"id": {1, 2}}]])
def test_rows_the_client_cannot_send_are_refused_before_sending(client, api, rows):
    error = refusal(lambda: client.append("events", rows))
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert not api.calls


def test_the_strategy_goes_to_the_api_and_comes_back_with_the_reason(client, api):
    populated(client)
    forced = client.create_dataflow("prod", "forced", "SELECT * FROM orders", index_key=(), strategy="recompute")
    assert api.last("create_dataflow")[1]["strategy"] == "recompute"
    assert forced.strategy == "recompute: asked for"
    assert client.list_dataflows("prod")[-1].strategy == "recompute: asked for"


def test_dataflows_round_trip(client, api):
    populated(client)
    client.create_instance("dev")
    view = client.create_dataflow(
        "dev", "copy", "SELECT * FROM orders", materialize=True, compaction_window_ms=60_000
    )
    assert view == api.dataflows["dev", "copy"]
    assert (view.index_key, view.index_id, view.sink_id) == (None, None, "m2")
    whole_row = client.create_dataflow("dev", "rows", "SELECT * FROM orders", index_key=())
    assert whole_row.index_key == ()
    assert api.last("create_dataflow")[1] == {
        "index_key": (),
        "materialize": False,
        "compaction_window_ms": 0,
        "strategy": "auto",
    }
    assert [d.name for d in client.list_dataflows()] == ["by_id", "copy", "rows"]
    assert [d.name for d in client.list_dataflows("dev")] == ["copy", "rows"]
    client.drop_dataflow("dev", "copy")
    assert [d.name for d in client.list_dataflows("dev")] == ["rows"]


def test_sources_drop(client):
    client.create_source("a", "x INT")
    client.drop_source("a")
    assert client.list_sources() == []


# --- Reads -----------------------------------------------------------------------------


def test_peek_returns_rows_table_timestamp_and_replica(client):
    populated(client)
    result = client.peek(
        "prod", "by_id", where={"region": "eu"}, order_by=["-id"], columns=["id", "amount"]
    )
    assert result.rows == [{"id": 3, "amount": None}, {"id": 1, "amount": 10.0}]
    assert result.table.schema.names == ["id", "amount"]
    assert (result.timestamp, result.replica) == (1000, "r1")
    assert client.peek("prod", "by_id", key=2).rows == [{"id": 2, "region": "us", "amount": 20.0}]
    page = client.peek("prod", "by_id", order_by="id", offset=1, limit=2)
    assert [r["id"] for r in page.rows] == [2, 3]


def test_an_empty_result_keeps_its_columns(client):
    populated(client)
    result = client.peek("prod", "by_id", key=99)
    assert result.rows == [] and result.table.schema.names == ["id", "region", "amount"]


def sent_peek(client: Client, api: FakeApi, **arguments: Any) -> dict[str, Any]:
    """The keyword arguments the API received for a peek with `arguments`."""
    api.fail = ControllerError("NOT_FOUND", "only the arguments matter here")
    refusal(lambda: client.peek("prod", "by_id", **arguments))
    return api.last("peek")[1]


@pytest.mark.parametrize(
    "where, expected",
    [
        (
            {"region": "eu", "amount": None, "id": [1, 3]},
            (
                Predicate("region", "=", "eu"),
                Predicate("amount", "is_null"),
                Predicate("id", "in", (1, 3)),
            ),
        ),
        (
            [("id", ">=", 2), ("region", "is_not_null"), ("id", "in", (2, 4))],
            (
                Predicate("id", ">=", 2),
                Predicate("region", "is_not_null"),
                Predicate("id", "in", (2, 4)),
            ),
        ),
        ([Predicate("id", "<", 3)], (Predicate("id", "<", 3),)),
        ({"day": dt.date(2024, 1, 31)}, (Predicate("day", "=", "2024-01-31"),)),
        (None, ()),
    ],
)
def test_where_forms(client, api, where, expected):
    assert sent_peek(client, api, where=where)["where"] == expected


@pytest.mark.parametrize(
    "order_by, expected",
    [
        (["region", "-id"], (OrderBy("region"), OrderBy("id", descending=True))),
        ([("amount", "DESC"), ("id", "asc")], (OrderBy("amount", descending=True), OrderBy("id"))),
        ([OrderBy("id", nulls_last=False)], (OrderBy("id", nulls_last=False),)),
        ("-amount", (OrderBy("amount", descending=True),)),
        (None, ()),
    ],
)
def test_order_by_forms(client, api, order_by, expected):
    assert sent_peek(client, api, order_by=order_by)["order_by"] == expected


@pytest.mark.parametrize(
    "key, expected",
    [
        (2, (2,)),
        ((1, "eu"), (1, "eu")),
        ([None, 1.5], (None, 1.5)),
        (dt.date(2024, 1, 2), ("2024-01-02",)),
        (None, None),
    ],
)
def test_key_forms(client, api, key, expected):
    assert sent_peek(client, api, key=key)["key"] == expected


def test_peek_options_cross_the_wire(client, api):
    populated(client)
    client.peek(
        "prod",
        "by_id",
        limit=0,
        offset=3,
        columns=[],
        timestamp=999,
        consistency="strict",
        timeout_ms=500,
    )
    options = api.last("peek")[1]
    assert (options["limit"], options["offset"], options["columns"]) == (0, 3, ())
    assert (options["timestamp"], options["consistency"], options["timeout_ms"]) == (
        999,
        "strict",
        500,
    )
    client.peek("prod", "by_id")
    options = api.last("peek")[1]
    assert (options["limit"], options["columns"], options["timestamp"], options["key"]) == (
        None,
        None,
        None,
        None,
    )


@pytest.mark.parametrize(
    "arguments",
    [
        {"where": [("id", "~", 1)]},
        {"where": [("id",)]},
        {"where": ["id = 1"]},
        {"where": [("id", "in", 1)]},
        {"where": {"id": object()}},
        {"order_by": [("id", "sideways")]},
        {"order_by": [42]},
        {"columns": "id"},
        {"consistency": "eventual"},
        {"key": (object(),)},
        {"limit": "3"},
        {"offset": "1"},
    ],
)
def test_peek_arguments_that_do_not_convert_are_refused_before_sending(client, api, arguments):
    error = refusal(lambda: client.peek("prod", "by_id", **arguments))
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert not api.calls


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.create_instance("x", min_in_sync="2"),
        lambda c: c.drop_instance(5),
        lambda c: c.add_replica("prod", "r", spark_conf=None, size=3),
        lambda c: c.resize("prod", "large", timeout_ms="soon"),
        lambda c: c.create_dataflow("prod", "d", "SELECT 1", index_key="id"),
        lambda c: c.create_dataflow("prod", "d", "SELECT 1", index_key=[1]),
        lambda c: c.query("prod", "SELECT 1", timestamp=-0.5),
        lambda c: c.query("prod", "SELECT 1", consistency="eventual"),
    ],
)
def test_arguments_of_the_wrong_type_are_refused_before_sending(client, api, call):
    error = refusal(lambda: call(client))
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert not api.calls


def test_query_round_trip(client, api):
    populated(client)
    result = client.query("prod", "SELECT 1", timestamp=5, consistency="strict", timeout_ms=700)
    assert result.rows == [{"sql": "SELECT 1", "consistency": "strict"}]
    assert (result.timestamp, result.replica) == (5, "r1")
    assert api.last("query") == (
        ("prod", "SELECT 1"),
        {"timestamp": 5, "consistency": "strict", "timeout_ms": 700},
    )


def test_results_beyond_four_mebibytes_pass(client, api):
    client.create_instance("prod")
    client.add_replica("prod", "r1")
    client.create_source("blobs", "id BIGINT NOT NULL, text STRING")
    big = pa.table({"id": pa.array(range(6), pa.int64()), "text": ["x" * 1_000_000] * 6})
    client.append("blobs", big)
    client.create_dataflow("prod", "all", "SELECT * FROM blobs", index_key=["id"])
    assert client.peek("prod", "all").table.to_pydict() == big.to_pydict()


# --- Codec laws ------------------------------------------------------------------------

json_values = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts
tagged_values = (
    st.dates()
    | st.datetimes()
    | st.datetimes(timezones=st.just(dt.UTC))
    | st.decimals(allow_nan=False, allow_infinity=False)
    | st.binary()
)


@given(st.lists(st.dictionaries(texts, json_values | tagged_values, max_size=4), max_size=4))
def test_json_rows_round_trip(rows):
    assert codec.rows_from_json(codec.rows_to_json(rows)) == rows


@given(
    key=st.none() | scalar_tuples,
    where=st.lists(predicates, max_size=3).map(tuple),
    limit=st.none() | st.integers(0, 2**63 - 1),
    columns=st.none() | st.lists(texts, max_size=3).map(tuple),
    timestamp=st.none() | st.integers(0, 2**63 - 1),
    consistency=st.sampled_from(["serializable", "strict"]),
)
def test_peek_requests_round_trip(key, where, limit, columns, timestamp, consistency):
    options = {
        "key": key,
        "where": where,
        "order_by": (OrderBy("a", True, False),),
        "limit": limit,
        "offset": 2,
        "columns": columns,
        "timestamp": timestamp,
        "consistency": consistency,
        "timeout_ms": 9,
    }
    wire = pb.PeekRequest.FromString(codec.peek_to_proto("i", "n", **options).SerializeToString())
    assert codec.peek_from_proto(wire) == ("i", "n", options)


@pytest.mark.parametrize(
    "line, problem",
    [
        ("[1]", "expected a JSON object"),
        ("{", "not JSON"),
        ('{"d": {"$type": "date", "value": "x"}}', "bad date"),
        ('{"d": {"$type": "set", "value": "x"}}', "not a tagged value"),
        ('{"d": [1]}', None),
    ],
)
def test_json_rows_that_do_not_decode(line, problem):
    if problem is None:  # a list is no tag: left for storage to refuse by column
        assert codec.rows_from_json([line]) == [{"d": [1]}]
        return
    with pytest.raises(Exception, match=problem) as caught:
        codec.rows_from_json(['{"a": 1}', line])
    assert "row index 1" in str(caught.value)


# --- Errors ----------------------------------------------------------------------------

CODES = [
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "INVALID_ARGUMENT",
    "FAILED_PRECONDITION",
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
]


@pytest.mark.parametrize("code", CODES)
def test_each_controller_error_arrives_with_its_status_and_message(client, api, code):
    api.fail = ControllerError(code, f"refused with {code}")
    error = refusal(lambda: client.list_sources())
    assert (error.code, error.message) == (grpc.StatusCode[code], f"refused with {code}")
    assert str(error) == f"{code}: refused with {code}"


@pytest.mark.parametrize(
    "call, code",
    [
        (lambda c: c.drop_instance("nope"), "NOT_FOUND"),
        (lambda c: c.create_instance("prod"), "ALREADY_EXISTS"),
        (lambda c: c.create_instance("x", min_in_sync=0), "INVALID_ARGUMENT"),
        (lambda c: c.create_source("s", "id NOT_A_TYPE"), "INVALID_ARGUMENT"),
        (lambda c: c.drop_replica("prod", "r1"), "FAILED_PRECONDITION"),
        (lambda c: c.peek("prod", "unindexed"), "FAILED_PRECONDITION"),
        (lambda c: c.query("bare", "SELECT 1"), "UNAVAILABLE"),
        (lambda c: c.status("nope"), "NOT_FOUND"),
    ],
)
def test_the_fakes_own_refusals_cross_the_wire(client, call, code):
    populated(client)
    client.create_dataflow("prod", "unindexed", "SELECT * FROM orders", materialize=True)
    client.create_instance("bare")
    assert refusal(lambda: call(client)).code is grpc.StatusCode[code]


def test_a_refusal_changes_nothing_the_client_sees(client):
    populated(client)
    before = client.status()
    refusal(lambda: client.create_instance("prod"))
    assert client.status() == before


def test_an_unexpected_exception_is_internal_and_logged_not_leaked(client, api, caplog):
    api.fail = KeyError("secret detail")
    with caplog.at_level(logging.ERROR, logger="controller._service"):
        error = refusal(lambda: client.list_instances())
    assert error.code is grpc.StatusCode.INTERNAL
    assert "KeyError" in error.message and "secret" not in error.message
    [record] = [r for r in caplog.records if r.name == "controller._service"]
    assert "ListInstances" in record.getMessage() and record.exc_info[0] is KeyError
    assert client.list_instances() == []  # the server still serves


@pytest.mark.parametrize(
    "method, message, problem",
    [
        ("Peek", pb.PeekRequest(instance="prod", name="x", consistency=99), "Consistency 99"),
        ("Query", pb.QueryRequest(instance="prod", sql="x", consistency=99), "Consistency 99"),
        ("Append", pb.AppendRequest(source="s"), "AppendRequest.rows is not set"),
        ("Append", pb.AppendRequest(source="s", rows_arrow=b"junk"), "not an Arrow IPC stream"),
        (
            "Append",
            pb.AppendRequest(source="s", rows_json=pb.JsonRows(rows=["[1]"])),
            "row index 0",
        ),
    ],
)
def test_a_request_that_does_not_decode_is_invalid_argument(server, api, method, message, problem):
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as caught:
        getattr(pb_grpc.ControllerStub(channel), method)(message, timeout=10)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert problem in caught.value.details()
    assert not api.calls


def test_a_protocol_error_from_the_api_itself_is_internal(client, api):
    api.fail = ProtocolError("a replica sent garbage")
    error = refusal(lambda: client.list_sources())
    assert error.code is grpc.StatusCode.INTERNAL and "garbage" not in error.message


def test_a_call_past_its_deadline_is_deadline_exceeded_naming_the_address(server, api):
    api.delay = 2.0
    with Client(server.address, deadline=0.2) as client:
        error = refusal(lambda: client.list_sources())
    assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert (
        error.message
        == f"no answer from the controller at {server.address} to ListSources within 0.2 s"
    )


def test_peek_deadline_follows_its_timeout(client, api, monkeypatch):
    populated(client)
    seen = []
    stub = client._stub

    class Recorder:
        def __getattr__(self, method):
            def call(request, timeout, metadata):
                seen.append((method, timeout))
                return getattr(stub, method)(request, timeout=timeout, metadata=metadata)

            return call

    monkeypatch.setattr(client, "_stub", Recorder())
    client.peek("prod", "by_id", timeout_ms=2000)
    client.query("prod", "SELECT 1", timeout_ms=500)
    client.resize("prod", "large", timeout_ms=60_000)
    client.list_sources()
    assert seen == [("Peek", 12.0), ("Query", 10.5), ("Resize", 250.0), ("ListSources", 120.0)]


def test_a_call_the_servers_grpc_stack_cancels_is_unavailable():
    # A controller whose server is stopping (fenced, say) has its gRPC stack cancel the
    # calls that reach it meanwhile: CANCELLED, with no status of the controller's. A
    # bare gRPC server that answers so stands in for that race.
    def cancelled(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")

    handlers = {"ListSources": grpc.unary_unary_rpc_method_handler(cancelled)}
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tandem.v1.Controller", handlers),))
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        with Client(address) as client:
            error = refusal(lambda: client.list_sources())
    finally:
        server.stop(0)
    assert error.code is grpc.StatusCode.UNAVAILABLE
    assert error.message == f"the controller at {address} went away before answering ListSources (CANCELLED)"


def test_an_unreachable_controller_is_unavailable_naming_the_address():
    address = free_address()
    error = refusal(lambda: Client.connect(address, timeout=0.3))
    assert error.code is grpc.StatusCode.UNAVAILABLE
    assert error.message.startswith(f"cannot reach the controller at {address} (no answer within 0.3 s): ")
    assert "Connection refused" in error.message  # gRPC's last connection error, not only the wait
    with Client(address) as client:
        error = refusal(lambda: client.list_instances())
    assert error.code is grpc.StatusCode.UNAVAILABLE
    assert error.message.startswith(f"cannot reach the controller at {address}: ")


def test_the_server_binds_loopback_unless_told_otherwise(server, api):
    async def bind(listen: str) -> str:
        other = ControllerServer(api, listen)
        await other.stop(0)
        return other.address

    assert server.run(bind(":0")).startswith("127.0.0.1:")
    assert server.run(bind("0.0.0.0:0")).startswith("0.0.0.0:")
    for bad in ("127.0.0.1:99999", "127.0.0.1:http", "256.0.0.1:0"):
        with pytest.raises(OSError, match="cannot listen on"):
            server.run(bind(bad))
