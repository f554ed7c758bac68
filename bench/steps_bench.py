"""What one incremental step costs by the number of change times it covers (issue 48:
a dataflow behind by many times computes them all in one step).

    .venv/bin/python bench/steps_bench.py [--rows 100000] [--times 1,10,100,1000]

A `sales` source of `--rows` rows, and the three dataflows of the load bench over it,
kept by Tandem's own maintainer in one local[2] / 1 GB session as a replica keeps them:
the view's `GROUP BY` with `count`/`sum`, the index's `GROUP BY` with `max` and
`COUNT(DISTINCT)` (its extremes repaired), and a filter/projection. Per count N: N
50-row changes (15 retractions of loaded rows each), each appended at a time of its
own, then one step per dataflow covering all N times, timed from `step` to `finish` (the
changes of every time applied to the index's version). Each step's version at the last
time must equal a recompute's. Printed: the step's seconds, and the marginal cost of a
time (the step less the one-time step, over N - 1). Each dataflow is kept twice, side by
side over the same changes: a change spread over many batches read by the replica's
driver (`DRIVER_READ_MIN_BATCHES`, as replicas read it) and by Spark, file by file; each
count is stepped twice, each way first once, and the two steps' mean printed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import change, log  # noqa: E402
from _in_process import SteppedFlow, sales_in_session  # noqa: E402

from replica_service._arrangement import Version  # noqa: E402
from replica_service.dataplane import _reader  # noqa: E402
from replica_service.dataplane._reader import DRIVER_READ_MAX_ROWS  # noqa: E402

FLOWS = {
    "view": "SELECT region, count(*) AS n, sum(amount) AS total FROM sales GROUP BY region",
    "index": "SELECT region, max(amount) AS top, count(DISTINCT id % 1000) AS kinds FROM sales GROUP BY region",
    "filter": "SELECT id, region, amount * 2 AS doubled FROM sales WHERE amount > 50",
}
MODES = {"spark": "Spark, every file", "driver": "driver (many batches)"}
CHANGE_ROWS = 50
RETRACTIONS = 15


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--times", default="1,10,100,1000")
    args = parser.parse_args()
    counts = [int(n) for n in args.times.split(",")]
    with tempfile.TemporaryDirectory(prefix="tandem-steps-") as directory:
        root = Path(directory)
        storage, session, sales, reader = sales_in_session(root, args.rows)
        flows = {(name, mode): SteppedFlow(session, f"{name}_{mode}", sql, {"sales": reader}) for name, sql in FLOWS.items() for mode in MODES}
        checks = {name: SteppedFlow(session, f"{name}_check", sql, {"sales": reader}, strategy="recompute") for name, sql in FLOWS.items()}
        at = storage.upper(sales).time - 1
        for flow in (*flows.values(), *checks.values()):
            flow.step(at)
        log(f"hydrated over {args.rows:,} rows")
        seconds: dict[tuple[str, str], dict[int, float]] = {key: {} for key in flows}
        step = 0
        for count in counts:
            # Twice, each mode first once: the first of two steps over the same new
            # batches pays for what the second finds ready (about a third more, even
            # when both read alike); the mean of the two rounds cancels it.
            for order in (tuple(MODES), tuple(reversed(MODES))):
                times = []
                for _ in range(count):
                    step += 1
                    times.append(storage.append(sales, change(args.rows, step, CHANGE_ROWS, retract=RETRACTIONS)))
                reader.refresh(session)
                for name in FLOWS:
                    checks[name].step(times[-1])
                    for mode in order:
                        flow = flows[name, mode]
                        took = _step(flow, times, driver_reads=mode == "driver")
                        seconds[name, mode][count] = seconds[name, mode].get(count, 0) + took / 2
                        got, want = (Version.build(times[-1], f.version, ()).digest for f in (flow, checks[name]))
                        assert got == want, f"{name} ({mode}): the step over {count} times differs from a recompute at {times[-1]}"
            log(f"{count} times: " + ", ".join(f"{name} {mode} {took[count]:.2f} s" for (name, mode), took in seconds.items()))
        for flow in (*flows.values(), *checks.values()):
            flow.close()
        reader.close()
    print(f"\n## One step over N change times of {CHANGE_ROWS} rows ({args.rows:,} rows, local[2] / 1 GB; each equal to a recompute)\n")
    print("| times N | reads | " + " | ".join(f"{name}: step / per time" for name in FLOWS) + " |")
    print("|---|---|" + "---|" * len(FLOWS))
    for count in counts:
        for mode in MODES:
            cells = []
            for name in FLOWS:
                took = seconds[name, mode][count]
                marginal = (took - seconds[name, mode][counts[0]]) / (count - counts[0]) * 1000 if count > counts[0] else None
                cells.append(f"{took:.2f} s / {'-' if marginal is None else f'{marginal:.1f} ms'}")
            print(f"| {count:,} | {MODES[mode]} | " + " | ".join(cells) + " |")


def _step(flow: SteppedFlow, times: list[int], *, driver_reads: bool) -> float:
    """Step `flow` over `times` in one step (as a replica behind by them does), its
    changes read by the driver where a replica would (`driver_reads`) or by Spark
    always; seconds."""
    if not driver_reads:
        _reader.DRIVER_READ_MAX_ROWS = 0
    try:
        return flow.step(*times)
    finally:
        _reader.DRIVER_READ_MAX_ROWS = DRIVER_READ_MAX_ROWS


if __name__ == "__main__":
    main()
