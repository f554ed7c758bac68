"""Controller benchmark: key peeks through the controller vs straight to a replica, the
state machine's response rate, and peek throughput with one and two replicas.

    .venv/bin/python bench/controller_bench.py

Runs, in one temporary directory:

1. Key peek through the controller vs straight to a replica. One `tandem serve` process
   (controller._process.ControllerProcess, SQLite catalog) with one managed `xsmall`
   replica (local[1], 512m), a source `events(id BIGINT NOT NULL, k STRING, amount
   DOUBLE)` of 10,000 rows (one append; 300 distinct `k`), and the indexed dataflow
   `select id, k, amount from events` keyed by `k` (about 33 rows per key). Then N=300
   serializable key peeks with `Client.peek` (unary gRPC to the controller, which peeks
   the replica over its command stream), interleaved with N=300 key peeks of the same
   index, at the same kind of timestamp (the replica's write frontier - 1), sent straight
   to a replica with `ScriptedClient` (tests/replica_harness.py).
   The direct replica is a SECOND replica process of the same size (local[1], 512m, the
   instance's spark.default.parallelism), not the controller's own: a `ScriptedClient`
   on the controller's replica would need a higher controller epoch and so fence the
   controller. It reads the controller's blob directory through a snapshot copy of the
   controller's SQLite catalog (sqlite3 backup API), so it sees the same batch files,
   ids and dataflow (`catalog.dataflow_by_name(...).description()`, as_of moved up to
   the copy's source since), and nothing it does reaches the controller: the copy's
   uppers stay where they were, so no storage since can pass it (with the live catalog,
   the controller's advancing read holds would compact the source under a lagging
   reader). Breakdown rows time the pieces of the controller's path on their own.
2. The sans-I/O state machine alone (pure Python, no I/O): a `ComputeInstance` with 2
   connected replicas and 100 dataflows (90 over a storage source, 10 over another
   dataflow's index), fed a pre-built stream of 210,000 responses: per 100 ms step, a
   `FrontiersResponse` advancing every collection from each replica, a `StatusResponse`
   heartbeat from each, 4 peeks issued with `instance.peek` at the readable time and
   answered by both replicas (the second answer is a duplicate: rows or PeekCanceled),
   and one `tick`. The stream is fed until it ends or a time budget runs out (the rate
   is what matters; `--full` feeds it all). The same stream shape with 10 dataflows shows
   how the per-response cost grows with the number of collections. Rates are given per
   wall-clock second and per CPU second of the feeding thread (the machine may be
   shared). The durable worker's cost per batch of sinces and holds (one catalog transaction) is timed
   on a scratch SQLite catalog of our own. `--profile` prints a cProfile of a
   4,200-response prefix to stderr.
3. Peek throughput through the controller: K=4 client threads (one `Client` each) doing
   serializable key peeks for 10 s, with 1 replica, then again after `add_replica`
   of a second `xsmall` replica is in sync (`status`).

Part 2 runs first, while no other process of ours runs. The controller is stopped with
SIGTERM and every replica process the catalog records is killed at the end, also on
error; the direct replica is stopped after part 1. `--keep` keeps the temporary
directory (catalog, blobs, controller and replica logs); `--spy-controller PREFIX`
samples the controller with py-spy during part 3 (raw stacks, for diagnosis).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import platform
import pstats
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import grpc  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyspark  # noqa: E402

import history as h  # noqa: E402
from catalog import Catalog, dataflow_holder  # noqa: E402
from controller._instance import ComputeInstance, InstanceOptions  # noqa: E402
from controller.client import Client, TandemError  # noqa: E402
from controller._process import ControllerProcess, kill_replicas, wait_until  # noqa: E402
from protocol import controller_codec as codec  # noqa: E402
from protocol import controller_pb2 as pb  # noqa: E402
from protocol import ipc_to_table  # noqa: E402
from replica_harness import ReplicaProcess, ScriptedClient  # noqa: E402
from storage import Storage  # noqa: E402

INSTANCE = "bench"
SCHEMA = "id BIGINT NOT NULL, k STRING, amount DOUBLE"
ROWS = 10_000
KEYS = 300
DATAFLOW = "by_k"
DATAFLOW_SQL = "select id, k, amount from events"
PEEKS, WARMUP = 300, 20
FLOOR_PEEKS = 200
THREADS, THROUGHPUT_S = 4, 10.0
SPAWN_TIMEOUT_S = 300  # a cold JVM on a loaded 2-core machine

SM_DATAFLOWS, SM_REPLICAS, SM_STEPS, SM_PEEKS_PER_STEP = 100, 2, 1_000, 4
SM_SMALL_DATAFLOWS = 10
SM_BUDGET_S, SM_SMALL_BUDGET_S = 40.0, 15.0
SM_PROFILE_STEPS = 20

Row = tuple[str, str, str, str]  # part, measure, value, note


# --- Helpers ----------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def pct(samples: list[float], q: int) -> float:
    if len(samples) == 1:
        return samples[0]
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.2f}"


def p50_p99(samples: list[float]) -> str:
    return f"p50 {ms(pct(samples, 50))} / p99 {ms(pct(samples, 99))} ms"


def keys() -> list[str]:
    return [f"k{i:03d}" for i in range(KEYS)]


def events_table() -> pa.Table:
    ids = range(ROWS)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "k": pa.array([f"k{(i * 31) % KEYS:03d}" for i in ids], pa.string()),
            "amount": pa.array([((i * 7919) % 10_000) / 100 for i in ids], pa.float64()),
        },
        schema=pa.schema([pa.field("id", pa.int64(), nullable=False), ("k", pa.string()), ("amount", pa.float64())]),
    )


def java_version() -> str:
    try:
        out = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=20).stderr
        return out.splitlines()[0].replace('"', "") if out else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- Part 2: the state machine alone ------------------------------------------------------

T0 = 1_000_000  # ms: the stream's clock starts here, and so does the instance's


def build_instance(dataflows: int, replicas: int) -> tuple[ComputeInstance, list[str]]:
    """An instance at clock T0 with `replicas` connected replicas and `dataflows` indexed
    dataflows at as_of T0: the last tenth read an earlier dataflow's index, the rest a
    storage source."""
    instance = ComputeInstance(h.InstanceConfig(INSTANCE), InstanceOptions())
    instance.tick(T0)  # the clock first: a replica silent since 0 would time out
    for r in range(replicas):
        instance.add_replica(f"r{r}")
        instance.replica_connected(f"r{r}", 1, f"nonce-{r}")
    ids: list[str] = []
    chained = dataflows // 10
    for i in range(dataflows):
        index = f"u{100 + i}"
        if i >= dataflows - chained:
            upstream = ids[i - (dataflows - chained)]
            imports = (h.Import(f"df{upstream}", upstream, "index"),)
        else:
            imports = (h.Import("events", "u1", "storage"),)
        desc = h.DataflowDescription(
            f"df{i}", "select k, count(*) as n from input group by k", imports, (h.IndexExport(index, ("k",)),), as_of=h.Frontier(T0), schema="k STRING, n BIGINT NOT NULL"
        )
        instance.create_dataflow(desc)
        ids.append(index)
    return instance, ids


RESPONSE, PEEK, TICK = 0, 1, 2


def build_stream(ids: list[str], replicas: int, steps: int) -> tuple[list[tuple[int, str | None, object]], int]:
    """Operations (kind, replica, payload) and the number of responses among them."""
    names = [f"r{r}" for r in range(replicas)]
    rows = h.PeekRows(b"\0" * 512, 33, "digest")
    ops: list[tuple[int, str | None, object]] = []
    responses = 0
    peek_number = 0
    for step in range(1, steps + 1):
        t = T0 + step * 100
        frontier = h.Frontier(t + 1)
        for name in names:
            for id in ids:
                ops.append((RESPONSE, name, h.FrontiersResponse(id, frontier)))
            ops.append((RESPONSE, name, h.StatusResponse(heartbeat=step)))
            responses += len(ids) + 1
        for _ in range(SM_PEEKS_PER_STEP):
            peek_number += 1
            peek_id = f"peek-{peek_number}"
            target = h.IndexTarget(ids[(peek_number * 7) % len(ids)])
            ops.append((PEEK, None, h.Peek(peek_id, target, t, h.RowSetFinishing(key=("k001",)))))
            winner = peek_number % replicas
            ops.append((RESPONSE, names[winner], h.PeekResponse(peek_id, rows)))
            for other in range(replicas):
                if other != winner:  # the duplicate: rows sent before the cancel arrived, or the cancel's answer
                    late = rows if peek_number % 2 else h.PeekCanceled()
                    ops.append((RESPONSE, names[other], h.PeekResponse(peek_id, late)))
            responses += replicas
        ops.append((TICK, None, t))
    return ops, responses


def feed(instance: ComputeInstance, ops, budget_s: float | None) -> tuple[int, int, collections.Counter, float, float, bool]:
    """Feed `ops` until they end or `budget_s` passes; (responses, ops done, effects by
    kind, wall seconds, CPU seconds of this thread, finished)."""
    handle, peek, tick = instance.handle_response, instance.peek, instance.tick
    effects: collections.Counter = collections.Counter()
    responses = 0
    started = time.perf_counter()
    deadline = None if budget_s is None else started + budget_s
    done = 0
    cpu_started = time.thread_time()
    for done, (kind, replica, payload) in enumerate(ops, 1):
        if kind == RESPONSE:
            out = handle(replica, 1, payload)
            responses += 1
        elif kind == PEEK:
            out = peek(payload)
        else:
            out = tick(payload)
            if deadline is not None and time.perf_counter() > deadline:
                break
        for effect in out:
            effects[type(effect).__name__] += 1
    elapsed = time.perf_counter() - started
    cpu = time.thread_time() - cpu_started
    return responses, done, effects, elapsed, cpu, done == len(ops)


def check_instance(instance: ComputeInstance, finished: bool) -> None:
    """The stream must have kept every replica active (a timeout would drop every later
    response as stale) and, if fed to the end, answered every peek."""
    failed = [r.name for r in instance.replicas.values() if r.phase != "active" or r.epoch != 1]
    if failed:
        raise RuntimeError(f"state machine: replicas {failed} failed during the stream")
    if finished and instance.peeks:
        raise RuntimeError(f"state machine: {len(instance.peeks)} peeks still pending at the end")


def state_machine_run(dataflows: int, budget_s: float | None, label: str) -> list[Row]:
    instance, ids = build_instance(dataflows, SM_REPLICAS)
    # About the same number of responses whatever the number of dataflows.
    per_step = SM_REPLICAS * (dataflows + 1) + SM_REPLICAS * SM_PEEKS_PER_STEP
    steps = -(-SM_STEPS * (SM_REPLICAS * (SM_DATAFLOWS + 1) + SM_REPLICAS * SM_PEEKS_PER_STEP) // per_step)
    built = time.perf_counter()
    ops, total = build_stream(ids, SM_REPLICAS, steps)
    build_s = time.perf_counter() - built
    log(f"part 2 ({label}): feeding up to {total:,} responses ({len(ops):,} operations; budget {budget_s} s)")
    responses, done, effects, elapsed, cpu, finished = feed(instance, ops, budget_s)
    check_instance(instance, finished)
    n_effects = sum(effects.values())
    fed = f"all {total:,} responses" if finished else f"{responses:,} of {total:,} responses ({done:,} ops) in the {budget_s:.0f} s budget"
    rows = [
        (
            "2",
            f"{label}: responses/s",
            f"{responses / elapsed:,.0f}/s",
            f"wall clock; per CPU second of the feeding thread {responses / cpu:,.0f}/s ({1e6 * cpu / responses:,.0f} us CPU per response); "
            f"fed {fed} in {elapsed:.1f} s (stream built in {build_s:.1f} s)",
        ),
        (
            "2",
            f"{label}: effects/s",
            f"{n_effects / elapsed:,.0f}/s",
            f"per CPU second {n_effects / cpu:,.0f}/s; {n_effects / responses:.2f} per response: " + ", ".join(f"{k} {v:,}" for k, v in effects.most_common()),
        ),
    ]
    if not finished:
        rows.append(("2", f"{label}: whole stream (extrapolated)", f"{total / responses * cpu:,.0f} CPU s", f"{total / responses * elapsed:,.0f} s at this wall-clock rate; --full feeds it all"))
    rows.append(
        (
            "2",
            f"{label}: state after",
            f"history {len(instance.history)}",
            f"{instance.history.pushed:,} commands pushed, {instance.history.reductions} reductions; "
            f"{instance.late_peek_responses:,} late peek responses dropped; pending peeks {len(instance.peeks)}",
        )
    )
    return rows


def state_machine_profile() -> None:
    """cProfile over a prefix of the 100-dataflow stream; the top entries to stderr."""
    instance, ids = build_instance(SM_DATAFLOWS, SM_REPLICAS)
    ops, total = build_stream(ids, SM_REPLICAS, SM_PROFILE_STEPS)
    profile = cProfile.Profile()
    profile.enable()
    feed(instance, ops, None)
    profile.disable()
    print(f"\ncProfile of the state machine over {total:,} responses (100 dataflows, 2 replicas):", file=sys.stderr)
    stats = pstats.Stats(profile, stream=sys.stderr)
    stats.sort_stats("tottime").print_stats(15)
    stats.sort_stats("cumulative").print_stats(15)


def durable_cost(root: Path) -> list[Row]:
    """What the driver's durable worker does per batch (runtime.Controller._record:
    `Catalog.record_compute_frontiers`, one transaction): a batch of one since and one
    storage hold, and one of a since and a hold for each of `SM_DATAFLOWS` dataflows (a
    frontier report moving them all at once). Timed on a scratch SQLite catalog."""
    catalog = Catalog.open(f"sqlite:///{root / 'scratch-catalog.db'}")
    try:
        catalog.become_controller()  # our own scratch catalog: fences nobody
        storage = Storage(catalog, root / "scratch-blobs")
        catalog.create_instance(INSTANCE)
        source = storage.create_source("events", SCHEMA).id
        indexes = [
            catalog.create_dataflow(
                INSTANCE, f"{DATAFLOW}_{n}", sql=DATAFLOW_SQL, imports=[h.Import("events", source, "storage")], schema=SCHEMA, as_of=h.Frontier(1), index_key=["k"]
            ).index_id
            for n in range(SM_DATAFLOWS)
        ]
        timings: dict[int, list[float]] = {1: [], SM_DATAFLOWS: []}
        t = 1
        for size, samples in timings.items():
            for round in range(WARMUP + FLOOR_PEEKS // 4):
                t += 1
                sinces = {id: h.Frontier(t) for id in indexes[:size]}
                holds = [(source, dataflow_holder(INSTANCE, id), h.Frontier(t)) for id in indexes[:size]]
                started = time.perf_counter()
                catalog.record_compute_frontiers(sinces, holds)
                if round >= WARMUP:
                    samples.append(time.perf_counter() - started)
    finally:
        catalog.close()
    one, all_ = timings[1], timings[SM_DATAFLOWS]
    return [
        ("2", "durable worker: a batch of 1 since + 1 hold", p50_p99(one), f"one transaction; at p50 {1 / pct(one, 50):,.0f} batches/s"),
        (
            "2",
            f"durable worker: a batch of {SM_DATAFLOWS} sinces + {SM_DATAFLOWS} holds",
            p50_p99(all_),
            f"one transaction; {1000 * pct(all_, 50) / (2 * SM_DATAFLOWS):.2f} ms per value at p50; scratch SQLite catalog",
        ),
    ]


def part2(root: Path, budget_s: float | None, small_budget_s: float | None) -> list[Row]:
    rows = state_machine_run(SM_DATAFLOWS, budget_s, f"{SM_DATAFLOWS} dataflows, {SM_REPLICAS} replicas")
    rows += state_machine_run(SM_SMALL_DATAFLOWS, small_budget_s, f"{SM_SMALL_DATAFLOWS} dataflows, {SM_REPLICAS} replicas")
    rows += durable_cost(root)
    return rows


def peek_step_cost() -> float:
    """Seconds per peek in the state machine of part 1's shape (1 replica, 1 dataflow):
    `instance.peek` + `handle_response(PeekResponse)` (answer, CancelPeek, holds)."""
    instance, ids = build_instance(1, 1)
    for id in ids:
        instance.handle_response("r0", 1, h.FrontiersResponse(id, h.Frontier(T0 + 101)))
    rows = h.PeekRows(b"\0" * 512, 33, "digest")
    peeks = [h.Peek(f"p{i}", h.IndexTarget(ids[0]), T0 + 100, h.RowSetFinishing(key=("k001",))) for i in range(2_000)]
    started = time.perf_counter()
    for peek in peeks:
        instance.peek(peek)
        instance.handle_response("r0", 1, h.PeekResponse(peek.uuid, rows))
    return (time.perf_counter() - started) / len(peeks)


# --- Part 1: through the controller vs straight to a replica -----------------------------


def rows_of(result: h.PeekResult) -> pa.Table:
    if not isinstance(result, h.PeekRows):
        raise RuntimeError(f"direct peek failed: {result}")
    return ipc_to_table(result.arrow_ipc)


def copy_catalog(data_dir: Path, target: Path) -> str:
    """A consistent snapshot of the controller's SQLite catalog (backup API: safe while
    the controller writes); its URL."""
    source = sqlite3.connect(data_dir / "catalog.db")
    copy = sqlite3.connect(target)
    try:
        with copy:
            source.backup(copy)
    finally:
        copy.close()
        source.close()
    return f"sqlite:///{target}"


def spawn_direct(root: Path, url: str, blob_dir: Path, parallelism: str | None) -> ReplicaProcess:
    """A replica process sized like `xsmall` (local[1]; the replica's default driver memory
    is xsmall's 512m) with the instance's launch-time parallelism, as the orchestrator
    starts one; its scratch dir lands in our temporary directory through TMPDIR."""
    scratch = root / "direct-tmp"
    scratch.mkdir(exist_ok=True)
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(scratch)
    try:
        conf = {"spark.default.parallelism": parallelism} if parallelism else {}
        return ReplicaProcess(url, blob_dir, master="local[1]", spark_conf=conf, log_path=root / "direct-replica.log")
    finally:
        if saved is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved


def setup_controller(data_dir: Path, opened: dict) -> Client:
    log("starting the controller (tandem serve)")
    started = time.perf_counter()
    opened["controller"] = controller = ControllerProcess(data_dir)
    client = opened["client"] = Client.connect(controller.address, timeout=60, deadline=SPAWN_TIMEOUT_S)
    log(f"controller at {controller.address} in {time.perf_counter() - started:.1f} s; adding replica r1 (xsmall)")
    client.create_instance(INSTANCE)
    client.add_replica(INSTANCE, "r1", size="xsmall")
    client.create_source("events", SCHEMA)
    client.append("events", events_table())
    client.create_dataflow(INSTANCE, DATAFLOW, DATAFLOW_SQL, index_key=["k"])
    first = client.peek(INSTANCE, DATAFLOW, key="k000", consistency="strict", timeout_ms=SPAWN_TIMEOUT_S * 1000)
    if first.table.num_rows == 0:
        raise RuntimeError("the index has no rows for k000")
    wait_until(lambda: all(r.in_sync for r in client.status(INSTANCE)[0].replicas), SPAWN_TIMEOUT_S, "r1 in sync")
    log(f"r1 hydrated and in sync ({time.perf_counter() - started:.1f} s since the controller started)")
    return client


def setup_direct(root: Path, data_dir: Path, opened: dict) -> tuple[ScriptedClient, h.IndexTarget, int, str]:
    url = copy_catalog(data_dir, root / "direct-catalog.db")
    catalog = Catalog.open(url)
    try:
        info = catalog.dataflow_by_name(INSTANCE, DATAFLOW)
        instance = catalog.get_instance(INSTANCE)
        source = catalog.get_collection(info.imports[0].id)
    finally:
        catalog.close()
    as_of = info.as_of.join(source.since)
    if not (as_of < source.upper):
        raise RuntimeError(f"the catalog copy cannot serve as_of {as_of}: source upper {source.upper}")
    desc = info.description(as_of=as_of)
    index = desc.export_ids[0]
    log(f"starting the direct replica (same size) on a catalog copy: {desc.name} = {index}, as_of {as_of.time}, source upper {source.upper.time}")
    replica = opened["direct"] = spawn_direct(root, url, data_dir / "blobs", instance.config.conf().get("spark.default.parallelism"))
    client = opened["direct_client"] = ScriptedClient(replica.address, epoch=1)
    commands: list[h.ComputeCommand] = [h.CreateInstance(instance.config)]
    if instance.parameters is not None:
        commands.append(h.UpdateConfiguration(instance.parameters))
    commands += [h.CreateDataflow(desc), h.Schedule(index), h.InitializationComplete()]
    client.send(*commands)
    frontier = client.wait_frontier(index, as_of.time, timeout=SPAWN_TIMEOUT_S)
    if frontier.is_empty:
        raise RuntimeError(f"direct replica: {index} closed")
    note = f"second replica process, local[1] 512m, on a snapshot copy of the controller's catalog; index {index} at {frontier.time - 1}"
    return client, h.IndexTarget(index), frontier.time - 1, note


def background_cpu(pids: dict[str, int], seconds: float = 3.0) -> dict[str, float]:
    """CPU seconds per second each process spends with no peeks (ticks, the advancer,
    frontier reports, heartbeats)."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    return {name: (cpu_seconds(pid) - before[name]) / seconds for name, pid in pids.items()}


def part1(client: Client, data_dir: Path, direct: ScriptedClient, target: h.IndexTarget, direct_ts: int, direct_note: str, pids: dict[str, int]) -> list[Row]:
    all_keys = keys()
    # The same rows both ways, for a few keys.
    for k in all_keys[:3]:
        via = client.peek(INSTANCE, DATAFLOW, key=k).table
        straight = rows_of(direct.timed_peek(target, direct_ts, h.RowSetFinishing(key=(k,)))[1])
        if via.num_rows < 1 or via.to_pylist() != straight.to_pylist():
            raise RuntimeError(f"controller and direct peeks disagree for {k!r}: {via.num_rows} vs {straight.num_rows} rows")
    for i in range(WARMUP):
        client.peek(INSTANCE, DATAFLOW, key=all_keys[i])
        direct.timed_peek(target, direct_ts, h.RowSetFinishing(key=(all_keys[i],)))

    idle = background_cpu(pids)
    log(f"part 1: {PEEKS} controller peeks interleaved with {PEEKS} direct peeks")
    via_controller, straight, row_counts, timestamps = [], [], [], []
    last_bytes = b""
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    loop_started = time.perf_counter()
    for i in range(PEEKS):
        k = all_keys[(i * 7) % KEYS]
        started = time.perf_counter()
        result = client.peek(INSTANCE, DATAFLOW, key=k)
        via_controller.append(time.perf_counter() - started)
        row_counts.append(result.table.num_rows)
        timestamps.append(result.timestamp)
        rtt, answer = direct.timed_peek(target, direct_ts, h.RowSetFinishing(key=(k,)))
        if not isinstance(answer, h.PeekRows):
            raise RuntimeError(f"direct peek failed: {answer}")
        straight.append(rtt)
        last_bytes = answer.arrow_ipc
    loop_s = time.perf_counter() - loop_started
    cpu_per_peek = {name: (cpu_seconds(pid) - cpu_before[name] - idle[name] * loop_s) / PEEKS for name, pid in pids.items()}
    added = pct(via_controller, 50) - pct(straight, 50)

    # The pieces of the controller's path, each on its own.
    log("part 1: timing the pieces of the controller's path")
    stub = client._stub  # the client's own channel: the floor of a unary call to the controller
    version = []
    for i in range(WARMUP + FLOOR_PEEKS):
        started = time.perf_counter()
        stub.GetVersion(pb.GetVersionRequest(), timeout=10)
        if i >= WARMUP:
            version.append(time.perf_counter() - started)
    missing = []
    for i in range(WARMUP + FLOOR_PEEKS):
        started = time.perf_counter()
        try:
            client.peek(INSTANCE, "no_such_dataflow", key="k000")
        except TandemError as error:
            if error.code != grpc.StatusCode.NOT_FOUND:
                raise
        else:
            raise RuntimeError("a peek of a missing dataflow succeeded")
        if i >= WARMUP:
            missing.append(time.perf_counter() - started)
    decode = []
    message = codec.read_result_to_proto(last_bytes, direct_ts, "r1")
    for i in range(WARMUP + FLOOR_PEEKS):
        started = time.perf_counter()
        codec.read_result_from_proto(message)  # client: the ReadResult's rows as a table
        if i >= WARMUP:
            decode.append(time.perf_counter() - started)
    state_machine = peek_step_cost()
    explained = pct(version, 50) + pct(decode, 50) + state_machine
    rows_per_peek = statistics.mean(row_counts)

    return [
        ("1", f"through the controller: Client.peek key, serializable (N={PEEKS})", p50_p99(via_controller), f"max {ms(max(via_controller))} ms; {rows_per_peek:.0f} rows per peek; read at W-1 (last {timestamps[-1]})"),
        ("1", f"straight to a replica: Peek on its stream (N={PEEKS})", p50_p99(straight), f"max {ms(max(straight))} ms; {direct_note}"),
        ("1", "added by the controller at p50", f"{ms(added)} ms", "goal < 1 ms: " + ("met" if added < 1e-3 else "NOT met") + f"; at p99 {ms(pct(via_controller, 99) - pct(straight, 99))} ms"),
        ("1", "  unary call floor: GetVersion on the client's channel", p50_p99(version), "client stub + gRPC + grpc.aio servicer, no controller work"),
        ("1", "  Client.peek of a missing dataflow (NOT_FOUND)", p50_p99(missing), "floor + the instance's name lookup + abort; no replica"),
        ("1", "  client: ReadResult rows -> pyarrow table", p50_p99(decode), f"{len(last_bytes):,} IPC bytes, passed through the controller as the replica sent them; the direct path's time excludes this decode"),
        ("1", "  state machine: peek + answer (1 replica, 1 dataflow)", f"{state_machine * 1e6:,.0f} us", "instance.peek + handle_response (CancelPeek, holds)"),
        ("1", "  sum of the pieces at p50 / rest", f"{ms(explained)} / {ms(added - explained)} ms", "rest: asyncio hops (stream writer task, response reader), aio stream vs threaded stream, codecs"),
        (
            "1",
            "CPU per peek: controller process",
            f"{ms(cpu_per_peek['controller'])} ms",
            f"from /proc, less its idle rate ({idle['controller'] * 100:.1f}% of a core with no peeks)",
        ),
        (
            "1",
            "CPU per peek: replica r1 (via controller) / direct replica",
            f"{ms(cpu_per_peek['r1'])} / {ms(cpu_per_peek['direct'])} ms",
            f"Python processes only (key peeks start no Spark job); idle {idle['r1'] * 100:.1f}% / {idle['direct'] * 100:.1f}% of a core",
        ),
    ]


# --- Part 3: throughput ------------------------------------------------------------------


def throughput(address: str, seconds: float) -> tuple[list[float], collections.Counter, list[str], float]:
    """K threads, one Client each, key peeks back to back for `seconds`."""
    latencies: list[list[float]] = [[] for _ in range(THREADS)]
    winners: list[collections.Counter] = [collections.Counter() for _ in range(THREADS)]
    errors: list[str] = []
    ready = threading.Barrier(THREADS + 1)
    go = threading.Event()
    stop_at = [0.0]
    all_keys = keys()

    def worker(n: int) -> None:
        rng = random.Random(n)
        with Client.connect(address, timeout=30) as own:
            for _ in range(5):  # warm the channel
                own.peek(INSTANCE, DATAFLOW, key=rng.choice(all_keys))
            ready.wait()
            go.wait()
            while time.perf_counter() < stop_at[0]:
                started = time.perf_counter()
                try:
                    result = own.peek(INSTANCE, DATAFLOW, key=rng.choice(all_keys))
                except TandemError as error:
                    errors.append(f"{error.code.name}: {error.message}")
                    continue
                latencies[n].append(time.perf_counter() - started)
                winners[n][result.replica] += 1

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    ready.wait(timeout=120)
    started = time.perf_counter()
    stop_at[0] = started + seconds
    go.set()
    for thread in threads:
        thread.join(seconds + 120)
    elapsed = time.perf_counter() - started
    merged = [x for lat in latencies for x in lat]
    won = sum(winners, collections.Counter())
    return merged, won, errors, elapsed


def spy(pid: int, seconds: float, output: str | None) -> subprocess.Popen | None:
    """py-spy sampling `pid` for `seconds` into `output` (raw collapsed stacks), if asked."""
    if output is None:
        return None
    spy_bin = Path(sys.executable).parent / "py-spy"
    command = [str(spy_bin), "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200", "--format", "raw", "--threads", "--nonblocking", "--output", output]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def part3(client: Client, controller_pid: int, spy_prefix: str | None = None) -> list[Row]:
    rows: list[Row] = []
    results = {}
    for replicas in (1, 2):
        if replicas == 2:
            log("part 3: adding replica r2 (xsmall) and waiting until it is in sync")
            started = time.perf_counter()
            client.add_replica(INSTANCE, "r2", size="xsmall")
            wait_until(
                lambda: (v := client.status(INSTANCE)[0]) and len(v.replicas) == 2 and all(r.in_sync for r in v.replicas),
                SPAWN_TIMEOUT_S,
                "r2 in sync",
            )
            rows.append(("3", "add_replica r2 -> both in sync", f"{time.perf_counter() - started:,.1f} s", "spawn (JVM) + replay + hydration"))
        before = client.status(INSTANCE)[0]
        pids = {"controller": controller_pid, **{r.name: r.pid for r in before.replicas}}
        log(f"part 3: {THREADS} threads x {THROUGHPUT_S:.0f} s of key peeks with {replicas} replica(s)")
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        spying = spy(controller_pid, THROUGHPUT_S, spy_prefix and f"{spy_prefix}-{replicas}.txt")
        latencies, won, errors, elapsed = throughput(client.address, THROUGHPUT_S)
        cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
        if spying is not None:
            spying.wait(60)
        after = client.status(INSTANCE)[0]
        if not latencies:
            raise RuntimeError(f"no peek succeeded with {replicas} replica(s): {errors[:3]}")
        rate = len(latencies) / elapsed
        results[replicas] = rate
        pushed = (after.commands_pushed - before.commands_pushed) / len(latencies)
        rows.append(
            (
                "3",
                f"{replicas} replica{'s' if replicas > 1 else ''}: {THREADS} threads x {THROUGHPUT_S:.0f} s",
                f"{rate:,.0f} peeks/s",
                f"{p50_p99(latencies)}; {len(latencies):,} peeks, {len(errors)} errors"
                + (f" (first: {errors[0]})" if errors else "")
                + "; answered by " + ", ".join(f"{name} {n:,}" for name, n in sorted(won.items())),
            )
        )
        rows.append(
            (
                "3",
                f"  {replicas} replica{'s' if replicas > 1 else ''}: CPU (share of a core)",
                f"controller {cpu['controller'] / elapsed * 100:.0f}%",
                f"{ms(cpu['controller'] / len(latencies))} ms controller CPU per peek; replica Python processes "
                + ", ".join(f"{name} {cpu[name] / elapsed * 100:.0f}%" for name in sorted(cpu) if name != "controller"),
            )
        )
        rows.append(
            (
                "3",
                f"  {replicas} replica{'s' if replicas > 1 else ''}: history while peeking",
                f"{pushed:.2f} commands/peek",
                f"commands pushed {before.commands_pushed:,} -> {after.commands_pushed:,}, reductions {before.history_reductions} -> {after.history_reductions}, "
                f"length now {after.history_length}; health {after.health}",
            )
        )
    rows.append(("3", "2 replicas / 1 replica throughput", f"{results[2] / results[1]:.2f}x", f"{os.cpu_count()} cores shared by the controller, the replicas and the {THREADS} client threads"))
    return rows


# --- Main -------------------------------------------------------------------------------


def print_table(rows: list[Row]) -> None:
    header = ("part", "measure", "value", "note")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    print()
    print(f"{header[0]:<{widths[0]}}  {header[1]:<{widths[1]}}  {header[2]:>{widths[2]}}  {header[3]}")
    print(f"{'-' * widths[0]}  {'-' * widths[1]}  {'-' * widths[2]}  {'-' * 4}")
    previous = None
    for part, measure, value, note in rows:
        if previous is not None and part != previous:
            print()
        previous = part
        print(f"{part:<{widths[0]}}  {measure:<{widths[1]}}  {value:>{widths[2]}}  {note}".rstrip())


def log_findings(data_dir: Path) -> Row:
    """Warnings and errors in the controller's log over the run."""
    path = data_dir / "controller.log"
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    warnings = [line for line in lines if " WARNING " in line]
    errors = [line for line in lines if " ERROR " in line or " CRITICAL " in line]
    first = (errors or warnings or [""])[0]
    return ("-", "controller log", f"{len(warnings)} warnings, {len(errors)} errors", first[:160])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (catalog, blobs, logs)")
    parser.add_argument("--full", action="store_true", help="part 2: feed the whole streams, however long it takes")
    parser.add_argument("--profile", action="store_true", help="part 2: print a cProfile of the state machine to stderr")
    parser.add_argument("--only-state-machine", action="store_true", help="run part 2 only (no processes)")
    parser.add_argument("--spy-controller", metavar="PREFIX", help="part 3: py-spy the controller into PREFIX-1.txt and PREFIX-2.txt (raw stacks)")
    args = parser.parse_args(argv)

    def terminate(signum: int, frame: object) -> None:  # leave through the finally below
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    load_start = os.getloadavg()
    print(
        f"controller_bench on {platform.node()}: nproc {os.cpu_count()}, Python {platform.python_version()}, "
        f"PySpark {pyspark.__version__}, pyarrow {pa.__version__}, grpcio {grpc.__version__}, {java_version()}; "
        f"replicas xsmall (local[1], 512m); load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} at start"
    )
    print(f"reproduce: cd {ROOT} && .venv/bin/python bench/controller_bench.py", flush=True)
    root = Path(tempfile.mkdtemp(prefix="tandem-controller-bench-"))
    data_dir = root / "data"
    started = time.perf_counter()
    opened: dict = {}
    rows: list[Row] = []
    try:
        # Part 2 first: pure Python, while none of our processes run.
        budget, small_budget = (None, None) if args.full else (SM_BUDGET_S, SM_SMALL_BUDGET_S)
        part2_rows = part2(root, budget, small_budget)
        if args.profile:
            state_machine_profile()
        if not args.only_state_machine:
            client = setup_controller(data_dir, opened)
            direct, target, direct_ts, note = setup_direct(root, data_dir, opened)
            pids = {
                "controller": opened["controller"].process.pid,
                "r1": next(r.pid for r in client.status(INSTANCE)[0].replicas if r.name == "r1"),
                "direct": opened["direct"].pid,
            }
            rows += part1(client, data_dir, direct, target, direct_ts, note, pids)
            opened.pop("direct_client").close()  # free its core for part 3
            opened.pop("direct").stop()
        rows += part2_rows
        if not args.only_state_machine:
            rows += part3(client, opened["controller"].process.pid, args.spy_controller)
            rows.append(log_findings(data_dir))
        load_end = os.getloadavg()
        rows.append(("-", "total run time", f"{time.perf_counter() - started:,.0f} s", f"load average {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f} at end"))
        print_table(rows)
        return 0
    finally:
        if opened.get("direct_client") is not None:
            opened["direct_client"].close()
        if opened.get("direct") is not None:
            opened["direct"].stop()
        if opened.get("client") is not None:
            opened["client"].close()
        if opened.get("controller") is not None:
            opened["controller"].stop()  # SIGTERM; replicas keep running ...
        if (data_dir / "catalog.db").exists():
            kill_replicas(data_dir)  # ... until killed here
        if args.keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
