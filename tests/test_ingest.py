"""Ingest that does not serialize (DESIGN section 3): appends are group-committed.

Storage commits a group of appends to any sources at one timestamp, in one catalog
transaction (`Storage.append_group`), all or nothing; the controller's `GroupCommit`
puts every append that arrives while a commit is in flight into the next one, so a
lone writer waits for nobody. Through a real controller killed with SIGKILL in the
middle of a stream of appends from eight clients, on SQLite and on PostgreSQL, no
append is lost, doubled or split across timestamps, and an append cut off by the kill
and sent again under its idempotency key is applied once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import postgres_schema
from sqlalchemy import select

from catalog import Catalog, FailedPrecondition, NotFound
from catalog._models import APPEND_KEYS_RETAINED_MS, AppendKey
from controller._ingest import GroupCommit
from controller._process import ControllerProcess, kill_replicas
from controller.client import Client, TandemError
from history import Frontier
from storage import TIME, Storage

SCHEMA = "writer BIGINT NOT NULL, seq BIGINT NOT NULL, n BIGINT"


def _rows(writer: int, seq: int, count: int) -> list[dict]:
    return [{"writer": writer, "seq": seq, "n": i} for i in range(count)]


def test_a_group_commits_appends_to_several_sources_at_one_time_and_moves_every_source(storage: Storage) -> None:
    a, b, idle = (storage.create_source(name, SCHEMA).id for name in ("a", "b", "idle"))
    group = [(a, storage.append_batch_of(a, _rows(1, 1, 2))), (b, storage.append_batch_of(b, _rows(2, 1, 3))), (a, storage.append_batch_of(a, _rows(3, 1, 1)))]
    ts, earlier = storage.append_group(group)
    assert earlier == {}
    for id, rows in ((a, 3), (b, 3), (idle, 0)):
        assert storage.upper(id) == Frontier(ts + 1)
        assert storage.read_snapshot(id, ts).num_rows == rows
    batches = storage.catalog.manifest(a).batches
    assert len(batches) == 1 and (batches[0].lower, batches[0].upper) == (0, Frontier(ts + 1)), "one file per source"
    assert set(storage.read_changes(a, ts - 1, ts)[TIME].to_pylist()) == {ts}
    assert storage.append_group([(a, storage.append_batch_of(a, _rows(1, 2, 1)))])[0] > ts


def test_an_append_whose_key_was_committed_appends_nothing_and_gets_the_first_timestamp(storage: Storage) -> None:
    a, b = (storage.create_source(name, SCHEMA).id for name in ("a", "b"))
    first, _ = storage.append_group([(a, storage.append_batch_of(a, _rows(1, 1, 2))), (b, storage.append_batch_of(b, _rows(2, 1, 1)))], ["k1", None])
    again, earlier = storage.append_group([(a, storage.append_batch_of(a, _rows(1, 1, 2))), (b, storage.append_batch_of(b, _rows(2, 2, 1)))], ["k1", "k2"])
    assert again > first and earlier == {"k1": (a, first)}
    assert storage.read_snapshot(a, again).num_rows == 2 and storage.read_snapshot(b, again).num_rows == 2
    assert storage.append_group([(b, storage.append_batch_of(b, _rows(2, 3, 1)))], ["k1"])[1] == {"k1": (a, first)}  # another source's key
    # Forgotten after the retention: the same key is a new append.
    real_clock = storage.catalog._now_ms
    storage.catalog._now_ms = lambda: real_clock() + APPEND_KEYS_RETAINED_MS + 1_000
    later, earlier = storage.append_group([(a, storage.append_batch_of(a, _rows(1, 1, 2)))], ["k1"])
    assert earlier == {} and storage.read_snapshot(a, later).num_rows == 4


def test_a_key_past_its_retention_is_a_new_append_before_the_prune_forgets_it(storage: Storage) -> None:
    """Expired keys are pruned at most once a second (`PRUNE_APPEND_KEYS_EVERY_MS`), not
    at every commit: until then a lookup skips them, and one given again is recorded
    anew at the new time, while the others wait for the prune."""
    a = storage.create_source("a", SCHEMA).id
    storage.append_group([(a, storage.append_batch_of(a, _rows(1, 1, 1))), (a, storage.append_batch_of(a, _rows(1, 2, 1)))], ["k1", "k2"])
    real_clock = storage.catalog._now_ms
    storage.catalog._now_ms = lambda: real_clock() + APPEND_KEYS_RETAINED_MS + 1_000
    storage.catalog._prune_keys_at_ms = real_clock() + 10 * APPEND_KEYS_RETAINED_MS  # not due
    later, earlier = storage.append_group([(a, storage.append_batch_of(a, _rows(1, 1, 1)))], ["k1"])
    assert earlier == {} and storage.read_snapshot(a, later).num_rows == 3
    with storage.catalog._engine.connect() as connection:
        kept = dict(connection.execute(select(AppendKey.key, AppendKey.ts)).all())
    assert sorted(kept) == ["k1", "k2"] and kept["k1"] == later and kept["k2"] < later  # k2 waits for the prune
    storage.catalog._prune_keys_at_ms = 0
    storage.append_group([(a, storage.append_batch_of(a, _rows(1, 3, 1)))])
    with storage.catalog._engine.connect() as connection:
        assert connection.execute(select(AppendKey.key)).scalars().all() == ["k1"]


def test_a_refused_group_writes_nothing(storage: Storage, blob_dir: Path) -> None:
    a, b = (storage.create_source(name, SCHEMA).id for name in ("a", "b"))
    batches = [(a, storage.append_batch_of(a, _rows(1, 1, 2))), (b, storage.append_batch_of(b, _rows(2, 1, 2)))]
    storage.catalog.drop_source(b)
    before = sorted(p.name for p in blob_dir.rglob("*.parquet"))
    with pytest.raises(NotFound):
        storage.append_group(batches)
    assert storage.upper(a) == Frontier(0) and not storage.catalog.manifest(a).batches
    assert sorted(p.name for p in blob_dir.rglob("*.parquet")) == before, "the refused group's files are removed"


class _Gated:
    """`Storage.append_group` that waits at the gate (when closed) before each commit,
    recording each commit's group."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.groups: list[list[str]] = []

    def __call__(self, appends, keys):
        self.entered.set()
        self.gate.wait(30)
        self.groups.append([id for id, _ in appends])
        return self.storage.append_group(appends, keys)


def test_appends_arriving_during_a_commit_share_the_next_one_and_a_lone_one_waits_for_nobody(storage: Storage) -> None:
    a, b = (storage.create_source(name, SCHEMA).id for name in ("a", "b"))

    async def scenario() -> None:
        gated = _Gated(storage)
        ingest = GroupCommit(gated)
        try:
            lone = await asyncio.wait_for(ingest.append(a, storage.append_batch_of(a, _rows(0, 0, 1))), 10)
            gated.gate.clear()
            gated.entered.clear()
            first = asyncio.ensure_future(ingest.append(a, storage.append_batch_of(a, _rows(1, 0, 1))))
            await asyncio.to_thread(gated.entered.wait, 10)  # its commit is in flight
            later = [asyncio.ensure_future(ingest.append(id, storage.append_batch_of(id, _rows(2, seq, 2)))) for seq, id in enumerate([a, b, a, b, b])]
            await asyncio.sleep(0.2)
            gated.gate.set()
            times = await asyncio.wait_for(asyncio.gather(first, *later), 10)
        finally:
            ingest.stop()
        assert gated.groups == [[a], [a], [a, b, a, b, b]]
        assert lone < times[0] < times[1] and len(set(times[1:])) == 1, times
        assert (ingest.commits, ingest.appends, ingest.last_group) == (3, 7, 5)
        ts = times[1]
        assert storage.read_changes(a, ts - 1, ts).num_rows == 4 and storage.read_changes(b, ts - 1, ts).num_rows == 6

    asyncio.run(scenario())


def test_an_append_sent_twice_at_once_is_committed_once_and_a_reused_key_is_refused(storage: Storage) -> None:
    a, b = (storage.create_source(name, SCHEMA).id for name in ("a", "b"))

    async def scenario() -> None:
        gated = _Gated(storage)
        ingest = GroupCommit(gated)
        try:
            gated.gate.clear()
            in_flight = asyncio.ensure_future(ingest.append(a, storage.append_batch_of(a, _rows(1, 0, 1)), "k"))
            await asyncio.to_thread(gated.entered.wait, 10)
            again = asyncio.ensure_future(ingest.append(a, storage.append_batch_of(a, _rows(1, 0, 1)), "k"))
            with pytest.raises(FailedPrecondition, match="idempotency key 'k' was given to an append to another source"):
                await ingest.append(b, storage.append_batch_of(b, _rows(1, 0, 1)), "k")
            gated.gate.set()
            ts = await in_flight
            assert await again == ts
            # Committed: a retry goes through a commit, which finds the key.
            assert await ingest.append(a, storage.append_batch_of(a, _rows(1, 0, 1)), "k") == ts
            with pytest.raises(FailedPrecondition, match="another source"):
                await ingest.append(b, storage.append_batch_of(b, _rows(1, 0, 1)), "k")
        finally:
            ingest.stop()
        assert gated.groups == [[a], [a], [b]] and ingest.appends == 1
        assert storage.read_snapshot(a, storage.upper(a).time - 1).num_rows == 1 and storage.read_snapshot(b, storage.upper(b).time - 1).num_rows == 0

    asyncio.run(scenario())


def test_a_group_refused_for_one_source_commits_the_others(storage: Storage) -> None:
    a, b = (storage.create_source(name, SCHEMA).id for name in ("a", "b"))

    async def scenario() -> None:
        gated = _Gated(storage)
        ingest = GroupCommit(gated)
        try:
            gated.gate.clear()
            blocker = asyncio.ensure_future(ingest.append(a, storage.append_batch_of(a, _rows(0, 0, 1))))
            await asyncio.to_thread(gated.entered.wait, 10)
            good = asyncio.ensure_future(ingest.append(a, storage.append_batch_of(a, _rows(1, 0, 1))))
            bad = asyncio.ensure_future(ingest.append(b, storage.append_batch_of(b, _rows(2, 0, 1))))
            tick = asyncio.ensure_future(ingest.advance())
            await asyncio.sleep(0.1)
            storage.catalog.drop_source(b)
            gated.gate.set()
            await blocker
            assert await good > 0 and await tick > 0
            with pytest.raises(NotFound):
                await bad
        finally:
            ingest.stop()

    asyncio.run(scenario())


# --- A real controller, killed in the middle of a stream of appends --------------------

WRITERS = 8
ROWS = 50


def _stream(address: str, writer: int, stop: threading.Event, acked: dict, tried: set) -> None:
    """Append 50-row batches, each with its own idempotency key, as fast as the
    controller takes them, until `stop` or the controller is gone; record each
    acknowledged one's timestamp."""
    seq = 0
    with Client.connect(address) as client:
        while not stop.is_set():
            tried.add((writer, seq))
            try:
                acked[writer, seq] = client.append("events", _rows(writer, seq, ROWS), idempotency_key=f"{writer}/{seq}")
            except TandemError:
                return  # killed: this append's outcome is unknown
            seq += 1


@contextmanager
def _catalog_url(kind: str, tmp_path: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'catalog.db'}"
    else:
        with postgres_schema() as url:
            yield url


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_appends_from_eight_clients_through_a_controller_kill_are_each_committed_once_whole_or_not_at_all(tmp_path, kind) -> None:
    data = tmp_path / "data"
    with _catalog_url(kind, tmp_path) as url:
        # Retention long enough that no compaction merges the appends' times meanwhile.
        controller = ControllerProcess(data, catalog_url=url, serve_args=["--http-listen", "off", "--retention-ms", "600000"])
        try:
            with Client.connect(controller.address) as client:
                source = client.create_source("events", SCHEMA).id
            stop, acked, tried = threading.Event(), {}, set()
            writers = [threading.Thread(target=_stream, args=(controller.address, w, stop, acked, tried)) for w in range(WRITERS)]
            for thread in writers:
                thread.start()
            deadline = time.monotonic() + 60
            while len(acked) < 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            controller.kill()  # SIGKILL, with commits in flight
            stop.set()
            for thread in writers:
                thread.join(30)
            assert len(acked) >= 200, f"only {len(acked)} appends acknowledged in 60 s"
            controller.start()
            with Client.connect(controller.address) as client:
                # Each writer's append cut off by the kill, sent again under its key: applied once.
                for writer, seq in tried - acked.keys():
                    acked[writer, seq] = client.append("events", _rows(writer, seq, ROWS), idempotency_key=f"{writer}/{seq}")
                last = client.append("events", _rows(WRITERS, 0, 1))  # it takes appends again
        finally:
            controller.kill()
            kill_replicas(data, url)
        catalog = Catalog.open(url)
        try:
            since = catalog.manifest(source).collection.since.time  # its creation: nothing before
            updates = Storage(catalog, data / "blobs").read_changes(source, since - 1, last)
        finally:
            catalog.close()
    times: dict[tuple[int, int], set[int]] = defaultdict(set)
    counts: Counter = Counter()
    for writer, seq, at in zip(updates["writer"].to_pylist(), updates["seq"].to_pylist(), updates[TIME].to_pylist()):
        counts[writer, seq] += 1
        times[writer, seq].add(at)
    for append, at in acked.items():
        assert counts[append] == ROWS and times[append] == {at}, f"acknowledged append {append} at {at}: {counts[append]} rows at {times[append]}"
    del counts[WRITERS, 0]
    assert counts.keys() == tried, "every append, retried after the kill or not, is there once"
    assert len({at for at in acked.values()}) < len(acked), "concurrent appends shared commits"
