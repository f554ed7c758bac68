"""Read holds whose owner is gone do not pin a collection for good (DESIGN section 3:
every hold has an owner the catalog can check). Real controller processes, killed with
SIGKILL: a dropped instance leaves no hold of its dataflows on their inputs; the storage
feeds of a killed controller are removed by the next one, with an event and a count;
every collection's since then moves on and compaction runs. No replica is needed: a
dataflow's input hold is the catalog's from the transaction that records it."""

from __future__ import annotations

import itertools
import urllib.request

import pytest

from catalog import Catalog, default_url
from controller import cli
from controller._process import ControllerProcess, kill_replicas, wait_until
from controller.client import Client

pytestmark = pytest.mark.spark  # a controller process starts its planner JVM

SCHEMA = "id BIGINT, region STRING, amount DOUBLE"
# Upkeep twice a second, retention 0: a since free of holds follows its upper at once,
# and a pass compacts 8 batches below it.
SERVE_ARGS = ["--upkeep-interval-ms", "500", "--retention-ms", "0"]


def holds(catalog: Catalog, id: str) -> dict[str, int]:
    return {holder: frontier.time for holder, frontier in catalog.manifest(id).holds}


def test_holds_of_a_dropped_instance_and_a_killed_controllers_feeds_go_and_compaction_resumes(tmp_path, capsys):
    ids = itertools.count()
    controller = ControllerProcess(tmp_path, serve_args=SERVE_ARGS)
    catalog = Catalog.open(default_url(tmp_path))
    try:
        client = Client.connect(controller.address)
        sales = client.create_source("sales", SCHEMA).id
        views = client.create_source("views", SCHEMA).id

        def append(n: int = 1) -> int:
            for _ in range(n):
                t = client.append("sales", [{"id": next(ids), "region": "a", "amount": 1.0}])
                client.append("views", [{"id": next(ids), "region": "b", "amount": 2.0}])
            return t

        first = append()
        client.create_instance("gone")  # no replica: nothing moves its dataflow's hold
        client.create_dataflow("gone", "totals", "SELECT region, count(*) AS n FROM sales GROUP BY region", index_key=["region"])
        assert any(holder.startswith("gone/") for holder in holds(catalog, sales))
        client.drop_instance("gone")
        assert not any(holder.startswith("gone/") for holder in holds(catalog, sales))

        feed = client.subscribe(None, "views", progress=True)
        next(feed)  # open: its hold is taken
        [feed_holder] = [h for h in holds(catalog, views) if h.startswith("subscribe:")]
        pinned = holds(catalog, views)[feed_holder]
        controller.kill()  # the feed's hold stays in the catalog, its owner gone

        controller = ControllerProcess(tmp_path, log_name="controller-2.log", serve_args=SERVE_ARGS)
        client.close()
        client = Client.connect(controller.address)
        last = append(10)
        for id in (sales, views):
            wait_until(lambda id=id: catalog.get_collection(id).since.time >= last, 60, f"{id}'s since past {last}")
            wait_until(lambda id=id: len(catalog.manifest(id).batches) < 11, 60, f"{id} compacted")
        assert feed_holder not in holds(catalog, views) and catalog.get_collection(views).since.time > pinned > first
        removed = [e for e in client.events() if e.kind == "hold_removed"]
        assert [e.instance for e in removed] == [""] and feed_holder in removed[0].message
        assert "feed of controller epoch 1" in removed[0].message
        metrics = urllib.request.urlopen(f"http://{controller.metrics_address}/metrics", timeout=10).read().decode()
        assert 'tandem_orphaned_holds_removed_total{owner="feed"} 1.0' in metrics
        # What pins each collection now: the retention window alone.
        storage = {view.name: view for view in client.storage_holds()}
        assert {(h.holder, h.owner) for h in storage["views"].holds} == {("tandem/retention", "retention")}
        assert storage["sales"].holds[0].held_back_ms is not None
        assert cli.main(["storage", "--address", controller.address]) == 0
        table = capsys.readouterr().out
        assert "HELD_BACK_MS" in table and "tandem/retention" in table and "views" in table
        client.close()
    finally:
        controller.kill()
        catalog.close()
        kill_replicas(tmp_path)
