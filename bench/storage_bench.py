"""Storage benchmark: compare_and_append of 1, 1,000 and 100,000 rows per batch.

    .venv/bin/python bench/storage_bench.py [--postgres-url URL] [--no-postgres]

For each batch size it appends a number of batches to a fresh source, one
compare_and_append at a time (validation, Parquet write with fsync, fenced manifest
commit), and prints batches/s, rows/s and the p50/p99 latency of compare_and_append,
SQLite and PostgreSQL side by side. SQLite lives in a temporary directory; PostgreSQL in
a temporary schema that is dropped afterwards. The blob directory is a local temporary
directory in both cases.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from catalog import Catalog
from history import Frontier
from storage import Storage

SIZES = {1: 300, 1_000: 100, 100_000: 16}  # rows per batch -> batches appended
SCHEMA = "id BIGINT NOT NULL, region STRING, amount DOUBLE"
DEFAULT_POSTGRES = os.environ.get(
    "TANDEM_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@dataclass(frozen=True)
class Result:
    batches_per_s: float
    rows_per_s: float
    p50_ms: float
    p99_ms: float


def batch(rows: int) -> pa.Table:
    regions = ["eu", "us", "apac", None]
    return pa.table(
        {
            "id": pa.array(range(rows), pa.int64()),
            "region": pa.array([regions[i % 4] for i in range(rows)], pa.string()),
            "amount": pa.array([i * 0.25 for i in range(rows)], pa.float64()),
        }
    )


def percentile(samples: list[float], q: float) -> float:
    return (
        statistics.quantiles(samples, n=100, method="inclusive")[q - 1]
        if len(samples) > 1
        else samples[0]
    )


def run(url: str, blob_dir: Path) -> dict[int, Result]:
    results = {}
    with Catalog.open(url) as catalog:
        catalog.become_controller()
        storage = Storage(catalog, blob_dir)
        for rows, count in SIZES.items():
            id = storage.create_source(f"bench_{rows}", SCHEMA).id
            table = batch(rows)
            storage.compare_and_append(id, Frontier(0), Frontier(1), table)  # warm up
            latencies = []
            started = time.perf_counter()
            for t in range(1, count + 1):
                begin = time.perf_counter()
                storage.compare_and_append(id, Frontier(t), Frontier(t + 1), table)
                latencies.append(time.perf_counter() - begin)
            elapsed = time.perf_counter() - started
            results[rows] = Result(
                batches_per_s=count / elapsed,
                rows_per_s=count * rows / elapsed,
                p50_ms=1000 * percentile(latencies, 50),
                p99_ms=1000 * percentile(latencies, 99),
            )
    return results


def run_sqlite() -> dict[int, Result]:
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as directory:
        return run(Catalog.default_url(directory), Path(directory) / "blobs")


def run_postgres(base_url: str) -> dict[int, Result]:
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(base_url).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        with tempfile.TemporaryDirectory(prefix="tandem-bench-") as directory:
            return run(url.render_as_string(hide_password=False), Path(directory) / "blobs")
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def cells(result: Result | None) -> list[str]:
    if result is None:
        return ["n/a"] * 4
    return [
        f"{result.batches_per_s:,.1f}",
        f"{result.rows_per_s:,.0f}",
        f"{result.p50_ms:.2f}",
        f"{result.p99_ms:.2f}",
    ]


def print_table(backends: dict[str, dict[int, Result] | None]) -> None:
    metrics = ["batches/s", "rows/s", "p50 ms", "p99 ms"]
    header = ["rows/batch", "batches"] + metrics * len(backends)
    body = [
        [f"{rows:,}", str(count)]
        + [cell for results in backends.values() for cell in cells(results and results[rows])]
        for rows, count in SIZES.items()
    ]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    groups = [" " * (widths[0] + widths[1] + 2)]
    for n, name in enumerate(backends):
        group = sum(widths[2 + 4 * n : 6 + 4 * n]) + 2 * 3
        groups.append(f" {name} ".center(group, "-"))
    print("  ".join(groups))
    for row in [header, *body]:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES)
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args()

    backends: dict[str, dict[int, Result] | None] = {"SQLite": run_sqlite()}
    if args.no_postgres:
        backends["PostgreSQL"] = None
    else:
        try:
            backends["PostgreSQL"] = run_postgres(args.postgres_url)
        except Exception as error:  # report and still print the SQLite side
            print(f"PostgreSQL unavailable at {args.postgres_url}: {error}", file=sys.stderr)
            backends["PostgreSQL"] = None
    print("compare_and_append, one batch at a time (Parquet + fsync + fenced manifest commit)")
    print_table(backends)


if __name__ == "__main__":
    main()
