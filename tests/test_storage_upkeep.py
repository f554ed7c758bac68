"""Storage upkeep as the controller runs it (`controller/_upkeep.py`), on SQLite and
PostgreSQL, without replicas or Spark: the retention hold moves since, compaction keeps
batches bounded under a steady stream of appends, garbage collection forgets retired
files after the grace, a dataflow created right after a pass keeps its as_of, and the
controller's background loop stops when fenced and carries on after other errors; a
reader following the manifest's tail holds its batches through compactions."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from catalog import Catalog, Fenced
from controller._orchestrator import Orchestrator
from controller._upkeep import RETENTION_HOLDER, StorageUpkeep, UpkeepOptions
from controller.runtime import Controller
from history import Frontier, Import
from storage import Storage

F = Frontier
SCHEMA = "id BIGINT NOT NULL"
T = TypeVar("T")


@pytest.fixture
def source(storage: Storage) -> str:
    return storage.create_source("orders", SCHEMA).id


def holds(storage: Storage, id: str) -> dict[str, Frontier]:
    return dict(storage.catalog.manifest(id).holds)


def files(blob_dir: Path) -> set[str]:
    return {p.relative_to(blob_dir).as_posix() for p in blob_dir.rglob("*.parquet")}


# --- Retention and compaction -------------------------------------------------------------


def test_the_retention_hold_moves_since(storage: Storage, source: str) -> None:
    upkeep = StorageUpkeep(storage, UpkeepOptions(retention_ms=500))
    for ts in (1000, 2000, 3000):
        storage.append(source, [{"id": ts}], ts=ts)
    storage.acquire_read_hold(source, "main/u9", F(1500))  # a dataflow reading at 1500
    upkeep.run_once()
    assert holds(storage, source) == {RETENTION_HOLDER: F(2500), "main/u9": F(1500)}
    assert storage.since(source) == F(1500)  # the dataflow holds it lower
    storage.release_read_hold(source, "main/u9")
    assert storage.since(source) == F(2500)  # upper 3001 - 1 - 500

    storage.append(source, [{"id": 1}], ts=5000)
    upkeep.run_once()
    assert storage.since(source) == F(4500)
    upkeep.run_once()  # nothing moved: nothing changes
    assert holds(storage, source) == {RETENTION_HOLDER: F(4500)}

    storage.compare_and_append(source, F(5001), F.empty())  # closed: the hold stays put
    upkeep.run_once()
    assert storage.since(source) == F(4500)


def test_a_young_collection_is_held_at_its_since_and_a_dropped_one_is_let_go(
    storage: Storage, source: str
) -> None:
    upkeep = StorageUpkeep(storage, UpkeepOptions(retention_ms=60_000))
    storage.append(source, [{"id": 1}], ts=10)
    storage.catalog.create_instance("main")
    view = storage.catalog.create_dataflow(
        "main", "copy", sql="SELECT * FROM o", imports=[Import("o", source)],
        schema=SCHEMA, as_of=F(10), materialized=True,
    )
    upkeep.run_once()
    # 11 - 1 - 60000, but not below the since, which the dataflow's hold (taken with its
    # record, before any pass) moved to its as_of.
    assert holds(storage, source) == {RETENTION_HOLDER: F(10), f"main/{view.sink_id}": F(10)}
    assert holds(storage, view.sink_id) == {RETENTION_HOLDER: F(10)}  # its since

    storage.catalog.drop_dataflow(view.id)
    storage.catalog.drop_source(source)
    assert upkeep.run_once().compacted == {}  # no error, no hold taken again
    assert storage.catalog.list_collections() == []


def test_compaction_waits_for_enough_batches_below_since(storage: Storage, source: str) -> None:
    upkeep = StorageUpkeep(storage, UpkeepOptions(retention_ms=0, compact_min_batches=4))
    for ts in range(1, 4):
        storage.append(source, [{"id": ts}], ts=ts)
    storage.compare_and_append(source, F(4), F(5))
    assert upkeep.run_once().compacted == {}  # since 4: three batches below it
    storage.append(source, [{"id": 4}], ts=5)
    storage.compare_and_append(source, F(6), F(7))
    assert upkeep.run_once().compacted == {source: 4}
    (merged,) = storage.catalog.manifest(source).batches
    assert (merged.lower, merged.upper, merged.rows) == (0, F(6), 4)
    assert storage.read_snapshot(source, 6)["id"].to_pylist() == [1, 2, 3, 4]


def test_a_manifest_tail_brings_a_follower_to_the_manifest_through_appends_and_compactions(storage: Storage, source: str) -> None:
    """A reader that keeps the batches it read and asks only for what changed since
    (`Catalog.manifest_tail`, as a replica's reader does at every poll) holds the
    manifest's batches after every round of appends, empty appends, compactions, and
    the close: new batches alone while none of its earlier ones changed, all of them
    once a compaction replaced some."""
    rng = random.Random(48)
    catalog = storage.catalog
    known: tuple = ()
    upper: Frontier = F(0)
    tails = {"whole": 0, "new": 0}
    storage.acquire_read_hold(source, "reader", F(0))
    for round_ in range(30):
        for _ in range(rng.randint(0, 3)):
            if rng.random() < 0.2:
                current = storage.upper(source)
                storage.compare_and_append(source, current, F(current.time + 1))  # no rows
            else:
                storage.append(source, [{"id": round_}])
        if rng.random() < 0.3:
            storage.downgrade_read_hold(source, "reader", storage.upper(source))
            storage.compact(source)
        if round_ == 29:
            storage.compare_and_append(source, storage.upper(source), Frontier.empty())  # closed
        tail = catalog.manifest_tail(source, None if upper.is_empty else upper.time, len(known))
        known = tail.batches if tail.whole else known + tail.batches
        upper = tail.collection.upper
        tails["whole" if tail.whole else "new"] += 1
        state = catalog.manifest(source)
        assert known == state.batches, f"round {round_}"
        assert (tail.collection.since, upper) == (state.collection.since, state.collection.upper)
    assert upper.is_empty
    assert tails["whole"] >= 3 and tails["new"] >= 10, tails  # both kinds of tail were read


class LogicalClock:
    """The catalog's clock, moved by the test alone."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def test_a_steady_stream_of_appends_stays_bounded(catalog_url: str, blob_dir: Path) -> None:
    """1,500 one-row appends while upkeep runs on a thread of its own, as the controller
    runs it. The catalog's clock moves 10 ms per append, so the retention is 20 appends,
    garbage is collected every 10 and the grace is 200 (and 2 s of wall-clock time, by
    which orphans are judged). Each 20 appends the stream waits for one full pass (the
    controller's tick is seconds, its appends milliseconds apart: the ratio is what
    matters), then counts what is live."""
    appends = 1500  # 1,300 in the steady state: six and a half grace periods
    clock = LogicalClock()
    catalog = Catalog.open(catalog_url, now_ms=clock)
    catalog.become_controller()
    storage = Storage(catalog, blob_dir, fsync=False)
    id = storage.create_source("events", SCHEMA).id
    options = UpkeepOptions(
        interval_ms=5,
        retention_ms=200,
        compact_min_batches=8,
        gc_grace_ms=2000,
        gc_interval_ms=100,
    )
    upkeep = StorageUpkeep(storage, options, clock=lambda: clock.now / 1000)
    passes, failures, stop = [0], [], threading.Event()
    progress = threading.Condition()

    def run() -> None:
        while not stop.wait(options.interval_ms / 1000):
            try:
                upkeep.run_once()
            except Exception as error:  # reported by the main thread
                failures.append(error)
                return
            with progress:
                passes[0] += 1
                progress.notify_all()

    worker = threading.Thread(target=run, name="upkeep")
    worker.start()
    live, retired, on_disk = [], [], []
    try:
        for number in range(appends):
            clock.now += 10
            storage.append(id, [{"id": number}])
            if number % 20 == 19:
                with progress:  # one whole pass after these appends
                    target = passes[0] + 2
                    assert progress.wait_for(lambda: passes[0] >= target or failures, 60)
                assert not failures, failures
                if number >= 200:  # steady
                    live.append(len(catalog.manifest(id).batches))
                    retired.append(len(catalog.retired_paths(clock.now + 1)))
                    on_disk.append(len(files(blob_dir)))
    finally:
        stop.set()
        worker.join(60)
    assert not failures, failures
    # The 20 appends of the retention window, fewer than 8 below since, and the merged
    # batches below them (a few: their sizes fall geometrically, `merge_run`).
    assert max(live) <= 30, live
    # Retired rows of the last 200 appends only: their batches, and the merged batches
    # merged again, at most one per compaction, which replaces two or more batches: no
    # more than the appended ones.
    assert max(retired) <= 2 * 200 + 40, retired
    assert max(on_disk) <= max(live) + max(retired), on_disk

    upper = storage.upper(id)
    assert storage.read_snapshot(id, upper.time - 1)["id"].to_pylist() == list(range(appends))
    clock.now += options.gc_grace_ms + 1  # the stream stops; the grace passes
    upkeep.run_once()
    assert catalog.retired_paths(clock.now + 1) == []
    assert files(blob_dir) == {b.path for b in catalog.manifest(id).batches}
    catalog.close()


# --- In the controller ----------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    schema: str
    not_incremental: str | None = None


class FakePlanner:
    """The three planner calls `create_dataflow` makes, without Spark: every query reads
    `orders` and returns its schema."""

    def referenced_tables(self, sql: str, conf: Any = None) -> list[str]:
        return ["orders"]

    def analyze(self, sql: str, schemas: dict[str, str], conf: Any = None) -> Planned:
        return Planned(schemas["orders"])

    def check_index_key(self, planned: Planned, key: Any) -> tuple[str, ...]:
        return tuple(key)

    def stop(self) -> None:
        pass


def new_controller(storage: Storage, tmp_path: Path, options: UpkeepOptions) -> Controller:
    """A `Controller` over `storage` (the controller's catalog), no background task yet."""
    planner: Future[FakePlanner] = Future()
    planner.set_result(FakePlanner())
    catalog = storage.catalog
    url = catalog.url.render_as_string(hide_password=False)
    orchestrator = Orchestrator(catalog, url, storage.blob_uri, tmp_path)
    controller = Controller(
        catalog, url, storage, planner, orchestrator, options  # type: ignore[arg-type]
    )
    controller._epoch = catalog.epoch  # type: ignore[assignment]
    return controller


async def eventually(predicate: Callable[[], T], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while not (value := await asyncio.to_thread(predicate)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        await asyncio.sleep(0.05)
    return value


def test_a_dataflow_created_right_after_an_upkeep_pass_keeps_its_as_of(
    storage: Storage, source: str, tmp_path: Path
) -> None:
    """`create_dataflow` picks as_of = upper - 1; the catalog records the dataflow, and
    its hold on the source, a moment later. Another pass in that moment, after more
    appends, must leave the source readable at that as_of: the retention window keeps
    since behind it."""
    controller = new_controller(storage, tmp_path, UpkeepOptions(retention_ms=60_000))
    record, raced = storage.catalog.create_dataflow, []

    def record_after_a_pass(*args: Any, **kwargs: Any) -> Any:  # the race, made to happen every time
        if not raced:
            later = storage.upper(source).time + 30_000
            raced.append(storage.append(source, [{"id": 2}], ts=later))
            controller.upkeep.run_once()
        return record(*args, **kwargs)

    storage.catalog.create_dataflow = record_after_a_pass  # type: ignore[method-assign]

    async def scenario() -> tuple[Frontier, Frontier]:
        storage.append(source, [{"id": 1}])
        controller.upkeep.run_once()
        await controller.create_instance("main")
        view = await controller.create_dataflow("main", "all", "SELECT * FROM o", index_key=["id"])
        as_of = storage.catalog.get_collection(view.index_id).since
        holder = f"main/{view.index_id}"
        hold = await eventually(lambda: holds(storage, source).get(holder), 30, "the hold")
        await controller.stop()
        return as_of, hold

    as_of, hold = asyncio.run(scenario())
    assert raced == [as_of.time + 30_001] and hold == as_of
    # The pass in between moved the retention hold 30 s on, still 30 s behind as_of.
    assert holds(storage, source)[RETENTION_HOLDER] == F(as_of.time + 30_001 - 60_000)
    assert storage.since(source) <= as_of  # readable there
    assert storage.read_snapshot(source, as_of.time)["id"].to_pylist() == [1]


def test_the_upkeep_task_stops_when_fenced_and_carries_on_after_other_errors(
    storage: Storage, source: str, catalog_url: str, blob_dir: Path, tmp_path: Path
) -> None:
    options = UpkeepOptions(interval_ms=20, retention_ms=0, gc_interval_ms=0)
    controller = new_controller(storage, tmp_path, options)
    passes: list[str] = []
    collect = storage.collect_garbage

    def collect_failing_once(grace_ms: int) -> Any:
        passes.append("gc")
        if len(passes) == 1:
            raise OSError("the object store is unreachable")
        return collect(grace_ms)

    storage.collect_garbage = collect_failing_once  # type: ignore[method-assign]
    storage.append(source, [{"id": 1}], ts=100)

    async def scenario() -> BaseException | None:
        controller._start_tasks()
        upkeep = controller._tasks[-1]
        await eventually(lambda: len(passes) >= 3, 30, "passes after a failed one")
        assert RETENTION_HOLDER in holds(storage, source)
        with Catalog.open(catalog_url) as successor:
            successor.become_controller()
            # A replica's write, which no epoch fences: the next pass has a hold to move.
            Storage(successor, blob_dir).compare_and_append(source, F(101), F(200))
        await asyncio.wait({upkeep}, timeout=30)
        error = controller.fenced if upkeep.done() else None  # the task ended, telling the controller
        await controller.stop()
        return error

    assert isinstance(asyncio.run(scenario()), Fenced)

