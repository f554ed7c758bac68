"""Snapshots with a few retractions: patched against consolidated whole, side by side.

    .venv/bin/python bench/snapshot_bench.py [--sf 0.1] [--repeats 3]

The TPC-H tables at `--sf` in storage (lineitem in 100,000-row appends, as the freshness
bench loads it), then a 1,000-row lineitem change (half retractions). In one local[2] /
1 GB session, `StorageReader.snapshot` of lineitem at the change's time, and the
recomputed TPC-H queries that read lineitem, over snapshots of every table: each
timed with the retracting batch patching the others (`_rows.patch`, the default) and
with every update consolidated (`PATCH_MAX_ROWS` = -1, the path before), alternating,
`--repeats` times after one warm-up; medians and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tpch  # noqa: E402
from _common import log, scratch_storage  # noqa: E402

from replica_service import _spark  # noqa: E402
from replica_service.dataplane import StorageReader, _reader  # noqa: E402

QUERIES = ("q4", "q17", "q18", "q20", "q21")  # recomputed, over lineitem
PATHS = {"patched": _reader.PATCH_MAX_ROWS, "consolidated": -1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sf", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-snapshot-") as directory:
        root = Path(directory)
        storage = scratch_storage(root)
        tables = tpch.generate(args.sf)
        ids = {}
        for name, table in tables.items():
            ids[name] = storage.create_source(name, tpch.SCHEMAS[name]).id
            for batch in table.to_batches(max_chunksize=100_000):
                storage.append(ids[name], pa.Table.from_batches([batch]))
        t = storage.append(ids["lineitem"], tpch.lineitem_change(tables, 1000, seed=7))
        log(f"loaded SF {args.sf}; lineitem {tables['lineitem'].num_rows:,} rows, changed at {t}")
        session = _spark.start_session(_spark.SparkSettings("local[2]", "1g"), root / "spark", {"spark.sql.shuffle.partitions": "4"})
        readers = {name: StorageReader(storage, id) for name, id in ids.items()}
        for reader in readers.values():
            reader.refresh(session)

        def snapshot() -> None:
            readers["lineitem"].snapshot(session, t).write.format("noop").mode("overwrite").save()

        def query(name: str):
            def run() -> None:
                for table, reader in readers.items():
                    reader.snapshot(session, min(t, reader.upper.time - 1)).createOrReplaceTempView(table)
                session.sql(tpch.QUERIES[name]).write.format("noop").mode("overwrite").save()

            return run

        print(f"\n## Snapshots after a 1,000-row lineitem change, TPC-H SF {args.sf}, local[2] / 1 GB: median of {args.repeats}\n")
        print("| read | patched | consolidated | consolidated / patched |")
        print("|---|---|---|---|")
        for label, run in (("lineitem snapshot", snapshot), *((name, query(name)) for name in QUERIES)):
            seconds = {path: [] for path in PATHS}
            run()  # warm-up
            for _ in range(args.repeats):
                for path, limit in PATHS.items():
                    _reader.PATCH_MAX_ROWS = limit
                    started = time.monotonic()
                    run()
                    seconds[path].append(time.monotonic() - started)
            patched, whole = (statistics.median(seconds[path]) for path in PATHS)
            print(f"| {label} | {patched:.2f} s | {whole:.2f} s | {whole / patched:.2f}x |", flush=True)
        session.stop()


if __name__ == "__main__":
    main()
