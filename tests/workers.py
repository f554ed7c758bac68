"""Functions run in separate processes (multiprocessing, spawn) by the catalog and storage
tests. Fault injection lives here, in the tests, never in the product."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pyarrow as pa

from catalog import Catalog, UpperMismatch
from history import Frontier
from storage import Storage


def open_catalog(url: str, start_at: float) -> int:
    """At wall-clock time `start_at`, open (and so migrate) the catalog; return its
    epoch as read."""
    time.sleep(max(0.0, start_at - time.time()))
    with Catalog.open(url) as catalog:
        return catalog.controller_epoch()


def race_appends(
    url: str, blob_dir: str, id: str, writer: int, until: int, start_at: float = 0.0
) -> tuple[int, int]:
    """Like a replica writing a materialized view: from wall-clock time `start_at`, for
    every time t below `until`, try to append this writer's row for t at [t, t+1); a
    lost race skips to the upper it found. Returns (appends won, appends lost)."""
    wins = losses = 0
    with Catalog.open(url) as catalog:
        time.sleep(max(0.0, start_at - time.time()))
        storage = Storage(catalog, blob_dir)
        t = storage.upper(id).time
        while t < until:
            rows = pa.table(
                {"t": pa.array([t], pa.int64()), "writer": pa.array([writer], pa.int64())}
            )
            try:
                storage.compare_and_append(id, Frontier(t), Frontier(t + 1), rows)
                wins += 1
                t += 1
            except UpperMismatch as lost:
                losses += 1
                t = lost.current.time
    return wins, losses


def append_then_die(url: str, blob_dir: str, id: str) -> None:
    """Write a batch file, then die by SIGKILL at the commit step."""

    def killed(*args: object, **kwargs: object) -> None:
        files = list(Path(blob_dir).rglob("*.parquet"))
        assert files, "the batch file must be written before the commit"
        os.kill(os.getpid(), signal.SIGKILL)

    with Catalog.open(url) as catalog:
        catalog.append_batch = killed  # type: ignore[method-assign]
        storage = Storage(catalog, blob_dir)
        upper = storage.upper(id)
        rows = pa.table(
            {"t": pa.array([upper.time], pa.int64()), "writer": pa.array([0], pa.int64())}
        )
        storage.compare_and_append(id, upper, Frontier(upper.time + 1), rows)
    raise AssertionError("unreachable: the process was killed at commit")
