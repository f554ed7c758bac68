"""The controller with real processes: a `tandem serve` process, managed replica
processes, the Python client over real gRPC, and real failures (kill -9).

One controller and its replicas serve the whole module; tests run in file order and
build on each other's state, as an operator's session would.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from catalog import Catalog, Fenced, default_url
from controller.client import Client, TandemError
from controller._process import ControllerProcess, kill_replicas, wait_until

pytestmark = pytest.mark.spark

SCHEMA = "id BIGINT NOT NULL, region STRING, amount DOUBLE"
TOTALS = "select region, sum(amount) as total, count(*) as n from sales group by region"




def replicas(client: Client, instance: str = "main") -> dict:
    return {r.name: r for r in client.status("main")[0].replicas}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tandem")
    state = {"data_dir": data_dir, "controller": ControllerProcess(data_dir)}
    state["client"] = Client.connect(state["controller"].address)
    yield state
    state["client"].close()
    state["controller"].stop()
    kill_replicas(data_dir)


def _reconnect(cluster) -> Client:
    cluster["client"].close()
    cluster["client"] = Client.connect(cluster["controller"].address)
    return cluster["client"]


def test_two_replicas_serve_a_dataflow(cluster):
    client: Client = cluster["client"]
    client.create_instance("main", min_in_sync=1, replica_timeout_ms=4000)
    client.add_replica("main", "r1", size="xsmall")
    client.add_replica("main", "r2", size="xsmall")
    client.create_source("sales", SCHEMA)
    t = client.append("sales", [{"id": i, "region": ["north", "south"][i % 2], "amount": float(i)} for i in range(10)])
    client.create_dataflow("main", "totals", TOTALS, index_key=["region"], materialize=True)
    result = client.peek("main", "totals", key="north", consistency="strict", timeout_ms=120_000)
    assert result.rows == [{"region": "north", "total": 20.0, "n": 5}]
    assert result.replica in ("r1", "r2")
    wait_until(lambda: all(r.in_sync for r in replicas(client).values()), 120, "both replicas in sync")
    status = client.status("main")[0]
    assert status.health == "healthy"


def test_a_dataflow_failing_everywhere_is_loud_and_the_others_still_serve(cluster):
    client: Client = cluster["client"]
    # ANSI mode: a division by zero fails the dataflow's first step on every replica.
    client.create_dataflow("main", "broken", "select id, 1 / (id - id) as x from sales", index_key=["id"])
    view = wait_until(
        lambda: (v := client.status("main")[0])
        and all(r.dataflows.get("broken") and r.dataflows["broken"].error for r in v.replicas)
        and v,
        120,
        "both replicas report the dataflow failed",
    )
    assert view.health == "degraded" and not any(r.in_sync for r in view.replicas)
    why = view.unavailable_dataflows["broken"]
    assert why.startswith("failed on r1: ") and "; failed on r2: " in why and "DIVIDE_BY_ZERO" in why
    started = time.monotonic()
    with pytest.raises(TandemError) as error:
        client.peek("main", "broken", timeout_ms=60_000)
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert error.value.message.startswith("replica r1: dataflow broken failed: ")
    assert "; replica r2: dataflow broken failed: " in error.value.message
    assert time.monotonic() - started < 10  # at once, not after the timeout
    (listed,) = [d for d in client.list_dataflows("main") if d.name == "broken"]
    assert sorted(listed.replicas) == ["r1", "r2"] and all(s.error for s in listed.replicas.values())
    assert client.peek("main", "totals", key="north").rows  # the other dataflow serves

    client.drop_dataflow("main", "broken")
    wait_until(lambda: client.status("main")[0].health == "healthy", 60, "healthy again")


def test_the_planner_picks_the_strategy_and_the_user_can_force_it(cluster):
    client: Client = cluster["client"]
    client.create_source("orders", SCHEMA)
    client.append("orders", [{"id": i, "region": ["north", "south"][i % 2], "amount": float(i)} for i in range(6)])
    assert {d.name: d.strategy for d in client.list_dataflows("main")}["totals"] == "incremental"
    outer = "select s.id, t.region from orders s left join orders t on s.id = t.id + 1"
    with pytest.raises(TandemError) as error:
        client.create_dataflow("main", "outer", outer, index_key=["id"], strategy="incremental")
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot be maintained incrementally: left outer join" in error.value.message
    assert "outer" not in [d.name for d in client.list_dataflows("main")]  # nothing written
    chosen = client.create_dataflow("main", "outer", outer, index_key=["id"])
    assert chosen.strategy.startswith("recompute: left outer join")
    by_region = TOTALS.replace("sales", "orders")
    client.create_dataflow("main", "maintained", by_region, index_key=["region"])
    forced = client.create_dataflow("main", "forced", by_region, index_key=["region"], strategy="recompute")
    assert forced.strategy == "recompute: asked for"
    client.append("orders", [{"id": 50, "region": "north", "amount": 1.5}, {"id": 0, "region": "north", "amount": 0.0, "_diff": -1}])
    incremental = client.peek("main", "maintained", consistency="strict", timeout_ms=120_000)
    recomputed = client.peek("main", "forced", consistency="strict", timeout_ms=120_000)
    assert incremental.rows == recomputed.rows == [
        {"region": "north", "total": 7.5, "n": 3},
        {"region": "south", "total": 9.0, "n": 3},
    ]  # the same bits either way
    assert client.peek("main", "outer", key=50, consistency="strict", timeout_ms=120_000).rows == [{"id": 50, "region": None}]
    view = wait_until(
        lambda: (v := client.status("main")[0])
        and all(r.dataflows.get(name) and r.dataflows[name].steps > 1 for r in v.replicas for name in ("forced", "maintained"))
        and v,
        60,
        "step figures in status",
    )
    for replica in view.replicas:
        figures = replica.dataflows["maintained"]
        assert figures.last_step_ms > 0 and figures.rows_changed > 0 and figures.steps > 1
    for name in ("outer", "maintained", "forced"):
        client.drop_dataflow("main", name)
    client.drop_source("orders")


def test_bad_input_gets_the_right_status_and_writes_nothing(cluster):
    client: Client = cluster["client"]
    def catalog_contents():  # what a refused request must not change (uppers and step figures move on their own)
        dataflows = [(d.id, d.name, d.sql, d.strategy) for d in client.list_dataflows("main")]
        return dataflows, [(s.id, s.name, s.schema) for s in client.list_sources()], client.list_instances()[0].replicas

    before = catalog_contents()
    cases = [
        (lambda: client.peek("main", "nope"), grpc.StatusCode.NOT_FOUND),
        (lambda: client.peek("nowhere", "totals"), grpc.StatusCode.NOT_FOUND),
        (lambda: client.create_source("sales", SCHEMA), grpc.StatusCode.ALREADY_EXISTS),
        (lambda: client.create_instance("main"), grpc.StatusCode.ALREADY_EXISTS),
        (lambda: client.create_dataflow("main", "broken", "select region from"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: client.create_dataflow("main", "random", "select id, rand() as r from sales"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: client.create_dataflow("main", "clock", "select id, current_timestamp() as t from sales"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: client.create_dataflow("main", "ghost", "select * from missing_table"), grpc.StatusCode.NOT_FOUND),
        (lambda: client.create_dataflow("main", "badkey", TOTALS, index_key=["nope"]), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: client.create_dataflow("main", "totals", TOTALS, index_key=["region"]), grpc.StatusCode.ALREADY_EXISTS),
        (lambda: client.append("sales", [{"id": "not a number", "region": "x", "amount": 1.0}]), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: client.append("sales", [{"id": None, "region": "x", "amount": 1.0}]), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: client.peek("main", "totals", timestamp=0), grpc.StatusCode.FAILED_PRECONDITION),
        (lambda: client.add_replica("main", "huge", size="galactic"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: client.add_replica("main", "odd", spark_master="spark://no-port"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: client.add_replica("main", "ext", address="127.0.0.1:1", driver_host="10.0.0.5"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: client.add_replica("main", "blank", driver_host=" "), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: client.add_replica("main", "nowait", timeout_ms=1000), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: client.add_replica("main", "twice", driver_host="a", spark_conf={"spark.driver.host": "b"}), grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for call, code in cases:
        with pytest.raises(TandemError) as error:
            call()
        assert error.value.code == code, (error.value.code, error.value.message)
        assert error.value.message
    after = catalog_contents()
    assert after[:2] == before[:2]
    assert [r.name for r in after[2]] == [r.name for r in before[2]]


def test_drop_replica_below_min_in_sync_is_refused_without_force(cluster):
    client: Client = cluster["client"]
    client.create_instance("solo", min_in_sync=1)
    client.add_replica("solo", "only", size="xsmall")
    # Dataflow (and index) names are per instance: "main" has a "totals" too.
    client.create_dataflow("solo", "totals", "select region, count(*) as n from sales group by region", index_key=["region"])
    wait_until(lambda: client.status("solo")[0].replicas[0].in_sync, 120, "the replica in sync")
    assert client.peek("solo", "totals", key="north").rows == [{"region": "north", "n": 5}]
    assert client.peek("main", "totals", key="north").rows == [{"region": "north", "total": 20.0, "n": 5}]
    with pytest.raises(TandemError) as error:
        client.drop_replica("solo", "only")
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION and "min_in_sync" in error.value.message
    assert [r.name for r in client.status("solo")[0].replicas] == ["only"]
    client.drop_replica("solo", "only", force=True)
    assert client.status("solo")[0].replicas == ()
    client.drop_instance("solo")


def test_killing_a_replica_under_peek_load_fails_no_peek(cluster):
    client: Client = cluster["client"]
    victim = replicas(client)["r1"]
    errors, answers, stop = [], [], threading.Event()

    def peek_loop():
        with Client.connect(cluster["controller"].address) as own:
            while not stop.is_set():
                try:
                    answers.append(own.peek("main", "totals", key="north", timeout_ms=20_000))
                except TandemError as e:
                    errors.append(e)

    loop = threading.Thread(target=peek_loop)
    loop.start()
    time.sleep(2)
    os.kill(victim.pid, signal.SIGKILL)
    rehydrated = wait_until(
        lambda: (r := replicas(client)["r1"]).epoch > victim.epoch and r.in_sync and r.pid != victim.pid and r,
        180,
        "r1 to be rehydrated",
    )
    time.sleep(1)
    stop.set()
    loop.join()
    assert errors == []
    assert len(answers) > 10
    assert all(a.rows == answers[0].rows for a in answers)
    assert {a.replica for a in answers} >= {"r2"}
    assert rehydrated.dataflows_built >= 1


def test_controller_kill_and_restart_reconciles_replicas(cluster):
    client: Client = cluster["client"]
    t = client.append("sales", [{"id": 100, "region": "west", "amount": 5.0}])
    client.peek("main", "totals", key="west", consistency="strict", timeout_ms=60_000)
    before = replicas(client)
    cluster["controller"].kill()
    cluster["controller"] = ControllerProcess(cluster["data_dir"], log_name="controller-2.log")
    client = _reconnect(cluster)
    assert [i.name for i in client.list_instances()] == ["main"]
    assert [d.name for d in client.list_dataflows("main")] == ["totals"]
    after = wait_until(
        lambda: (r := replicas(client)) and all(x.in_sync and x.dataflows_kept > 0 for x in r.values()) and r,
        120,
        "replicas reconciled and in sync",
    )
    for name, replica in after.items():
        assert replica.pid == before[name].pid  # the same processes, kept alive
        assert replica.dataflows_built == before[name].dataflows_built  # nothing recomputed
    result = client.peek("main", "totals", key="west", consistency="strict")
    assert result.rows == [{"region": "west", "total": 5.0, "n": 1}]


def test_a_second_controller_fences_the_first(cluster):
    old = Catalog.open(default_url(cluster["data_dir"]))
    old.become_controller()
    newer = Catalog.open(default_url(cluster["data_dir"]))
    newer.become_controller()
    with pytest.raises(Fenced):
        old.write_ts()
    old.close()
    newer.close()
    # The running controller was fenced too: its next write is refused.
    with pytest.raises(TandemError) as error:
        cluster["client"].create_source("late", SCHEMA)
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION and "epoch" in error.value.message
