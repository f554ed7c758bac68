"""Failover benchmark: what a crash, a slow replica, a long history and a controller
restart cost the readers, next to Spark Structured Streaming restarting from its
checkpoint.

    .venv/bin/python bench/failover_bench.py            # all five, 10-15 minutes
    .venv/bin/python bench/failover_bench.py --quick    # smaller counts, a smoke run (~6 minutes)
    .venv/bin/python bench/failover_bench.py --write    # and rewrite bench/RESULTS.md's table

Every measurement runs on a controller of its own (`tandem serve` on the embedded
defaults, controller._process), in its own directory under one temporary directory,
with `xsmall` replicas (local[1], 512m) and a source `events(id BIGINT NOT NULL, k
STRING, amount DOUBLE)` of 3,000 rows over 30 keys, appended once. Peeks are key peeks
(`Client.peek(..., key="k01")`, serializable) of `select k, sum(amount) as total,
count(*) as n from events group by k`, indexed on `k`. "Kill" is SIGKILL of the process
group (a replica and its JVM, or the peer and its JVM).

1. crash: a `PeekLoop` (one thread, 20 ms between peeks, 20 s peek timeout, answers
   checked against the rows read before) runs `steady_s` seconds against an instance
   with 1 replica, then the replica that won the most peeks is killed; the crash window
   runs from the kill until that replica is back in sync (epoch + 1) and a peek has
   been answered since the kill. Steady p50/p99 are over the peeks before the kill
   (the first 5 left out); the window's figures are over every peek that ended in it:
   the outage (longest time with no successful answer, from the kill on), the failed
   peeks, and p50/p99/max latency, also split at the moment the successor connected.
   Then the same with 2 replicas.
2. gray: an instance with one managed replica; `steady_s` of the same loop with it
   alone; then a second replica, a `python -m replica_service` started by hand
   (tests/replica_harness.py) and added by address through a `FaultProxy`
   (tests/fault_proxy.py): `steady_s` with both healthy, then `steady_s` with the proxy
   delaying every chunk each way by 5x the alone p50, so the slow replica answers at
   least 10x later than a steady peek; then the healthy replica is dropped and
   `steady_s` with the slow one alone shows how slow its answers are.
3. rehydration: kill the only replica of an instance right after it got in sync (about
   10 commands pushed), and of one whose history had `pushes` (100,000) commands pushed
   by 4 client threads of key peeks (each pushes a Peek and a CancelPeek); time from the
   kill until the replica is connected again (new process up, reduced history replayed)
   and until it is in sync. `kills` (3) of each, interleaved (a new short instance, the
   long one, ...) so that load from elsewhere falls on both alike; medians compared.
4. restart: one replica and `dataflows` (50) dataflows, `... where id % 50 = i group by
   k`. (a) kill the controller only, start it again, time until every dataflow answered
   one peek (in order, retried until answered); the replica must reconcile (status:
   dataflows_kept, dataflows_built, same pid). (b) kill the controller and its replica,
   start the controller again (it spawns the replica, which recomputes), same timing.
   Both clocks start when the new controller is started, right after the kills.
5. peer: Spark Structured Streaming in a child process of its own (this script with
   `--peer DIR`): a file source of JSON-lines files (the same 3,000 rows first, then
   100 rows every 0.5 s, written by this process and renamed into place), the same
   aggregation in complete mode into a memory sink (`totals`), checkpoint directory
   `DIR/checkpoint`, and a loop in that process querying `select total, n from totals
   where k = 'k01'` (a Spark job) every 20 ms, printing each answer with its
   CLOCK_MONOTONIC times. A memory sink, not a Parquet table: a table on disk would
   stay readable (and stale) through the crash, while Tandem's index, like the memory
   sink, lives in the serving process; so the peer's outage is the time its process is
   down plus its recovery. Its session is the replica's own (replica_service._spark:
   local[1], 512m, the same JVM options, PYSPARK_PYTHON = the child's interpreter) with
   the instance default `spark.sql.shuffle.partitions=4`, and nothing is downloaded.
   Killed after `peer_steady_s` and started again at once on the same checkpoint: the
   outage runs from the kill to the first answer of the new process. Shown beside the
   outage of measurement 1 (Tandem, 1 and 2 replicas).

Figures are printed, never asserted. A measurement that fails prints its error as its
row and the run goes on to the next (exit status 1). Every process is ended on the way
out, also on error, Ctrl-C or SIGTERM: controllers and their replicas
(`embedded_controller`), the hand-started replica and its proxy, the peer.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyspark

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from controller._api import ReplicaView  # noqa: E402
from controller._process import ControllerProcess, PeekLoop, embedded_controller, kill_replicas, wait_until  # noqa: E402
from controller.client import Client, TandemError  # noqa: E402
from fault_proxy import FaultProxy  # noqa: E402
from replica_harness import ReplicaProcess  # noqa: E402

SCHEMA = "id BIGINT NOT NULL, k STRING, amount DOUBLE"
ROWS, KEYS, KEY = 3_000, 30, "k01"
TOTALS = "select k, sum(amount) as total, count(*) as n from events group by k"
WAIT_S = 300.0  # for any one spawn, hydration or rehydration: JVM starts on a loaded 2-core machine
PEEK_TIMEOUT_MS = 20_000  # PeekLoop's: a peek on a dead lone replica waits this long for its successor
WARMUP_PEEKS = 5
PUSH_THREADS = 4
PEER_APPEND_EVERY_S, PEER_APPEND_ROWS = 0.5, 100
RESULTS = ROOT / "bench" / "RESULTS.md"
BEGIN, END = "<!-- failover_bench:begin -->", "<!-- failover_bench:end -->"

Row = tuple[str, str, str, str]  # measurement, measure, value, note


@dataclass(frozen=True)
class Plan:
    steady_s: float  # each steady phase of measurements 1 and 2
    pushes: int  # commands pushed into the long history of measurement 3
    kills: int  # measurement 3: of a short history and of the long one each
    dataflows: int  # measurement 4
    peer_steady_s: float


FULL = Plan(steady_s=20.0, pushes=100_000, kills=3, dataflows=50, peer_steady_s=10.0)
QUICK = Plan(steady_s=5.0, pushes=1_000, kills=1, dataflows=10, peer_steady_s=3.0)


# --- Helpers ----------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def pct(samples: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest sample with q% of them at or below it."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f}"


def latency(samples: list[float]) -> str:
    if not samples:
        return "none"
    return f"p50 {ms(pct(samples, 50))} / p99 {ms(pct(samples, 99))} / max {ms(max(samples))} ms"


def peeks(count: int) -> str:
    return f"{count} peek{'' if count == 1 else 's'}"


def counted(samples: list[float]) -> str:
    return peeks(len(samples)) + (f", {latency(samples)}" if samples else "")


def times(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:,.0f}x"


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def events() -> list[dict[str, Any]]:
    return [{"id": i, "k": f"k{i % KEYS:02d}", "amount": (i % 97) / 4} for i in range(ROWS)]


def kill_group(pid: int) -> None:
    """kill -9 of a process and its JVM: each leads a process group of its own."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def replicas(client: Client, instance: str) -> dict[str, ReplicaView]:
    return {r.name: r for r in client.status(instance)[0].replicas}


def all_in_sync(client: Client, instance: str) -> bool:
    return all(r.in_sync for r in replicas(client, instance).values())


def back_in_sync(client: Client, instance: str, victim: ReplicaView) -> tuple[float, float, ReplicaView]:
    """Wait until the killed `victim` is in sync again as a new incarnation; the
    time.monotonic() when it was first seen connected (process up, reduced history
    replayed) and in sync, and its view then. Status is polled every 0.25 s."""
    connected: list[float] = []

    def back() -> ReplicaView | None:
        replica = replicas(client, instance)[victim.name]
        if replica.epoch > victim.epoch and replica.state == "active" and not connected:
            connected.append(time.monotonic())
        return replica if replica.epoch > victim.epoch and replica.in_sync else None

    view = wait_until(back, WAIT_S, f"{instance}: {victim.name} back in sync")
    return connected[0], time.monotonic(), view


@contextlib.contextmanager
def tandem(root: Path, name: str) -> Iterator[tuple[ControllerProcess, Client]]:
    """A controller in `root/name` with the source `events` filled; on the way out it
    is stopped and every replica it spawned is killed."""
    with embedded_controller(root / name) as controller:
        with Client.connect(controller.address, timeout=60, deadline=WAIT_S) as client:
            client.create_source("events", SCHEMA)
            client.append("events", events())
            yield controller, client


def setup(client: Client, instance: str, names: list[str], dataflow: str) -> list[dict[str, Any]]:
    """An instance of xsmall replicas `names` computing TOTALS as `dataflow`, in sync;
    returns the rows of key KEY (what every later peek must answer)."""
    log(f"{instance}: {len(names)} replica(s), dataflow {dataflow}")
    client.create_instance(instance)
    for name in names:
        client.add_replica(instance, name, size="xsmall")
    client.create_dataflow(instance, dataflow, TOTALS, index_key=["k"])
    rows = client.peek(instance, dataflow, key=KEY, consistency="strict", timeout_ms=int(WAIT_S * 1000)).rows
    wait_until(lambda: all_in_sync(client, instance), WAIT_S, f"{instance}: replicas in sync")
    return rows


def warm_up(loop: PeekLoop) -> None:
    """Wait for the loop's first WARMUP_PEEKS peeks: a new channel's first are slower."""
    wait_until(lambda: len(loop.timings) >= WARMUP_PEEKS, WAIT_S, "the first peeks")


def steady(loop: PeekLoop, seconds: float) -> list[float]:
    """Latencies of the answered peeks of `loop` that start in the next `seconds`."""
    started = time.monotonic()
    time.sleep(seconds)
    return [end - begin for begin, end, ok in list(loop.timings) if ok and begin >= started]


def phase(address: str, instance: str, dataflow: str, expected: list[dict[str, Any]], seconds: float) -> tuple[list[float], int]:
    """A PeekLoop of its own for `seconds`: (latencies past the warm-up, failed peeks)."""
    with PeekLoop(address, instance, dataflow, key=KEY, expect=expected, timeout_ms=PEEK_TIMEOUT_MS) as loop:
        warm_up(loop)
        samples = steady(loop, seconds)
    return samples, len(loop.failures)


# --- 1. Crash masking ----------------------------------------------------------------------


@dataclass
class CrashWindow:
    seconds: float  # from the kill to its end
    outage: float  # longest time with no successful answer
    peeks: int
    failed: int
    latencies: list[float]  # of every peek that ended in the window, failed ones included
    down: list[float]  # those that ended before the victim reconnected
    rejoining: list[float]  # the others: while the victim replays and hydrates


def crash_window(loop: PeekLoop, killed: float, connected: float, in_sync: float) -> CrashWindow:
    """The window opens at the kill and closes when the victim is in sync again and a
    peek has been answered since the kill, whichever is later."""
    timings = list(loop.timings)
    first = min(end for _, end, ok in timings if ok and end > killed)
    closed = max(in_sync, first)
    inside = [(begin, end, ok) for begin, end, ok in timings if end > killed and begin <= closed]
    answers = sorted(end for _, end, ok in inside if ok and end <= closed)
    edges = [killed, *answers, closed]
    return CrashWindow(
        seconds=closed - killed,
        outage=max(b - a for a, b in zip(edges, edges[1:])),
        peeks=len(inside),
        failed=sum(not ok for *_, ok in inside),
        latencies=[end - begin for begin, end, _ in inside],
        down=[end - begin for begin, end, _ in inside if end < connected],
        rejoining=[end - begin for begin, end, _ in inside if end >= connected],
    )


def crash(root: Path, plan: Plan, found: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    with tandem(root, "crash") as (controller, client):
        for count in (1, 2):
            instance = f"crash{count}"
            label = f"{count} replica{'s' if count > 1 else ''}"
            expected = setup(client, instance, [f"r{i}" for i in range(1, count + 1)], f"{instance}_totals")
            with PeekLoop(controller.address, instance, f"{instance}_totals", key=KEY, expect=expected, timeout_ms=PEEK_TIMEOUT_MS) as loop:
                warm_up(loop)
                log(f"{instance}: {plan.steady_s:g} s steady")
                steady_latencies = steady(loop, plan.steady_s)
                failed_before = len(loop.failures)
                victim = max(replicas(client, instance).values(), key=lambda r: r.peeks_won)
                killed = time.monotonic()
                kill_group(victim.pid)
                log(f"{instance}: killed {victim.name} (pid {victim.pid}, {victim.peeks_won} peeks won)")
                connected, in_sync, back = back_in_sync(client, instance, victim)
                wait_until(lambda: any(ok and end > killed for _, end, ok in loop.timings), WAIT_S, "a peek answered after the kill")
            window = crash_window(loop, killed, connected, in_sync)
            found[f"outage {count}"] = window.outage
            steady_p99 = pct(steady_latencies, 99)
            rows.append(
                ("1 crash", f"{label}: steady ({len(steady_latencies)} peeks, {plan.steady_s:g} s)", f"p50 {ms(pct(steady_latencies, 50))} / p99 {ms(steady_p99)} ms", f"max {ms(max(steady_latencies))} ms; {failed_before} failed")
            )
            errors = sorted({f.split(":")[0] for f in loop.failures[failed_before:]})
            note = (
                f"{window.failed} of {peeks(window.peeks)} failed{' (' + ', '.join(errors) + ')' if errors else ''}; {latency(window.latencies)}; "
                f"window {window.seconds:.1f} s: kill of {victim.name} (most peeks won), its successor (epoch {back.epoch}) connected at {connected - killed:.1f} s, in sync at {in_sync - killed:.1f} s; "
                f"until it connected {counted(window.down)}; then {counted(window.rejoining)}"
            )
            if count == 2:
                ratio = pct(window.latencies, 99) / steady_p99
                note += f"; goal 0 failed and p99 <= 2x steady p99: {met(window.failed == 0 and ratio <= 2)} ({ratio:.2f}x)"
            rows.append(("1 crash", f"{label}: crash window outage", f"{window.outage:.2f} s", note))
            client.drop_instance(instance)
    return rows


# --- 2. Gray failure -----------------------------------------------------------------------


def gray(root: Path, plan: Plan, found: dict[str, Any]) -> list[Row]:
    from catalog import default_url  # SQLAlchemy: loaded only here, not in the peer child

    with tandem(root, "gray") as (controller, client):
        data_dir = controller.data_dir
        expected = setup(client, "gray", ["healthy"], "gray_totals")

        def measure(what: str) -> list[float]:
            log(f"gray: {plan.steady_s:g} s, {what}")
            samples, failed = phase(controller.address, "gray", "gray_totals", expected, plan.steady_s)
            if failed:
                raise RuntimeError(f"{failed} peeks failed with {what}")
            return samples

        alone = measure("the healthy replica alone")
        external = ReplicaProcess(default_url(data_dir), data_dir / "blobs", log_path=data_dir / "slow-replica.log")
        try:
            proxy = FaultProxy(external.address)
            try:
                client.add_replica("gray", "slow", address=proxy.address)
                wait_until(lambda: all_in_sync(client, "gray"), WAIT_S, "gray: both in sync")
                both = measure("both healthy (the second through the proxy)")
                delay = 5 * pct(alone, 50)
                proxy.delay(delay)
                before = replicas(client, "gray")
                grayed = measure(f"the second delayed {ms(delay)} ms each way")
                after = replicas(client, "gray")
                client.drop_replica("gray", "healthy")
                slow = measure("the slow one alone")
                client.drop_instance("gray")  # before the proxy goes: no reconnects to a closed port
            finally:
                proxy.close()
        finally:
            external.stop()
    won = {name: after[name].peeks_won - before[name].peeks_won for name in after}
    p50, p99 = pct(grayed, 50) / pct(alone, 50), pct(grayed, 99) / pct(alone, 99)
    return [
        ("2 gray", f"healthy replica alone ({len(alone)} peeks)", latency(alone), "baseline"),
        ("2 gray", f"+ a healthy second replica ({len(both)} peeks)", latency(both), "its traffic through the proxy, no delay"),
        (
            "2 gray",
            f"+ the second delayed {ms(delay)} ms each way ({len(grayed)} peeks)",
            latency(grayed),
            f"vs alone: p50 {p50:.2f}x, p99 {p99:.2f}x; goal <= 1.2x: {met(max(p50, p99) <= 1.2)}; peeks won: healthy {won['healthy']}, slow {won['slow']}",
        ),
        ("2 gray", f"the slow replica alone ({len(slow)} peeks)", latency(slow), f"its answers: {pct(slow, 50) / pct(alone, 50):.1f}x the healthy p50 (goal of the set-up: ~10x)"),
    ]


# --- 3. Rehydration time vs history length ----------------------------------------------


@dataclass
class Rehydration:
    pushed: int  # commands pushed before the kill
    length: int  # history length at the kill
    connected: float  # kill -> new incarnation active (process up, history replayed)
    in_sync: float  # kill -> in sync
    length_after: int
    reductions: int

    @property
    def hydrating(self) -> float:
        """Connected -> in sync: the dataflow computed again."""
        return self.in_sync - self.connected


def rehydrate(client: Client, instance: str) -> Rehydration:
    """Kill the instance's only replica; wait until it is back in sync."""
    before = client.status(instance)[0]
    killed = time.monotonic()
    kill_group(before.replicas[0].pid)
    connected, in_sync, _ = back_in_sync(client, instance, before.replicas[0])
    after = client.status(instance)[0]
    result = Rehydration(before.commands_pushed, before.history_length, connected - killed, in_sync - killed, after.history_length, after.history_reductions)
    log(f"{instance}: {result}")
    return result


def push(address: str, instance: str, dataflow: str, client: Client, target: int) -> tuple[int, int, float, int]:
    """Key peeks on PUSH_THREADS threads until `target` more commands were pushed;
    (commands pushed, peeks, seconds, failed peeks)."""
    stop = threading.Event()
    counts = [0] * PUSH_THREADS
    failed = [0] * PUSH_THREADS

    def worker(n: int) -> None:
        with Client(address) as own:
            while not stop.is_set():
                try:
                    own.peek(instance, dataflow, key=KEY)
                    counts[n] += 1
                except TandemError:
                    failed[n] += 1

    start = client.status(instance)[0].commands_pushed
    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(PUSH_THREADS)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    try:
        reported = started
        while (pushed := client.status(instance)[0].commands_pushed - start) < target:
            if time.monotonic() - reported > 30:
                reported = time.monotonic()
                log(f"{instance}: {pushed:,} of {target:,} commands pushed, {sum(counts) / (reported - started):,.0f} peeks/s")
            time.sleep(0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    return pushed, sum(counts), time.monotonic() - started, sum(failed)


def rehydration(root: Path, plan: Plan, found: dict[str, Any]) -> list[Row]:
    with tandem(root, "rehydration") as (controller, client):

        def short(n: int) -> Rehydration:
            instance = f"short{n}"
            setup(client, instance, ["r1"], f"{instance}_totals")
            result = rehydrate(client, instance)
            client.drop_instance(instance)
            return result

        setup(client, "long", ["r1"], "long_totals")
        log(f"long: pushing {plan.pushes:,} commands with {PUSH_THREADS} threads of key peeks")
        pushed, peeked, seconds, failed = push(controller.address, "long", "long_totals", client, plan.pushes)
        shorts, longs = [], []
        for n in range(1, plan.kills + 1):
            shorts.append(short(n))
            longs.append(rehydrate(client, "long"))

    def median(results: list[Rehydration], field: str) -> float:
        return statistics.median(getattr(r, field) for r in results)

    def each(results: list[Rehydration]) -> str:
        return "; ".join(
            f"pushed {r.pushed:,}, length {r.length} at the kill: connected {r.connected:.1f} s, in sync {r.in_sync:.1f} s, length after {r.length_after}"
            for r in results
        )

    def kills(results: list[Rehydration]) -> str:
        return f"{len(results)} kill{'s, median' if len(results) > 1 else ''}"

    ratio = median(longs, "in_sync") / median(shorts, "in_sync")
    return [
        (
            "3 rehydration",
            f"pushing: {peeked:,} key peeks on {PUSH_THREADS} threads",
            f"{peeked / seconds:,.0f} peeks/s",
            f"{pushed:,} commands pushed in {seconds:.0f} s ({pushed / seconds:,.0f}/s), {failed} failed peeks",
        ),
        ("3 rehydration", f"short history ({kills(shorts)})", f"{median(shorts, 'in_sync'):.1f} s", each(shorts)),
        (
            "3 rehydration",
            f"long history ({kills(longs)})",
            f"{median(longs, 'in_sync'):.1f} s",
            each(longs) + f"; {longs[-1].reductions:,} reductions",
        ),
        (
            "3 rehydration",
            f"long ({longs[0].pushed:,} pushed) / short",
            times(ratio),
            f"goal <= 1.1: {met(ratio <= 1.1)}; medians, short vs long: kill -> connected (spawn, replay) {median(shorts, 'connected'):.1f} vs {median(longs, 'connected'):.1f} s, "
            f"connected -> in sync (hydration) {median(shorts, 'hydrating'):.1f} vs {median(longs, 'hydrating'):.1f} s",
        ),
    ]


# --- 4. Controller restart to serving -------------------------------------------------------


def serve_all(address: str, names: list[str], started: float) -> tuple[float, float, int]:
    """Peek each dataflow in turn until it answers; (first answer, all answered) in
    seconds since `started`, and the refused or failed attempts."""
    first, failed = None, 0
    deadline = started + WAIT_S
    with Client.connect(address, timeout=60) as client:
        for name in names:
            while True:
                try:
                    client.peek("many", name, key=KEY, timeout_ms=60_000)
                    break
                except TandemError:
                    failed += 1
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            first = first or time.monotonic() - started
    return first, time.monotonic() - started, failed


def restart(root: Path, plan: Plan, found: dict[str, Any]) -> list[Row]:
    names = [f"df{i:02d}" for i in range(plan.dataflows)]
    rows: list[Row] = []
    with tandem(root, "restart") as (controller, client):
        client.create_instance("many")
        client.add_replica("many", "r1", size="xsmall")
        built = time.monotonic()
        for i, name in enumerate(names):
            sql = f"select k, sum(amount) as total, count(*) as n from events where id % {plan.dataflows} = {i} group by k"
            client.create_dataflow("many", name, sql, index_key=["k"])
        serve_all(controller.address, names, built)
        wait_until(lambda: all_in_sync(client, "many"), WAIT_S, "many: r1 in sync")
        log(f"many: {plan.dataflows} dataflows built and in sync in {time.monotonic() - built:.1f} s")
        served, listening = {}, {}
        with contextlib.ExitStack() as clients:
            current = client  # of the running controller
            for case, kill_replica in (("a", False), ("b", True)):
                before = replicas(current, "many")["r1"]
                controller.kill()
                if kill_replica:
                    kill_replicas(controller.data_dir)
                started = time.monotonic()
                controller.start()
                listening[case] = time.monotonic() - started
                first, served[case], failed = serve_all(controller.address, names, started)
                current = clients.enter_context(Client.connect(controller.address, timeout=60, deadline=WAIT_S))

                def accounted() -> ReplicaView | None:
                    """r1 in sync, with every dataflow kept or built since the restart (its
                    counters are per process; a heartbeat sent before it reconciled has
                    neither)."""
                    r = replicas(current, "many")["r1"]
                    counted = r.dataflows_kept + r.dataflows_built
                    if r.pid == before.pid:
                        counted -= before.dataflows_kept + before.dataflows_built
                    return r if r.in_sync and counted >= len(names) else None

                after = wait_until(accounted, WAIT_S, "many: r1 in sync, every dataflow kept or built")
                log(f"many ({case}): all served {served[case]:.1f} s after the restart; r1 pid {after.pid}, kept {after.dataflows_kept}, built {after.dataflows_built}")
                what = "controller killed, replica live: reconciles" if case == "a" else "controller and replica killed: respawned, recomputes"
                rows.append(
                    (
                        "4 restart",
                        f"({case}) {what}",
                        f"{served[case]:.1f} s",
                        f"all {plan.dataflows} dataflows answered, {served[case] - listening[case]:.1f} s after the new controller listened ({listening[case]:.1f} s); "
                        f"first answer at {first:.1f} s; {failed} attempts refused or failed before; "
                        f"r1 pid {before.pid} -> {after.pid}, dataflows kept {before.dataflows_kept} -> {after.dataflows_kept}, built {before.dataflows_built} -> {after.dataflows_built}",
                    )
                )
    after_listening = {case: served[case] - listening[case] for case in served}
    return rows + [
        (
            "4 restart",
            "(b) / (a)",
            times(served["b"] / served["a"]),
            f"what reconciliation saves on a controller crash; counted from when the controller listened: {after_listening['a']:.1f} s vs {after_listening['b']:.1f} s",
        )
    ]


# --- 5. The peer: Spark Structured Streaming --------------------------------------------------


def run_peer(directory: Path) -> int:
    """The peer's own process (`--peer DIR`): the streaming query, and a loop querying
    its memory sink, one line per answer on stdout."""
    from pyspark.sql import functions as F

    from replica_service._spark import SparkSettings, start_session

    spark = start_session(SparkSettings("local[1]", "512m", {"spark.sql.shuffle.partitions": "4"}), directory / "spark")
    print(f"session {time.monotonic():.6f}", flush=True)
    stream = spark.readStream.schema(SCHEMA.replace(" NOT NULL", "")).json(str(directory / "input"))
    totals = stream.groupBy("k").agg(F.sum("amount").alias("total"), F.count("*").alias("n"))
    query = (
        totals.writeStream.outputMode("complete")
        .format("memory")
        .queryName("totals")
        .option("checkpointLocation", str(directory / "checkpoint"))
        .start()
    )
    print(f"query {time.monotonic():.6f}", flush=True)
    while query.isActive:
        started = time.monotonic()
        answer = spark.sql(f"select total, n from totals where k = '{KEY}'").collect()
        if answer:
            print(f"answer {started:.6f} {time.monotonic():.6f} {answer[0].n}", flush=True)
        time.sleep(0.02)
    print(f"query ended: {query.exception()}", file=sys.stderr, flush=True)
    return 1


class Peer:
    """The peer process, started on `directory`, and the lines it printed (by kind, with
    their CLOCK_MONOTONIC values) read on a thread."""

    def __init__(self, directory: Path, log_path: Path) -> None:
        self.spawned = time.monotonic()
        self.lines: dict[str, list[list[float]]] = {"session": [], "query": [], "answer": []}
        with open(log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, __file__, "--peer", str(directory)],
                stdout=subprocess.PIPE,
                stderr=log_file,
                stdin=subprocess.DEVNULL,
                cwd=directory,  # whatever Spark leaves in its working directory stays there
                start_new_session=True,  # so the kill takes its JVM too
            )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            kind, *values = line.decode(errors="replace").split() or [""]
            if kind in self.lines:  # anything else on stdout is not ours
                self.lines[kind].append([float(v) for v in values])

    def first_answer(self) -> list[float]:
        """(started, finished, n) of its first answer."""

        def answered() -> list[float] | None:
            if self.process.poll() is not None:
                raise RuntimeError(f"the peer exited ({self.process.returncode}); see peer.log")
            return self.lines["answer"][0] if self.lines["answer"] else None

        return wait_until(answered, WAIT_S, "the peer's first answer")

    def kill(self) -> None:
        kill_group(self.process.pid)
        self.process.wait()


def append_files(input_dir: Path, stop: threading.Event) -> None:
    """The peer's input: the 3,000 rows first, then PEER_APPEND_ROWS every
    PEER_APPEND_EVERY_S; each file renamed into place (Spark skips names starting with
    a dot), so no partial file is ever listed."""
    batch, next_id = events(), ROWS
    for n in range(1_000_000):
        staging = input_dir / f".part-{n:06d}.json"
        staging.write_text("".join(json.dumps(row) + "\n" for row in batch))
        staging.rename(input_dir / f"part-{n:06d}.json")
        if stop.wait(PEER_APPEND_EVERY_S):
            return
        batch = [{"id": i, "k": f"k{i % KEYS:02d}", "amount": (i % 97) / 4} for i in range(next_id, next_id + PEER_APPEND_ROWS)]
        next_id += PEER_APPEND_ROWS


def peer(root: Path, plan: Plan, found: dict[str, Any]) -> list[Row]:
    directory = root / "peer"
    (directory / "input").mkdir(parents=True)
    stop = threading.Event()
    appender = threading.Thread(target=append_files, args=(directory / "input", stop), daemon=True)
    appender.start()
    peers: list[Peer] = []
    try:
        log("peer: starting Spark Structured Streaming (cold)")
        peers.append(Peer(directory, directory / "peer.log"))
        cold = peers[0].first_answer()[1] - peers[0].spawned
        log(f"peer: first answer {cold:.1f} s after the spawn; {plan.peer_steady_s:g} s steady")
        time.sleep(plan.peer_steady_s)
        steady_answers = peers[0].lines["answer"][WARMUP_PEEKS:]
        n_before = peers[0].lines["answer"][-1][2]
        killed = time.monotonic()
        peers[0].kill()
        peers.append(Peer(directory, directory / "peer.log"))  # at once, as a supervisor would
        started, answered, n_after = peers[1].first_answer()
        session, query = peers[1].lines["session"][0][0], peers[1].lines["query"][0][0]
    finally:
        stop.set()
        for process in peers:
            process.kill()
        appender.join(10)
    outage = answered - killed
    steady_latencies = [end - begin for begin, end, _ in steady_answers]
    rows: list[Row] = [
        ("5 peer", "Spark SS: cold start to first answer", f"{cold:.1f} s", "spawn, session, query start, first micro-batch, first query"),
        ("5 peer", f"Spark SS: steady in-process query ({len(steady_latencies)} queries)", latency(steady_latencies), "spark.sql on the memory sink: a Spark job per query"),
        (
            "5 peer",
            "Spark SS: kill -9, restart from checkpoint",
            f"{outage:.1f} s",
            f"outage until the first answer: session up {session - killed:.1f} s, query started {query - killed:.1f} s, answered {outage:.1f} s; "
            f"n for {KEY}: {n_before:.0f} in the last answer before the kill, {n_after:.0f} in the first after (not less: the state came back from the checkpoint)",
        ),
    ]
    for count in (1, 2):
        tandem_outage = found.get(f"outage {count}")
        label = f"Tandem, {count} replica{'s' if count > 1 else ''}: outage (from 1)"
        if tandem_outage is None:
            rows.append(("5 peer", label, "n/a", "run measurement crash in the same run"))
        else:
            rows.append(("5 peer", label, f"{tandem_outage:.2f} s", f"Spark SS outage / this: {times(outage / tandem_outage)}"))
    return rows


# --- Main -------------------------------------------------------------------------------


MEASUREMENTS: dict[str, Callable[[Path, Plan, dict[str, Any]], list[Row]]] = {
    "crash": crash,
    "gray": gray,
    "rehydration": rehydration,
    "restart": restart,
    "peer": peer,
}


def java_version() -> str:
    try:
        out = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.SubprocessError):
        return "Java ?"
    return out.splitlines()[0].replace('"', "") if out else "Java ?"


def code_version() -> str:
    """The checkout's commit, and whether files differ from it."""
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "code outside a git checkout"
    return f"commit {commit}" + (" with uncommitted changes" if changed else "")


def section(rows: list[Row], command: str, seconds: float, load: tuple[float, float]) -> str:
    """The generated part of RESULTS.md: the run's circumstances and the table."""
    lines = [
        BEGIN,
        f"Command: `{command}` (`--write` rewrites this section). "
        f"Run {dt.date.today().isoformat()} ({code_version()}) on {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"PySpark {pyspark.__version__}, {java_version()}; load average {load[0]:.2f} at the start, {load[1]:.2f} at the end "
        f"(other work shares the machine); {seconds / 60:.1f} minutes.",
        "",
        "| measurement | measure | value | note |",
        "|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join([*lines, END])


def write_results(text: str) -> None:
    current = RESULTS.read_text()
    begin, end = current.find(BEGIN), current.find(END)
    if begin < 0 or end < begin:
        raise SystemExit(f"{RESULTS} has no {BEGIN} ... {END} section to rewrite")
    RESULTS.write_text(current[:begin] + text + current[end + len(END) :])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--quick", action="store_true", help="smaller counts and shorter phases: a smoke run of a few minutes")
    parser.add_argument("--only", choices=MEASUREMENTS, action="append", help="run this measurement only (repeatable)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (catalogs, logs, checkpoints)")
    parser.add_argument("--write", action="store_true", help=f"rewrite the generated section of {RESULTS.relative_to(ROOT)}")
    parser.add_argument("--peer", type=Path, help=argparse.SUPPRESS)  # the peer's own process
    args = parser.parse_args(argv)
    if args.peer is not None:
        return run_peer(args.peer)

    def terminate(signum: int, frame: object) -> None:  # leave through the finally blocks
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    plan = QUICK if args.quick else FULL
    command = " ".join([".venv/bin/python bench/failover_bench.py", *(argv if argv is not None else sys.argv[1:])])
    root = Path(tempfile.mkdtemp(prefix="tandem-failover-bench-"))
    load_start, started = os.getloadavg()[0], time.monotonic()
    found: dict[str, Any] = {}
    rows: list[Row] = []
    failed = False
    try:
        for name in args.only or MEASUREMENTS:
            log(f"--- {name}")
            try:
                rows += MEASUREMENTS[name](root, plan, found)
            except Exception as error:  # the others still run; the error is the row
                traceback.print_exc()
                rows.append((name, "FAILED", type(error).__name__, str(error).splitlines()[0][:300] if str(error) else ""))
                failed = True
        rows += log_findings(root)
    finally:
        if args.keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    text = section(rows, command, time.monotonic() - started, (load_start, os.getloadavg()[0]))
    print(text)
    if args.write:
        write_results(text)
        log(f"wrote {RESULTS}")
    return 1 if failed else 0


def log_findings(root: Path) -> list[Row]:
    """Errors in the controllers' logs over the run (a bug the bench exposed shows here)."""
    rows: list[Row] = []
    for path in sorted(root.glob("*/controller.log")):
        lines = path.read_text(errors="replace").splitlines()
        errors = [line for line in lines if " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback")]
        warnings = sum(" WARNING " in line for line in lines)
        rows.append(("-", f"controller log ({path.parent.name})", f"{len(errors)} errors, {warnings} warnings", errors[0][:200] if errors else ""))
    return rows


if __name__ == "__main__":
    sys.exit(main())
