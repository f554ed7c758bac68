"""The replica service with real processes, a real gRPC channel and real Spark.

Two replica processes (`local[1]` and `local[2]`) serve one instance for the whole
module; a scripted controller in the test drives them. The tests share the processes
and run in order: later ones use the dataflows and epochs of earlier ones. Answers are checked against the
same SQL run directly with Spark, in the test process, on the storage snapshot.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor
import pyarrow as pa
import pytest

import history as h
from catalog import Catalog, dataflow_holder
from controller._process import wait_until
from protocol import HelloAck, ipc_to_table
from rows import assert_same_rows
from test_metrics import scrape
from replica_harness import ReplicaProcess, ScriptedClient
from replica_service import _spark
from replica_service._replica import DEFAULT_PARAMETERS, STEP_WORKERS
from storage import Storage, schema_to_ddl

pytestmark = pytest.mark.spark

SALES = "id BIGINT NOT NULL, region STRING, amount DOUBLE"
REGIONS = "region STRING NOT NULL, country STRING"


class Controller:
    """A scripted controller for one replica: a history, pushed before it is sent."""

    def __init__(self, address: str, instance: h.InstanceConfig, epoch: int = 1, resume: h.Resume | None = None) -> None:
        self.address = address
        self.history = h.CommandHistory([h.CreateInstance(instance)])
        self.client = self._connect(epoch, None, resume)

    def send(self, *commands: h.ComputeCommand) -> None:
        for command in commands:
            self.history.push(command)
            self.client.send(command)

    def reconnect(
        self, epoch: int, history: list[h.ComputeCommand] | None = None, *, resume: h.Resume | None = None, close: bool = True
    ) -> ScriptedClient:
        """A new connection (the current one closed first, unless not to `close`) that
        offers to `resume` a session; unless the replica resumes it, the reduced history
        (or `history`) is replayed on it."""
        if close:
            self.client.close()
        self.client = self._connect(epoch, history, resume)
        return self.client

    def resume(self, min_applied: int) -> ScriptedClient:
        """Cut the current connection and offer to resume its session."""
        return self.reconnect(self.epoch, resume=h.Resume(self.client.nonce, min_applied))

    def _connect(self, epoch: int, history: list[h.ComputeCommand] | None, resume: h.Resume | None) -> ScriptedClient:
        self.epoch = epoch
        client = ScriptedClient(self.address, epoch=epoch, resume=resume)
        if not client.ack.resumed:
            client.send(*(history if history is not None else self._replay()))
        return client

    def _replay(self) -> list[h.ComputeCommand]:
        return h.reduce_commands([*self.history.commands, h.InitializationComplete()])


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
    session.stop()  # the process's one SparkContext: later modules start their own


@pytest.fixture(scope="module")
def spark(env):
    """The test's own Spark session, with the instance's settings, to compute expectations."""
    return env["planner"]


# The strategy of a dataflow whose test is not about incremental maintenance.
RECOMPUTED = "recompute: chosen by the test"


def _dataflow(
    env, name: str, sql: str, imports: dict[str, str], *, strategy: str, key=None, materialized=False, as_of=None
) -> h.DataflowDescription:
    """Record a dataflow in the catalog (as the controller would, with the `strategy`
    given: "incremental", or `RECOMPUTED`; a test says which) and describe it."""
    catalog: Catalog = env["catalog"]
    storage: Storage = env["storage"]
    imported = [h.Import(alias, storage_id, "storage") for alias, storage_id in imports.items()]
    since = max(storage.since(i.id).time for i in imported)
    empty = {alias: storage.schema(id).empty_table() for alias, id in imports.items()}
    schema = schema_to_ddl(_spark.query(env["planner"], sql, empty).toArrow().schema)
    info = catalog.create_dataflow(
        env["config"].name,
        name,
        sql=sql,
        imports=imported,
        schema=schema,
        as_of=h.Frontier(as_of if as_of is not None else since),
        index_key=key,
        materialized=materialized,
        strategy=strategy,
    )
    return info.description()


def _expected(spark, env, sql: str, imports: dict[str, str], t: int) -> pa.Table:
    tables = {alias: env["storage"].read_snapshot(id, t) for alias, id in imports.items()}
    return _spark.query(spark, sql, tables).toArrow()


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
    """Its first connection offers to resume a session the fresh process never had."""
    controller = Controller(env["large"].address, env["config"], resume=h.Resume("no-such-session", 0))
    yield controller
    controller.client.close()


TOTALS = "select region, sum(amount) as total, count(*) as n from sales group by region"
JOINED = (
    "select r.country, sum(s.amount * 1.1) as total, count(*) as n "
    "from sales s join regions r on s.region = r.region group by r.country"
)


def test_peeks_at_several_times_match_spark(env, sales, small, spark):
    desc = _dataflow(env, "totals", TOTALS, {"sales": sales["id"]}, key=["region"], strategy=RECOMPUTED)
    small.send(h.CreateDataflow(desc), h.Schedule(desc.export_ids[0]))
    index = desc.export_ids[0]
    small.client.wait_frontier(index, past=sales["times"][-1])
    for t in sales["times"]:
        answer = _peek_rows(small.client.peek(h.IndexTarget(index), t))
        expected = _expected(spark, env, TOTALS, {"sales": sales["id"]}, t)
        assert_same_rows(answer, expected)


def test_a_strict_peek_does_not_wait_for_the_next_storage_poll(env, sales, small, spark):
    index = _index_of(env, "totals")
    small.send(h.UpdateConfiguration(h.ComputeParameters(input_poll_interval_ms=600_000)))
    try:
        t = append(env, sales, [{"id": 800, "region": "north", "amount": 4.0}])
        # Peeked at a time its input has reached, the replica reads storage at once,
        # not ten minutes later.
        answer = _peek_rows(small.client.peek(h.IndexTarget(index), t, timeout=60))
        assert_same_rows(answer, _expected(spark, env, TOTALS, {"sales": sales["id"]}, t))
    finally:
        default = DEFAULT_PARAMETERS.input_poll_interval_ms
        small.send(h.UpdateConfiguration(h.ComputeParameters(input_poll_interval_ms=default)))


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
    expected = _spark.query(spark, "select region, n * 2 as doubled from t where region is not null order by region", {"t": _expected(spark, env, TOTALS, {"sales": sales["id"]}, t)}).toArrow()
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
    desc = _dataflow(env, "joined", JOINED, imports, key=["country"], strategy=RECOMPUTED)
    totals = _dataflow(env, "totals_large", TOTALS, {"sales": sales["id"]}, key=["region"], strategy=RECOMPUTED)
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
    assert client.responses.first is refusal and client.responses.ack is None  # no HelloAck
    client.close()


def test_a_fresh_process_starts_a_new_session(small, large):
    # Whether or not the first Hello offered to resume a session.
    assert small.client.ack == large.client.ack == HelloAck(resumed=False, applied=0)


def test_a_failing_dataflow_does_not_stop_the_others(env, sales, small):
    bad = _dataflow(env, "bad_cast", "select cast(region as int) as r from sales", {"sales": sales["id"]}, key=["r"], strategy=RECOMPUTED)
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


def _dataflow_status(client: ScriptedClient, id: str, ready, what: str) -> h.DataflowStatus:
    """The first reported status of dataflow `id` that is `ready`."""
    return client.wait_for(
        lambda r: next((d for s in reversed(r.statuses) for d in s.dataflows if d.id == id and ready(d)), None), 60, what
    )


def test_a_materialized_view_whose_sink_was_dropped_fails_instead_of_retrying(env, small):
    storage: Storage = env["storage"]
    source = storage.create_source(f"orders_{uuid.uuid4().hex[:6]}", SALES)
    storage.append(source.id, [{"id": 1, "region": "north", "amount": 1.0}])
    desc = _dataflow(env, "orders_mv", TOTALS, {"sales": source.id}, materialized=True, strategy=RECOMPUTED)
    small.send(h.CreateDataflow(desc), h.Schedule(desc.export_ids[0]))
    sink = desc.sink_exports[0].id
    small.client.wait_frontier(sink, past=desc.as_of.time)
    env["catalog"].drop_dataflow(env["catalog"].dataflow_by_name(env["config"].name, "orders_mv").id)
    storage.append(source.id, [{"id": 2, "region": "north", "amount": 2.0}])

    failed = _dataflow_status(small.client, sink, lambda d: d.error, "the view to fail")
    assert failed.error.startswith("storage refused the step: ") and "dropped" in failed.error
    assert failed.retries == 0  # failed at once, not retried
    small.send(h.AllowCompaction(sink, h.Frontier.empty()))


def test_a_dataflow_whose_input_was_compacted_past_it_asks_for_a_new_session(env, small):
    """A replica left behind (the controller released its holds) finds its input
    compacted past what it must read: not an error of the dataflow, and no retry helps;
    it says so in its status, for the controller to start a new session."""
    storage: Storage = env["storage"]
    source = storage.create_source(f"events_{uuid.uuid4().hex[:6]}", SALES)
    first = storage.append(source.id, [{"id": 1, "region": "north", "amount": 1.0}])
    desc = _dataflow(env, "events_totals", TOTALS, {"sales": source.id}, key=["region"], strategy=RECOMPUTED, as_of=first)
    latest = storage.append(source.id, [{"id": 2, "region": "south", "amount": 2.0}])
    storage.acquire_read_hold(source.id, "test", h.Frontier(latest))
    storage.release_read_hold(source.id, dataflow_holder(env["config"].name, desc.export_ids[0]))
    assert storage.since(source.id) == h.Frontier(latest)

    small.send(h.CreateDataflow(desc), h.Schedule(desc.export_ids[0]))
    stuck = _dataflow_status(small.client, desc.export_ids[0], lambda d: d.needs_new_session, "the dataflow to ask for a new session")
    assert f"cannot read {source.id} from time {first}: its since is {latest}" in stuck.needs_new_session
    assert stuck.error is None and not stuck.hydrated
    small.send(h.AllowCompaction(desc.export_ids[0], h.Frontier.empty()))
    storage.release_read_hold(source.id, "test")


def test_two_replicas_write_a_materialized_view_exactly_once(env, sales, small, large, spark):
    desc = _dataflow(env, "totals_mv", TOTALS, {"sales": sales["id"]}, key=["region"], materialized=True, strategy=RECOMPUTED)
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
        assert_same_rows(storage.read_snapshot(sink, t), expected.cast(storage.schema(sink)))


def test_a_recomputed_materialized_view_writes_its_first_and_every_version(env, sales, small, spark):
    # A window function has no delta plan: recomputed at every change, diffed against the
    # view's own contents, which are empty (and below its since) before its first write.
    ranked = "select id, region, row_number() over (partition by region order by id) as position from sales"
    desc = _dataflow(env, "ranked_mv", ranked, {"sales": sales["id"]}, materialized=True, as_of=sales["times"][-1], strategy=RECOMPUTED)
    assert desc.strategy == "recompute"
    small.send(h.CreateDataflow(desc), h.Schedule(desc.export_ids[0]))
    sink = desc.sink_exports[0].id
    small.client.wait_frontier(sink, past=desc.as_of.time)
    times = [append(env, sales, [{"id": 2000 + i, "region": "north", "amount": 1.0}]) for i in range(2)]
    small.client.wait_frontier(sink, past=times[-1])
    # Its last step wrote one row (the new id ranked last in its region), and says so.
    small.client.wait_for(
        lambda r: r.statuses and any(d.id == sink and d.rows_changed == 1 for d in r.statuses[-1].dataflows),
        10,
        "the view's status counting the row its last step wrote",
    )
    storage: Storage = env["storage"]
    for t in (desc.as_of.time, *times):
        expected = _expected(spark, env, ranked, {"sales": sales["id"]}, t)
        assert_same_rows(storage.read_snapshot(sink, t), expected.cast(storage.schema(sink)))


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


def test_a_dataflow_compacted_past_the_new_as_of_is_rebuilt_not_kept(env, sales, small):
    """A controller recovered from a record older than the compaction its predecessor
    allowed replays the dataflow at an as_of below the kept arrangement's since: kept,
    its reads in between would be refused. It is rebuilt, and reads there answer."""
    index = _index_of(env, "totals")
    earlier, latest = sales["times"][-2], sales["times"][-1]
    small.send(h.AllowCompaction(index, h.Frontier(latest)))
    assert isinstance(small.client.peek(h.IndexTarget(index), earlier), h.PeekError)  # compacted
    before = small.client.latest_status()
    replay = [
        h.CreateDataflow(c.desc.with_as_of(h.Frontier(earlier))) if isinstance(c, h.CreateDataflow) and index in c.desc.export_ids else c
        for c in h.reduce_commands([*small.history.commands, h.InitializationComplete()])
    ]
    client = small.reconnect(epoch=3, history=replay)
    status = client.wait_for(lambda r: r.statuses[-1] if r.statuses and r.statuses[-1].dataflows_built > before.dataflows_built else None, 60, "a rebuild")
    assert status.dataflows_built == before.dataflows_built + 1
    answer = _peek_rows(client.peek(h.IndexTarget(index), earlier, h.RowSetFinishing(key=("west",))))
    assert answer.num_rows == 1


def test_a_dataflow_behind_the_new_as_of_catches_up_from_where_it_stands_not_jumped_over_changes(env, sales, small, spark):
    """Found by the divergence check: a replica lagging when the controller restarted
    kept its dataflow, and its frontier jumped to the recovered as_of over input changes
    it had not computed, which then were missing from every later version. A dataflow
    of storage that has not computed every time before the new as_of, its inputs still
    readable where it stands, is kept and computes every time it missed (one whose
    inputs are compacted past it is rebuilt: `test_replica_units`)."""
    index = _index_of(env, "totals")
    storage = env["storage"]
    upper = storage.upper(sales["id"]).time
    small.client.wait_frontier(index, past=upper - 1)
    as_of = upper + 5_000  # beyond what the replica has computed
    before = small.client.latest_status()
    replay = [
        h.CreateDataflow(c.desc.with_as_of(h.Frontier(as_of))) if isinstance(c, h.CreateDataflow) and index in c.desc.export_ids else c
        for c in h.reduce_commands([*small.history.commands, h.InitializationComplete()])
    ]
    client = small.reconnect(epoch=3, history=replay)
    changed = storage.append(sales["id"], [{"id": 9_000, "region": "east", "amount": 1.0}], ts=upper + 100)
    storage.compare_and_append(sales["id"], h.Frontier(changed + 1), h.Frontier(as_of + 1))
    sales["times"].append(changed)
    status = client.wait_for(lambda r: r.statuses[-1] if r.statuses and r.statuses[-1].dataflows_kept > before.dataflows_kept else None, 60, "a keep")
    assert status.dataflows_built == before.dataflows_built
    client.wait_frontier(index, past=as_of)
    answer = _peek_rows(client.peek(h.IndexTarget(index), as_of))
    assert_same_rows(answer, _expected(spark, env, TOTALS, {"sales": sales["id"]}, as_of))


def _index_of(env, name: str) -> str:
    return env["catalog"].dataflow_by_name(env["config"].name, name).index_id


# --- Sessions ----------------------------------------------------------------------------


def test_a_cut_stream_resumes_its_session(env, sales, small, spark):
    old = small.reconnect(epoch=4)  # a session of its own
    desc = _dataflow(env, "resumed_totals", TOTALS, {"sales": sales["id"]}, key=["region"], strategy=RECOMPUTED)
    index = desc.export_ids[0]
    small.send(h.CreateDataflow(desc), h.Schedule(index))
    old.wait_frontier(index, past=sales["times"][-1])
    waiting = env["storage"].upper(sales["id"]).time  # readable after the next append
    old.send(h.Peek("kept", h.IndexTarget(index), waiting, timeout_ms=120_000))
    old.send(h.Peek("answered", h.IndexTarget(index), sales["times"][-1], timeout_ms=60_000))
    old.wait_for(lambda r: r.peeks.get("answered"), 60, "the answered peek")  # so every command arrived
    before = old.latest_status()

    resumed = small.resume(min_applied=len(old.sent))
    assert resumed.ack == HelloAck(resumed=True, applied=len(old.sent))
    # Reported again at once, before any heartbeat.
    first_status = resumed.wait_for(lambda r: r.statuses and r.statuses[0], 10, "a heartbeat")
    assert resumed.responses.frontiers[index].is_complete(sales["times"][-1])
    # As the controller does, send again the peeks it has no answer for (say "answered"'s
    # answer was lost with the stream): answered once more, while "kept", still pending,
    # is not restarted.
    resumed.send(
        h.Peek("answered", h.IndexTarget(index), sales["times"][-1], timeout_ms=60_000),
        h.Peek("kept", h.IndexTarget(index), waiting, timeout_ms=120_000),
    )
    resumed.wait_for(lambda r: r.peeks.get("answered"), 60, "the answer sent again")
    assert set(resumed.responses.peeks) == {"answered"}
    t = append(env, sales, [{"id": 2000, "region": "north", "amount": 2.5}])
    kept = resumed.wait_for(lambda r: r.peeks.get("kept"), 90, "the kept peek")
    assert_same_rows(_peek_rows(kept), _expected(spark, env, TOTALS, {"sales": sales["id"]}, waiting))
    resumed.wait_frontier(index, past=t)
    assert resumed.responses.peek_counts["kept"] == 1  # sent twice, answered once
    assert first_status.dataflows_built == before.dataflows_built  # nothing rebuilt
    assert first_status.dataflows_kept == before.dataflows_kept  # nor reconciled

    # Only the missing commands: the counting goes on, and nothing answered comes again.
    resumed.send(h.CancelPeek("kept"), h.CancelPeek("answered"))
    assert isinstance(resumed.peek(h.IndexTarget(index), t), h.PeekRows)
    applied = len(old.sent) + len(resumed.sent)
    again = small.resume(min_applied=applied)
    assert again.ack == HelloAck(resumed=True, applied=applied)
    again.wait_for(lambda r: r.statuses, 10, "a heartbeat")
    assert again.responses.peeks == {}  # answers are not sent again: peeks are
    assert again.responses.nonces == {again.nonce}
    log = (env["root"] / "local[1].log").read_text()
    assert log.count("dataflow resumed_totals built") == 1
    assert f"nonce {again.nonce} resumes the session of connection {resumed.nonce} after {applied} commands" in log


def test_a_session_is_not_resumed_without_a_match(env, sales, small):
    index = _index_of(env, "resumed_totals")
    first = small.reconnect(epoch=5)
    first.send(h.Peek("orphan", h.IndexTarget(index), sales["times"][-1] + 10**9, timeout_ms=60_000))
    first.peek(h.IndexTarget(index), sales["times"][-1])  # every command arrived
    offers = [
        (5, lambda current: h.Resume("not-" + current.nonce, 0)),  # another session
        (5, lambda current: h.Resume(current.nonce, len(current.sent) + 1)),  # commands it lacks
        (6, lambda current: h.Resume(current.nonce, len(current.sent))),  # another epoch
    ]
    for epoch, offer in offers:
        current = small.client
        client = small.reconnect(epoch, resume=offer(current), close=False)
        assert client.ack == HelloAck(resumed=False, applied=0)
        if current is first:  # a new session cancels the pending peeks of the old one
            assert isinstance(first.wait_for(lambda r: r.peeks.get("orphan"), 10, "the cancel"), h.PeekCanceled)
        current.wait_for(lambda r: r.ended, 10, "the superseded stream to end")
        current.close()
        client.wait_frontier(index, past=sales["times"][-1], timeout=30)  # the replay reconciled
        client.peek(h.IndexTarget(index), sales["times"][-1])  # so every command arrived


def test_a_session_resumed_while_buffering_keeps_buffering(env, sales, small):
    index = _index_of(env, "resumed_totals")
    replay = small._replay()
    before = small.client.latest_status()
    buffering = small.reconnect(epoch=7, history=replay[:-1])  # no InitializationComplete yet
    time.sleep(1)  # for the commands to arrive; the ack says how many did
    resumed = small.resume(min_applied=0)
    ack = resumed.ack
    assert ack.resumed and 0 < ack.applied <= len(buffering.sent)
    resumed.wait_for(lambda r: r.statuses, 10, "a heartbeat")
    assert resumed.responses.frontier_log == []  # nothing is reported before reconciliation
    # The rest, without CreateInstance: a new session would refuse it.
    resumed.send(*buffering.sent[ack.applied :], replay[-1])
    resumed.wait_frontier(index, past=sales["times"][-1], timeout=30)
    status = resumed.latest_status()
    dataflows = sum(isinstance(c, h.CreateDataflow) for c in replay)
    assert status.dataflows_kept == before.dataflows_kept + dataflows  # one reconciliation
    assert status.dataflows_built == before.dataflows_built
    assert resumed.responses.refusal is None


# A dataflow whose step exhausts a 512 MB heap: a thousand strings of a million characters
# collected into one group. Spark exits the JVM on the task's OutOfMemoryError.
HEAP_EATER = (
    "select region, size(collect_list(repeat('x', 1000000))) as n "
    "from (select region, explode(sequence(1, 1000)) as i from sales) group by region"
)


def test_a_dataflow_that_kills_the_jvm_is_refused_after_two_deaths_not_looped(env, sales, tmp_path):
    """The replica dies with its JVM and records what it was computing; the incarnation
    that would compute it a third time marks it failed instead, and serves the rest."""
    crash_file = tmp_path / "crashes.json"
    desc = _dataflow(env, "heap_eater", HEAP_EATER, {"sales": sales["id"]}, key=["region"], strategy=RECOMPUTED)
    for death in (1, 2):
        replica = ReplicaProcess(env["url"], env["root"] / "blobs", log_path=tmp_path / f"eater-{death}.log", args=("--crash-file", str(crash_file)))
        controller = Controller(replica.address, env["config"])
        controller.send(h.CreateDataflow(desc), h.Schedule(desc.export_ids[0]))
        assert replica.exit_code(timeout=180) == 70, f"incarnation {death} should die with its JVM"
        controller.client.close()
        recorded = json.loads(crash_file.read_text())["dataflows"][desc.export_ids[0]]
        assert recorded["deaths"] == death and "OutOfMemoryError" in recorded["cause"]
    replica = ReplicaProcess(env["url"], env["root"] / "blobs", log_path=tmp_path / "eater-3.log", args=("--crash-file", str(crash_file)))
    try:
        controller = Controller(replica.address, env["config"])
        totals = _dataflow(env, "totals_beside", TOTALS, {"sales": sales["id"]}, key=["region"], strategy=RECOMPUTED)
        controller.send(h.CreateDataflow(desc), h.Schedule(desc.export_ids[0]), h.CreateDataflow(totals), h.Schedule(totals.export_ids[0]))
        status = controller.client.wait_for(
            lambda r: next((d for s in r.statuses[-1:] for d in s.dataflows if d.id == desc.export_ids[0] and d.error), None), 60, "the refusal"
        )
        assert "JVM died 2 times while computing this dataflow" in status.error
        peek = controller.client.peek(h.IndexTarget(desc.export_ids[0]), sales["times"][-1])
        assert isinstance(peek, h.PeekError) and "JVM died 2 times" in peek.message
        controller.client.wait_frontier(totals.export_ids[0], past=sales["times"][-1])  # the rest is served
        assert replica.process.poll() is None
        controller.client.close()
    finally:
        replica.stop()


def test_hydration_progress_is_the_tasks_of_the_steps_job_group(spark):
    """What a hydrating dataflow's status reports: the tasks done of its step's Spark
    jobs (the step sets the job group), read on a watch thread, never by the caller."""
    group = _spark.step_job_group("u99", 5)

    def step() -> None:
        spark.sparkContext.setJobGroup(group, "a step")
        spark.range(0, 5_000_000, numPartitions=6).selectExpr("id % 7 as k").groupBy("k").count().collect()

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()

    def finished() -> tuple[int, int] | None:
        tasks = _spark.job_tasks(frozenset({group})).get(group)
        return tasks if tasks and tasks[0] == tasks[1] > 0 else None

    done, total = wait_until(finished, 10, "the watch to read the group's tasks")
    assert total >= 6  # at least one task per partition of the first stage


def test_a_cancelled_steps_jobs_stop_and_its_later_ones_are_refused(spark):
    """What a drop does to the step a worker is still running (`_spark.cancel_jobs`):
    its running job fails at once, and a job the step starts after that is refused, so
    that a dropped dataflow's hydration no longer holds the cluster; no later step is."""
    group = _spark.step_job_group("u98", 5)
    errors: list[Exception] = []

    def step() -> None:
        spark.sparkContext.setJobGroup(group, "a step")
        for _ in range(2):
            try:
                spark.range(0, 10**13, numPartitions=2).selectExpr("sum(id)").collect()  # hours
            except Exception as e:
                errors.append(e)

    thread = threading.Thread(target=step)
    thread.start()
    try:
        wait_until(lambda: _spark.job_tasks(frozenset({group})).get(group, (0, 0))[1] > 0, 30, "the job to start")
        _spark.cancel_jobs(group)
        thread.join(30)
        assert not thread.is_alive() and len(errors) == 2
        running, later = (e.java_exception.toString() for e in errors)
        assert "cancelled because its step was cancelled" in running and f"part of cancelled job group {group}" in later

        def rebuilt_step() -> int:  # of a dataflow rebuilt under the same id, at the same time
            spark.sparkContext.setJobGroup(_spark.step_job_group("u98", 5), "a rebuilt dataflow's step")
            return spark.range(10).count()

        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(rebuilt_step).result(30) == 10
    finally:
        spark.sparkContext.cancelJobGroup(group)


SLOW_TO_HYDRATE = "select region, count(*) as n from (select region, explode(sequence(1, 400000)) as i from sales) group by region"


def test_a_hydrating_dataflow_reports_its_first_steps_tasks_then_none(env, sales, small):
    """The wiring of the above: while a dataflow's first step runs, the replica's status
    carries that step's tasks; once hydrated, none."""
    # As of the latest time, so that the first step (its hydration) has every row to do.
    desc = _dataflow(env, "slow_to_hydrate", SLOW_TO_HYDRATE, {"sales": sales["id"]}, key=["region"], as_of=sales["times"][-1], strategy=RECOMPUTED)
    id = desc.export_ids[0]

    def reported(responses, hydrated: bool):
        for status in reversed(responses.statuses):
            mine = next((d for d in status.dataflows if d.id == id), None)
            if mine is not None and mine.hydrated == hydrated and (hydrated or mine.hydration_tasks_total):
                return mine
        return None

    small.send(h.CreateDataflow(desc), h.Schedule(id))
    hydrating = small.client.wait_for(lambda r: reported(r, False), 120, "hydration progress in a status")
    assert 0 <= hydrating.hydration_tasks_done <= hydrating.hydration_tasks_total
    hydrated = small.client.wait_for(lambda r: reported(r, True), 180, "the dataflow hydrated")
    assert (hydrated.hydration_tasks_done, hydrated.hydration_tasks_total) == (0, 0)
    small.send(h.AllowCompaction(id, h.Frontier.empty()))
    small.client.wait_for(lambda r: r.frontiers.get(id) == h.Frontier.empty(), 30, "the drop")


def test_a_dataflow_dropped_while_hydrating_frees_the_cluster_at_once(env, sales, small):
    """A drop cancels the Spark jobs of the step still running (hours of them here, on
    `small`'s one core): the next dataflow hydrates at once, not after them."""
    # Spark stops a cancelled task only between its input rows: the repartition makes
    # each of the 3.2 million input rows of the long stage 20,000 rows of work.
    endless = (
        "select region, count(*) as n from (select region, explode(sequence(1, 20000)) as j from "
        "(select /*+ REPARTITION(2) */ region, explode(sequence(1, 20000)) as i from sales)) group by region"
    )
    desc = _dataflow(env, "endless", endless, {"sales": sales["id"]}, key=["region"], as_of=sales["times"][-1], strategy=RECOMPUTED)
    id = desc.export_ids[0]
    small.send(h.CreateDataflow(desc), h.Schedule(id))
    hydrating = lambda r: any(d.id == id and d.hydration_tasks_total for s in r.statuses[-3:] for d in s.dataflows)
    small.client.wait_for(hydrating, 120, "the hydration's tasks running")
    small.send(h.AllowCompaction(id, h.Frontier.empty()))
    small.client.wait_for(lambda r: r.frontiers.get(id) == h.Frontier.empty(), 30, "the drop")

    after = _dataflow(env, "after_endless", TOTALS, {"sales": sales["id"]}, key=["region"], as_of=sales["times"][-1], strategy=RECOMPUTED)
    small.send(h.CreateDataflow(after), h.Schedule(after.export_ids[0]))
    small.client.wait_frontier(after.export_ids[0], past=sales["times"][-1], timeout=60)
    small.send(h.AllowCompaction(after.export_ids[0], h.Frontier.empty()))


# Minutes of work on one core, in 2,000 tasks of a fraction of a second each: Spark
# cannot preempt a task, so a core frees often. The repartitioned rows are exploded again
# after the shuffle, so every task of the long stage has about the same work.
LONG_IN_SHORT_TASKS = (
    "select region, count(*) as n from (select region, explode(sequence(1, 4000)) as j from "
    "(select /*+ REPARTITION(2000) */ region, i from (select region, explode(sequence(1, 2500)) as i from sales))) group by region"
)


def test_an_incremental_dataflow_rehearses_a_step_once_after_hydrating(env, sales, small, spark):
    """An incremental dataflow created live rehearses a step over a made-up change
    right after its hydration (`Replica._rehearse`), once, before it reports it; the
    versions after it are still right. One rebuilt from a replayed history rehearses
    nothing. (Nor does one hydrated with changes after its `as_of` to compute at once:
    those steps compile their code.)"""
    imports = {"sales": sales["id"], "regions": sales["regions"]}
    as_of = sales["times"][-1]  # hydrated there, with no change after it to step at once
    desc = _dataflow(env, "rehearsed_joined", JOINED, imports, key=["country"], strategy="incremental", as_of=as_of)
    small.send(h.CreateDataflow(desc), h.Schedule(desc.export_ids[0]))
    small.client.wait_frontier(desc.export_ids[0], past=as_of, timeout=120)
    log = env["root"] / "local[1].log"
    assert "dataflow rehearsed_joined: rehearsed a step in" in log.read_text()
    t = append(env, sales, [{"id": 9_100, "region": "south", "amount": 2.5}, {"id": 5, "region": "south", "amount": 0.5, "_diff": -1}])
    answer = _peek_rows(small.client.peek(h.IndexTarget(desc.export_ids[0]), t, timeout=120))
    assert_same_rows(answer, _expected(spark, env, JOINED, imports, t))
    assert log.read_text().count("dataflow rehearsed_joined: rehearsed a step in") == 1
    # Rebuilt from a replayed history (a changed definition here; in life, a replica
    # added, restarted or reconnected, catching up), it hydrates at the latest time,
    # with no change to step at once, and still rehearses nothing.
    changed = [
        h.CreateDataflow(replace(c.desc, sql=JOINED + " having count(*) > 0").with_as_of(h.Frontier(t)))
        if isinstance(c, h.CreateDataflow) and c.desc.export_ids == desc.export_ids
        else c
        for c in h.reduce_commands([*small.history.commands, h.InitializationComplete()])
    ]
    client = small.reconnect(epoch=small.epoch, history=changed)
    client.wait_frontier(desc.export_ids[0], past=t, timeout=120)
    assert log.read_text().count("dataflow rehearsed_joined: rehearsed a step in") == 1
    small.send(h.AllowCompaction(desc.export_ids[0], h.Frontier.empty()))


def test_a_live_dataflows_step_does_not_queue_behind_hydrations_filling_the_step_workers(env, sales, small):
    """A long hydration does not hold back the steps of dataflows already live: with
    STEP_WORKERS hydrations running (every worker of the heavy step pool taken, minutes
    of tasks each on `small`'s one core), an append's step of a live incremental
    dataflow runs on the light pool and its tasks take the core between theirs. It
    answers while every hydration still runs; with one pool, it queued behind them."""
    as_of = sales["times"][-1]
    live = _dataflow(env, "live_beside_hydrations", TOTALS, {"sales": sales["id"]}, key=["region"], as_of=as_of, strategy="incremental")
    small.send(h.CreateDataflow(live), h.Schedule(live.export_ids[0]))
    small.client.wait_frontier(live.export_ids[0], past=as_of, timeout=120)
    descs = [
        _dataflow(env, f"long_hydration_{i}", LONG_IN_SHORT_TASKS, {"sales": sales["id"]}, key=["region"], as_of=as_of, strategy=RECOMPUTED)
        for i in range(STEP_WORKERS)
    ]
    long = [desc.export_ids[0] for desc in descs]
    small.send(*(c for desc in descs for c in (h.CreateDataflow(desc), h.Schedule(desc.export_ids[0]))))
    try:

        def hydrating(responses) -> list[h.DataflowStatus] | None:
            mine = [d for d in responses.statuses[-1].dataflows if d.id in long] if responses.statuses else []
            return mine if len(mine) == len(long) and all(d.hydration_tasks_total and not d.hydrated for d in mine) else None

        small.client.wait_for(hydrating, 120, "every long hydration's tasks running")
        t = append(env, sales, [{"id": 9_000, "region": "east", "amount": 1.5}])
        small.client.wait_frontier(live.export_ids[0], past=t, timeout=180)
        frontiers = small.client.wait_for(lambda r: dict(r.frontiers), 1, "the frontiers")
        hydrated = [id for id in long if frontiers.get(id, h.Frontier(as_of)).is_complete(as_of)]
        assert not hydrated, f"{hydrated} hydrated before the live dataflow's step: the test proves nothing"
    finally:
        small.send(*(h.AllowCompaction(id, h.Frontier.empty()) for id in long))
        small.client.wait_for(lambda r: all(r.frontiers.get(id) == h.Frontier.empty() for id in long), 60, "the drops")
    small.send(h.AllowCompaction(live.export_ids[0], h.Frontier.empty()))


def _consolidated(reports: list[h.SubscribeResponse], through: int) -> dict[tuple, int]:
    """The rows the changes at times up to `through` add up to: row -> count."""
    counts: dict[tuple, int] = {}
    for report in reports:
        for change in report.changes:
            if change.time <= through:
                for row in ipc_to_table(change.arrow_ipc).to_pylist():
                    key = (row["region"], round(row["total"], 9), row["n"])
                    counts[key] = counts.get(key, 0) + row["_diff"]
    return {key: count for key, count in counts.items() if count}


def test_a_subscription_reports_its_snapshot_then_each_times_changes_alike_on_two_replicas(env, sales, small, large, spark):
    desc = _dataflow(env, "followed", TOTALS, {"sales": sales["id"]}, key=["region"], strategy=RECOMPUTED)
    index, as_of = desc.export_ids[0], sales["times"][1]
    subscribe = h.Subscribe("feed-1", index, as_of)
    for controller in (small, large):
        controller.send(h.CreateDataflow(desc), h.Schedule(index), subscribe)
    later = append(env, sales, [{"id": 900, "region": "west", "amount": 2.5}, {"id": 1, "region": "south", "amount": 0.1, "_diff": -1}])
    reports = {}
    for controller in (small, large):
        reached = lambda r: (got := r.subscriptions.get("feed-1")) and got[-1].upper > later and got
        reports[controller] = list(controller.client.wait_for(reached, 120, "the feed past the append"))
        assert reports[controller][0].lower == as_of and reports[controller][0].upper == as_of + 1  # the snapshot
        assert all(c.time == as_of for c in reports[controller][0].changes)
        assert all(a.upper == b.lower for a, b in zip(reports[controller], reports[controller][1:]))  # no gap, no overlap
    # The same changes, to the byte, at the same times on both replicas.
    by_time = [{c.time: c.arrow_ipc for r in reports[c_] for c in r.changes} for c_ in (small, large)]
    assert by_time[0] == by_time[1] and later in by_time[0]
    for t in [as_of, *[t for t in sales["times"] if as_of < t <= later]]:
        expected = _expected(spark, env, TOTALS, {"sales": sales["id"]}, t).to_pylist()
        assert _consolidated(reports[small], t) == {(r["region"], round(r["total"], 9), r["n"]): 1 for r in expected}, t

    # A Subscribe for an open uuid restarts its reports there (the controller resends it
    # after a resume); a cancel ends them.
    small.send(h.Subscribe("feed-1", index, later, snapshot=False))
    last = append(env, sales, [{"id": 901, "region": "west", "amount": 1.0}])
    reached = lambda r: (got := r.subscriptions["feed-1"][len(reports[small]) :]) and got[-1].upper > last and got
    again = small.client.wait_for(reached, 60, "reports after the resend")
    assert again[0].lower == later + 1 and [c.time for r in again for c in r.changes] == [last]
    small.send(h.CancelSubscribe("feed-1"))
    time.sleep(0.5)
    count = len(small.client.responses.subscriptions["feed-1"])
    append(env, sales, [{"id": 902, "region": "west", "amount": 1.0}])
    small.client.wait_frontier(index, past=sales["times"][-1])
    assert len(small.client.responses.subscriptions["feed-1"]) == count


def test_a_subscription_to_what_is_not_an_index_here_is_an_error(small):
    small.send(h.Subscribe("feed-2", "u999999", 0))
    (report,) = small.client.wait_for(lambda r: r.subscriptions.get("feed-2"), 30, "the error")
    assert report.error == "collection u999999 is not an index on this replica" and not report.changes


def test_a_dropped_dataflow_leaves_no_spark_state(env, sales, small):
    """Last in the module: it drops every dataflow of `small` first, so that no other
    step changes what Spark keeps meanwhile. An incremental dataflow's state (its
    checkpoints) and its inputs' cached bases (of a join) live in Spark's block stores
    while it lives and are released when it is dropped (before, the checkpoints stayed
    until the JVM collected their RDDs, which may take half an hour):
    `tandem_replica_spark_state_bytes` falls to 0 with every dataflow dropped (it once
    stayed above: blocks that a query planned over a base just before its release built
    again, owned by nothing; the reader's leases prevent that)."""
    small.reconnect(small.epoch + 1, [h.CreateInstance(env["config"]), h.InitializationComplete()])  # nothing to keep
    wait_until(lambda: not small.client.latest_status().dataflows, 30, "every dataflow dropped")
    address = small.client.latest_status().metrics_address
    state = lambda: scrape(address)[("tandem_replica_spark_state_bytes", frozenset())]
    # The dropped dataflows' last steps end and release (a watch, read once a second).
    wait_until(lambda: state() == 0, 30, "the dropped dataflows' Spark state released")

    desc = _dataflow(env, "state_totals", JOINED, {"sales": sales["id"], "regions": sales["regions"]}, key=["country"], strategy="incremental")
    small.send(h.CreateDataflow(desc), h.Schedule(desc.export_ids[0]))
    t = append(env, sales, [{"id": 903, "region": "west", "amount": 1.0}])
    small.client.wait_frontier(desc.export_ids[0], past=t)
    wait_until(lambda: state() > 0, 30, "the dataflow's state to show")

    small.send(h.AllowCompaction(desc.export_ids[0], h.Frontier.empty()))

    small.client.wait_for(lambda r: r.frontiers.get(desc.export_ids[0]) == h.Frontier.empty(), 30, "the drop")
    wait_until(lambda: state() == 0, 30, "the Spark state released")
