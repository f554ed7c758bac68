"""The controller with real processes: a `tandem serve` process, managed replica
processes, the Python client over real gRPC, and real failures (kill -9).

One controller and its replicas serve the whole module; tests run in file order and
build on each other's state, as an operator's session would.
"""

from __future__ import annotations

import json
import os
from collections import Counter
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from catalog import Catalog, Fenced, default_url
from controller.cli import main
from controller.client import Client, TandemError
from controller._process import ControllerProcess, kill_replicas, wait_until

pytestmark = pytest.mark.spark

SCHEMA = "id BIGINT NOT NULL, region STRING, amount DOUBLE"
CHROMIUM = shutil.which("chromium")
ROOT = Path(__file__).resolve().parent.parent
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
        (lambda: client.create_dataflow("main", "some", "select id from sales limit 3"), grpc.StatusCode.INVALID_ARGUMENT),
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


def scrape(cluster, address: str | None = None) -> dict[tuple[str, frozenset], float]:
    """The /metrics of the controller (or of the process at `address`): (sample name,
    its labels) -> value."""
    with urllib.request.urlopen(f"http://{address or cluster['controller'].metrics_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_killing_a_replica_under_peek_load_fails_no_peek(cluster):
    """Also what the metrics show meanwhile: the failure and the rehydration counted,
    the dead replica's lag rising and then falling again, reads won by the other."""
    client: Client = cluster["client"]
    victim = replicas(client)["r1"]
    errors, answers, stop = [], [], threading.Event()
    r1 = frozenset({("instance", "main"), ("replica", "r1")})
    before = scrape(cluster)
    index = next(d.index_id for d in client.list_dataflows("main") if d.name == "totals")
    lag = frozenset({("instance", "main"), ("replica", "r1"), ("collection", index)})

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
    lags = []

    def back() -> object:
        lags.append(scrape(cluster).get(("tandem_wallclock_lag_seconds", lag), 0.0))
        return (r := replicas(client)["r1"]).epoch > victim.epoch and r.in_sync and r.pid != victim.pid and r

    rehydrated = wait_until(back, 180, "r1 to be rehydrated")
    time.sleep(1)
    stop.set()
    loop.join()
    # Read once more: the last read in `back` came before its status showed r1 in sync.
    lags.append(scrape(cluster).get(("tandem_wallclock_lag_seconds", lag), 0.0))
    assert errors == []
    assert len(answers) > 10
    assert all(a.rows == answers[0].rows for a in answers)
    assert {a.replica for a in answers} >= {"r2"}
    assert rehydrated.dataflows_built >= 1
    after = scrape(cluster)
    assert after[("tandem_replica_failures_total", r1)] > before[("tandem_replica_failures_total", r1)]
    assert after[("tandem_rehydrations_total", r1)] > before[("tandem_rehydrations_total", r1)]
    assert after[("tandem_replica_in_sync", r1)] == 1.0
    assert max(lags) > 2 * lags[-1] and max(lags) > 1.0, lags  # rose while it was down, fell back
    won = frozenset({("instance", "main"), ("replica", "r2"), ("outcome", "rows")})
    assert after[("tandem_peeks_total", won)] > before.get(("tandem_peeks_total", won), 0)
    assert after[("tandem_history_commands", frozenset({("instance", "main")}))] > 0
    # The replica serves its own metrics, at the address its status gives.
    own = scrape(cluster, rehydrated.metrics_address)
    totals = frozenset({("dataflow", "totals")})
    assert own[("tandem_replica_hydrated", totals)] == 1.0 and own[("tandem_replica_dataflows", frozenset())] == 1
    assert own[("tandem_replica_step_seconds_count", totals)] >= 1 and ("tandem_replica_write_frontier_ms", totals) in own


def test_controller_kill_and_restart_reconciles_replicas(cluster, capsys):
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
    assert after["r1"].epoch >= 2  # killed and respawned earlier: its incarnation goes on, not back to 1
    for name, replica in after.items():
        assert replica.pid == before[name].pid  # the same processes, kept alive
        assert replica.dataflows_built == before[name].dataflows_built  # nothing recomputed
    result = client.peek("main", "totals", key="west", consistency="strict")
    assert result.rows == [{"region": "west", "total": 5.0, "n": 1}]

    # What happened is in the catalog's events, across the restart, and `tandem events`.
    recorded = client.events("main", limit=1_000)
    events = [(e.kind, e.replica) for e in recorded]
    assert {("replica_added", "r1"), ("replica_failed", "r1"), ("rehydrating", "r1"), ("hydrated", "r2")} <= set(events)
    after_restart = events[events.index(("took_over", "")) :]
    assert {("reconciled", "r1"), ("reconciled", "r2")} <= set(after_restart), after_restart
    # Found on the status page: the recovered instance's clock started at 0, so at the
    # first tick every replica looked silent since 1970 and was failed, then resumed.
    assert not any(kind == "replica_failed" for kind, _ in after_restart), after_restart
    assert main(["events", "--address", cluster["controller"].address, "--instance", "main", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    ids = [e["id"] for e in printed]
    assert 0 < len(printed) <= 50 and ids == sorted(ids) and ids[-1] >= recorded[-1].id  # the latest 50, oldest first
    assert all(e["instance"] == "main" and e["message"] for e in printed)


class Subscriber:
    """A client following the feed of dataflow `name` on a thread: every batch, in order."""

    def __init__(self, address: str, name: str, **options) -> None:
        self.batches: list = []
        self.error: Exception | None = None
        self._client = Client.connect(address)
        self._feed = self._client.subscribe("main", name, progress=True, **options)
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            for batch in self._feed:
                self.batches.append(batch)
        except Exception as error:  # the controller went away: the stream broke
            self.error = error

    @property
    def progress(self) -> int:
        return max((b.progress for b in self.batches if b.progress is not None), default=-1)

    def close(self) -> None:
        self._client.close()
        self._thread.join(timeout=30)


def _peek_seen_by(client: Client, subscriber: Subscriber, name: str) -> tuple[int, list[dict]]:
    """A strict peek of `name` (its time, its rows), once the feed has passed that time."""
    result = client.peek("main", name, consistency="strict", timeout_ms=60_000)
    wait_until(lambda: subscriber.progress > result.timestamp, 120, f"the feed past {result.timestamp}")
    return result.timestamp, result.rows


@pytest.mark.parametrize("name", ["totals", "totals_index"])
def test_a_feed_of_an_aggregate_survives_replica_and_controller_kills_exactly_once(cluster, name):
    """Issue 12's "done when", for a dataflow with a materialized view (read from
    storage) and for one with an index alone (each time forwarded once from whichever
    replica reports it first): the feed goes on through a replica's kill -9, is resumed
    from its last progress after the controller's kill -9, and no time is delivered
    twice; consolidated through a peek's time, it is what that peek read. (The peeks
    read the latest time, not a past progress: a materialized view's feed holds the
    view's since, not the index's.)"""
    client: Client = cluster["client"]
    if name == "totals_index":
        # The window keeps the index readable from where a client that lost its stream
        # (with the controller) resumes.
        client.create_dataflow("main", name, TOTALS, index_key=["region"], compaction_window_ms=120_000)
    subscriber = Subscriber(cluster["controller"].address, name)
    wait_until(lambda: subscriber.batches, 60, "the snapshot")
    # Both up (a run before may have killed one), so that the kill below hits a live one.
    wait_until(lambda: all(r.in_sync for r in replicas(client).values()), 180, "both replicas in sync")
    changes = [
        [{"id": 200, "region": "north", "amount": 1.5}, {"id": 201, "region": "east", "amount": 2.0}],
        [{"id": 200, "region": "north", "amount": 1.5, "_diff": -1}],  # a retraction
        [{"id": 201, "region": "east", "amount": 2.0, "_diff": -1}, {"id": 202, "region": "east", "amount": 9.0}],
    ]
    times = [client.append("sales", rows) for rows in changes[:2]]
    os.kill(replicas(client)["r1"].pid, signal.SIGKILL)  # mid-stream
    times.append(client.append("sales", changes[2]))
    checked = dict([_peek_seen_by(client, subscriber, name)])
    if name == "totals_index":  # two replicas reported the same times: one of each was dropped
        metrics = scrape(cluster)
        main = frozenset({("instance", "main")})
        assert metrics[("tandem_subscriptions", main)] == 1 and metrics[("tandem_subscribe_duplicates_total", main)] > 0

    cluster["controller"].kill()
    wait_until(lambda: subscriber.error is not None, 30, "the stream to break with the controller")
    resume_at = subscriber.progress
    subscriber.close()
    cluster["controller"] = ControllerProcess(cluster["data_dir"], log_name=f"controller-after-{name}.log")
    client = _reconnect(cluster)
    resumed = Subscriber(cluster["controller"].address, name, as_of=resume_at, snapshot=False)
    later = client.append("sales", [{"id": 203, "region": "west", "amount": 4.0}])
    checked.update([_peek_seen_by(client, resumed, name)])
    resumed.close()

    batches = subscriber.batches + resumed.batches
    delivered = [{row["_time"] for row in b.updates.to_pylist()} for b in batches]
    assert all(not (a & b) for i, a in enumerate(delivered) for b in delivered[i + 1 :])  # no time twice
    assert set().union(*delivered) >= set(times) | {later}  # every change arrived

    def feed_at(time: int) -> Counter:
        counts: Counter = Counter()
        for batch in batches:
            for row in batch.updates.to_pylist():
                if row["_time"] <= time:
                    counts[(row["region"], row["total"], row["n"])] += row["_diff"]
        return +counts

    for time, rows in checked.items():
        assert feed_at(time) == Counter((r["region"], r["total"], r["n"]) for r in rows), time


def _chromium(url: str, *options: str) -> str:
    """Load `url` in headless Chromium, letting its scripts run for a few (virtual)
    seconds; what Chromium printed."""
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=6000", *options, url]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout


def _api_status(cluster) -> dict:
    with urllib.request.urlopen(f"http://{cluster['controller'].metrics_address}/api/status", timeout=10) as response:
        return json.load(response)


def test_the_status_page_shows_replicas_lag_plots_and_events_in_a_browser(cluster, tmp_path):
    """The page as an operator sees it in a real browser. Issue 50: numbers sat under
    the neighbouring header, times were raw epoch milliseconds, an index and a
    materialized view were both just "totals", sources were missing, plots had no
    values. `TANDEM_STATUS_PAGE_PNG=docs/status-page.png` also writes the screenshot
    there (the README's)."""
    assert CHROMIUM, "the status page test needs Debian's chromium (.ci/run installs it)"
    main_lag = lambda: (status := _api_status(cluster)) and all(len(points) >= 2 for points in status["instances"][0]["lag_history"].values()) and status
    status = wait_until(main_lag, 30, "two lag samples of every collection")
    (instance,) = status["instances"]
    assert [r["name"] for r in instance["replicas"]] == ["r1", "r2"] and instance["lag_history"]
    assert any(e["kind"] == "took_over" for e in status["events"])
    (sales,) = [s for s in status["sources"] if s["name"] == "sales"]
    assert "retention window" in [h["holder"] for h in sales["holds"]]
    assert {"kind": "index", "dataflow": "totals_index"} in instance["kinds"].values()

    page = f"http://{cluster['controller'].metrics_address}/"
    dom = _chromium(page, "--dump-dom")
    assert 'data-replica="r1"' in dom and 'data-replica="r2"' in dom, dom[-2_000:]
    assert dom.count('class="lag-plot"') == len(instance["collections"])
    assert re.search(r'<polyline points="[\d.]+,[\d.]+ [\d.]+,[\d.]+', dom)  # a line through the samples
    assert re.search(r"<circle [^>]*><title>[^<]+ UTC \([^)]+\): \w+ \d+ (ms|s) behind the clock</title>", dom)  # values on hover
    assert 'data-kind="took_over"' in dom and 'data-dataflow="totals"' in dom
    # Numbers right-aligned under right-aligned headers; times readable; kinds named.
    assert '<th class="num">incarnation</th>' in dom and '<th class="num">behind clock</th>' in dom
    assert '<th class="num">steps</th>' in dom and '<td class="num">' in dom
    assert '<th class="num">times pending</th>' in dom and '<th class="num">rows pending</th>' in dom  # the backlog
    rows = re.findall(r'<tr data-collection-row="[^"]+">(.*?)</tr>', dom)
    assert len(rows) == len(instance["collections"]) and all(" UTC</span>" in row for row in rows)
    assert any("<td class=\"\">materialized view</td>" in row for row in rows) and any("<td class=\"\">index</td>" in row for row in rows)
    assert not re.search(r"\b1\d{12}\b(?! ms since)", re.sub(r'title="[^"]*"', "", dom.split("<script>")[0]))  # no raw epoch ms shown
    assert 'data-source="sales"' in dom and "retention window at" in dom
    # One self-contained file: nothing loaded from elsewhere.
    raw = (ROOT / "controller" / "status_page.html").read_text()
    assert "<link" not in raw and "<script src" not in raw and "<img" not in raw
    assert set(re.findall(r"https?://[^\s\"'`]+", raw)) <= {"http://www.w3.org/2000/svg", "http://${r.metrics_address}/metrics"}

    screenshot = tmp_path / "status-page.png"
    _chromium(page, f"--screenshot={screenshot}", "--window-size=1280,1500", "--hide-scrollbars")
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 20_000
    if os.environ.get("TANDEM_STATUS_PAGE_PNG"):
        shutil.copyfile(screenshot, os.environ["TANDEM_STATUS_PAGE_PNG"])


def test_a_second_controller_fences_the_first(cluster):
    old = Catalog.open(default_url(cluster["data_dir"]))
    old.become_controller()
    newer = Catalog.open(default_url(cluster["data_dir"]))
    newer.become_controller()
    with pytest.raises(Fenced):
        old.write_ts()
    old.close()
    newer.close()
    # The running controller was fenced too: it stops serving (a call that reaches it
    # first is UNAVAILABLE, naming the newer epoch) and exits, saying why.
    try:
        cluster["client"].create_source("late", SCHEMA)
        raise AssertionError("a fenced controller accepted a write")
    except TandemError as error:
        assert error.code == grpc.StatusCode.UNAVAILABLE
        assert "epoch" in error.message or "connect" in error.message.lower() or "went away" in error.message
    process = cluster["controller"].process
    assert process.wait(timeout=30) == 1
    assert "error: UNAVAILABLE: controller epoch" in cluster["controller"].log_path.read_text()
