"""What an incremental step costs by the number of groups its state keeps: the state
rewritten at every step, or kept as a base and an overlay, side by side.

    .venv/bin/python bench/groups_bench.py [--groups 1000,10000,50000,150000,500000] [--steps 12]

A `GROUP BY g` with `count(*)` and `sum(v)` over a source of four rows per group, kept
by Tandem's own maintainer (`maintainer`, incremental) in one local[2] / 1 GB session
with an instance's default settings, as a replica keeps it: two dataflows over the same
source, one forced to full steps (the whole state summed with the change and written
again: `OVERLAY_MIN_GROUPS` out of reach), one to overlaid steps (only the touched
groups' rows summed, the base left as it is: `OVERLAY_MIN_GROUPS` 0; a full step still
merges the overlay once it may hold `OVERLAY_MAX_GROUPS` groups). Each step follows a
100-row change (30 retractions of live rows, 70 inserts); the two step in turn, each
timed from `step` to `finish` (the changes applied to the index's version), and their
versions' digests must agree. Medians of the steps after the first two, per group
count.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import log, scratch_storage  # noqa: E402
from _in_process import SteppedFlow, small_session  # noqa: E402

from replica_service._arrangement import Version  # noqa: E402
from replica_service.dataplane import StorageReader, _incremental  # noqa: E402
from storage import Storage  # noqa: E402

ROWS_PER_GROUP = 4
CHANGE_ROWS = 100
RETRACTIONS = 30
SKIPPED = 2  # the first steps compile code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", default="1000,10000,50000,150000,500000")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-groups-") as directory:
        root = Path(directory)
        storage = scratch_storage(root)
        session = small_session(root)
        print(f"\n## An incremental GROUP BY's step by its number of groups (local[2] / 1 GB; median of {args.steps - SKIPPED} steps)\n")
        print("| groups | full steps | overlaid steps | overlaid / full |")
        print("|---|---|---|---|")
        for groups in (int(g) for g in args.groups.split(",")):
            seconds = _steps(storage, session, groups, args.steps)
            full, overlaid = (statistics.median(seconds[way][SKIPPED:]) for way in WAYS)
            print(
                f"| {groups:,} | {full * 1000:.0f} ms | {overlaid * 1000:.0f} ms | {overlaid / full:.2f}x |",
                flush=True,
            )


WAYS = {"full": 1 << 62, "overlaid": 0}  # each way's OVERLAY_MIN_GROUPS


def _steps(storage: Storage, session, groups: int, steps: int) -> dict[str, list[float]]:
    """Each way's step seconds over a fresh source of `groups` groups."""
    source = storage.create_source(f"s{groups}", "id BIGINT, g BIGINT, v BIGINT").id
    ids = list(range(groups * ROWS_PER_GROUP))
    storage.append(source, pa.table({"id": ids, "g": [i % groups for i in ids], "v": ids}, schema=_schema()))
    reader = StorageReader(storage, source)
    reader.refresh(session)
    sql = f"SELECT g, count(*) AS n, sum(v) AS total FROM s{groups} GROUP BY g"
    flows = {way: SteppedFlow(session, f"{way}{groups}", sql, {f"s{groups}": reader}) for way in WAYS}

    def step(way: str, at: int) -> tuple[float, str]:
        _incremental.OVERLAY_MIN_GROUPS = WAYS[way]
        took = flows[way].step(at)
        return took, Version.build(at, flows[way].version, ()).digest

    hydrated_at = storage.upper(source).time - 1
    for way in WAYS:
        step(way, hydrated_at)
    log(f"{groups:,} groups: hydrated")
    rng = random.Random(groups)
    live = list(ids)
    next_id = len(ids)
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(steps):
        retracted = [live.pop(rng.randrange(len(live))) for _ in range(RETRACTIONS)]
        inserted = list(range(next_id, next_id + CHANGE_ROWS - RETRACTIONS))
        next_id += len(inserted)
        live += inserted
        rows = retracted + inserted
        change = pa.table(
            {"id": rows, "g": [i % groups for i in rows], "v": rows, "_diff": [-1] * len(retracted) + [1] * len(inserted)},
            schema=_schema().append(pa.field("_diff", pa.int64())),
        )
        at = storage.append(source, change)
        reader.refresh(session)
        digests = set()
        for way in WAYS:
            took, digest = step(way, at)
            seconds[way].append(took)
            digests.add(digest)
        assert len(digests) == 1, f"{groups} groups: the two ways' versions differ at {at}"
    for flow in flows.values():
        flow.close()
    reader.close()
    return seconds


def _schema() -> pa.Schema:
    return pa.schema([("id", pa.int64()), ("g", pa.int64()), ("v", pa.int64())])


if __name__ == "__main__":
    main()
