"""What a step costs once a replica is warm, under a steady stream (issue 48: the fixed
cost of a step, not the rows, sets the lag).

    .venv/bin/python bench/steady_steps_bench.py [--rows 100000] [--rounds 50]
        [--appends 10] [--jvm-options "-XX:TieredStopAtLevel=1"]

The load bench's `sales` source and three of its dataflows (`steps_bench.FLOWS`: a
`GROUP BY` view, a `max` / `COUNT(DISTINCT)` index, a filter), kept by Tandem's own
maintainer in one local[2] / 1 GB session as a replica keeps them. Per round:
`--appends` 50-row changes, each at a time of its own, then one step per dataflow over
all of them. Printed per ten rounds: each dataflow's mean step (from `step` to
`finish`), and the CPU the session's JVM used a round; per dataflow, the Spark jobs,
stages and tasks of its last step. `--jvm-options` replaces the replica's JIT option
(`-XX:TieredStopAtLevel=1`) in the JVM's options, for spikes of other JIT settings ("",
the full tiered compiler).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import JvmCpu, change, log  # noqa: E402
from _in_process import SteppedFlow, sales_in_session  # noqa: E402
from steps_bench import FLOWS  # noqa: E402

from replica_service import _spark  # noqa: E402

JIT = "-XX:TieredStopAtLevel=1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--appends", type=int, default=10)
    parser.add_argument("--jvm-options", default=JIT, help=f"what replaces {JIT} in the JVM's options")
    args = parser.parse_args()
    assert JIT in _spark.DRIVER_JVM_OPTIONS, "the replica's JIT option moved: update this bench"
    _spark.DRIVER_JVM_OPTIONS = _spark.DRIVER_JVM_OPTIONS.replace(JIT, args.jvm_options)  # read as the session starts
    with tempfile.TemporaryDirectory(prefix="tandem-steady-") as directory:
        root = Path(directory)
        storage, session, sales, reader = sales_in_session(root, args.rows)
        flows = {name: SteppedFlow(session, name, sql, {"sales": reader}) for name, sql in FLOWS.items()}
        for flow in flows.values():
            flow.step(storage.upper(sales).time - 1)
        log(f"hydrated over {args.rows:,} rows; JIT option {args.jvm_options!r}")
        context, tracker, jvm = session.sparkContext, session.sparkContext.statusTracker(), JvmCpu(session)
        seconds: dict[str, list[float]] = {name: [] for name in flows}
        cpu: list[float] = []
        jobs: dict[str, tuple[int, int, int]] = {}
        step = 0
        print(f"\n## Steady steps: rounds of {args.appends} appends of 50 rows, each dataflow stepped over them ({args.rows:,} rows)\n")
        print("| rounds | " + " | ".join(f"{name} (s)" for name in flows) + " | JVM CPU-s a round |")
        print("|---|" + "---|" * (len(flows) + 1))
        for round_ in range(args.rounds):
            times = []
            for _ in range(args.appends):
                step += 1
                times.append(storage.append(sales, change(args.rows, step, 50, retract=15)))
            reader.refresh(session)
            jvm.mark()
            for name, flow in flows.items():
                group = f"steady-{name}-{round_}"
                context.setJobGroup(group, group)
                seconds[name].append(flow.step(*times))
                jobs[name] = _jobs(tracker, group)
            cpu.append(jvm.since_mark()[0])
            if round_ % 10 == 9:
                cells = [f"{sum(took[-10:]) / 10:.3f}" for took in seconds.values()]
                print(f"| {round_ - 8}-{round_ + 1} | " + " | ".join(cells) + f" | {sum(cpu[-10:]) / 10:.2f} |", flush=True)
        print("\nThe last step's Spark work: " + "; ".join(f"{name} {j} jobs, {s} stages, {t} tasks" for name, (j, s, t) in jobs.items()))
        for flow in flows.values():
            flow.close()
        reader.close()


def _jobs(tracker, group: str) -> tuple[int, int, int]:
    """The jobs, stages and tasks Spark ran for job group `group`."""
    job_ids = tracker.getJobIdsForGroup(group)
    stage_ids = [s for j in job_ids if (info := tracker.getJobInfo(j)) is not None for s in info.stageIds]
    tasks = sum(info.numTasks for s in stage_ids if (info := tracker.getStageInfo(s)) is not None)
    return len(job_ids), len(stage_ids), tasks


if __name__ == "__main__":
    main()
