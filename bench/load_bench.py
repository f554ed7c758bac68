"""Load: dataflows under steady streams of appends; their cost must follow the rows
written, not the number of writes (DESIGN section 10, "Times are data").

    .venv/bin/python bench/load_bench.py [--rates 1,10,100,1000] [--seconds 120]
        [--rows 100000] [--catalog sqlite|postgres|URL] [--only tandem|streaming]

Tandem: a controller and two `small` replicas (local[2], 1 GB each), a 100k-row source
`sales` (id, one of 100 regions, amount) and a 100-row `regions` (region -> zone), and
four dataflows over them:
- `view`: `GROUP BY region` with `count(*)` and `sum(amount)`, a materialized view;
- `index`: `GROUP BY region` with `max(amount)` and `COUNT(DISTINCT id % 1000)`, indexed;
- `filter`: a filter and projection, indexed on the id;
- `join`: `sales JOIN regions ... GROUP BY zone`, indexed.
Per rate, a steady stream of 50-row appends (new rows) from one client thread, or 8 at
1,000 appends/s, each on its own schedule (open loop: an append that is late goes at
once), held for `--seconds`. Measured: the rate achieved; every second, each dataflow's
wallclock lag (now minus its write frontier, as `tandem status` shows it), its p50,
p99 and trend (the least-squares slope over the run, and the mean of its last 30 s
less that of its first 30 s); once the stream ends, every acknowledged append checked
in storage (its 50 rows, once, at its timestamp where compaction has not moved it to
the since yet), then the time from the last acknowledged append to a strict peek
seeing it (to the view's write frontier passing it; "-" past `CATCH_UP_S`); the CPU
per row appended, in all and by part (the controller, the replicas' Python, their
JVMs); the times the replicas' last steps covered.

Structured Streaming: the `view` aggregation as a Spark user would keep it fresh (a
file source over Parquet, `count`, `sum`, update mode, the fastest trigger, RocksDB
state) in a local[2] / 1 GB session, on the same streams written as 50-row files
(renamed into place, as a producer would); lag sampled every second as now minus the
arrival of the oldest file no micro-batch has finished reading (0 when none waits),
and the time from the last file's arrival to the end of the micro-batch that read it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import SALES, catalog_for, jvm_of, load, log, pct, sales_rows, wait_until  # noqa: E402

from catalog import Catalog  # noqa: E402
from controller._process import ControllerProcess, kill_replicas  # noqa: E402
from controller.client import Client, TandemError  # noqa: E402
from storage import Storage  # noqa: E402

REGIONS = "region STRING, zone STRING"
QUERIES = {
    "view": ("SELECT region, count(*) AS n, sum(amount) AS total FROM sales GROUP BY region", {"materialize": True}),
    "index": ("SELECT region, max(amount) AS top, count(DISTINCT id % 1000) AS ids FROM sales GROUP BY region", {"index_key": ["region"]}),
    "filter": ("SELECT id, region, amount * 2 AS doubled FROM sales WHERE amount >= 50", {"index_key": ["id"]}),
    "join": (
        "SELECT r.zone, count(*) AS n, sum(s.amount) AS total FROM sales s JOIN regions r ON s.region = r.region GROUP BY r.zone",
        {"index_key": ["zone"]},
    ),
}
PEEK_KEYS = {"index": "r1", "filter": None, "join": "z1"}
APPEND_ROWS = 50
THREADS_AT = {1000: 8}  # client threads at a rate (1 below it)
WARMUP_S = 30  # the trend compares the last 30 s with the first 30 s
CATCH_UP_S = 300  # how long the dataflows may take to show the last append ("-": longer)


def regions() -> pa.Table:
    return pa.table({"region": [f"r{i}" for i in range(100)], "zone": [f"z{i % 10}" for i in range(100)]})


@dataclass
class Stream:
    """A steady stream of `rate` appends a second from `threads` threads, for `seconds`;
    `send(thread, seq, rows)` makes one and returns its timestamp (or raises)."""

    rate: float
    threads: int
    seconds: float
    acked: dict[tuple[int, int], int] = field(default_factory=dict)  # (thread, seq) -> timestamp
    failed: int = 0
    started: float = 0.0
    ended: float = 0.0
    last_ack: float = 0.0  # monotonic time of the last acknowledgement

    def run(self, send, make_rows) -> None:
        self.started = time.monotonic()
        workers = [threading.Thread(target=self._thread, args=(n, send, make_rows)) for n in range(self.threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        self.ended = time.monotonic()

    def _thread(self, n: int, send, make_rows) -> None:
        interval = self.threads / self.rate
        seq = 0
        while True:
            due = self.started + (n / self.threads + seq) * interval
            if due - self.started >= self.seconds:
                return
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            rows = make_rows(n, seq)
            try:
                ts = send(n, seq, rows)
            except Exception as e:  # counted: every append must be acknowledged
                self.failed += 1
                log(f"append {n}/{seq} failed: {e}")
            else:
                self.acked[n, seq] = ts
                self.last_ack = time.monotonic()
            seq += 1

    @property
    def achieved(self) -> float:
        return len(self.acked) / max(self.ended - self.started, 1e-9)


def append_rows(rate_index: int, thread: int, seq: int) -> pa.Table:
    """50 new rows, ids unique to (rate, thread, seq): 10^12 + ..."""
    start = 10**12 + ((rate_index * 16 + thread) * 10**6 + seq) * APPEND_ROWS
    return sales_rows(start, APPEND_ROWS, seed=start)


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds of the processes `pids` (gone ones count 0)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def slope_ms_per_min(samples: list[tuple[float, float]]) -> float:
    """The least-squares slope of (seconds, lag ms) samples, in ms a minute."""
    if len(samples) < 2:
        return 0.0
    xs, ys = [s for s, _ in samples], [lag for _, lag in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


@dataclass
class Lags:
    """Per dataflow, (seconds into the stream, wallclock lag ms) samples."""

    samples: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def add(self, name: str, at: float, lag_ms: float) -> None:
        self.samples.setdefault(name, []).append((at, lag_ms))

    def summary(self, name: str, seconds: float) -> str:
        points = self.samples.get(name, [])
        if not points:
            return "-"
        lags = [lag for _, lag in points]
        first = [lag for at, lag in points if at < WARMUP_S] or lags
        last = [lag for at, lag in points if at >= seconds - WARMUP_S] or lags
        drift = statistics.fmean(last) - statistics.fmean(first)
        return f"{pct(lags, 50):.0f} / {pct(lags, 99):.0f} ms, {slope_ms_per_min(points):+.0f} ms/min, last-first {drift:+.0f} ms"

    def p99(self, name: str) -> float:
        return pct([lag for _, lag in self.samples.get(name, [(0, 0)])], 99)


# --- Tandem ------------------------------------------------------------------------------


def tandem(root: Path, rates: list[float], seconds: float, rows: int, catalog: str | None) -> list[dict]:
    results = []
    process = ControllerProcess(root, catalog_url=catalog, serve_args=["--http-listen", "off"])
    try:
        with Client.connect(process.address) as client:
            client.create_instance("load")
            for name in ("r1", "r2"):
                client.add_replica("load", name, size="small")
            client.create_source("sales", SALES)
            client.create_source("regions", REGIONS)
            client.append("regions", regions())
            load(client, "sales", rows)
            for name, (sql, options) in QUERIES.items():
                view = client.create_dataflow("load", name, sql, **options)
                log(f"{name}: {view.strategy}")
            started = time.monotonic()
            wait_until(lambda: _all_hydrated(client), 3600, "both replicas hydrated")
            log(f"hydrated on both replicas in {time.monotonic() - started:.0f} s")
            source = next(s.id for s in client.list_sources() if s.name == "sales")
            for index, rate in enumerate(rates):
                results.append(_tandem_rate(client, process, root, catalog, source, index, rate, seconds))
    finally:
        process.stop()
        kill_replicas(root, catalog)
    return results


def _all_hydrated(client: Client) -> bool:
    replicas = client.status("load")[0].replicas
    return len(replicas) == 2 and all(r.dataflows.get(n) is not None and r.dataflows[n].hydrated for r in replicas for n in QUERIES)


def _pids(client: Client, controller: ControllerProcess) -> dict[str, list[int]]:
    """The processes whose CPU is counted, by part: the controller, the replicas'
    Python processes and their JVMs."""
    replicas = [r.pid for r in client.status("load")[0].replicas if r.pid]
    return {"controller": [controller.pid], "replicas": replicas, "jvms": [pid for pid in map(jvm_of, replicas) if pid]}


def _tandem_rate(client: Client, controller: ControllerProcess, root: Path, catalog: str | None, source: str, index: int, rate: float, seconds: float) -> dict:
    threads = THREADS_AT.get(int(rate), 1)
    stream = Stream(rate, threads, seconds)
    clients = [Client.connect(controller.address) for _ in range(threads)]
    lags = Lags()
    pending: dict[str, int] = {}
    covered: dict[str, int] = {}
    stop = threading.Event()

    def sample() -> None:
        with Client.connect(controller.address) as own:
            while not stop.wait(1.0):
                instance = own.status("load")[0]
                at = time.monotonic() - stream.started
                for collection in instance.collections:
                    if collection.name in QUERIES and collection.wallclock_lag_ms is not None:
                        lags.add(collection.name, at, collection.wallclock_lag_ms)
                for replica in instance.replicas:
                    for name, status in replica.dataflows.items():
                        pending[name] = max(pending.get(name, 0), status.pending_times)
                        covered[name] = max(covered.get(name, 0), status.last_step_times)

    pids = _pids(client, controller)
    cpu_before = {part: cpu_seconds(of_part) for part, of_part in pids.items()}
    sampler = threading.Thread(target=sample)
    sampler.start()
    log(f"tandem: {rate:g} appends/s of {APPEND_ROWS} rows from {threads} thread(s) for {seconds:g} s")
    try:
        stream.run(lambda n, seq, rows: clients[n].append("sales", rows), lambda n, seq: append_rows(index, n, seq))
    finally:
        stop.set()
        sampler.join()
        for own in clients:
            own.close()
    last = max(stream.acked.values())
    # Storage first: whether every acknowledged append is there does not depend on the
    # dataflows, which may be minutes behind a stream they cannot hold.
    missing = _check_appends(root, catalog, source, stream, index)
    visible: dict[str, float | None] = {}
    deadline = time.monotonic() + CATCH_UP_S
    for name, key in PEEK_KEYS.items():
        # One row: a strict peek waits for the last append's time; the answer is not read.
        try:
            client.peek("load", name, key=key, limit=1, consistency="strict", timeout_ms=max(1, int(1000 * (deadline - time.monotonic()))))
            visible[name] = time.monotonic() - stream.last_ack
        except TandemError as error:
            log(f"{name}: not caught up within {CATCH_UP_S} s ({error.code.name})")
            visible[name] = None
    try:
        wait_until(lambda: (w := _frontier(client, "view")) is not None and w > last, max(0.0, deadline - time.monotonic()), "the view past the last append")
        visible["view"] = time.monotonic() - stream.last_ack
    except TimeoutError:
        visible["view"] = None
    cpu = {part: cpu_seconds(of_part) - cpu_before[part] for part, of_part in pids.items()}
    appended = len(stream.acked) * APPEND_ROWS
    result = {
        "rate": rate,
        "threads": threads,
        "achieved": stream.achieved,
        "failed": stream.failed,
        "missing": missing,
        "lags": {name: lags.summary(name, seconds) for name in QUERIES},
        "p99": {name: lags.p99(name) for name in QUERIES},
        "visible": visible,
        "cpu_us_per_row": 1e6 * sum(cpu.values()) / max(appended, 1),
        "cpu_split": {part: 1e6 * seconds / max(appended, 1) for part, seconds in cpu.items()},
        "max_pending": pending,
        "max_covered": covered,
    }
    log(f"tandem at {rate:g}/s: {result}")
    return result


def _frontier(client: Client, name: str) -> int | None:
    return next((c.write_frontier for c in client.status("load")[0].collections if c.name == name), None)


def _check_appends(root: Path, catalog: str | None, source: str, stream: Stream, index: int) -> int:
    """Acknowledged appends not found whole and once in storage: in the snapshot at the
    last acknowledged time, and at their own timestamp where that is not compacted yet
    (by the check, the retention window has moved past the first of a 2-minute run)."""
    opened = Catalog.open(catalog or f"sqlite:///{root / 'catalog.db'}")
    try:
        storage = Storage(opened, root / "blobs")
        last = max(stream.acked.values())
        snapshot = storage.read_snapshot(source, last)
        after = max(min(stream.acked.values()), storage.since(source).time) - 1
        updates = storage.read_changes(source, after, last)
    finally:
        opened.close()
    present: dict[int, int] = {}
    for id in snapshot["id"].to_pylist():
        present[id] = present.get(id, 0) + 1
    found: dict[int, list[int]] = {}
    for id, at in zip(updates["id"].to_pylist(), updates["_time"].to_pylist()):
        found.setdefault(id, []).append(at)
    missing = 0
    for (thread, seq), ts in stream.acked.items():
        ids = append_rows(index, thread, seq)["id"].to_pylist()
        if any(present.get(id) != 1 for id in ids) or (ts > after and any(found.get(id) != [ts] for id in ids)):
            missing += 1
    return missing


# --- Structured Streaming ---------------------------------------------------------------


def streaming(root: Path, rates: list[float], seconds: float, rows: int) -> list[dict]:
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]").config("spark.driver.memory", "1g").config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.streaming.stateStore.providerClass", "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
        .getOrCreate()
    )
    try:
        return [_streaming_rate(session, root / f"rate-{index}", index, rate, seconds, rows) for index, rate in enumerate(rates)]
    finally:
        session.stop()


def _streaming_rate(session, root: Path, index: int, rate: float, seconds: float, rows: int) -> dict:
    from pyspark.sql import functions as F
    from pyspark.sql.streaming import StreamingQueryListener

    source = root / "input"
    source.mkdir(parents=True)
    pq.write_table(sales_rows(0, rows, seed=1), source / "load.parquet")
    read_rows = [0]  # rows the finished micro-batches read
    ends: list[tuple[float, int]] = []  # (end, rows read through it)

    class Progress(StreamingQueryListener):
        def onQueryStarted(self, event):
            pass

        def onQueryProgress(self, event):
            read_rows[0] += event.progress.numInputRows
            ends.append((time.monotonic(), read_rows[0]))

        def onQueryIdle(self, event):
            pass

        def onQueryTerminated(self, event):
            pass

    listener = Progress()
    session.streams.addListener(listener)
    stream_df = session.readStream.schema("id BIGINT, region STRING, amount DOUBLE").parquet(str(source))
    totals = stream_df.groupBy("region").agg(F.count("*").alias("n"), F.sum("amount").alias("total"))
    query = (
        totals.writeStream.outputMode("update").format("memory").queryName(f"totals{index}")
        .option("checkpointLocation", str(root / "checkpoint")).trigger(processingTime="0 seconds").start()
    )
    wait_until(lambda: read_rows[0] >= rows, 600, "the stream read its input")
    threads = THREADS_AT.get(int(rate), 1)
    stream = Stream(rate, threads, seconds)
    arrivals: dict[int, float] = {}  # files in arrival order: number -> monotonic time
    counter = iter(range(10**9))
    lock = threading.Lock()

    def send(n: int, seq: int, table: pa.Table) -> int:
        staged = root / f"staged-{n}-{seq}.parquet"
        pq.write_table(table, staged)
        with lock:  # arrivals numbered in the order files appear
            number = next(counter)
            staged.rename(source / f"{number:09d}.parquet")
            arrivals[number] = time.monotonic()
        return number

    lags = Lags()
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(1.0):
            done_files = (read_rows[0] - rows) // APPEND_ROWS
            with lock:
                waiting = [arrivals[k] for k in range(done_files, len(arrivals)) if k in arrivals]
            now = time.monotonic()
            lags.add("view", now - stream.started, 1000 * (now - min(waiting)) if waiting else 0.0)

    jvm = session._jvm.java.lang.ProcessHandle.current().pid()
    cpu_before = cpu_seconds([jvm, os.getpid()])
    sampler = threading.Thread(target=sample)
    sampler.start()
    log(f"structured streaming: {rate:g} appends/s of {APPEND_ROWS} rows from {threads} thread(s) for {seconds:g} s")
    try:
        stream.run(send, lambda n, seq: append_rows(index, n, seq))
    finally:
        stop.set()
        sampler.join()
    total = rows + len(arrivals) * APPEND_ROWS
    last_arrival = max(arrivals.values())
    wait_until(lambda: read_rows[0] >= total, 3600, "the stream read every file")
    visible = next(end for end, read in ends if read >= total) - last_arrival
    cpu = cpu_seconds([jvm, os.getpid()]) - cpu_before
    query.stop()
    session.streams.removeListener(listener)
    result = {
        "rate": rate,
        "achieved": stream.achieved,
        "lags": {"view": lags.summary("view", seconds)},
        "p99": {"view": lags.p99("view")},
        "visible": {"view": visible},
        "cpu_us_per_row": 1e6 * cpu / max(len(arrivals) * APPEND_ROWS, 1),
    }
    log(f"structured streaming at {rate:g}/s: {result}")
    return result


# --- Report ------------------------------------------------------------------------------


def report(tandem_results: list[dict], peer: list[dict], seconds: float, catalog: str) -> None:
    print(f"\n## Load: steady streams of {APPEND_ROWS}-row appends, {seconds:g} s each, two small replicas ({catalog} catalog)\n")
    if tandem_results:
        print("| rate (appends/s) | achieved | failed / missing | lag p50 / p99, trend: view | index | filter | join | last append visible after (view / index / filter / join) | CPU per row (controller / replicas / JVMs) | most times a step covered |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in tandem_results:
            lags = " | ".join(r["lags"][name] for name in QUERIES)
            visible = " / ".join("-" if r["visible"][name] is None else f"{r['visible'][name]:.1f}" for name in QUERIES)
            covered = max(r["max_covered"].values(), default=0)
            split = " / ".join(f"{us:.0f}" for us in r["cpu_split"].values())  # _pids' order
            print(f"| {r['rate']:g} ({r['threads']} thread{'s' if r['threads'] > 1 else ''}) | {r['achieved']:.1f} | {r['failed']} / {r['missing']} | {lags} | {visible} s | {r['cpu_us_per_row']:.0f} us ({split}) | {covered} |")
    if peer:
        print("\n| rate (appends/s) | Structured Streaming: achieved | lag p50 / p99, trend | last file visible after | CPU per row |")
        print("|---|---|---|---|---|")
        for r in peer:
            print(f"| {r['rate']:g} | {r['achieved']:.1f} | {r['lags']['view']} | {r['visible']['view']:.1f} s | {r['cpu_us_per_row']:.0f} us |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1,10,100,1000")
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--catalog", default="sqlite", help="sqlite (the embedded default), postgres (127.0.0.1:5432/test, a schema of its own) or a URL")
    parser.add_argument("--only", choices=["tandem", "streaming"])
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory(prefix="tandem-load-") as root:
        results, peer = [], []
        if args.only in (None, "tandem"):
            with catalog_for(args.catalog) as url:
                results = tandem(Path(root) / "tandem", rates, args.seconds, args.rows, url)
        if args.only in (None, "streaming"):
            peer = streaming(Path(root) / "streaming", rates, args.seconds, args.rows)
    report(results, peer, args.seconds, args.catalog)


if __name__ == "__main__":
    main()
