"""The data plane on Spark: hydration, append latency and memory against source size.

    .venv/bin/python bench/dataplane_bench.py [--sizes 10000,100000,1000000,10000000]

For each size, a fresh controller with one replica (`xsmall` by default: local[1], a
512 MB driver), a 3-column source (id, one of 100 regions, amount) loaded through the
client, and two dataflows:
- `totals`: `SELECT region, count(*), sum(amount), avg(amount) ... GROUP BY region`,
  indexed on the region;
- `big`: a filter/projection materialized view (about half the rows).
Printed per size: hydration time of each (create to first strict read / sink caught
up), per-append latency (100 rows, 30 of them retractions: append to a strict peek
that sees them, and to the view's frontier passing them) p50/p99, and the peak resident
memory of the replica's Python process and of its JVM.

Then the physical floor for hydration: `spark.read.parquet(files).groupBy(region).agg(...)`
in a fresh local[2] / 1 GB session over the same batch files, beside the `totals`
hydration on a `small` replica (the goal: within 2x).

The predecessor path (whole snapshots through the driver) is not kept: its figures are
in the issue (0.33 s / 0.76 s per append at 10k / 100k, OutOfMemoryError at 1M).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    SALES,
    Peak,
    change,
    controller,
    hydrated,
    jvm_of,
    load,
    log,
    p50_p99,
    replica_pid,
    write_frontier,
)

TOTALS = "SELECT region, count(*) AS n, sum(amount) AS total, avg(amount) AS mean FROM sales GROUP BY region"
BIG = "SELECT id, region, amount * 2 AS doubled FROM sales WHERE amount >= 50"


def run_size(root: Path, rows: int, size: str, appends: int) -> dict:
    with controller(root) as client:
        client.create_instance("bench")
        client.add_replica("bench", "r1", size=size)
        pid = replica_pid(client, "bench")
        jvm = jvm_of(pid)
        peak = Peak(lambda: {"python": pid, "jvm": jvm})
        client.create_source("sales", SALES)
        started = time.monotonic()
        load(client, "sales", rows)
        log(f"{rows:,} rows loaded in {time.monotonic() - started:.1f} s")

        started = time.monotonic()
        client.create_dataflow("bench", "totals", TOTALS, index_key=["region"])
        client.peek("bench", "totals", key="r1", consistency="strict", timeout_ms=3_600_000)
        hydrate_totals = time.monotonic() - started
        started = time.monotonic()
        client.create_dataflow("bench", "big", BIG, materialize=True)
        wait_for(lambda: hydrated(client, "bench", "big"), 3600)
        hydrate_big = time.monotonic() - started
        log(f"hydrated: totals {hydrate_totals:.1f} s, big {hydrate_big:.1f} s")

        index_latency, view_latency = [], []
        for step in range(appends):
            appended = change(rows, step)  # made before the clock starts
            started = time.monotonic()
            t = client.append("sales", appended)
            client.peek("bench", "totals", key="r1", consistency="strict", timeout_ms=600_000)
            index_latency.append(time.monotonic() - started)
            wait_for(lambda: (w := write_frontier(client, "bench", "big")) is not None and w > t, 600)
            view_latency.append(time.monotonic() - started)
        memory = peak.stop()
        strategies = {d.name: d.strategy for d in client.list_dataflows("bench")}
    return dict(
        rows=rows,
        hydrate_totals=hydrate_totals,
        hydrate_big=hydrate_big,
        index=p50_p99(index_latency),
        view=p50_p99(view_latency),
        python=memory.get("python", 0),
        jvm=memory.get("jvm", 0),
        strategies=strategies,
    )


def wait_for(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the materialized view did not catch up")
        time.sleep(0.02)


def floor(root: Path, rows: int) -> tuple[float, float]:
    """(hydration of `totals` on a `small` replica, the same aggregation as a plain Spark
    job in a fresh local[2] / 1 GB session over the same files)."""
    with controller(root) as client:
        client.create_instance("bench")
        client.add_replica("bench", "r1", size="small")
        replica_pid(client, "bench")
        client.create_source("sales", SALES)
        loaded = load(client, "sales", rows)
        started = time.monotonic()
        client.create_dataflow("bench", "totals", TOTALS, index_key=["region"])
        client.peek("bench", "totals", key="r1", consistency="strict", timeout_ms=3_600_000)
        tandem = time.monotonic() - started
        files = [str(p) for p in (root / "blobs").glob("u*/*.parquet")]
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    session = (
        SparkSession.builder.master("local[2]").config("spark.driver.memory", "1g")
        .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "4").getOrCreate()
    )
    started = time.monotonic()
    frame = session.read.parquet(*files).where(F.col("_time") <= loaded)
    frame.groupBy("region").agg(F.count("*"), F.sum("amount"), F.avg("amount")).collect()
    spark = time.monotonic() - started
    session.stop()
    return tandem, spark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000,10000000")
    parser.add_argument("--size", default="xsmall", help="the replica size (default xsmall)")
    parser.add_argument("--appends", type=int, default=20)
    parser.add_argument("--floor-rows", type=int, default=10_000_000, help="rows for the hydration floor (0: skip)")
    args = parser.parse_args()
    results = []
    for rows in [int(s) for s in args.sizes.split(",")]:
        with tempfile.TemporaryDirectory(prefix="tandem-dataplane-") as root:
            log(f"size {rows:,}")
            results.append(run_size(Path(root), rows, args.size, args.appends))
    print(f"\n## Data plane, one {args.size} replica, {args.appends} appends of 100 rows (30 retractions)\n")
    print("| rows | hydration: GROUP BY index / filter view | append -> strict peek p50/p99 | append -> view frontier p50/p99 | peak RSS Python / JVM |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['rows']:,} | {r['hydrate_totals']:.1f} s / {r['hydrate_big']:.1f} s | {r['index']} | {r['view']} "
            f"| {r['python']:.0f} / {r['jvm']:.0f} MB |"
        )
    print(f"\nstrategies: {results[-1]['strategies']}")
    if len(results) > 1:
        print(f"Python RSS at {results[-1]['rows']:,} rows / at {results[0]['rows']:,}: {results[-1]['python'] / results[0]['python']:.2f}x")
    if args.floor_rows:
        with tempfile.TemporaryDirectory(prefix="tandem-floor-") as root:
            tandem, spark = floor(Path(root), args.floor_rows)
        print(f"\nhydration of the GROUP BY over {args.floor_rows:,} rows on a small replica: {tandem:.1f} s; "
              f"spark.read.parquet(...).groupBy(...).agg(...) in a fresh local[2] session: {spark:.1f} s ({tandem / spark:.2f}x)")


if __name__ == "__main__":
    main()
