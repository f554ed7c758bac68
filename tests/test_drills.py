"""Failure drills with real processes: a controller, a managed replica, and an external
replica behind a fault-injecting TCP proxy.

After each drill every peek answer is checked against the same SQL run directly with
Spark on the storage snapshot at the peek's timestamp.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from catalog import Catalog, Fenced, default_url
from controller.client import Client, ReplicaView, TandemError
from controller._process import ControllerProcess, kill_replicas, wait_until
from fault_proxy import FaultProxy
from replica_harness import ReplicaProcess, ScriptedClient
from replica_service import _spark
from replica_service._replica import PERTURB_ENV
from storage import file_schema, parse_schema, snapshot_of

pytestmark = pytest.mark.spark

SCHEMA = "id BIGINT NOT NULL, region STRING, amount DOUBLE"
TOTALS = "select region, sum(amount) as total, count(*) as n from sales group by region"
REGIONS = ["north", "south", "east", "west"]
# The controller keeps an hour of every storage collection (its retention hold), so its
# upkeep compacts nothing the verifier reads: the verifier holds no read hold itself.
SERVE_ARGS = ["--retention-ms", str(3_600_000)]




class Drill:
    """The cluster under drill, and every peek answer it gave."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.controller = ControllerProcess(root, serve_args=SERVE_ARGS)
        self.client = Client.connect(self.controller.address)
        self.answers: list[tuple[str, str, int, list[dict]]] = []  # (instance, key, timestamp, rows)
        self.failures: list[TandemError] = []

    def replicas(self, instance: str) -> dict:
        return {r.name: r for r in self.client.status(instance)[0].replicas}

    def peek(self, instance: str, key: str, client: Client | None = None):
        # Index names are unique across instances in the catalog, hence one per instance.
        name = "totals" if instance == "duo" else f"{instance}_totals"
        result = (client or self.client).peek(instance, name, key=key, timeout_ms=20_000)
        self.answers.append((instance, key, result.timestamp, result.rows))
        return result

    @contextmanager
    def peek_loop(self, instance: str) -> Iterator[list]:
        """Peek continuously from a thread of its own while the block runs; yields the
        list of results it fills (failures go to `self.failures`)."""
        stop, results = threading.Event(), []

        def loop() -> None:
            with Client.connect(self.controller.address) as own:
                while not stop.is_set():
                    try:
                        results.append(self.peek(instance, random.choice(REGIONS), own))
                    except TandemError as e:
                        self.failures.append(e)

        thread = threading.Thread(target=loop)
        thread.start()
        try:
            yield results
        finally:
            stop.set()
            thread.join()

    def wait_in_sync(self, instance: str, timeout: float, what: str) -> None:
        """Wait until every replica of `instance` is in sync; the timeout's message shows
        them as they are then."""
        try:
            wait_until(lambda: all(r.in_sync for r in self.replicas(instance).values()), timeout, what)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; replicas now: {self.replicas(instance)}") from None

    def settled(self, instance: str, name: str, timeout: float = 60) -> ReplicaView:
        """The replica's view once it is in sync and its session counters have stayed the
        same for a second: whatever a previous drill set off (a reconciliation, say) has
        been reported in full."""

        def counters(view: ReplicaView) -> tuple:
            return view.epoch, view.replays, view.resumes, view.dataflows_kept, view.dataflows_built

        def steady():
            first = self.replicas(instance)[name]
            time.sleep(1)
            second = self.replicas(instance)[name]
            return second.in_sync and counters(first) == counters(second) and second

        return wait_until(steady, timeout, f"replica {name} settled")

    def restart_controller(self) -> None:
        self.controller.kill()
        self.controller = ControllerProcess(self.root, log_name=f"controller-{time.monotonic_ns()}.log", serve_args=SERVE_ARGS)
        self.client.close()
        self.client = Client.connect(self.controller.address)


def snapshot(root: Path, catalog: Catalog, source_id: str, t: int) -> pa.Table:
    """The source at `t`, consolidated from its batch files (nothing compacts them in
    these drills: see `SERVE_ARGS`)."""
    schema = parse_schema(catalog.get_collection(source_id).schema)
    batches = catalog.manifest(source_id).batches
    tables = [pq.read_table(root / "blobs" / b.path, schema=file_schema(schema)) for b in batches]
    updates = pa.concat_tables(tables) if tables else file_schema(schema).empty_table()
    updates = updates.filter(pa.compute.less_equal(updates["_time"], t))
    return snapshot_of(updates, schema.names, f"{source_id} at {t}").cast(schema)


@pytest.fixture(scope="module")
def drill(tmp_path_factory):
    root = tmp_path_factory.mktemp("drill")
    state = Drill(root)
    client = state.client
    client.create_instance("duo", min_in_sync=1, replica_timeout_ms=3000, max_lag_ms=2000, max_hold_back_ms=10_000)
    client.add_replica("duo", "managed", size="xsmall")
    external = ReplicaProcess(default_url(root), root / "blobs", log_path=root / "external.log")
    proxy = FaultProxy(external.address)
    client.add_replica("duo", "external", address=proxy.address)
    client.create_source("sales", SCHEMA)
    client.append("sales", [{"id": i, "region": REGIONS[i % 4], "amount": i * 0.5} for i in range(40)])
    client.create_dataflow("duo", "totals", TOTALS, index_key=["region"])
    state.wait_in_sync("duo", 180, "both replicas in sync")
    state.external, state.proxy = external, proxy
    yield state
    try:
        verify(state)
    finally:  # no process outlives the module, whatever the verification found
        state.client.close()
        state.controller.stop()
        proxy.close()
        external.stop()
        kill_replicas(root)


def verify(state: Drill) -> None:
    """Every answer equals Spark's answer on the storage snapshot at its timestamp."""
    catalog = Catalog.open(default_url(state.root))
    session = _spark.start_session(_spark.SparkSettings("local[1]"), state.root / "verifier")
    try:
        source = catalog.collection_by_name("sales").id
        expected: dict[int, dict[str, list[dict]]] = {}
        for instance, key, t, rows in state.answers:
            if t not in expected:
                result = _spark.query(session, TOTALS, {"sales": snapshot(state.root, catalog, source, t)}).toArrow().to_pylist()
                expected[t] = {r["region"]: [r] for r in result}
            assert rows == expected[t].get(key, []), (instance, key, t)
    finally:
        # The process's one SparkContext: a later test module must get its own settings.
        session.stop()
        catalog.close()


def test_a_slow_replica_is_outrun_and_shows_its_lag(drill):
    before = drill.replicas("duo")
    drill.proxy.delay(0.5)
    try:
        for _ in range(20):
            drill.peek("duo", random.choice(REGIONS))
        # Its frontier reports arrive late, so its lag shows; the fast replica wins the peeks.
        wait_until(lambda: (drill.replicas("duo")["external"].lag_ms or 0) >= 400, 30, "the slow replica's lag to show")
        after = drill.replicas("duo")
        assert after["managed"].peeks_won - before["managed"].peeks_won >= 15
        assert after["external"].peeks_won - before["external"].peeks_won <= 5
    finally:
        drill.proxy.heal()
    wait_until(lambda: drill.replicas("duo")["external"].in_sync, 60, "the slow replica to catch up")


def test_a_partition_fails_the_replica_after_the_timeout_and_heals(drill):
    before = drill.replicas("duo")["external"]
    with drill.peek_loop("duo") as results:
        cut_at = time.monotonic()
        drill.proxy.partition()
        try:
            failed = wait_until(lambda: (r := drill.replicas("duo")["external"]).epoch > before.epoch and r, 30, "the partitioned replica to fail")
            detected_after = time.monotonic() - cut_at
            # Silence counts from the last message heard, not from the cut: a replica
            # busy computing on a loaded machine may have been quiet for a while already,
            # so only an instant failure (a broken stream) would be wrong here.
            assert detected_after >= 1.0, f"failed after {detected_after:.1f}s: not by the 3 s replica_timeout"
            assert not failed.in_sync  # (a reconnect may get through to the proxy, then time out again)
            time.sleep(2)
        finally:
            drill.proxy.heal()
        # It comes back resumed (if the heal beat the expiry of its resume offer) or
        # reconciled (a new session): either way without recomputing.
        healed = wait_until(
            lambda: (r := drill.replicas("duo")["external"]).in_sync
            and (r.dataflows_kept > before.dataflows_kept or r.resumes > before.resumes)
            and r,
            90,
            "the replica to rejoin, resumed or reconciled, after the heal",
        )
    assert drill.failures == [] and len(results) > 5
    assert healed.pid == before.pid  # the same process: it rejoined rather than restarting
    assert healed.dataflows_built == before.dataflows_built


def test_a_cut_stream_resumes_the_session_with_just_what_it_missed(drill):
    before = drill.settled("duo", "external")
    with drill.peek_loop("duo") as results:
        drill.client.append("sales", [{"id": 1000, "region": "north", "amount": 1.0}])
        drill.proxy.cut()  # both ends see the stream break at once; the process lives on
        resumed = wait_until(
            # (pid: its first heartbeat on the new stream, which carries its counters)
            lambda: (r := drill.replicas("duo")["external"]).resumes > before.resumes and r.in_sync and r.pid and r,
            60,
            "the replica to resume its session",
        )
        drill.client.append("sales", [{"id": 1001, "region": "south", "amount": 2.0}])
        time.sleep(1)  # peeks keep going over the resumed session
    assert drill.failures == [] and len(results) > 5
    assert resumed.epoch > before.epoch and resumed.pid == before.pid
    # Near-horizon: no new session, so nothing replayed, reconciled or rebuilt.
    assert (resumed.replays, resumed.dataflows_kept, resumed.dataflows_built) == (
        before.replays,
        before.dataflows_kept,
        before.dataflows_built,
    )


def test_one_replica_killed_peeks_wait_or_fail_clearly_never_wrongly(drill):
    client = drill.client
    client.create_instance("single", replica_timeout_ms=3000)
    client.add_replica("single", "only", size="xsmall")
    client.create_dataflow("single", "single_totals", TOTALS, index_key=["region"])
    wait_until(lambda: drill.replicas("single")["only"].in_sync, 120, "the replica in sync")
    victim = drill.replicas("single")["only"]
    failures_before = len(drill.failures)
    with drill.peek_loop("single") as results:
        time.sleep(1)
        os.kill(victim.pid, signal.SIGKILL)
        wait_until(lambda: (r := drill.replicas("single")["only"]).epoch > victim.epoch and r.in_sync, 180, "rehydration")
        served_after = len(results)
        wait_until(lambda: len(results) > served_after + 3, 60, "peeks served again")
    for failure in drill.failures[failures_before:]:
        assert failure.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), failure
        assert "single" in failure.message or "replica" in failure.message
    del drill.failures[failures_before:]
    client.drop_instance("single")


def test_controller_killed_mid_operations_leaves_catalog_and_replicas_agreeing(drill):
    client = drill.client
    errors: list[Exception] = []
    created: list[str] = []

    def churn() -> None:
        with Client.connect(drill.controller.address) as own:
            for n in range(50):
                try:
                    own.append("sales", [{"id": 1000 + n, "region": REGIONS[n % 4], "amount": 1.0}])
                    own.create_dataflow("duo", f"churn{n}", "select region, count(*) as n from sales group by region", index_key=["region"])
                    created.append(f"churn{n}")
                    if n % 2:
                        own.drop_dataflow("duo", f"churn{n}")
                except TandemError as e:
                    errors.append(e)
                    return

    thread = threading.Thread(target=churn)
    thread.start()
    time.sleep(random.uniform(3, 6))
    drill.restart_controller()
    thread.join()
    client = drill.client
    dataflows = {d.name: d for d in client.list_dataflows("duo")}
    try:
        drill.wait_in_sync("duo", 180, "replicas in sync after restart")
        status = client.status("duo")[0]
        live_indexes = {c.id for c in status.collections if c.since is not None}
        assert {d.index_id for d in dataflows.values()} == live_indexes  # nothing half-made
        for name in dataflows:
            client.peek("duo", name, consistency="strict", timeout_ms=60_000)
    finally:  # the later drills run beside `totals` alone, whatever this one found
        for name in [n for n in dataflows if n.startswith("churn")]:
            client.drop_dataflow("duo", name)
    for name in ("managed", "external"):  # and from replicas done with what the churn set off
        drill.settled("duo", name, timeout=180)  # as long as they had to get in sync


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (its JVM, say), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def test_a_stuck_replica_stops_holding_compaction_back_and_comes_back(drill):
    """Bounded hold-back: the external replica's JVM is stopped, so its frontier stands
    still. Appends go on; past the instance's max_hold_back_ms (10 s) the replica no
    longer holds the dataflow's input (the hold on `sales` moves on with the other
    replica) and is rehydrated; let go, it gets back in sync. Its Python side usually
    heartbeats meanwhile, so the hold-back bound evicts it; when a call into the stopped
    JVM holds up its messages, replica_timeout_ms (3 s) does first. Either lets go of
    the hold, which is what this drill is about (`test_instance_sim.py` has the bound's
    own cases)."""
    catalog = Catalog.open(default_url(drill.root))
    source = catalog.collection_by_name("sales").id
    key = catalog.dataflow_by_name("duo", "totals").export_ids[0]

    def hold() -> int:
        return dict(catalog.manifest(source).holds)[f"duo/{key}"].time

    def evicted() -> bool:
        # Not in the session it had at the stop: its stopped JVM cannot be active again
        # (an earlier drill may have left a failure message, with the replica active).
        external = drill.replicas("duo")["external"]
        return external.state != "active" or external.epoch > epoch

    def moved_on() -> bool:
        drill.client.append("sales", [{"id": 1_001, "region": "south", "amount": 1.0}])  # W moves on
        return hold() > stopped_at + 5_000

    jvms = [pid for pid in _descendants(drill.external.pid) if b"java" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert jvms, "the external replica's JVM was not found"
    epoch = drill.replicas("duo")["external"].epoch
    stopped_at = drill.client.append("sales", [{"id": 1_000, "region": "north", "amount": 1.0}])
    for pid in jvms:
        os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 90
        while not evicted():
            assert time.monotonic() < deadline, f"not evicted: {drill.replicas('duo')['external']}, {drill.client.status('duo')[0].events}"
            drill.client.append("sales", [{"id": 1_001, "region": "south", "amount": 1.0}])
            time.sleep(0.5)
        wait_until(moved_on, 30, "the input hold to move past the stuck replica")
    finally:
        for pid in jvms:
            os.kill(pid, signal.SIGCONT)
        catalog.close()
    wait_until(lambda: drill.replicas("duo")["external"].in_sync, 180, "the stuck replica back in sync")
    drill.peek("duo", "north")


def test_a_replica_computing_wrong_answers_is_caught_and_answers_no_read(drill):
    """Divergence: a third replica, started with the test hook that makes it compute a
    wrong `totals` (one row twice), disagrees with the other two on the digest of a
    version they all computed. It is named in status and the events, counted, and
    rehydrated; it keeps computing wrongly, so it stays untrusted, and no peek takes its
    answer (`verify` checks every answer of the module against Spark)."""
    wrong = ReplicaProcess(
        default_url(drill.root), drill.root / "blobs", log_path=drill.root / "wrong.log", env={PERTURB_ENV: "totals"}
    )
    try:
        drill.client.add_replica("duo", "wrong", address=wrong.address)
        wait_until(lambda: drill.replicas("duo")["wrong"].hydrated, 180, "the wrong replica hydrated")
        deadline = time.monotonic() + 60
        while not drill.replicas("duo")["wrong"].diverged:  # versions all three compute
            assert time.monotonic() < deadline, f"not caught: {drill.client.status('duo')[0].events}"
            drill.client.append("sales", [{"id": 2_000, "region": "east", "amount": 2.0}])
            time.sleep(1)
        (view,) = drill.client.status("duo")
        assert view.divergences >= 1 and any("replica wrong diverged on dataflow totals" in e for e in view.events)
        assert not view.replicas[[r.name for r in view.replicas].index("wrong")].in_sync
        for _ in range(3):
            drill.client.append("sales", [{"id": 2_001, "region": "west", "amount": 3.0}])
            for region in REGIONS:
                assert drill.peek("duo", region).replica != "wrong"
    finally:
        drill.client.drop_replica("duo", "wrong", force=True)
        wrong.stop()


def test_two_replicas_that_disagree_are_settled_by_a_recompute_from_storage(drill):
    """With two replicas there is no majority: the controller recomputes the disputed
    version from storage on its own Spark, with the replicas' code, and distrusts the
    replica whose digest differs (the wrong one), never the right one."""
    client = drill.client
    client.create_instance("pair", min_in_sync=1, replica_timeout_ms=3000, max_lag_ms=2000)
    wrong = ReplicaProcess(
        default_url(drill.root), drill.root / "blobs", log_path=drill.root / "pair-wrong.log", env={PERTURB_ENV: "totals"}
    )
    try:
        client.add_replica("pair", "right", size="xsmall")
        client.add_replica("pair", "wrong", address=wrong.address)
        client.create_dataflow("pair", "totals", TOTALS, index_key=["region"])
        wait_until(lambda: all(r.hydrated for r in drill.replicas("pair").values()), 240, "both hydrated")
        deadline = time.monotonic() + 90
        while not drill.replicas("pair")["wrong"].diverged:
            assert time.monotonic() < deadline, f"not settled: {client.status('pair')[0].events}"
            client.append("sales", [{"id": 3_000, "region": "north", "amount": 4.0}])
            time.sleep(1)
        (view,) = client.status("pair")
        assert any("recomputing that version from storage" in e for e in view.events)
        assert not any("no replica matches" in e for e in view.events), view.events
        assert view.replicas[[r.name for r in view.replicas].index("right")].diverged is None
        for region in REGIONS:
            assert client.peek("pair", "totals", key=region, timeout_ms=20_000).replica == "right"
    finally:
        client.drop_instance("pair")
        wrong.stop()


def test_a_stale_controller_is_refused_by_replicas_and_the_catalog(drill):
    old = Catalog.open(default_url(drill.root))
    stale_epoch = old.become_controller()
    drill.restart_controller()  # the newest controller fences the older ones
    with pytest.raises(Fenced):
        old.create_source("from_the_past", SCHEMA)
    old.close()
    # Once the newest controller has driven the replica, the older epoch is refused.
    drill.wait_in_sync("duo", 180, "replicas in sync")
    stale = ScriptedClient(drill.external.address, epoch=stale_epoch)
    refusal = stale.wait_for(lambda r: r.refusal, 20, "a refusal")
    assert refusal.code == "stale_epoch"
    stale.close()
    assert [s.name for s in drill.client.list_sources()] == ["sales"]
    drill.peek("duo", "north")
