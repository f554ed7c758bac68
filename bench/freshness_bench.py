"""Freshness: how long a change takes to show, incremental against recompute, and the
Spark Structured Streaming peer, against source size; and TPC-H after a change.

    .venv/bin/python bench/freshness_bench.py [--sizes 10000,100000,1000000,10000000]
        [--appends 10] [--only shapes|streaming|tpch] [--strategies incremental,recompute]
        [--shapes abc] [--tpch-sf 0.1] [--tpch-queries q1,q3,...] [--tpch-strategies auto,recompute]
        [--tpch-changes 1]

Shapes, on one `small` replica (local[2], 1 GB), over a source `sales` (id, one of 100
regions, amount) of each size and a dimension `regions` (100 rows: region -> one of 10
zones):
- (a) `SELECT region, count(*), sum(amount), avg(amount) FROM sales GROUP BY region`,
  indexed on the region;
- (b) `sales JOIN regions ... GROUP BY zone` with counts and sums, indexed on the zone;
- (c) a filter/projection materialized view.
Each append is 100 rows, 30 of them retractions. Latency: from the append (its rows
made already) to a strict peek that sees it ((a), (b)), or to the view's write frontier
passing it ((c)); p50/p99.
The three run together (`--shapes` picks some: `a` alone is the like-for-like peer of
Structured Streaming, which keeps that one query), first all incremental, then all with
`strategy="recompute"` (the whole query at every change), on the same data.

Structured Streaming: the same aggregation as (a), as a Spark user would keep it fresh
(a file source over Parquet, `sum(amount * _diff)`, `sum(_diff)`, update mode, the
fastest trigger) in a local[2] / 1 GB session; latency from a change file's arrival to
the end of the micro-batch that read it.

TPC-H: the 22 standard queries (or those `--tpch-queries` names) at `--tpch-sf` on two
`small` replicas, each as a dataflow with an index; after a 1,000-row change to
`lineitem` (half retractions), the time until each answers at the change's timestamp.
`--tpch-changes N` makes N changes one after the other, the change and its undo in
turn: a step that grows with the number of changes shows. The first change is made once
both replicas have hydrated every query, each later one once both have computed the one
before (the goal is of a change, not of changes coming faster than the replicas compute
them, nor of a replica still hydrating), and the time until both have is printed too:
each answer is the first replica's, and the replicas take waiting steps in opposite
orders of cost (`replica_service._step_pool`). `--tpch-strategies auto,recompute` runs
the whole of it twice, once with every query forced to recompute, and prints the two
side by side.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import SALES, change, controller, hydrated, load, log, p50_p99, pct, replica_pid, sales_rows, wait_until, write_frontier  # noqa: E402

REGIONS = "region STRING, zone STRING"
SHAPES = {
    "a": "SELECT region, count(*) AS n, sum(amount) AS total, avg(amount) AS mean FROM sales GROUP BY region",
    "b": (
        "SELECT r.zone, count(*) AS n, sum(s.amount) AS total, max(s.amount) AS top "
        "FROM sales s JOIN regions r ON s.region = r.region GROUP BY r.zone"
    ),
    "c": "SELECT id, region, amount * 2 AS doubled FROM sales WHERE amount >= 50",
}
KEYS = {"a": ("region", "r1"), "b": ("zone", "z1")}


def regions() -> pa.Table:
    return pa.table({"region": [f"r{i}" for i in range(100)], "zone": [f"z{i % 10}" for i in range(100)]})


def shapes(root: Path, rows: int, appends: int, strategies: list[str], chosen: str = "abc") -> dict[str, dict[str, list[float]]]:
    """Per strategy, per shape of `chosen`: the latency of each append."""
    chosen_shapes = {shape: sql for shape, sql in SHAPES.items() if shape in chosen}
    keyed = {shape: key for shape, key in KEYS.items() if shape in chosen}
    latencies: dict[str, dict[str, list[float]]] = {}
    with controller(root) as client:
        client.create_instance("bench")
        client.add_replica("bench", "r1", size="small")
        replica_pid(client, "bench")
        client.create_source("sales", SALES)
        client.create_source("regions", REGIONS)
        client.append("regions", regions())
        load(client, "sales", rows)
        step = 0
        for strategy in strategies:
            names = {shape: f"{shape}_{strategy}" for shape in chosen_shapes}
            for shape, sql in chosen_shapes.items():
                options = {"index_key": [KEYS[shape][0]]} if shape in KEYS else {"materialize": True}
                view = client.create_dataflow("bench", names[shape], sql, strategy=strategy, **options)
                log(f"{view.name}: {view.strategy}")
            started = time.monotonic()
            for shape, (_, key) in keyed.items():
                client.peek("bench", names[shape], key=key, consistency="strict", timeout_ms=3_600_000)
            if "c" in names:
                wait_until(lambda: hydrated(client, "bench", names["c"]), 3600, f"{names['c']} hydrated")
            log(f"{rows:,} rows, {strategy}: hydrated in {time.monotonic() - started:.1f} s")
            samples = {shape: [] for shape in chosen_shapes}
            for _ in range(appends):
                # Made before the clock starts, as Structured Streaming's file is: regenerating the
                # retracted rows alone took 50-90 ms at 10M rows.
                appended = change(rows, step)
                started = time.monotonic()
                t = client.append("sales", appended)
                step += 1
                for shape, (_, key) in keyed.items():
                    client.peek("bench", names[shape], key=key, consistency="strict", timeout_ms=600_000)
                    samples[shape].append(time.monotonic() - started)
                if "c" in names:
                    wait_past(client, names["c"], t)
                    samples["c"].append(time.monotonic() - started)
            latencies[strategy] = samples
            for name in names.values():
                client.drop_dataflow("bench", name)
    return latencies


def wait_past(client, name: str, t: int, timeout: float = 3600) -> None:
    deadline = time.monotonic() + timeout
    while (w := write_frontier(client, "bench", name)) is None or w <= t:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not pass {t}")
        time.sleep(0.02)


def streaming(root: Path, rows: int, appends: int) -> list[float]:
    """Structured Streaming's micro-batch latency for aggregation (a)."""
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F
    from pyspark.sql.streaming import StreamingQueryListener

    source = root / "input"
    source.mkdir()
    for start in range(0, rows, 500_000):
        batch = sales_rows(start, min(500_000, rows - start), seed=1 + start)
        pq.write_table(batch.append_column("_diff", pa.array([1] * batch.num_rows, pa.int64())), source / f"load-{start}.parquet")
    session = (
        SparkSession.builder.master("local[2]").config("spark.driver.memory", "1g").config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4").config("spark.sql.streaming.stateStore.providerClass",
        "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider").getOrCreate()
    )
    ended: list[tuple[float, int]] = []

    class Ends(StreamingQueryListener):
        def onQueryStarted(self, event):
            pass

        def onQueryProgress(self, event):
            ended.append((time.time(), event.progress.numInputRows))

        def onQueryIdle(self, event):
            pass

        def onQueryTerminated(self, event):
            pass

    session.streams.addListener(Ends())
    stream = session.readStream.schema("id BIGINT, region STRING, amount DOUBLE, _diff BIGINT").parquet(str(source))
    totals = stream.groupBy("region").agg(F.sum("_diff").alias("n"), F.sum(F.col("amount") * F.col("_diff")).alias("total"))
    query = (
        totals.writeStream.outputMode("update").format("memory").queryName("totals")
        .option("checkpointLocation", str(root / "checkpoint")).trigger(processingTime="0 seconds").start()
    )
    deadline = time.monotonic() + 3600
    while not any(n > 0 for _, n in ended):
        if time.monotonic() > deadline:
            raise TimeoutError("the stream did not read its input")
        time.sleep(0.05)
    log(f"structured streaming: {rows:,} rows read")
    samples = []
    for step in range(appends):
        staged = root / f"change-{step}.parquet"
        pq.write_table(change(rows, step).select(["id", "region", "amount", "_diff"]), staged)
        seen = len(ended)
        arrived = time.time()
        staged.rename(source / staged.name)  # atomic: the source never sees half a file
        while not any(n > 0 for _, n in ended[seen:]):
            time.sleep(0.005)
        samples.append(next(at for at, n in ended[seen:] if n > 0) - arrived)
    query.stop()
    session.stop()
    return samples


def tpch(root: Path, sf: float, names: list[str], strategy: str = "auto", changes: int = 1) -> list[tuple[str, str, list[float], bool]]:
    """(query, strategy, seconds from each lineitem change to its answer at that time,
    whether its last answer is Spark's over the changed tables), for the TPC-H queries
    `names`, each created with `strategy`; `changes` changes, the change and its undo in
    turn."""
    import tpch as benchmark

    queries = {name: benchmark.QUERIES[name] for name in names}

    tables = benchmark.generate(sf)
    with controller(root) as client:
        client.create_instance("tpch")
        for name in ("r1", "r2"):
            client.add_replica("tpch", name, size="small")
        benchmark.load(client, tables)
        strategies = {}
        started = time.monotonic()
        for name, sql in queries.items():
            created = time.monotonic()
            view = client.create_dataflow("tpch", name, sql, index_key=[], strategy=strategy)
            strategies[name] = view.strategy
            log(f"{name}: {view.strategy}, created in {time.monotonic() - created:.2f} s")
        log(f"TPC-H SF {sf}: all {len(queries)} created in {time.monotonic() - started:.1f} s (the controller plans each)")
        started = time.monotonic()
        for name in queries:
            client.peek("tpch", name, consistency="strict", timeout_ms=3_600_000)
        log(f"TPC-H SF {sf}: all {len(queries)} hydrated in {time.monotonic() - started:.0f} s")
        # Answers come from the first replica to hydrate; the first change waits for the
        # other too, as each change waits for both to compute the one before.
        wait_until(lambda: hydrated(client, "tpch", *queries), 3600, "both replicas hydrated")
        log(f"TPC-H SF {sf}: both replicas hydrated all {len(queries)} after {time.monotonic() - started:.0f} s")
        lineitem_change = benchmark.lineitem_change(tables, 1000, seed=7)
        diff = benchmark.DIFF
        lineitem_undo = lineitem_change.set_column(lineitem_change.schema.get_field_index(diff), diff, pc.negate(lineitem_change[diff]))
        results: dict[str, list[float]] = {name: [] for name in queries}
        answers: dict[str, pa.Table] = {}
        changed = [name for name, sql in queries.items() if "lineitem" in sql]
        for number in range(changes):
            steps = _steps(client, changed)
            started = time.monotonic()
            client.append("lineitem", lineitem_undo if number % 2 else lineitem_change)

            def wait(name: str, started: float = started) -> None:
                from controller.client import Client

                with Client.connect(client.address) as own:
                    answers[name] = own.peek("tpch", name, consistency="strict", timeout_ms=3_600_000).table
                results[name].append(time.monotonic() - started)

            threads = [threading.Thread(target=wait, args=(name,)) for name in queries]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            answered = max(r[-1] for r in results.values())
            wait_until(lambda before=steps: all(now > before[key] for key, now in _steps(client, changed).items()), 3600, "both replicas' steps")
            log(f"change {number + 1} of {changes}: all {len(queries)} answered after {answered:.1f} s, both replicas done after {time.monotonic() - started:.1f} s")
    # Spark's own answers over the tables after the last change, after the replicas stopped.
    session = benchmark._spark_session(root / "check")
    benchmark._register(session, benchmark.apply_change(tables, lineitem_change) if changes % 2 else tables)
    same = {name: _rows(answers[name]) == _rows(benchmark._run(session, name)[0]) for name in queries}
    session.stop()
    return [(name, strategies[name], results[name], same[name]) for name in queries]


def _steps(client, names: list[str]) -> dict[tuple[str, str], int]:
    """The steps each replica has computed of each dataflow of `names`, by (replica,
    dataflow), as their last status reports (every heartbeat: 500 ms by default)."""
    replicas = client.status("tpch")[0].replicas
    return {(r.name, name): r.dataflows[name].steps for r in replicas for name in names}


def _rows(table: pa.Table) -> list[tuple]:
    """A result's rows in a canonical order (a peek sorts them; Spark, by the query)."""
    return sorted((tuple(row.values()) for row in table.to_pylist()), key=repr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000,10000000")
    parser.add_argument("--appends", type=int, default=10)
    parser.add_argument("--only", choices=["shapes", "streaming", "tpch"])
    parser.add_argument("--strategies", default="incremental,recompute", help="of the shapes, side by side")
    parser.add_argument("--shapes", default="abc", help="which shapes run, together (a alone: the like-for-like peer of Structured Streaming)")
    parser.add_argument("--tpch-sf", type=float, default=0.1)
    parser.add_argument("--tpch-queries", default=",".join(f"q{i}" for i in range(1, 23)))
    parser.add_argument("--tpch-strategies", default="auto", help="auto,recompute: both, one after the other, side by side")
    parser.add_argument("--tpch-changes", type=int, default=1, help="changes one after the other: the change, its undo, ...")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    table = {}
    if args.only in (None, "shapes"):
        for rows in sizes:
            with tempfile.TemporaryDirectory(prefix="tandem-fresh-") as root:
                table[rows] = shapes(Path(root), rows, args.appends, args.strategies.split(","), args.shapes)
    peer = {}
    if args.only in (None, "streaming"):
        for rows in sizes:
            with tempfile.TemporaryDirectory(prefix="tandem-stream-") as root:
                peer[rows] = streaming(Path(root), rows, args.appends)
    if table or peer:
        print(f"\n## Freshness, one small replica, {args.appends} appends of 100 rows (30 retractions), p50 / p99\n")
        print("| rows | (a) GROUP BY incr. | (a) recompute | (b) join+GROUP BY incr. | (b) recompute | (c) view incr. | (c) recompute | Structured Streaming (a) |")
        print("|---|---|---|---|---|---|---|---|")
        for rows in sizes:
            r = table.get(rows, {})
            cells = [p50_p99(r.get(s, {}).get(shape, [])) for shape in "abc" for s in ("incremental", "recompute")]
            print(f"| {rows:,} | {' | '.join(cells)} | {p50_p99(peer.get(rows, []))} |")
        incremental = [rows for rows in sizes if "incremental" in table.get(rows, {})]
        if len(incremental) > 1:
            low, high = incremental[0], incremental[-1]
            for shape in [shape for shape in "ab" if shape in args.shapes]:
                ratio = pct(table[high]["incremental"][shape], 50) / pct(table[low]["incremental"][shape], 50)
                print(f"({shape}) incremental p50 at {high:,} / at {low:,}: {ratio:.2f}x")
        for rows in sizes:
            if {"incremental", "recompute"} <= set(table.get(rows, {})):
                for shape in [shape for shape in "ab" if shape in args.shapes]:
                    speedup = pct(table[rows]["recompute"][shape], 50) / pct(table[rows]["incremental"][shape], 50)
                    print(f"({shape}) at {rows:,}: recompute / incremental p50 = {speedup:.1f}x")
    if args.only in (None, "tpch"):
        runs = {}
        for strategy in args.tpch_strategies.split(","):
            with tempfile.TemporaryDirectory(prefix="tandem-tpch-") as root:
                runs[strategy] = tpch(Path(root), args.tpch_sf, args.tpch_queries.split(","), strategy, args.tpch_changes)
        print(f"\n## TPC-H SF {args.tpch_sf}, two small replicas: a 1,000-row lineitem change to every answer ({args.tpch_changes} changes)\n")
        print(f"| query | strategy | {' | '.join(f'seconds ({s})' for s in runs)} | answer is Spark's |")
        print(f"|---|---|{'---|' * len(runs)}---|")
        first = next(iter(runs.values()))
        for i, (name, strategy, _, _) in enumerate(first):
            same = all(answers[i][3] for answers in runs.values())
            cells = (", ".join(f"{s:.1f}" for s in answers[i][2]) for answers in runs.values())
            print(f"| {name} | {strategy} | {' | '.join(cells)} | {'yes' if same else 'NO'} |")
        for run, answers in runs.items():
            def slowest(rows) -> str:  # the last answer to each change
                return ", ".join(f"{max(column):.1f}" for column in zip(*(seconds for _, _, seconds, _ in rows)))

            incremental = [row for row in answers if row[1] == "incremental"]
            maintained = f"the {len(incremental)} incremental ones reflect it after {slowest(incremental)} s; " if incremental else ""
            print(
                f"\n{run}: {maintained}all {len(answers)} after {slowest(answers)} s; "
                f"{sum(same for *_, same in answers)} of {len(answers)} last answers are Spark's"
            )


if __name__ == "__main__":
    main()
