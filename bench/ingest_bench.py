"""Ingest alone: how many 50-row appends a controller accepts from concurrent writers
(issue 48's goal: 1,000 appends/s from 8 client threads, on SQLite and on PostgreSQL).

    .venv/bin/python bench/ingest_bench.py [--threads 1,8] [--seconds 15] [--catalog sqlite,postgres]

A `tandem serve` with no instance (so no replica competes for the cores), one source,
and per catalog and thread count: that many client threads in this process, each with
its own connection, appending 50-row Arrow tables one after the other (each with its
own idempotency key, as the client sends) for `--seconds`. Printed: appends
acknowledged per second, each append's latency (p50 / p99), and the mean group a commit
wrote (`tandem_appends_committed` over `tandem_append_commits` from `/metrics`; the
source advancer's ticks count as commits).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import catalog_for, log, pct  # noqa: E402

from controller._process import ControllerProcess  # noqa: E402
from controller.client import Client  # noqa: E402

ROWS = 50
SCHEMA = "id BIGINT NOT NULL, region STRING, amount DOUBLE"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,8")
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--catalog", default="sqlite,postgres")
    args = parser.parse_args()
    rows = []
    for kind in args.catalog.split(","):
        with catalog_for(kind) as url, tempfile.TemporaryDirectory(prefix="tandem-ingest-") as root:
            controller = ControllerProcess(Path(root) / "data", catalog_url=url, serve_args=["--http-listen", "127.0.0.1:0"])
            try:
                with Client.connect(controller.address) as client:
                    client.create_source("events", SCHEMA)
                for threads in (int(t) for t in args.threads.split(",")):
                    rows.append((kind, threads, *_run(controller, threads, args.seconds)))
                    log(f"{kind}, {threads} thread(s): {rows[-1][2]:.0f} appends/s")
            finally:
                controller.kill()
    print(f"\n## Appends of {ROWS} rows from concurrent client threads ({args.seconds:g} s each, no replica)\n")
    print("| catalog | threads | appends/s | rows/s | latency p50 / p99 | appends per commit |")
    print("|---|---|---|---|---|---|")
    for kind, threads, rate, p50, p99, group in rows:
        print(f"| {kind} | {threads} | {rate:.0f} | {rate * ROWS:,.0f} | {p50:.1f} / {p99:.1f} ms | {group:.1f} |")


def _run(controller: ControllerProcess, threads: int, seconds: float) -> tuple[float, float, float, float]:
    """Appends/s, latency p50 and p99 (ms), and appends per commit, of `threads` writers."""
    batch = pa.table({"id": pa.array(range(ROWS), pa.int64()), "region": ["r1"] * ROWS, "amount": [1.0] * ROWS})
    stop = threading.Event()
    latencies: list[list[float]] = [[] for _ in range(threads)]

    def write(mine: list[float]) -> None:
        with Client.connect(controller.address) as client:
            while not stop.is_set():
                started = time.perf_counter()
                client.append("events", batch)
                mine.append(time.perf_counter() - started)

    before = _committed(controller)
    writers = [threading.Thread(target=write, args=(mine,)) for mine in latencies]
    started = time.perf_counter()
    for writer in writers:
        writer.start()
    time.sleep(seconds)
    stop.set()
    for writer in writers:
        writer.join()
    took = time.perf_counter() - started
    commits, appends = (now - then for now, then in zip(_committed(controller), before))
    every = [latency * 1000 for mine in latencies for latency in mine]
    return len(every) / took, pct(every, 50), pct(every, 99), appends / max(commits, 1)


def _committed(controller: ControllerProcess) -> tuple[float, float]:
    """(commits, appends committed) from the controller's `/metrics`."""
    text = urllib.request.urlopen(f"http://{controller.metrics_address}/metrics", timeout=10).read().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(("tandem_append_commits_total", "tandem_appends_committed_total")))
    return float(values["tandem_append_commits_total"]), float(values["tandem_appends_committed_total"])


if __name__ == "__main__":
    main()
