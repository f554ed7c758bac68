"""How far a light step is from the cheapest Spark query, side by side with a recompute:
what the issue's "incremental at least 10x faster than recompute" leaves a step.

    .venv/bin/python bench/floor_bench.py [--rows 1000000] [--rounds 20] [--change-rows 100]

The freshness bench's shape (a) (`freshness_bench.SHAPES["a"]`, a GROUP BY of one
source) over `--rows` generated rows, kept by Tandem's own maintainer in one local[2] /
1 GB session (a `small` replica's) with an instance's default settings, twice: once
incremental, once forced to recompute. Each round appends a change (`_common.change`:
30% retractions), then times, one after the other:
- **incremental**: the incremental dataflow's step (from `step` to `finish`, its
  changes applied to the index's version);
- **recompute**: the recomputed dataflow's step, the same way;
- **cheapest GROUP BY**: the one Spark query any step of (a) must at least run: the
  change's batch file read by the replica's reader, grouped by region (the diffs' sum
  and the amounts' times their diffs), collected. No state is read or written;
- **trivial job**: `spark.range(1).collect()`, Spark's fixed price of one job;
- **plain Spark over the source**: what a user's batch query over the same files costs,
  the updates grouped with their diffs (not consolidated, not exact: a lower bound on
  any recompute).
Printed: each one's median after `WARM_ROUNDS` rounds (they compile code), and the
budget a step would have at 10x a recompute, against the cheapest query. In-process,
so it leaves out what end to end adds (the append, the poll, the peek): a lower bound on
the freshness bench's figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import change, log  # noqa: E402
from _in_process import SteppedFlow, sales_in_session  # noqa: E402
from freshness_bench import SHAPES  # noqa: E402

from catalog._instances import DETERMINISTIC_SPARK_CONF  # noqa: E402
from replica_service import _spark  # noqa: E402

WARM_ROUNDS = 3  # left out of the medians: the first steps compile code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--change-rows", type=int, default=100)
    args = parser.parse_args()
    if args.rounds <= WARM_ROUNDS:
        parser.error(f"--rounds must exceed the {WARM_ROUNDS} warm rounds")
    with tempfile.TemporaryDirectory(prefix="tandem-floor-") as directory:
        medians = _run(Path(directory), args.rows, args.rounds, args.change_rows)
    print(f"\n## A step of (a) at {args.rows:,} rows after {args.change_rows:,}-row changes, against the cheapest Spark query (local[2] / 1 GB, in-process)\n")
    print("| what | median |")
    print("|---|---|")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds * 1000:.0f} ms |")
    budget = medians["recompute"] / 10
    print(
        f"\nAt 10x the recompute, a step would have {budget * 1000:.0f} ms: "
        f"{budget / medians['cheapest GROUP BY']:.2f}x the cheapest GROUP BY, "
        f"{budget / medians['incremental']:.2f}x the incremental step."
    )


def _run(root: Path, rows: int, rounds: int, change_rows: int) -> dict[str, float]:
    """Each measurement's median seconds over the rounds after the warm ones."""
    storage, session, sales, reader = sales_in_session(root, rows)
    flows = {s: SteppedFlow(session, f"a_{s}", SHAPES["a"], {"sales": reader}, strategy=s) for s in ("incremental", "recompute")}
    queries = _spark.dataflow_session(session, DETERMINISTIC_SPARK_CONF)
    queries.conf.set("spark.sql.shuffle.partitions", "1")  # as a small step is planned
    last = storage.upper(sales).time - 1
    for flow in flows.values():
        flow.step(last)
    log(f"(a) at {rows:,} rows: hydrated, incremental and recompute")
    samples: dict[str, list[float]] = {}
    for i in range(rounds):
        at = storage.append(sales, change(rows, i, change_rows, retract=change_rows * 3 // 10))
        reader.refresh(session)
        measured = {
            "incremental": lambda at=at: flows["incremental"].step(at),
            "recompute": lambda at=at: flows["recompute"].step(at),
            "cheapest GROUP BY": lambda at=at, after=last: _grouped(reader.updates(queries, at, after=after)),
            "trivial job": lambda: queries.range(1).collect(),
            "plain Spark over the source": lambda at=at: _grouped(reader.updates(queries, at)),
        }
        for name, run in measured.items():
            started = time.perf_counter()
            run()
            if i >= WARM_ROUNDS:
                samples.setdefault(name, []).append(time.perf_counter() - started)
        last = at
    incremental, recompute = (flows[s].version.sort_by("region") for s in ("incremental", "recompute"))
    assert incremental.equals(recompute), "the two strategies disagree"
    for flow in flows.values():
        flow.close()
    reader.close()
    return {name: statistics.median(seconds) for name, seconds in samples.items()}


def _grouped(updates: DataFrame) -> None:
    """(a)'s sums over `updates` with their diffs, collected."""
    updates.groupBy("region").agg(F.sum("_diff").alias("n"), F.sum(F.col("amount") * F.col("_diff")).alias("total")).collect()


if __name__ == "__main__":
    main()
