"""Concurrency and faults, on SQLite and PostgreSQL: threads and processes racing
compare_and_append on one collection, a writer killed between writing its file and
committing, and a fenced writer."""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from workers import append_then_die, race_appends

from catalog import Catalog, Fenced
from history import Frontier
from storage import Storage

SCHEMA = "t BIGINT NOT NULL, writer BIGINT NOT NULL"
UNTIL = 30


def files(blob_dir: Path) -> set[str]:
    return {p.relative_to(blob_dir).as_posix() for p in blob_dir.rglob("*.parquet")}


def assert_written_exactly_once(storage: Storage, id: str, blob_dir: Path) -> None:
    batches = storage.catalog.manifest(id).batches
    assert [(b.lower, b.upper) for b in batches] == [(t, Frontier(t + 1)) for t in range(UNTIL)]
    assert storage.upper(id) == Frontier(UNTIL)
    contents = storage.read_snapshot(id, UNTIL - 1)
    assert sorted(contents["t"].to_pylist()) == list(range(UNTIL))
    changes = storage.read_changes(id, 0, UNTIL - 1)
    assert changes["_diff"].to_pylist() == [1] * (UNTIL - 1)  # time 0 is not after 0
    assert files(blob_dir) == {b.path for b in batches}  # no orphan, none missing


def test_threads_racing_write_every_range_once(
    storage: Storage, catalog_url: str, blob_dir: Path
) -> None:
    id = storage.create_source("view", SCHEMA).id
    outcomes: list[tuple[int, int]] = []
    observed: list[Frontier] = []
    done = threading.Event()
    start_at = time.time() + 0.5

    def writer(n: int) -> None:
        outcomes.append(race_appends(catalog_url, str(blob_dir), id, n, UNTIL, start_at))

    def watch() -> None:
        while not done.is_set():
            observed.append(storage.upper(id))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    watcher.join()

    assert len(outcomes) == 4
    assert sum(wins for wins, _ in outcomes) == UNTIL
    assert sum(losses for _, losses in outcomes) > 0  # they did race
    assert observed == sorted(observed)  # the upper never went back
    assert_written_exactly_once(storage, id, blob_dir)


def test_processes_racing_write_every_range_once(
    storage: Storage, catalog_url: str, blob_dir: Path
) -> None:
    id = storage.create_source("view", SCHEMA).id
    context = multiprocessing.get_context("spawn")
    start_at = time.time() + 2  # after every process has started and imported
    with context.Pool(3) as pool:
        outcomes = pool.starmap(
            race_appends, [(catalog_url, str(blob_dir), id, n, UNTIL, start_at) for n in range(3)]
        )
    assert sum(wins for wins, _ in outcomes) == UNTIL
    assert sum(losses for _, losses in outcomes) > 0  # they did race
    assert_written_exactly_once(storage, id, blob_dir)
    writers = set(storage.read_snapshot(id, UNTIL - 1)["writer"].to_pylist())
    assert writers <= {0, 1, 2}


def test_a_writer_killed_before_commit_leaves_no_visible_batch(
    storage: Storage, catalog_url: str, blob_dir: Path, dump
) -> None:  # type: ignore[no-untyped-def]
    id = storage.create_source("view", SCHEMA).id
    storage.compare_and_append(id, Frontier(0), Frontier(1), pa.table({"t": [0], "writer": [9]}))
    before, kept = dump(), files(blob_dir)

    process = multiprocessing.get_context("spawn").Process(
        target=append_then_die, args=(catalog_url, str(blob_dir), id)
    )
    process.start()
    process.join(60)
    assert process.exitcode == -signal.SIGKILL

    (orphan,) = files(blob_dir) - kept  # its file was written...
    assert dump() == before  # ...but nothing was committed
    assert storage.upper(id) == Frontier(1)
    assert storage.read_snapshot(id, 0).to_pylist() == [{"t": 0, "writer": 9}]
    assert all(Path(p).name != Path(orphan).name for p in storage.snapshot(id, 0).paths)

    assert storage.collect_garbage(grace_ms=60_000).orphans == ()  # too recent to judge
    assert storage.collect_garbage(grace_ms=0).orphans == (orphan,)
    assert files(blob_dir) == kept
    storage.compare_and_append(id, Frontier(1), Frontier(2), pa.table({"t": [1], "writer": [1]}))
    assert sorted(storage.read_snapshot(id, 1)["t"].to_pylist()) == [0, 1]


def test_a_fenced_writer_changes_nothing(catalog_url: str, blob_dir: Path, dump) -> None:  # type: ignore[no-untyped-def]
    old_catalog = Catalog.open(catalog_url)
    old_catalog.become_controller()
    old = Storage(old_catalog, blob_dir)
    id = old.create_source("orders", SCHEMA).id
    old.append(id, [{"t": 1, "writer": 1}])
    old.acquire_read_hold(id, "controller", Frontier(0))
    new_catalog = Catalog.open(catalog_url)
    new_catalog.become_controller()

    before, kept = dump(), files(blob_dir)
    upper = old.upper(id)
    attempts = [
        lambda: old.compare_and_append(
            id, upper, Frontier(upper.time + 5), [{"t": 2, "writer": 1}]
        ),
        lambda: old.compare_and_append(id, upper, Frontier(upper.time + 5)),
        lambda: old.append(id, [{"t": 3, "writer": 1}]),
        lambda: old.append(id, [{"t": 3, "writer": 1}], ts=upper.time + 10),
        lambda: old.downgrade_read_hold(id, "controller", Frontier(1)),
        lambda: old.compact(id),
        lambda: old.collect_garbage(0),
    ]
    for attempt in attempts:
        with pytest.raises(Fenced):
            attempt()
        assert dump() == before and files(blob_dir) == kept

    # The new controller carries on from the same upper.
    Storage(new_catalog, blob_dir).append(id, [{"t": 4, "writer": 2}])
    old_catalog.close()
    new_catalog.close()
