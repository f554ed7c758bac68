"""Many times in one step, with real processes (DESIGN section 10, "Times are data").

A burst of 200 appends lands while the one replica is stopped (SIGSTOP on its process
group, the JVM included). Continued, it catches up in a few steps, not 200; yet every
one of those times has its version: a peek at each equals an independent recompute
(pyarrow over the storage snapshot at that time), and a subscription opened before the
burst delivers each time once, in time order, with exactly that time's changes.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from catalog import Catalog
from controller._process import ControllerProcess, kill_replicas, wait_until
from controller.client import Client, TandemError
from storage import Storage

pytestmark = pytest.mark.spark

SCHEMA = "id BIGINT NOT NULL, k STRING, v BIGINT"
SQL = "SELECT k, count(*) AS n, sum(v) AS total FROM events GROUP BY k"
BURST = 200


def _append(client: Client, i: int) -> int:
    """Append `i` of the burst: two new rows, and from the tenth on a retraction of an
    earlier one, so groups grow, shrink and vanish."""
    rows = [{"id": 2 * i, "k": f"g{i % 7}", "v": i}, {"id": 2 * i + 1, "k": f"g{i % 3}", "v": -i}]
    if i >= 10 and i % 2 == 0:
        j = i - 10
        rows.append({"id": 2 * j, "k": f"g{j % 7}", "v": j, "_diff": -1})
    return client.append("events", rows)


def _expected(updates: pa.Table, time: int) -> list[tuple]:
    """The query at `time`, recomputed with pyarrow from the source's updates."""
    live = updates.filter(pc.less_equal(updates["_time"], time))
    counts: Counter = Counter()
    totals: Counter = Counter()
    for k, v, diff in zip(live["k"].to_pylist(), live["v"].to_pylist(), live["_diff"].to_pylist()):
        counts[k] += diff
        totals[k] += v * diff
    return sorted((k, counts[k], totals[k]) for k in counts if counts[k])


def _rows(table: pa.Table) -> list[tuple]:
    return sorted((row["k"], row["n"], row["total"]) for row in table.to_pylist())


def test_a_burst_while_the_replica_is_stopped_is_caught_up_in_a_few_steps_with_every_time_computed(tmp_path) -> None:
    data = tmp_path / "data"
    controller = ControllerProcess(data, serve_args=["--http-listen", "off"])
    try:
        with Client.connect(controller.address) as client:
            client.create_instance("burst")
            client.add_replica("burst", "r1", size="small")
            client.create_source("events", SCHEMA)
            client.append("events", [{"id": -1, "k": "g0", "v": 0}])
            # Its versions stay readable for the peeks at every time of the burst below.
            client.create_dataflow("burst", "totals", SQL, index_key=["k"], compaction_window_ms=600_000)
            start = client.peek("burst", "totals", consistency="strict", timeout_ms=300_000).timestamp
            feed = client.subscribe("burst", "totals", as_of=start, snapshot=False, progress=True)
            delivered: list[pa.Table] = []
            last_progress = [start]

            def read() -> None:
                try:
                    for batch in feed:
                        if batch.updates.num_rows:
                            delivered.append(batch.updates)
                        if batch.progress is not None:
                            last_progress[0] = batch.progress
                except TandemError:
                    pass  # the controller is gone: the test has read what it needs

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            replica = next(r for r in client.status("burst")[0].replicas if r.name == "r1")
            steps_before = replica.dataflows["totals"].steps
            os.killpg(replica.pid, signal.SIGSTOP)
            try:
                times = [_append(client, i) for i in range(BURST)]
            finally:
                os.killpg(replica.pid, signal.SIGCONT)
            answer = client.peek("burst", "totals", consistency="strict", timeout_ms=300_000)
            assert answer.timestamp >= times[-1]
            wait_until(lambda: last_progress[0] >= times[-1], 120, "the subscription to pass the burst")

            def caught_up():
                # The status a replica reports lags its steps by a heartbeat or so.
                replica = next(r for r in client.status("burst")[0].replicas if r.name == "r1")
                dataflow = replica.dataflows["totals"]
                return dataflow if dataflow.steps > steps_before and dataflow.pending_times == 0 else None

            dataflow = wait_until(caught_up, 60, "r1's status to show the burst caught up")
            # The advancer's ticks are times too (one a step once caught up): a few more.
            assert dataflow.steps - steps_before <= 10, f"caught up in a few steps, not {BURST}: {dataflow.steps - steps_before}"
            catalog = Catalog.open(f"sqlite:///{data / 'catalog.db'}")
            try:
                source = catalog.collection_by_name("events").id
                since = catalog.manifest(source).collection.since.time
                updates = Storage(catalog, data / "blobs").read_changes(source, since - 1, times[-1])
            finally:
                catalog.close()
            for time in times:
                at = client.peek("burst", "totals", timestamp=time, timeout_ms=60_000)
                assert _rows(at.table) == _expected(updates, time), f"the version at {time}"
    finally:
        controller.kill()
        kill_replicas(data)
    by_time: dict[int, list[tuple]] = {}
    for chunk in delivered:
        for row in chunk.to_pylist():
            by_time.setdefault(row["_time"], []).append((row["k"], row["n"], row["total"], row["_diff"]))
    chunk_times = [row["_time"] for chunk in delivered for row in chunk.to_pylist()]
    assert chunk_times == sorted(chunk_times), "in time order"
    before = _expected(updates, start)
    for time in times:
        after = _expected(updates, time)
        expected = sorted([(*row, -1) for row in set(before) - set(after)] + [(*row, 1) for row in set(after) - set(before)])
        assert sorted(by_time.pop(time, [])) == expected, f"the changes at {time}, once"
        before = after
    assert not by_time, f"changes at times the burst has none: {sorted(by_time)}"
