"""Spark settings for a light step, side by side: one of the freshness bench's shapes
stepped in-process after small changes, the steps taking each way in turn.

    .venv/bin/python bench/step_settings_bench.py [--shape a|b] [--rows 1000000] [--groups 100]
        [--change-rows 100] [--steps 40] [--way spark.sql.codegen.factoryMode=NO_CODEGEN] [--way k1=v1,k2=v2] ...

The shape's query (`freshness_bench.SHAPES`) over `--rows` generated rows, in `--groups`
regions (the state's groups, for (a)), is kept by Tandem's own maintainer (incremental)
in one local[2] / 1 GB session with an instance's default settings, as a replica keeps
it. The first way is those settings; each `--way` sets the SQL confs it names on the
dataflow's session for its steps (the others' are put back before each step). The ways
take the steps round-robin, so whatever drifts over the run (the JIT still compiling,
the machine) falls on every way alike. Each change of `--change-rows` rows retracts 30%
of them from the loaded rows and inserts the rest (`_common.change`); a step is timed
from `step` to `finish` (its changes applied to the index's version). Printed: each
way's median step (the first two rounds left out: they compile code), and the JVM's CPU
per step over the timed rounds (all of Spark; this process's is mostly making the
changes). A setting changes how Spark runs a step, never what it computes (the tests
hold that); this measures only the time. A conf the step decides itself
(`Incremental._size_plans`: adaptive execution, shuffle partitions, the codegen factory
mode) is set again by the step, over the way's: such a way measures nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import GROUPS, JvmCpu, change, log, scratch_storage  # noqa: E402
from _in_process import SteppedFlow, load_sales, small_session  # noqa: E402
from freshness_bench import REGIONS, SHAPES, regions  # noqa: E402

import history as h  # noqa: E402
from replica_service.dataplane import StorageReader  # noqa: E402

WARM_ROUNDS = 2  # left out of the medians: the first steps compile code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("a", "b"), default="a")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--groups", type=int, default=GROUPS)
    parser.add_argument("--change-rows", type=int, default=100)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--way", action="append", default=[], help="SQL confs k=v[,k=v...] for one way")
    args = parser.parse_args()
    ways = [{}] + [dict(pair.split("=", 1) for pair in way.split(",")) for way in args.way]
    if args.steps <= WARM_ROUNDS * len(ways):
        parser.error(f"--steps must exceed {WARM_ROUNDS} warm rounds of the {len(ways)} ways")
    with tempfile.TemporaryDirectory(prefix="tandem-settings-") as directory:
        seconds, cpu = _run(Path(directory), args.shape, args.rows, args.groups, args.change_rows, args.steps, ways)
    print(f"\n## A light step of ({args.shape}) at {args.rows:,} rows, {args.groups:,} regions, {args.change_rows:,}-row changes, by Spark settings (local[2] / 1 GB, in-process)\n")
    print("| way | steps | median step |")
    print("|---|---|---|")
    for way, times in zip(ways, seconds):
        name = ", ".join(f"{k}={v}" for k, v in way.items()) or "the instance's settings"
        print(f"| {name} | {len(times)} | {statistics.median(times) * 1000:.0f} ms |")
    print(f"\nThe JVM's CPU per timed step, all ways: {cpu * 1000:.0f} ms")


def _run(root: Path, shape: str, rows: int, groups: int, change_rows: int, steps: int, ways: list[dict[str, str]]) -> tuple[list[list[float]], float]:
    """Each way's step seconds (after the warm rounds), and the JVM's CPU seconds per timed step."""
    storage = scratch_storage(root)
    session = small_session(root)
    sales = load_sales(storage, rows, groups=groups)
    sources = {"sales": sales}
    if shape == "b":
        sources["regions"] = storage.create_source("regions", REGIONS).id
        storage.append(sources["regions"], regions(), storage.upper(sales).time - 1)
    readers = {name: StorageReader(storage, id) for name, id in sources.items()}
    for reader in readers.values():
        reader.refresh(session)
    flow = SteppedFlow(session, shape, SHAPES[shape], readers)
    conf = flow.session.conf
    keys = {key for way in ways for key in way}
    defaults = {key: conf.get(key, None) for key in keys}
    flow.step(storage.upper(sales).time - 1)
    log(f"({shape}) at {rows:,} rows: hydrated")
    cpu = JvmCpu(session)
    seconds: list[list[float]] = [[] for _ in ways]
    timed = 0
    for i in range(steps):
        at = storage.append(sales, change(rows, i, change_rows, retract=change_rows * 3 // 10, groups=groups))
        if "regions" in sources:  # storage uppers move together in a replica
            storage.compare_and_append(sources["regions"], storage.upper(sources["regions"]), h.Frontier(at + 1))
        for reader in readers.values():
            reader.refresh(session)
        way = i % len(ways)
        for key in keys:
            value = ways[way].get(key, defaults[key])
            if value is None:
                conf.unset(key)
            else:
                conf.set(key, value)
        if i == WARM_ROUNDS * len(ways):
            cpu.mark()
        took = flow.step(at)
        if i >= WARM_ROUNDS * len(ways):
            seconds[way].append(took)
            timed += 1
    jvm, _ = cpu.since_mark()
    flow.close()
    for reader in readers.values():
        reader.close()
    return seconds, jvm / max(1, timed)


if __name__ == "__main__":
    main()
