"""The runtime's requests that check the instance, write the catalog, then change the
instance: a check must still hold when the change lands, and a refused request leaves
nothing behind (issue 13, defects 1, 3 and 5).

A real catalog, storage and `Controller`, with the SQL planner replaced by a stand-in
(planning is not what is tested) and replicas faked at the state machine's edge.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from catalog import Catalog, CatalogError, _manifest, default_url
from controller._api import ControllerError
from controller._orchestrator import Orchestrator
from controller._upkeep import RETENTION_HOLDER
from controller.runtime import Controller
from history import Frontier
from storage import Storage

SCHEMA = "id BIGINT NOT NULL"


@dataclass(frozen=True)
class _Planned:
    schema: str = SCHEMA
    not_incremental: str | None = None


class _Planner:
    """Stands in for the Spark planner: `select * from <table>` reads `<table>`."""

    def referenced_tables(self, sql: str, conf) -> list[str]:
        return [sql.split()[-1]]

    def analyze(self, sql: str, schemas, conf) -> _Planned:
        return _Planned()

    def check_index_key(self, planned, key):
        return tuple(key)


def _controller(tmp_path) -> Controller:
    url = default_url(tmp_path)
    catalog = Catalog.open(url)
    storage = Storage(catalog, tmp_path / "blobs")
    planner: Future = Future()
    planner.set_result(_Planner())
    controller = Controller(catalog, url, storage, planner, Orchestrator(catalog, url, storage.blob_uri, tmp_path))
    controller._epoch = catalog.become_controller()
    return controller


async def _stop(controller: Controller) -> None:
    for task in controller._tasks:
        task.cancel()
    for driver in controller.drivers.values():
        await driver.stop()
    controller.catalog.close()


def _step(call):
    return lambda instance: ([], call(instance))


async def _active_replica(controller: Controller, name: str) -> None:
    """Replica `name`, recorded as external and active in the instance, reporting
    nothing yet (no connection is opened)."""
    driver = controller.drivers["main"]
    controller.catalog.create_replica("main", name, size="custom", spark_master="local[1]", address="127.0.0.1:9")
    await driver.call(lambda inst: inst.tick(int(time.time() * 1000)))
    await driver.call(_step(lambda inst: inst.add_replica(name)))
    await driver.call(_step(lambda inst: inst.replica_connected(name, 1, f"{name}-nonce")))


def test_an_import_compacted_while_the_dataflow_is_recorded_is_no_half_written_dataflow(tmp_path):
    """While the catalog records dataflow `b` over index `a`, a's since moves on (its
    replicas report, its compaction window passes). Before the fix the catalog kept `b`
    while the instance refused it: a retry got ALREADY_EXISTS and `b` came back after a
    restart. Now `a` is held at b's as_of from before the record on."""

    async def run() -> None:
        controller = _controller(tmp_path)
        await controller.create_instance("main")
        await controller.create_source("s", SCHEMA)
        await controller.create_dataflow("main", "a", "select * from s", index_key=["id"])
        driver = controller.drivers["main"]
        a = driver.instance.dataflow_named("a").desc.index_exports[0].id
        loop = asyncio.get_running_loop()
        record = controller.catalog.create_dataflow

        def compacting(*args, **kwargs):
            def forward(inst):
                inst.collections[a].holds["implied"] = Frontier(1_000)
                return inst._update_holds([a], ())

            info = record(*args, **kwargs)
            loop.call_soon_threadsafe(driver.post, forward)
            time.sleep(0.2)  # the loop moves a's since before the instance hears of b, if it can
            return info

        controller.catalog.create_dataflow = compacting
        try:
            view = await controller.create_dataflow("main", "b", "select * from a", index_key=["id"])
        except ControllerError as error:  # a refusal is allowed, if it leaves nothing
            assert [d.name for d in controller.catalog.list_dataflows("main")] == ["a"], error
        else:
            assert view.name == "b" and "b" in driver.instance.names
            assert driver.instance.collections[a].since <= driver.instance.dataflow_named("b").desc.as_of
        assert not any(h.startswith("reserve:") for c in driver.instance.collections.values() for h in c.holds)
        await _stop(controller)

    asyncio.run(run())


def test_a_new_source_or_materialized_view_is_held_by_the_retention_window_from_its_creation(tmp_path):
    """A new source, and a new materialized view's collection, carry the retention hold
    at once, not from upkeep's next pass: until then a dataflow's hold alone set the
    since, which moved past the times a chaos run had read answers at, before the
    window held them."""

    async def run() -> None:
        controller = _controller(tmp_path)
        await controller.create_instance("main")
        await controller.create_source("s", SCHEMA)
        await controller.create_dataflow("main", "v", "select * from s", materialize=True)
        for name in ("s", "v"):
            collection = controller.catalog.collection_by_name(name).id
            assert dict(controller.catalog.manifest(collection).holds)[RETENTION_HOLDER] == Frontier.minimum(), name
        await _stop(controller)

    asyncio.run(run())


def test_an_append_completes_every_other_source_through_its_time(tmp_path):
    """An append at t moves every other live source to t + 1 at once (no advancer runs
    here): a dataflow joining the appended source with an idle one waited for the
    advancer's next tick, up to a second. A materialized view's upper stays its
    replicas'."""

    async def run() -> None:
        controller = _controller(tmp_path)
        await controller.create_instance("main")
        for name in ("appended", "idle", "gone"):
            await controller.create_source(name, SCHEMA)
        await controller.create_dataflow("main", "view", "select * from idle", materialize=True)
        await controller.drop_source("gone")
        ids = {name: controller.catalog.collection_by_name(name).id for name in ("appended", "idle", "view")}
        gone = next(c for c in controller.catalog.list_collections(include_dropped=True) if c.name == "gone")
        before = controller.storage.upper(ids["view"])
        t = await controller.append("appended", [{"id": 1}])
        assert controller.storage.upper(ids["appended"]) == controller.storage.upper(ids["idle"]) == Frontier(t + 1)
        assert controller.storage.upper(ids["view"]) == before
        assert controller.catalog.get_collection(gone.id).upper == gone.upper
        await _stop(controller)

    asyncio.run(run())


def test_appends_follow_a_source_name_through_its_drop_and_recreation(tmp_path):
    """The controller remembers an appended source's id by name; a drop forgets it, so
    an append after the drop is refused, and one after a new source takes the name goes
    to the new one. Appends to a materialized view are refused."""

    async def run() -> None:
        controller = _controller(tmp_path)
        await controller.create_instance("main")
        await controller.create_source("events", SCHEMA)
        await controller.create_source("other", SCHEMA)
        await controller.create_dataflow("main", "view", "select * from other", materialize=True)
        first = controller.catalog.collection_by_name("events").id
        await controller.append("events", [{"id": 1}])
        await controller.drop_source("events")
        with pytest.raises(ControllerError, match="events") as refused:
            await controller.append("events", [{"id": 2}])
        assert refused.value.code == "NOT_FOUND"
        await controller.create_source("events", SCHEMA)
        second = controller.catalog.collection_by_name("events").id
        later = await controller.append("events", [{"id": 3}])
        assert second != first and controller.storage.read_snapshot(second, later).column("id").to_pylist() == [3]
        with pytest.raises(ControllerError, match="only sources take appends"):
            await controller.append("view", [{"id": 4}])
        with pytest.raises(ControllerError, match="an idempotency key has at most 128 characters, not 129") as refused:
            await controller.append("events", [{"id": 5}], idempotency_key="k" * 129)
        assert refused.value.code == "INVALID_ARGUMENT"
        assert controller.storage.read_snapshot(second, controller.storage.upper(second).time - 1).column("id").to_pylist() == [3]
        await _stop(controller)

    asyncio.run(run())


def test_an_in_process_controller_has_no_standby_to_hand_over_to(tmp_path):
    async def run() -> None:
        controller = _controller(tmp_path)
        for call in (controller.handover(), controller.take_lead(3)):
            with pytest.raises(ControllerError, match="only `tandem serve` hands the lead over") as refused:
                await call
            assert refused.value.code == "FAILED_PRECONDITION"
        await _stop(controller)

    asyncio.run(run())


def test_an_append_and_the_move_of_the_other_sources_are_one_commit(tmp_path, monkeypatch):
    """The append and the move of every other source past its time are one transaction
    (the group commit's): when the catalog fails in the middle of it, nothing is
    appended, no upper moves, no file is left, and the client gets an error, so
    appending again cannot double the rows."""

    async def run() -> None:
        controller = _controller(tmp_path)
        await controller.create_instance("main")
        for name in ("appended", "idle"):
            await controller.create_source(name, SCHEMA)
        appended, idle = (controller.catalog.collection_by_name(name).id for name in ("appended", "idle"))

        def unavailable(session, upper):
            raise CatalogError("the catalog is away for a moment")

        monkeypatch.setattr(_manifest, "advance_sources", unavailable)
        with pytest.raises(ControllerError, match="away for a moment"):
            await controller.append("appended", [{"id": 1}])
        assert controller.storage.upper(appended) == controller.storage.upper(idle) == Frontier.minimum()
        assert not controller.catalog.manifest(appended).batches
        assert not list((tmp_path / "blobs").rglob("*.parquet")), "the refused commit's file is removed"
        monkeypatch.undo()
        t = await controller.append("appended", [{"id": 1}])
        assert controller.storage.upper(appended) == controller.storage.upper(idle) == Frontier(t + 1)
        assert controller.storage.read_snapshot(appended, t).num_rows == 1
        await _stop(controller)

    asyncio.run(run())


def test_concurrent_drops_never_go_below_min_in_sync(tmp_path):
    """Two drops of in-sync replicas race, each allowed alone by `min_in_sync = 1`.
    Before the fix both passed the check before either landed, leaving none."""

    async def run() -> None:
        controller = _controller(tmp_path)
        await controller.create_instance("main", min_in_sync=1)
        for name in ("r1", "r2"):
            await _active_replica(controller, name)
        driver = controller.drivers["main"]
        assert all(h.in_sync for h in driver.instance.health())
        drop = controller.catalog.drop_replica

        def slow_drop(*args):
            time.sleep(0.2)
            return drop(*args)

        controller.catalog.drop_replica = slow_drop
        results = await asyncio.gather(
            controller.drop_replica("main", "r1"), controller.drop_replica("main", "r2"), return_exceptions=True
        )
        refused = [r for r in results if isinstance(r, ControllerError)]
        assert len(refused) == 1 and refused[0].code == "FAILED_PRECONDITION", results
        assert len(driver.instance.replicas) == 1
        assert len(controller.catalog.list_replicas("main")) == 1
        await _stop(controller)

    asyncio.run(run())


def test_a_fenced_controller_learns_it_within_a_tick_and_refuses_as_unavailable(tmp_path):
    async def run() -> None:
        controller = _controller(tmp_path)
        controller._start_tasks()
        newer = Catalog.open(default_url(tmp_path))
        newer.become_controller()
        newer.close()
        await asyncio.wait_for(controller.fenced_event.wait(), 5)
        assert "superseded by epoch" in str(controller.fenced)
        with pytest.raises(ControllerError) as error:
            await controller.create_instance("late")
        assert error.value.code == "UNAVAILABLE" and "superseded by epoch" in error.value.message
        await _stop(controller)

    asyncio.run(run())
