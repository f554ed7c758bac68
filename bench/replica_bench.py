"""Replica benchmark: start-up, one Spark step per append, key peeks vs SQL peeks.

    .venv/bin/python bench/replica_bench.py

Runs one real replica process (`python -m replica_service`, local[2], the instance's
`spark.default.parallelism` on the command line so CreateInstance does not restart the
SparkContext) against a SQLite catalog and blob directory in a temporary directory, and
drives it with `ScriptedClient` (tests/replica_harness.py) over a real gRPC stream:

1. Start-up to first served peek: a fresh replica against a catalog that already holds
   one source (1,000 rows, one append) and one indexed dataflow over it (as_of 0). It
   replays CreateInstance, CreateDataflow, Schedule, InitializationComplete, then a key
   peek at the append's timestamp. Breakdown: spawn -> ready line (JVM + SparkSession +
   gRPC), -> connected (first heartbeat), -> index frontier past the append, -> first
   key peek answered.
2. Append to frontier: a source `sales(id BIGINT NOT NULL, region STRING, amount DOUBLE)`
   built by 100 appends of 1,000 rows (100,000 rows; ids unique, 300 distinct regions),
   with the indexed dataflow `select region, count(*) as n, sum(amount) as total from
   sales group by region` keyed by `region` (a per-key aggregate: the serving-index shape
   Tandem is for, and the test suite's own). For each append: time from the return of
   `storage.append` until `FrontiersResponse` for the index passes the append's
   timestamp. The replica recomputes the dataflow from the whole snapshot with Spark at
   every input change time, so each sample is one full Spark step over 1k..100k rows
   (plus up to one input poll interval, 100 ms by default). The replica's own
   "computed ... in N ms" log lines give the Spark part.
3. Key peek vs SQL peek, as round trips through the stream, at the last append's
   timestamp: an `IndexTarget` peek with `RowSetFinishing(key=(k,))` (a hash lookup in
   the arrangement) vs a `SqlTarget` peek `select * from <index> where <key> = k` over
   the same index (a Spark job). After warm-up, N=200 key peeks and N=20 SQL peeks. Done
   for the aggregate index (300 rows) and for a row-level index over the same source
   (`select id, region, amount from sales` keyed by `id`, 100,000 rows, created after
   step 2 at the last timestamp, so it hydrates with one step).

Round trips are stamped on the client's reader thread when the response arrives
(`ScriptedClient.timed_peek`; frontier reports by a subclass). The replica's log and the
temporary directory are removed at the end, also on error (`--keep` keeps them).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import pyarrow as pa  # noqa: E402
import pyspark  # noqa: E402

import history as h  # noqa: E402
from catalog import Catalog  # noqa: E402
from protocol import ipc_to_table  # noqa: E402
from replica_harness import ReplicaProcess, ScriptedClient  # noqa: E402
from storage import Storage  # noqa: E402

SCHEMA = "id BIGINT NOT NULL, region STRING, amount DOUBLE"
REGIONS = 300
APPENDS = 100
ROWS_PER_APPEND = 1_000
KEY_PEEKS, KEY_WARMUP = 200, 20
SQL_PEEKS, SQL_WARMUP = 20, 3
MASTER = "local[2]"

TOTALS_SQL = "select region, count(*) as n, sum(amount) as total from sales group by region"
TOTALS_DDL = "region STRING, n BIGINT NOT NULL, total DOUBLE"
ROWS_SQL = "select id, region, amount from sales"
ROWS_DDL = SCHEMA


# --- A client that stamps arrivals --------------------------------------------------------


class TimedClient(ScriptedClient):
    """`ScriptedClient` that also records, on its reader thread, when each frontier report
    and the first heartbeat arrived (`time.perf_counter()`; peek answers are stamped by
    `ScriptedClient` itself)."""

    def __init__(self, address: str, **kwargs) -> None:
        self.frontier_arrivals: list[tuple[float, str, h.Frontier]] = []
        self.first_status_at: float | None = None
        super().__init__(address, **kwargs)

    def _record(self, nonce: str, response) -> None:
        now = time.perf_counter()
        if isinstance(response, h.FrontiersResponse):
            self.frontier_arrivals.append((now, response.id, response.write_frontier))
        elif isinstance(response, h.StatusResponse) and self.first_status_at is None:
            self.first_status_at = now
        super()._record(nonce, response)

    def frontier_passed_at(self, id: str, past: int) -> float:
        """When the first report of `id`'s frontier beyond `past` arrived (after waiting)."""
        self.wait_frontier(id, past)
        with self._condition:
            return next(at for at, fid, f in self.frontier_arrivals if fid == id and f.is_complete(past))


# --- Helpers ----------------------------------------------------------------------------


def batch(first_id: int, rows: int) -> pa.Table:
    ids = range(first_id, first_id + rows)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "region": pa.array([f"r{(i * 31) % REGIONS:03d}" for i in ids], pa.string()),
            "amount": pa.array([((i * 7919) % 10_000) / 100 for i in ids], pa.float64()),
        },
        schema=pa.schema([pa.field("id", pa.int64(), nullable=False), ("region", pa.string()), ("amount", pa.float64())]),
    )


def pct(samples: list[float], q: int) -> float:
    if len(samples) == 1:
        return samples[0]
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f}"


def rows_of(result: h.PeekResult) -> pa.Table:
    if not isinstance(result, h.PeekRows):
        raise RuntimeError(f"peek failed: {result}")
    return ipc_to_table(result.arrow_ipc)


def step_log(log_path: Path, dataflow: str) -> dict[int, float]:
    """The replica's own step durations (seconds) for `dataflow`, by computed time."""
    pattern = re.compile(rf"dataflow {re.escape(dataflow)}: computed time (\d+) in (\d+) ms")
    steps = {}
    for line in log_path.read_text(errors="replace").splitlines():
        if m := pattern.search(line):
            steps[int(m.group(1))] = float(m.group(2)) / 1000
    return steps


def java_version() -> str:
    try:
        out = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=20).stderr
        return out.splitlines()[0].replace('"', "") if out else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


@dataclass
class Env:
    root: Path
    url: str
    catalog: Catalog
    storage: Storage
    instance: h.InstanceConfig

    def dataflow(self, name: str, sql: str, source: str, ddl: str, key: list[str], as_of: int) -> h.DataflowDescription:
        info = self.catalog.create_dataflow(
            self.instance.name,
            name,
            sql=sql,
            imports=[h.Import("sales", source, "storage")],
            schema=ddl,
            as_of=h.Frontier(as_of),
            index_key=key,
        )
        return info.description()


def spawn(env: Env) -> ReplicaProcess:
    """A replica with the instance's launch-time settings; its scratch dir (the replica
    makes one with mkdtemp) lands in our temporary directory through TMPDIR."""
    scratch = env.root / "replica-tmp"
    scratch.mkdir(exist_ok=True)
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(scratch)
    try:
        conf = env.instance.conf()
        return ReplicaProcess(
            env.url,
            env.root / "blobs",
            master=MASTER,
            spark_conf={"spark.default.parallelism": conf["spark.default.parallelism"]},
            log_path=env.root / "replica.log",
        )
    finally:
        if saved is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved


# --- The phases ---------------------------------------------------------------------------


def startup(env: Env, opened: dict) -> tuple[ReplicaProcess, TimedClient, list[tuple[str, str, str]]]:
    """Phase 1; the replica and client go into `opened` as soon as they exist, so that
    the caller stops them even if this phase fails."""
    source = env.storage.create_source("warm", SCHEMA).id
    ts = env.storage.append(source, batch(0, ROWS_PER_APPEND))
    desc = env.dataflow("warm_totals", TOTALS_SQL, source, TOTALS_DDL, ["region"], as_of=0)
    index = desc.export_ids[0]

    spawned = time.perf_counter()
    replica = opened["replica"] = spawn(env)
    ready = time.perf_counter()
    client = opened["client"] = TimedClient(replica.address, epoch=1)
    client.send(h.CreateInstance(env.instance), h.CreateDataflow(desc), h.Schedule(index), h.InitializationComplete())
    peek_id = uuid.uuid4().hex
    client.send(h.Peek(peek_id, h.IndexTarget(index), ts, h.RowSetFinishing(key=("r007",)), 120_000))
    answer = client.wait_for(lambda r: r.peeks.get(peek_id), 125, "the first peek")
    rows = rows_of(answer)
    assert rows.num_rows == 1, rows
    hydrated = client.frontier_passed_at(index, ts)
    answered = client.peek_arrivals[peek_id]
    connected = client.first_status_at or ready
    steps = step_log(env.root / "replica.log", "warm_totals")
    restarted = "restarting the SparkContext" in (env.root / "replica.log").read_text(errors="replace")
    table = [
        ("spawn -> ready line (JVM, SparkSession, gRPC)", ms(ready - spawned), ""),
        ("ready -> connected (first heartbeat)", ms(connected - ready), f"cumulative {ms(connected - spawned)}"),
        (
            "connected -> index frontier past the append",
            ms(hydrated - connected),
            f"{len(steps)} Spark steps ({', '.join(ms(s) for s in steps.values())} ms)",
        ),
        ("frontier -> first key peek answered", ms(answered - hydrated), f"total spawn -> peek {ms(answered - spawned)}"),
    ]
    if restarted:
        table.append(("WARNING", "", "the replica restarted its SparkContext on CreateInstance"))
    return replica, client, table


def appends(env: Env, client: TimedClient) -> tuple[str, str, int, list[tuple[str, str, str]]]:
    source = env.storage.create_source("sales", SCHEMA).id
    desc = env.dataflow("sales_by_region", TOTALS_SQL, source, TOTALS_DDL, ["region"], as_of=0)
    index = desc.export_ids[0]
    client.send(h.CreateDataflow(desc), h.Schedule(index))
    # A new source's upper is 0: move it to "now", as the controller's advancer does
    # for idle sources, so the dataflow can compute its as_of (the empty source).
    env.storage.compare_and_append(source, env.storage.upper(source), h.Frontier(env.catalog.write_ts() + 1))
    client.wait_frontier(index, past=0)
    batches = [batch(i * ROWS_PER_APPEND, ROWS_PER_APPEND) for i in range(APPENDS)]
    latencies, append_calls, stamps = [], [], []
    for table in batches:
        called = time.perf_counter()
        ts = env.storage.append(source, table)
        returned = time.perf_counter()
        latencies.append(client.frontier_passed_at(index, ts) - returned)
        append_calls.append(returned - called)
        stamps.append(ts)
    steps = step_log(env.root / "replica.log", "sales_by_region")
    spark = [steps[ts] for ts in stamps if ts in steps]
    rest = [lat - steps[ts] for lat, ts in zip(latencies, stamps) if ts in steps]
    first, last = latencies[:10], latencies[-10:]
    rows = [
        (
            f"append -> frontier past it ({APPENDS} appends)",
            f"p50 {ms(pct(latencies, 50))} / p99 {ms(pct(latencies, 99))} / max {ms(max(latencies))}",
            f"mean of first 10 {ms(statistics.mean(first))}, of last 10 {ms(statistics.mean(last))}",
        ),
        (
            "  of which the step (replica log)",
            f"p50 {ms(pct(spark, 50))} / p99 {ms(pct(spark, 99))} / max {ms(max(spark))}",
            f"{len(spark)} steps; snapshot + Spark + canonical sort",
        ),
        (
            "  of which the rest (poll wait, load, install)",
            f"p50 {ms(pct(rest, 50))} / p99 {ms(pct(rest, 99))} / max {ms(max(rest))}",
            "input poll interval 100 ms",
        ),
        (
            "storage.append (1,000 rows, client side)",
            f"p50 {ms(pct(append_calls, 50))} / p99 {ms(pct(append_calls, 99))}",
            "",
        ),
    ]
    return source, index, stamps[-1], rows


def peeks(client: TimedClient, index: str, alias: str, key_column: str, keys: list, ts: int, label: str) -> list[tuple[str, str, str]]:
    target = h.IndexTarget(index)
    sql_target = lambda k: h.SqlTarget(f"select * from {alias} where {key_column} = {k!r}", (h.Import(alias, index, "index"),))  # noqa: E731

    first_key, first_result = client.timed_peek(target, ts, h.RowSetFinishing(key=(keys[0],)))
    # The same answer both ways, for a few keys.
    for k in keys[:3]:
        by_key = rows_of(client.timed_peek(target, ts, h.RowSetFinishing(key=(k,)))[1])
        by_sql = rows_of(client.timed_peek(sql_target(k), ts, h.RowSetFinishing())[1])
        if by_key.num_rows < 1 or by_key.to_pylist() != by_sql.to_pylist():
            raise RuntimeError(f"key peek and SQL peek disagree for {k!r}: {by_key.to_pylist()} vs {by_sql.to_pylist()}")

    for i in range(KEY_WARMUP):
        client.timed_peek(target, ts, h.RowSetFinishing(key=(keys[i % len(keys)],)))
    key_rtts = [client.timed_peek(target, ts, h.RowSetFinishing(key=(keys[(i * 7) % len(keys)],)))[0] for i in range(KEY_PEEKS)]
    for i in range(SQL_WARMUP):
        client.timed_peek(sql_target(keys[i % len(keys)]), ts, h.RowSetFinishing())
    sql_rtts = [client.timed_peek(sql_target(keys[(i * 13) % len(keys)]), ts, h.RowSetFinishing())[0] for i in range(SQL_PEEKS)]
    ratio = pct(sql_rtts, 50) / pct(key_rtts, 50)
    return [
        (f"{label}: first key peek of the version", ms(first_key), "builds the version's hash index, on the event loop"),
        (f"{label}: key peek, IndexTarget (N={KEY_PEEKS})", f"p50 {ms(pct(key_rtts, 50))} / p99 {ms(pct(key_rtts, 99))}", f"max {ms(max(key_rtts))}"),
        (f"{label}: SQL peek, SqlTarget (N={SQL_PEEKS})", f"p50 {ms(pct(sql_rtts, 50))} / p99 {ms(pct(sql_rtts, 99))}", f"max {ms(max(sql_rtts))}"),
        (f"{label}: SQL p50 / key p50", f"{ratio:,.0f}x", "goal >= 50x: " + ("met" if ratio >= 50 else "NOT met")),
    ]


def floor(client: TimedClient, ts: int) -> tuple[str, str, str]:
    """The stream's round trip with no lookup and no rows: a peek of an unknown index,
    answered at once with an error."""
    target = h.IndexTarget("u999999999")
    for _ in range(KEY_WARMUP):
        client.timed_peek(target, ts, h.RowSetFinishing())
    rtts = []
    for _ in range(KEY_PEEKS):
        rtt, result = client.timed_peek(target, ts, h.RowSetFinishing())
        assert isinstance(result, h.PeekError), result
        rtts.append(rtt)
    return (f"floor: peek of an unknown index (N={KEY_PEEKS})", f"p50 {ms(pct(rtts, 50))} / p99 {ms(pct(rtts, 99))}", "answered with an error: gRPC + asyncio only")


def during_steps(env: Env, client: TimedClient, source: str, indexes: list[str], index: str, keys: list, ts: int) -> list[tuple[str, str, str]]:
    """Key peeks at an old, readable time, sent back to back while one more append is
    computed by both dataflows (one step each, one after the other)."""
    table = batch(APPENDS * ROWS_PER_APPEND, ROWS_PER_APPEND)
    new_ts = env.storage.append(source, table)
    returned = time.perf_counter()
    rtts = []
    while not all(client.responses.frontiers[i].is_complete(new_ts) for i in indexes):
        rtt, result = client.timed_peek(h.IndexTarget(index), ts, h.RowSetFinishing(key=(keys[len(rtts) % len(keys)],)))
        rows_of(result)
        rtts.append(rtt)
    done = max(client.frontier_passed_at(i, new_ts) for i in indexes) - returned
    return [
        (f"key peeks on rows_by_id during the steps (N={len(rtts)})", f"p50 {ms(pct(rtts, 50))} / p99 {ms(pct(rtts, 99))}", f"max {ms(max(rtts))}"),
        ("append -> both indexes past it", ms(done), "two steps, one after the other"),
    ]


def memory(pid: int) -> str:
    """Resident memory of the replica process and of its children (the JVM)."""

    def rss(p: int) -> int:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    try:
        children = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
        return f"Python {rss(pid) / 2**20:,.0f} MB, JVM {sum(rss(c) for c in children) / 2**20:,.0f} MB"
    except OSError as e:
        return f"unknown ({e})"


# --- Main -------------------------------------------------------------------------------


def print_table(title: str, rows: list[tuple[str, str, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(r[1]) for r in rows)
    print(f"\n{title}")
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:>{vwidth}}  {note}".rstrip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (catalog, blobs, replica log)")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()
    print(
        f"replica_bench on {platform.node()}: nproc {os.cpu_count()}, Python {platform.python_version()}, "
        f"PySpark {pyspark.__version__}, pyarrow {pa.__version__}, {java_version()}; replica {MASTER}, "
        f"load average {load_before[0]:.2f} at start"
    )
    print(f"reproduce: cd {ROOT} && .venv/bin/python bench/replica_bench.py")
    root = Path(tempfile.mkdtemp(prefix="tandem-replica-bench-"))
    started = time.perf_counter()
    opened: dict = {}
    catalog = None
    try:
        url = f"sqlite:///{root / 'catalog.db'}"
        catalog = Catalog.open(url)
        catalog.become_controller()
        storage = Storage(catalog, root / "blobs")
        instance = catalog.create_instance("bench").config
        env = Env(root, url, catalog, storage, instance)

        replica, client, table = startup(env, opened)
        print_table("1. start-up to first served peek (ms; source of 1,000 rows, dataflow as_of 0)", table)

        source, index, last_ts, table = appends(env, client)
        print_table(f"2. append -> index frontier, {APPENDS} x {ROWS_PER_APPEND:,} rows, group by region, keyed by region (ms)", table)

        regions = [f"r{i:03d}" for i in range(REGIONS)]
        table = [floor(client, last_ts)]
        table += peeks(client, index, "sales_by_region", "region", regions, last_ts, "by_region (300 rows)")
        rows_desc = env.dataflow("sales_rows", ROWS_SQL, source, ROWS_DDL, ["id"], as_of=last_ts)
        rows_index = rows_desc.export_ids[0]
        hydrate_from = time.perf_counter()
        client.send(h.CreateDataflow(rows_desc), h.Schedule(rows_index))
        hydrated = client.frontier_passed_at(rows_index, last_ts) - hydrate_from
        ids = [(i * 4_999) % (APPENDS * ROWS_PER_APPEND) for i in range(1_000)]
        table += [("rows_by_id (100,000 rows): create -> hydrated", ms(hydrated), "one step at the last timestamp")]
        table += peeks(client, rows_index, "sales_rows", "id", ids, last_ts, "rows_by_id (100,000 rows)")
        print_table("3. peek round trips at the last append's timestamp (ms)", table)

        table = during_steps(env, client, source, [index, rows_index], rows_index, ids, last_ts)
        print_table("4. key peeks while the replica computes (ms)", table)

        print(f"\nreplica memory at the end: {memory(replica.pid)}")
        load_after = os.getloadavg()
        print(f"\ntotal {time.perf_counter() - started:.1f} s; load average {load_after[0]:.2f} at end")
        return 0
    finally:
        if opened.get("client") is not None:
            opened["client"].close()
        if opened.get("replica") is not None:
            code = opened["replica"].stop()
            if code not in (0, None):
                print(f"replica exited with {code} on SIGTERM", file=sys.stderr)
        if catalog is not None:
            catalog.close()
        if args.keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
