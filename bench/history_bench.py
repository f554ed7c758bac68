"""Benchmark: `CommandHistory` under a controller's steady workload.

    .venv/bin/python bench/history_bench.py [--commands N] [--seed S] [--verify]

The workload is what one instance's history sees in production: about 100 live dataflows
whose exports receive `AllowCompaction`s as time advances, peeks answered a few ticks
later (each followed by its `CancelPeek`), now and then a dataflow dropped and another
created with fresh ids, and occasional configuration updates. Every command object is
built before the clock starts, so the figure measures the history (push plus amortized
reduction), not the workload generator.

Targets: at least 200,000 pushes/s amortized over the whole run, reductions included; and
a final length at most twice the reduced size (the history stays bounded by what is live,
whatever the number of commands pushed). Exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from history import (  # noqa: E402
    AllowCompaction,
    CancelPeek,
    CommandHistory,
    ComputeCommand,
    ComputeParameters,
    CreateDataflow,
    CreateInstance,
    DataflowDescription,
    Frontier,
    Import,
    IndexExport,
    IndexTarget,
    InitializationComplete,
    InstanceConfig,
    Peek,
    RowSetFinishing,
    Schedule,
    SinkExport,
    UpdateConfiguration,
    apply,
)

TARGET_PUSHES_PER_SECOND = 200_000
LIVE_DATAFLOWS = 100
COMPACTION_LAG = 10  # ticks between "now" and the compaction frontier
PEEK_LATENCY = (1, 5)  # ticks until a peek is answered and canceled
CHURN_EVERY = 2_000  # commands between a drop and a create
CONFIG_EVERY = 25_000  # commands between configuration updates


class TimedHistory(CommandHistory):
    """A `CommandHistory` that times its reductions and notes the longest it got.

    The length peaks right before a reduction, so recording it there costs nothing on
    the push path.
    """

    __slots__ = ("reduce_seconds", "longest")

    def __init__(self) -> None:
        self.reduce_seconds = 0.0
        self.longest = 0
        super().__init__()

    def reduce(self) -> None:
        self.longest = max(self.longest, len(self))
        started = time.perf_counter()
        super().reduce()
        self.reduce_seconds += time.perf_counter() - started


class Workload:
    """Builds the commands a controller would push, in order. Deterministic per seed."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)
        self.commands: list[ComputeCommand] = []
        self.next_id = 10  # u1..u9: storage sources
        self.next_uuid = 0
        self.now = COMPACTION_LAG
        self.exports: dict[str, tuple[str, ...]] = {}  # dataflow key -> export ids
        self.indexes: list[str] = []  # index export ids of live dataflows
        self.pending: dict[int, list[str]] = {}  # tick -> uuids answered then
        self.held: dict[str, int] = {}  # index id -> peeks pending on it
        self.peek_targets: dict[str, str] = {}  # pending uuid -> index id
        self.frontiers: dict[
            int, Frontier
        ] = {}  # one object per time, as the controller shares them

    def frontier(self, time: int) -> Frontier:
        frontier = self.frontiers.get(time)
        if frontier is None:
            frontier = self.frontiers[time] = Frontier.at(time)
        return frontier

    def fresh_id(self) -> str:
        self.next_id += 1
        return f"u{self.next_id}"

    def create(self) -> None:
        rng = self.random
        index_exports = tuple(
            IndexExport(self.fresh_id(), ("id",)) for _ in range(rng.choice((1, 1, 2)))
        )
        sink_exports = (SinkExport(self.fresh_id()),) if rng.random() < 0.3 else ()
        imports = [Import("src", f"u{rng.randint(1, 9)}")]
        if self.indexes and rng.random() < 0.3:
            imports.append(Import("idx", rng.choice(self.indexes), "index"))
        desc = DataflowDescription(
            name=f"df_{index_exports[0].id}",
            sql="SELECT region, sum(amount) AS total FROM src GROUP BY region",
            imports=tuple(imports),
            index_exports=index_exports,
            sink_exports=sink_exports,
            as_of=self.frontier(self.now - COMPACTION_LAG),
            schema="region STRING, total DOUBLE",
        )
        self.commands.append(CreateDataflow(desc))
        self.commands.append(Schedule(desc.export_ids[0]))
        self.exports[desc.export_ids[0]] = desc.export_ids
        self.indexes.extend(e.id for e in index_exports)

    def drop(self) -> None:
        """Drop a dataflow nobody peeks (imports are not tracked: a real controller would
        hold the importer's inputs; the history does not check, and the cost is the same)."""
        candidates = [
            k for k, ids in self.exports.items() if not any(self.held.get(e) for e in ids)
        ]
        if not candidates:
            return
        key = self.random.choice(candidates)
        export_ids = self.exports.pop(key)
        empty = Frontier.empty()
        for export_id in export_ids:
            self.commands.append(AllowCompaction(export_id, empty))
        self.indexes = [i for i in self.indexes if i not in export_ids]

    def peek(self) -> None:
        target = self.random.choice(self.indexes)
        uuid = f"p{self.next_uuid}"
        self.next_uuid += 1
        self.commands.append(Peek(uuid, IndexTarget(target), self.now, RowSetFinishing(limit=100)))
        self.pending.setdefault(self.now + self.random.randint(*PEEK_LATENCY), []).append(uuid)
        self.held[target] = self.held.get(target, 0) + 1
        self.peek_targets[uuid] = target

    def answer_due_peeks(self) -> None:
        for uuid in self.pending.pop(self.now, ()):
            self.commands.append(CancelPeek(uuid))
            target = self.peek_targets.pop(uuid)
            self.held[target] -= 1

    def compact(self) -> None:
        """Forward the since of a few exports: `now - lag`, never past a pending peek
        (peeks read at a `now` later than that)."""
        frontier = self.frontier(self.now - COMPACTION_LAG)
        for key in self.random.sample(list(self.exports), 8):
            for export_id in self.exports[key]:
                self.commands.append(AllowCompaction(export_id, frontier))

    def build(self, total: int) -> list[ComputeCommand]:
        rng = self.random
        self.commands.append(
            CreateInstance(InstanceConfig.of("bench", {"spark.sql.shuffle.partitions": "8"}))
        )
        self.commands.append(UpdateConfiguration(ComputeParameters(max_result_rows=10_000)))
        for _ in range(LIVE_DATAFLOWS):
            self.create()
        self.commands.append(InitializationComplete())
        next_churn, next_config = CHURN_EVERY, CONFIG_EVERY
        while len(self.commands) < total:
            self.now += 1
            self.answer_due_peeks()
            self.compact()
            for _ in range(rng.randint(0, 4)):
                self.peek()
            if len(self.commands) >= next_churn:
                next_churn += CHURN_EVERY
                self.drop()
                while len(self.exports) < LIVE_DATAFLOWS:
                    self.create()
            if len(self.commands) >= next_config:
                next_config += CONFIG_EVERY
                self.commands.append(
                    UpdateConfiguration(
                        ComputeParameters(heartbeat_interval_ms=rng.choice((250, 500, 1000)))
                    )
                )
        return self.commands[:total]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--commands", type=int, default=1_000_000, help="commands to push (default 1,000,000)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--verify",
        action="store_true",
        help="also check the reduced history means what all commands mean",
    )
    args = parser.parse_args(argv)

    started = time.perf_counter()
    commands = Workload(args.seed).build(args.commands)
    built_in = time.perf_counter() - started
    kinds: dict[str, int] = {}
    for command in commands:
        kinds[type(command).__name__] = kinds.get(type(command).__name__, 0) + 1

    history = TimedHistory()
    push = history.push
    gc.collect()
    gc.freeze()  # the pre-built workload is not the history's garbage to scan
    started, cpu_started = time.perf_counter(), time.process_time()
    for command in commands:
        push(command)
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    load = os.getloadavg()[0]

    final_length = len(history)
    longest = max(history.longest, final_length)
    reductions = history.reductions
    history.reduce()
    reduced_size = len(history)
    rate = len(commands) / elapsed

    by_kind = sorted(kinds.items(), key=lambda kv: -kv[1])
    cpu_rate = len(commands) / cpu
    in_reduce = history.reduce_seconds
    print(f"workload:        {len(commands):,} commands, pre-built in {built_in:.2f} s (not timed)")
    print("                 " + ", ".join(f"{name} {count:,}" for name, count in by_kind))
    print(f"pushed:          {history.pushed:,} commands in {elapsed:.3f} s")
    print(f"pushes/s:        {rate:,.0f} (amortized over the whole run, reductions included)")
    print(f"  per CPU second {cpu_rate:,.0f} (process time {cpu:.3f} s, load average {load:.2f})")
    print(f"time in reduce:  {in_reduce:.3f} s ({100 * in_reduce / elapsed:.1f}% of the run)")
    print(f"reductions:      {reductions:,}")
    print(f"length:          max {longest:,}, final {final_length:,}")
    print(f"reduced size:    {reduced_size:,} (length after a final explicit reduce())")

    rate_ok = rate >= TARGET_PUSHES_PER_SECOND
    bound_ok = final_length <= 2 * reduced_size
    print(f"target pushes/s >= {TARGET_PUSHES_PER_SECOND:,}: {'met' if rate_ok else 'NOT met'}")
    if not rate_ok and cpu_rate >= TARGET_PUSHES_PER_SECOND:
        print("  (met per CPU second: the machine is busy; run again on an idle one)")
    print(
        f"target final length <= 2 x reduced size ({final_length:,} <= {2 * reduced_size:,}): "
        f"{'met' if bound_ok else 'NOT met'}"
    )
    if args.verify:
        started = time.perf_counter()
        same = apply(history) == apply(commands)
        verdict = "means" if same else "DOES NOT mean"
        took = time.perf_counter() - started
        print(
            f"verify:          the reduced history {verdict} what all commands mean ({took:.1f} s)"
        )
        bound_ok = bound_ok and same
    return 0 if rate_ok and bound_ok else 1


if __name__ == "__main__":
    sys.exit(main())
