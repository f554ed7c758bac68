"""The replica service with real processes, a real gRPC channel and real Spark.

Two replica processes (`local[1]` and `local[2]`) serve one instance for the whole
module; a scripted controller in the test drives them. Answers are checked against the
same SQL run directly with Spark, in the test process, on the storage snapshot.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor
import pyarrow as pa
import pytest

import history as h
from catalog import Catalog
from protocol import ipc_to_table
from replica_harness import ReplicaProcess, ScriptedClient
from replica_service import _spark
from storage import Storage, schema_to_ddl

pytestmark = pytest.mark.spark

SALES = "id BIGINT NOT NULL, region STRING, amount DOUBLE"
REGIONS = "region STRING NOT NULL, country STRING"


class Controller:
    """A scripted controller for one replica: a history, pushed before it is sent."""

    def __init__(self, address: str, instance: h.InstanceConfig, epoch: int = 1) -> None:
        self.address = address
        self.history = h.CommandHistory([h.CreateInstance(instance)])
        self.client = ScriptedClient(address, epoch=epoch)
        self.client.send(h.CreateInstance(instance), h.InitializationComplete())

    def send(self, *commands: h.ComputeCommand) -> None:
        for command in commands:
            self.history.push(command)
            self.client.send(command)

    def reconnect(self, epoch: int, history: list[h.ComputeCommand] | None = None) -> ScriptedClient:
        """A new connection replaying the reduced history (or `history`)."""
        self.client.close()
        self.client = ScriptedClient(self.address, epoch=epoch)
        replay = history if history is not None else h.reduce_commands([*self.history.commands, h.InitializationComplete()])
        self.client.send(*replay)
        return self.client


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("replica")
    url = f"sqlite:///{root / 'catalog.db'}"
    catalog = Catalog.open(url)
    catalog.become_controller()
    storage = Storage(catalog, root / "blobs")
    info = catalog.create_instance("analytics")
    config = info.config
    with ThreadPoolExecutor(2) as pool:  # start both JVMs at once
        small, large = pool.map(
            lambda master: ReplicaProcess(url, root / "blobs", master=master, log_path=root / f"{master}.log"),
            ["local[1]", "local[2]"],
        )
    # The test's own Spark session, with the instance's settings: it derives output
    # schemas (as the controller's planner will) and computes the expected answers.
    session = _spark.start_session(_spark.SparkSettings("local[1]"), root / "test-spark", config.conf())
    planner = _spark.dataflow_session(session, config.conf())
    yield dict(root=root, url=url, catalog=catalog, storage=storage, config=config, small=small, large=large, planner=planner)
    for replica in (small, large):
        replica.stop()


@pytest.fixture(scope="module")
def spark(env):
    """The test's own Spark session, with the instance's settings, to compute expectations."""
    return env["planner"]


def _dataflow(env, name: str, sql: str, imports: dict[str, str], *, key=None, materialized=False, as_of=None) -> h.DataflowDescription:
    """Record a dataflow in the catalog (as the controller would) and describe it."""
    catalog: Catalog = env["catalog"]
    storage: Storage = env["storage"]
    imported = [h.Import(alias, storage_id, "storage") for alias, storage_id in imports.items()]
    since = max(storage.since(i.id).time for i in imported)
    empty = {alias: storage.schema(id).empty_table() for alias, id in imports.items()}
    schema = schema_to_ddl(_spark.run_sql(env["planner"], sql, empty).schema)
    info = catalog.create_dataflow(
        env["config"].name,
        name,
        sql=sql,
        imports=imported,
        schema=schema,
        as_of=h.Frontier(as_of if as_of is not None else since),
        index_key=key,
        materialized=materialized,
    )
    return info.description()


def _expected(spark, env, sql: str, imports: dict[str, str], t: int) -> pa.Table:
    tables = {alias: env["storage"].read_snapshot(id, t) for alias, id in imports.items()}
    return _spark.run_sql(spark, sql, tables)


def _rows(table: pa.Table) -> list[dict]:
    return sorted(table.to_pylist(), key=lambda row: [(v is None, str(v)) for v in row.values()])


def _peek_rows(result: h.PeekResult) -> pa.Table:
    assert isinstance(result, h.PeekRows), result
    return ipc_to_table(result.arrow_ipc)


@pytest.fixture(scope="module")
def sales(env):
    """A source with three appends at increasing times, and those times."""
    storage: Storage = env["storage"]
    source = storage.create_source(f"sales_{uuid.uuid4().hex[:6]}", SALES)
    regions = storage.create_source(f"regions_{uuid.uuid4().hex[:6]}", REGIONS)
    storage.append(regions.id, [{"region": r, "country": c} for r, c in [("north", "NO"), ("south", "ZA"), ("east", "JP")]])
    times = []
    for batch in range(3):
        rows = [{"id": batch * 100 + i, "region": ["north", "south", "east", None][i % 4], "amount": (i * 0.1) + batch / 3} for i in range(40)]
        times.append(storage.append(source.id, rows))
    retraction = [{"id": 0, "region": "north", "amount": 0.0, "_diff": -1}]
    times.append(storage.append(source.id, retraction))
    advance(storage, regions.id)
    return dict(id=source.id, regions=regions.id, times=times)


def advance(storage: Storage, *ids: str) -> None:
    """Move idle sources' uppers to now, as the controller's advancer does each tick."""
    now = storage.catalog.write_ts()
    for id in ids:
        storage.compare_and_append(id, storage.upper(id), h.Frontier(now + 1))


def append(env, sales, rows) -> int:
    """Append to the sales source and keep the regions source in step."""
    t = env["storage"].append(sales["id"], rows)
    advance(env["storage"], sales["regions"])
    sales["times"].append(t)
    return t


@pytest.fixture(scope="module")
def small(env):
    controller = Controller(env["small"].address, env["config"])
    yield controller
    controller.client.close()


@pytest.fixture(scope="module")
def large(env):
    controller = Controller(env["large"].address, env["config"])
    yield controller
    controller.client.close()


TOTALS = "select region, sum(amount) as total, count(*) as n from sales group by region"
JOINED = (
    "select r.country, sum(s.amount * 1.1) as total, count(*) as n "
    "from sales s join regions r on s.region = r.region group by r.country"
)


def test_peeks_at_several_times_match_spark(env, sales, small, spark):
    desc = _dataflow(env, "totals", TOTALS, {"sales": sales["id"]}, key=["region"])
    small.send(h.CreateDataflow(desc), h.Schedule(desc.export_ids[0]))
    index = desc.export_ids[0]
    small.client.wait_frontier(index, past=sales["times"][-1])
    for t in sales["times"]:
        answer = _peek_rows(small.client.peek(h.IndexTarget(index), t))
        expected = _expected(spark, env, TOTALS, {"sales": sales["id"]}, t)
        assert _rows(answer) == _rows(expected), f"at {t}"


def test_peek_finishing_key_filter_order_limit_projection(env, sales, small):
    index = _index_of(env, "totals")
    t = sales["times"][-1]
    by_key = _peek_rows(small.client.peek(h.IndexTarget(index), t, h.RowSetFinishing(key=("south",))))
    assert by_key.column("region").to_pylist() == ["south"]
    missing = _peek_rows(small.client.peek(h.IndexTarget(index), t, h.RowSetFinishing(key=("west",))))
    assert missing.num_rows == 0
    finished = _peek_rows(
        small.client.peek(
            h.IndexTarget(index),
            t,
            h.RowSetFinishing(
                filter=(h.Predicate("region", "is_not_null"), h.Predicate("n", ">=", 10)),
                order_by=(h.OrderBy("region", descending=True),),
                offset=1,
                limit=1,
                projection=("region",),
            ),
        )
    )
    assert finished.to_pylist() == [{"region": "north"}]


def test_sql_peek_over_an_index(env, sales, small, spark):
    index = _index_of(env, "totals")
    t = sales["times"][1]
    target = h.SqlTarget("select region, n * 2 as doubled from totals where region is not null order by region", (h.Import("totals", index, "index"),))
    answer = _peek_rows(small.client.peek(target, t))
    expected = _spark.run_sql(spark, "select region, n * 2 as doubled from t where region is not null order by region", {"t": _expected(spark, env, TOTALS, {"sales": sales["id"]}, t)})
    assert answer.to_pylist() == expected.to_pylist()


def test_peek_below_since_is_an_error_naming_the_since(env, sales, small):
    index = _index_of(env, "totals")
    since = sales["times"][1]
    small.send(h.AllowCompaction(index, h.Frontier(since)))
    result = small.client.peek(h.IndexTarget(index), sales["times"][0])
    assert isinstance(result, h.PeekError) and f"since Frontier([{since}])" in result.message


def test_cancel_peek_answers_canceled_exactly_once(env, sales, small):
    index = _index_of(env, "totals")
    far_future = sales["times"][-1] + 10**9  # waits for an upper that never comes
    peek = h.Peek("to-cancel", h.IndexTarget(index), far_future, timeout_ms=60_000)
    small.send(peek)
    time.sleep(0.3)
    small.send(h.CancelPeek(peek.uuid))
    assert isinstance(small.client.wait_for(lambda r: r.peeks.get(peek.uuid)), h.PeekCanceled)
    time.sleep(0.5)
    assert small.client.responses.peek_counts[peek.uuid] == 1


def test_replicas_of_different_sizes_agree_bit_for_bit(env, sales, small, large):
    imports = {"sales": sales["id"], "regions": sales["regions"]}
    desc = _dataflow(env, "joined", JOINED, imports, key=["country"])
    totals = _dataflow(env, "totals_large", TOTALS, {"sales": sales["id"]}, key=["region"])
    for controller in (small, large):
        controller.send(h.CreateDataflow(desc), h.Schedule(desc.export_ids[0]))
    large.send(h.CreateDataflow(totals), h.Schedule(totals.export_ids[0]))
    t = sales["times"][-1]
    answers = [c.client.peek(h.IndexTarget(desc.export_ids[0]), t) for c in (small, large)]
    assert all(isinstance(a, h.PeekRows) for a in answers), answers
    assert answers[0].row_count > 0
    assert answers[0].digest == answers[1].digest
    assert _peek_rows(answers[0]).equals(_peek_rows(answers[1]))


def test_status_heartbeats_at_least_once_a_second(small):
    start = len(small.client.responses.statuses)
    time.sleep(2.2)
    assert len(small.client.responses.statuses) - start >= 2
    status = small.client.responses.statuses[-1]
    assert status.pid == small.client.responses.statuses[0].pid
    assert all(d.hydrated for d in status.dataflows if d.error is None)


def test_stale_epoch_is_refused(env):
    client = ScriptedClient(env["small"].address, epoch=0)
    refusal = client.wait_for(lambda r: r.refusal, 20, "a refusal")
    assert refusal.code == "stale_epoch" and "epoch 0 is stale" in refusal.message
    client.wait_for(lambda r: r.ended, 10, "the stream to end")
    client.close()


def test_a_failing_dataflow_does_not_stop_the_others(env, sales, small):
    bad = _dataflow(env, "bad_cast", "select cast(region as int) as r from sales", {"sales": sales["id"]}, key=["r"])
    small.send(h.CreateDataflow(bad), h.Schedule(bad.export_ids[0]))
    status = small.client.wait_for(
        lambda r: next((s for s in reversed(r.statuses) for d in s.dataflows if d.id == bad.export_ids[0] and d.error), None),
        60,
        "the bad dataflow to fail",
    )
    error = next(d.error for d in status.dataflows if d.id == bad.export_ids[0])
    assert "CAST" in error.upper()
    peek = small.client.peek(h.IndexTarget(bad.export_ids[0]), sales["times"][-1])
    assert isinstance(peek, h.PeekError) and "bad_cast" in peek.message
    # The healthy dataflow keeps advancing with new data.
    t = append(env, sales, [{"id": 999, "region": "west", "amount": 1.0}])
    index = _index_of(env, "totals")
    small.client.wait_frontier(index, past=t)
    rows = _peek_rows(small.client.peek(h.IndexTarget(index), t, h.RowSetFinishing(key=("west",))))
    assert rows.to_pylist() == [{"region": "west", "total": 1.0, "n": 1}]
    small.send(h.AllowCompaction(bad.export_ids[0], h.Frontier.empty()))
    small.client.wait_for(lambda r: r.frontiers.get(bad.export_ids[0]) == h.Frontier.empty(), 20, "the drop")


def test_two_replicas_write_a_materialized_view_exactly_once(env, sales, small, large, spark):
    desc = _dataflow(env, "totals_mv", TOTALS, {"sales": sales["id"]}, key=["region"], materialized=True)
    for controller in (small, large):
        controller.send(h.CreateDataflow(desc), h.Schedule(desc.export_ids[0]))
    sink = desc.sink_exports[0].id
    for i in range(3):
        append(env, sales, [{"id": 1000 + i, "region": "east", "amount": float(i)}])
    for controller in (small, large):
        controller.client.wait_frontier(sink, past=sales["times"][-1])
    storage: Storage = env["storage"]
    manifest = env["catalog"].manifest(sink)
    batches = sorted(manifest.batches, key=lambda b: b.lower)
    for before, after in zip(batches, batches[1:]):
        assert before.upper.time <= after.lower  # no time range written twice
    change_times = [t for t in sales["times"] if t >= desc.as_of.time]
    with_rows = [b for b in batches if b.rows > 0]
    assert len(with_rows) == len(change_times)  # each change written once, by one replica
    for t in change_times:
        expected = _expected(spark, env, TOTALS, {"sales": sales["id"]}, t)
        assert _rows(storage.read_snapshot(sink, t)) == _rows(expected.cast(storage.schema(sink)))


def test_reconnect_with_a_compatible_history_keeps_dataflows(env, sales, small):
    before = small.client.latest_status()
    index = _index_of(env, "totals")
    client = small.reconnect(epoch=2)
    status = client.wait_for(lambda r: r.statuses[-1] if r.statuses and r.statuses[-1].dataflows_kept > before.dataflows_kept else None, 30, "reconciliation")
    assert status.dataflows_built == before.dataflows_built  # nothing was recomputed
    assert client.wait_frontier(index, past=sales["times"][-1], timeout=5)  # reported at once
    answer = _peek_rows(client.peek(h.IndexTarget(index), sales["times"][-1], h.RowSetFinishing(key=("west",))))
    assert answer.num_rows == 1
    assert client.responses.nonces == {client.nonce}


def test_reconnect_with_a_changed_definition_rebuilds_it(env, sales, small):
    before = small.client.latest_status()
    index = _index_of(env, "totals")
    changed = [
        h.CreateDataflow(replace(c.desc, sql=TOTALS + " having count(*) > 0")) if isinstance(c, h.CreateDataflow) and index in c.desc.export_ids else c
        for c in h.reduce_commands([*small.history.commands, h.InitializationComplete()])
    ]
    client = small.reconnect(epoch=3, history=changed)
    status = client.wait_for(lambda r: r.statuses[-1] if r.statuses and r.statuses[-1].dataflows_built > before.dataflows_built else None, 30, "a rebuild")
    assert status.dataflows_built == before.dataflows_built + 1
    client.wait_frontier(index, past=sales["times"][-1])


def _index_of(env, name: str) -> str:
    return env["catalog"].dataflow_by_name(env["config"].name, name).index_id
