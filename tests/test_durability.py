"""Durability order (DESIGN section 6): record first, then act.

The controller's driver records sinces and holds in the catalog while replicas report
frontiers. Here a real driver and the real recording path run against a real catalog,
with a replica faked at the state machine's edge; the controller "dies" after its n-th
recording, for every n, and a new controller must then recover from what the catalog
holds: every dataflow comes back, no dataflow's recorded since is below an index it
imports, and no storage hold of a dataflow is above the time it is rebuilt at (its
replicas would find their input compacted away).
"""

from __future__ import annotations

import asyncio
import threading
import time
import time as pytime
from concurrent.futures import Future

from catalog import Catalog, dataflow_holder, default_url
from controller._orchestrator import Orchestrator
from controller.runtime import Controller
from history import Frontier, FrontiersResponse, Import
from storage import Storage

SCHEMA = "id BIGINT NOT NULL"


class Died(Exception):
    """The controller's process is gone: nothing it does from here on is recorded."""


def _controller(tmp_path) -> Controller:
    url = default_url(tmp_path)
    catalog = Catalog.open(url)
    storage = Storage(catalog, tmp_path / "blobs")
    controller = Controller(catalog, url, storage, Future(), Orchestrator(catalog, url, storage.blob_uri, tmp_path))
    controller._epoch = catalog.become_controller()
    return controller


class _Connection:
    """Replica r's connection, keeping what is sent on it."""

    epoch = 1

    def __init__(self, sent: list) -> None:
        self.send = sent.extend

    def close(self) -> None:
        pass


def _step(call):
    """A driver step for `call`'s side alone: what it would send goes nowhere."""
    return lambda instance: ([], call(instance))


async def _run(tmp_path, die_after: int | None) -> int:
    """Two chained dataflows (`a` over a source, `b` over `a`'s index) whose frontiers
    advance; the controller dies after `die_after` recordings. Returns how many it made."""
    controller = _controller(tmp_path)
    catalog = controller.catalog
    recordings = 0
    record = controller._record

    def dying(effects):
        nonlocal recordings
        if die_after is not None and recordings >= die_after:
            raise Died()
        recordings += 1
        pytime.sleep(0.03)  # a slow catalog: frontiers move on while it writes
        record(effects)

    controller._record = dying
    source = controller.storage.create_source("s", SCHEMA)
    catalog.create_instance("main")
    driver = controller._new_driver("main")
    await driver.call(lambda inst: inst.tick(int(time.time() * 1000)))  # the replica is heard from now on
    await driver.call(_step(lambda inst: inst.add_replica("r")))
    await driver.call(_step(lambda inst: inst.replica_connected("r", 1, "nonce")))
    a = catalog.create_dataflow(
        "main", "a", sql="select * from s", imports=[Import("s", source.id, "storage")], schema=SCHEMA, as_of=Frontier(0), index_key=("id",)
    )
    await driver.call(lambda inst: inst.create_dataflow(a.description()))
    b = catalog.create_dataflow(
        "main", "b", sql="select * from a", imports=[Import("a", a.index_id, "index")], schema=SCHEMA, as_of=Frontier(0), index_key=("id",)
    )
    await driver.call(lambda inst: inst.create_dataflow(b.description()))
    for at in range(2, 12):
        # b lags a by one report: each moves a's since or b's, and b's hold on a.
        for export in (a.index_id, b.index_id):
            report = FrontiersResponse(export, Frontier(at))
            driver.post(lambda inst, report=report: inst.handle_response("r", 1, report))
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    await driver.stop()
    catalog.close()
    return recordings


async def _recover(tmp_path) -> None:
    controller = _controller(tmp_path)
    try:
        await controller._recover()  # refuses a dataflow whose import is compacted past it
        instance = controller.drivers["main"].instance
        assert sorted(d.desc.name for d in instance.dataflows.values()) == ["a", "b"]
        for key, dataflow in instance.dataflows.items():
            holder = dataflow_holder("main", key)
            for source in dataflow.desc.imports:
                if source.kind == "storage":
                    holds = dict(controller.catalog.manifest(source.id).holds)
                    assert holder in holds, f"{holder} holds nothing on {source.id}: it may be compacted away"
                    assert holds[holder] <= dataflow.desc.as_of, f"{holder} holds {source.id} past {dataflow.desc.as_of}"
    finally:
        for driver in controller.drivers.values():
            await driver.stop()
        controller.catalog.close()


def test_a_controller_killed_after_any_recording_recovers(tmp_path):
    total = asyncio.run(_run(tmp_path / "full", None))
    assert total >= 3
    for die_after in range(total + 1):
        run = tmp_path / f"died-after-{die_after}"
        asyncio.run(_run(run, die_after))
        asyncio.run(_recover(run))


def test_replicas_are_allowed_to_compact_only_what_is_recorded(tmp_path):
    """While the catalog write of a since has not returned, no AllowCompaction for it is
    sent: a controller dying then rebuilds the dataflow at the since on record, which
    every replica can still serve."""

    async def run() -> None:
        controller = _controller(tmp_path)
        # A thread's event, not the loop's: a write still waiting when the driver stops
        # (its stop joins the writers on the loop's thread) must not need the loop.
        gate = threading.Event()
        record = controller._record

        def slow(effects):
            gate.wait()
            record(effects)

        controller._record = slow
        source = controller.storage.create_source("s", SCHEMA)
        controller.catalog.create_instance("main")
        driver = controller._new_driver("main")
        await driver.call(lambda inst: inst.tick(int(time.time() * 1000)))  # the replica is heard from now on
        await driver.call(_step(lambda inst: inst.add_replica("r")))
        await driver.call(_step(lambda inst: inst.replica_connected("r", 1, "nonce")))
        a = controller.catalog.create_dataflow(
            "main", "a", sql="select * from s", imports=[Import("s", source.id, "storage")], schema=SCHEMA, as_of=Frontier(0), index_key=("id",)
        )
        await driver.call(lambda inst: inst.create_dataflow(a.description()))
        sent = []
        driver.connections["r"] = _Connection(sent)
        driver.post(lambda inst: inst.handle_response("r", 1, FrontiersResponse(a.index_id, Frontier(10))))
        await asyncio.sleep(0.2)
        assert driver.instance.collections[a.index_id].since == Frontier(9)
        assert not [c for c in sent if type(c).__name__ == "AllowCompaction"]
        gate.set()
        for _ in range(100):
            if controller.catalog.get_collection(a.index_id).since == Frontier(9) and sent:
                break
            await asyncio.sleep(0.05)
        assert [(type(c).__name__, c.frontier) for c in sent] == [("AllowCompaction", Frontier(9))]
        await driver.stop()
        controller.catalog.close()

    asyncio.run(run())
