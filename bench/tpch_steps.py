"""What each TPC-H query's step costs after a lineitem change, in one replica's session,
without the controller: seconds of each step, and the CPU the change cost the JVM (all
of Spark: planning, jobs, collection, GC) and this process (the Python side).

    .venv/bin/python bench/tpch_steps.py [--sf 0.1] [--changes 3] [--queries q18,q21] [--recompute] [--no-rehearsal]

The TPC-H tables are loaded into scratch storage and the chosen queries kept by Tandem's
own maintainer (`maintainer`: incremental where the planner finds a delta plan, else
recomputed), in one local[2] / 1 GB session with an instance's default settings, as a
replica keeps them. After hydration, each query rehearses a step, as a replica does
(`Incremental.rehearse`; not with `--no-rehearsal`); then each change (1,000 lineitem rows, half retractions:
the change, its undo, the change, ...) is appended at one time to every table (empty
batches to all but lineitem, as storage uppers move together in a replica), and the
queries that read lineitem are stepped one after another, each timed from `step` to
`finish` (its changes applied to its index version); the others are told nothing
changed. `--recompute` forces every query to full recompute, for the side-by-side.
Each change's row also says how many classes Spark compiled for its generated code.

The JVM's CPU is also broken down by kind of thread, over all the changes: what Spark's
driver does for the steps (analysis, planning), what the executors' tasks do, garbage
collection, and the rest. End to end, two replicas share the machine's cores and step
the same queries: a change costs about the JVM CPU printed here, twice, so on two cores
the CPU per change bounds the freshness bench's latency from below (`bench/RESULTS.md`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tpch
from _common import JvmCpu, log, scratch_storage

import history as h
from catalog._instances import DETERMINISTIC_SPARK_CONF
from replica_service import _spark
from replica_service.dataplane import Maintainer, NotIncremental, StorageReader, maintainer

CHANGE_ROWS = 1000
PARTITIONS = 4  # an instance's default canonical partitions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sf", type=float, default=0.1)
    parser.add_argument("--changes", type=int, default=3)
    parser.add_argument("--queries", default=",".join(tpch.QUERIES))
    parser.add_argument("--recompute", action="store_true", help="every query recomputed in full")
    parser.add_argument("--no-rehearsal", action="store_true", help="no rehearsal step after hydration")
    args = parser.parse_args()
    names = [q for q in args.queries.split(",") if q]
    unknown = sorted(set(names) - set(tpch.QUERIES))
    if unknown:
        parser.error(f"unknown queries: {', '.join(unknown)}")
    with tempfile.TemporaryDirectory(prefix="tandem-tpch-steps-") as directory:
        root = Path(directory)
        storage = scratch_storage(root)
        session = _spark.start_session(
            _spark.SparkSettings("local[2]", "1g"), root / "spark", DETERMINISTIC_SPARK_CONF
        )
        tables = tpch.generate(args.sf)
        ids, readers = {}, {}
        for name in tpch.TABLES:
            ids[name] = storage.create_source(name, tpch.SCHEMAS[name]).id
            storage.append(ids[name], tables[name], ts=1)
            readers[name] = StorageReader(storage, ids[name])
            readers[name].refresh(session)
        log(f"TPC-H SF {args.sf} loaded")
        flows = {q: _maintainer(q, session, readers, args.recompute) for q in names}
        steps = _Steps(flows)
        started = time.perf_counter()
        for q in names:
            steps.step(q, 1)
        log(f"{len(names)} queries hydrated in {time.perf_counter() - started:.1f} s")
        if not args.no_rehearsal:
            started = time.perf_counter()
            for q in names:
                flows[q].rehearse(root / "rehearsals")
            log(f"{len(names)} queries rehearsed in {time.perf_counter() - started:.1f} s ({_compiled(session)} classes compiled so far)")

        change = tpch.lineitem_change(tables, CHANGE_ROWS, seed=1)
        undo = change.set_column(
            change.schema.get_field_index(tpch.DIFF), tpch.DIFF, pc.negate(change[tpch.DIFF])
        )
        stepped = [q for q in names if "lineitem" in tpch.QUERIES[q]]
        seconds: dict[str, list[float]] = {q: [] for q in stepped}
        cpu = JvmCpu(session)  # by thread, from here: the changes (appends and steps)
        print(
            f"\n## TPC-H SF {args.sf}: steps after a {CHANGE_ROWS:,}-row lineitem change (local[2] / 1 GB, one session)\n"
        )
        print("| change | the steps' seconds | JVM CPU (s) | Python CPU (s) | classes compiled | slowest |")
        print("|---|---|---|---|---|---|")
        for number in range(1, args.changes + 1):
            at = 1 + number
            for name in tpch.TABLES:
                batch = (
                    (change if number % 2 else undo)
                    if name == "lineitem"
                    else tables[name].slice(0, 0)
                )
                storage.append(ids[name], batch, ts=at)
                readers[name].refresh(session)
            cpu.mark()
            compiled = _compiled(session)
            for q in names:
                if q in seconds:
                    seconds[q].append(steps.step(q, at))
                else:
                    flows[q].unchanged_through(at)
            jvm, python = cpu.since_mark()
            slowest = sorted(stepped, key=lambda q: -seconds[q][-1])[:3]
            print(
                f"| {number} | {sum(seconds[q][-1] for q in stepped):.2f} | {jvm:.1f} | {python:.1f} | "
                f"{_compiled(session) - compiled} | "
                + ", ".join(f"{q} {seconds[q][-1]:.2f}" for q in slowest)
                + " |",
                flush=True,
            )
        print("\n| query | strategy | median step (s) |\n|---|---|---|")
        for q in stepped:
            print(
                f"| {q} | {type(flows[q]).__name__.lower()} | {statistics.median(seconds[q]):.2f} |"
            )
        print(f"\n| JVM threads, over the {args.changes} changes | CPU (s) |\n|---|---|")
        for kind, cpu_seconds in cpu.by_kind():
            print(f"| {kind} | {cpu_seconds:.1f} |")
        for flow in flows.values():
            flow.close()


def _maintainer(
    query: str, session, readers: dict[str, StorageReader], recompute: bool
) -> Maintainer:
    """The query's maintainer, as a replica makes it for the planner's strategy."""
    inputs = {name: readers[name] for name in tpch.TABLES}
    for strategy in ("recompute",) if recompute else ("incremental", "recompute"):
        desc = h.DataflowDescription(
            query, tpch.QUERIES[query], (), (h.IndexExport(query, ()),), strategy=strategy
        )
        try:
            return maintainer(
                desc,
                _spark.dataflow_session(session, DETERMINISTIC_SPARK_CONF),
                inputs,
                {},
                PARTITIONS,
            )
        except NotIncremental:
            continue
    raise AssertionError("recompute always has a maintainer")


def _compiled(session) -> int:
    """How many classes Spark's generated code compiled to in this JVM so far."""
    return session._jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME().getCount()


class _Steps:
    """Steps the maintainers, keeping each query's index version."""

    def __init__(self, flows: dict[str, Maintainer]) -> None:
        self.flows = flows
        self.versions: dict[str, object] = {}

    def step(self, query: str, at: int) -> float:
        started = time.perf_counter()
        output = self.flows[query].step([at])
        _, self.versions[query] = output.versions(self.versions.get(query))
        output.finish()
        return time.perf_counter() - started


if __name__ == "__main__":
    main()
