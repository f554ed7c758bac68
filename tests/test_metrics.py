"""The controller's Prometheus metrics, scraped over HTTP from a real `Controller` (a
real catalog and storage; the planner stands in and a replica is faked at the state
machine's edge, as in `test_runtime_ddl`). `test_controller` scrapes a real cluster
through a replica kill."""

from __future__ import annotations

import asyncio
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from test_runtime_ddl import SCHEMA, _active_replica, _controller, _stop

from catalog import Catalog, ControllerSpec
from history import DataflowStatus, Frontier, FrontiersResponse, StatusResponse


def scrape(address: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_show_history_frontiers_hydration_peeks_and_steps(tmp_path):
    async def run() -> dict:
        controller = _controller(tmp_path)
        await controller.create_instance("main")
        await controller.create_source("s", SCHEMA)
        await _active_replica(controller, "r1")
        await controller.create_dataflow("main", "a", "select * from s", index_key=["id"])
        driver = controller.drivers["main"]
        index = driver.instance.dataflow_named("a").desc.index_exports[0].id
        now = int(time.time() * 1000)
        driver.post(lambda inst: inst.handle_response("r1", 1, FrontiersResponse(index, Frontier(now - 3_000))))
        controller.metrics.observe_peek("main", "r1", "rows", 0.02)
        controller.metrics.observe_peek("main", None, "timeout", 30.0)
        for steps in (1, 3):  # three steps seen over two reports
            status = StatusResponse(1, (DataflowStatus(index, True, steps=steps, last_step_ms=400),))
            controller.metrics.observe_status("main", "r1", status)
        standby = Catalog.open(controller.catalog_url)
        standby.register_standby(ControllerSpec("s1", "127.0.0.1:6877", "h", 2, None))
        standby.close()
        address = controller.http.start("127.0.0.1:0")
        scraped = await asyncio.to_thread(scrape, address)  # the scrape reads state on this loop

        def unreachable():
            raise OSError("the catalog is unreachable")

        controller.catalog.leadership = unreachable
        without_catalog = await asyncio.to_thread(scrape, address)
        await asyncio.to_thread(controller.http.close)
        await _stop(controller)
        return {"scraped": scraped, "index": index, "now": now, "without_catalog": without_catalog}

    result = asyncio.run(run())
    scraped, index = result["scraped"], result["index"]
    main, r1 = frozenset({("instance", "main")}), frozenset({("instance", "main"), ("replica", "r1")})
    collection = r1 | {("collection", index)}
    assert (scraped[("tandem_controller_epoch", frozenset())], scraped[("tandem_standbys", frozenset())]) == (1, 1)
    assert ("tandem_lease_remaining_seconds", frozenset()) not in scraped  # it took the epoch without a lease
    # An unreachable catalog costs the leadership samples, not the scrape.
    assert result["without_catalog"][("tandem_controller_epoch", frozenset())] == 1
    assert ("tandem_standbys", frozenset()) not in result["without_catalog"]
    assert scraped[("tandem_history_commands", main)] >= 4
    assert scraped[("tandem_history_pushes_total", main)] >= 4
    assert scraped[("tandem_write_frontier_ms", collection)] == result["now"] - 3_000
    assert 3.0 <= scraped[("tandem_wallclock_lag_seconds", collection)] < 60
    assert scraped[("tandem_hydrated", collection)] == 1.0
    assert scraped[("tandem_hydration_seconds", collection)] >= 0
    assert scraped[("tandem_replica_failures_total", r1)] == 0
    assert scraped[("tandem_durable_backlog", main)] >= 0
    assert scraped[("tandem_peeks_total", main | {("replica", "r1"), ("outcome", "rows")})] == 1
    assert scraped[("tandem_peeks_total", main | {("replica", ""), ("outcome", "timeout")})] == 1
    assert scraped[("tandem_peek_seconds_count", main)] == 2
    steps = r1 | {("dataflow", "a")}
    assert scraped[("tandem_step_seconds_count", steps)] == 3
    assert scraped[("tandem_step_seconds_sum", steps)] == 3 * 0.4
