"""Subscription latency: from an append returning to the update arriving at a subscriber.

    .venv/bin/python bench/subscribe_bench.py                  # about 11 minutes
    .venv/bin/python bench/subscribe_bench.py --gap 0.5        # appends faster than steps

A controller (`tandem serve`, embedded defaults) with `xsmall` replicas (local[1],
512m); a source `sales(id BIGINT NOT NULL, region STRING, amount DOUBLE)` loaded with
10,000 rows over 100 regions; a dataflow of `select region, sum(amount) as total,
count(*) as n from sales group by region`, either materialized and indexed on region
(the "view" feed reads the view from storage) or indexed only (the "index" feed comes
from the replicas, each time forwarded once by the controller), one per run: two on
these `xsmall` replicas would saturate the machine's two cores. A subscriber follows it
with `Client.subscribe` on a thread. Then `--appends` appends, one every `--gap` seconds (default 2), each 10 inserts
and the retraction of 5 rows the append before inserted; the latency of an append is from its call returning (its timestamp
known) to the first batch whose updates carry that timestamp arriving at the client.
Three runs side by side: 1 replica; 2 replicas; 2 replicas with one killed (SIGKILL)
a quarter of the way in (the latencies of the appends from the kill until the killed
replica is back in sync are shown apart, as "during the kill").
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from _common import SALES, log, p50_p99, sales_rows

from controller._process import ControllerProcess, kill_replicas, wait_until
from controller.client import Client

TOTALS = "select region, sum(amount) as total, count(*) as n from sales group by region"
ROWS = 10_000


FEEDS = ("view", "index")  # how the feed of `totals` is read: its materialized view, or its index


class Subscriber:
    """Notes when each timestamp's first update arrives."""

    def __init__(self, address: str, name: str) -> None:
        self.arrived: dict[int, float] = {}
        self._client = Client.connect(address)
        self._feed = self._client.subscribe("main", name)
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        try:
            for batch in self._feed:
                now = time.monotonic()
                for t in set(batch.updates.column("_time").to_pylist()):
                    self.arrived.setdefault(t, now)
        except Exception:
            pass  # closed

    def close(self) -> None:
        self._client.close()


def run(data_dir: Path, feed: str, replicas: int, appends: int, gap_s: float, kill: bool) -> tuple[list[float], list[float]]:
    """(latencies in steady state, latencies while a killed replica was away)."""
    controller = ControllerProcess(data_dir)
    try:
        with Client.connect(controller.address) as client:
            client.create_instance("main")
            for n in range(replicas):
                client.add_replica("main", f"r{n + 1}", size="xsmall")
            client.create_source("sales", SALES)
            client.append("sales", sales_rows(0, ROWS, seed=1))
            client.create_dataflow("main", "totals", TOTALS, index_key=["region"], materialize=feed == "view")
            client.peek("main", "totals", key="r1", consistency="strict", timeout_ms=180_000)
            wait_until(lambda: all(r.in_sync for r in client.status("main")[0].replicas), 180, "replicas in sync")
            subscriber = Subscriber(controller.address, "totals")
            wait_until(lambda: subscriber.arrived, 60, "the snapshot")
            appended: list[tuple[int, float]] = []
            killed_at = back_at = None
            victim = None
            previous: list[dict] = []
            for n in range(appends):
                if kill and n == appends // 4:
                    victim = client.status("main")[0].replicas[0]
                    os.kill(victim.pid, signal.SIGKILL)
                    killed_at = time.monotonic()
                inserts = sales_rows(ROWS + 10 * n, 10, seed=100 + n).to_pylist()
                rows = inserts + [{**r, "_diff": -1} for r in previous[:5]]  # half of the last append's
                previous = inserts
                t = client.append("sales", rows)
                appended.append((t, time.monotonic()))
                if victim is not None and back_at is None:
                    now = next(r for r in client.status("main")[0].replicas if r.name == victim.name)
                    if now.in_sync and now.epoch > victim.epoch:
                        back_at = time.monotonic()
                time.sleep(gap_s)
            wait_until(lambda: all(t in subscriber.arrived for t, _ in appended), 120, "every append in the feed")
            subscriber.close()
            steady, during = [], []
            for t, at in appended:
                latency = subscriber.arrived[t] - at
                away = killed_at is not None and at >= killed_at and (back_at is None or at <= back_at)
                (during if away else steady).append(latency)
            if kill:
                log(f"killed {victim.name}; back in sync after {'-' if back_at is None else f'{back_at - killed_at:.1f} s'}")
            return steady, during
    finally:
        controller.stop()
        kill_replicas(data_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--appends", type=int, default=30)
    parser.add_argument("--gap", type=float, default=2.0, help="seconds between appends (default: %(default)s)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-subscribe-bench-") as root:
        for feed in FEEDS:
            for label, replicas, kill in (("1 replica", 1, False), ("2 replicas", 2, False), ("2 replicas, one killed", 2, True)):
                log(f"{feed} feed, {label}: {args.appends} appends")
                data_dir = Path(root) / f"{feed}_{label.replace(' ', '_').replace(',', '')}"
                rows.append((label, feed, *run(data_dir, feed, replicas, args.appends, args.gap, kill)))
    print(f"\nappend -> update at the subscriber, p50 / p99 ({args.appends} appends, one per {args.gap} s, 15 rows each)")
    print(f"{'run':<24} {'feed':<6} {'steady':>16} {'during the kill':>18}")
    for label, feed, steady, during in rows:
        print(f"{label:<24} {feed:<6} {p50_p99(steady):>16} {p50_p99(during) if during else '-':>18}")


if __name__ == "__main__":
    main()
