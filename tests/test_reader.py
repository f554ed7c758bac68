"""Snapshots of storage collections as a replica's Spark reads them
(`StorageReader.snapshot`), on real Spark: the batches without retractions are expanded
as they are, few retractions patch them (broadcast, no shuffle of the collection), many
are consolidated with everything; every way gives the rows storage gives, with the same
bits (a float's -0.0 and NaN as Spark's grouping leaves them)."""

from __future__ import annotations

import math
import os
import struct
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.sql import DataFrame

from catalog import Catalog
from history import Frontier
from replica_service import _spark
from replica_service.dataplane import Lease, StorageReader
from replica_service.dataplane import _reader
from storage import Storage

pytestmark = pytest.mark.spark

EXAMPLES = int(os.environ.get("TANDEM_PROPERTY_EXAMPLES", "4"))
SCHEMA = "id BIGINT, k STRING, x DOUBLE"
SETTLED_ROWS = 40  # the first batch: more rows than every later batch together


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("reader")
    catalog = Catalog.open(f"sqlite:///{root / 'catalog.db'}")
    catalog.become_controller()
    storage = Storage(catalog, root / "blobs", fsync=False)
    session = _spark.start_session(_spark.SparkSettings("local[2]"), root / "spark", {"spark.sql.shuffle.partitions": "2"})
    yield dict(storage=storage, session=session, sources=iter(range(10**6)))
    session.stop()


values_x = st.sampled_from([0.0, -0.0, float("nan"), 1.5, -2.25, None])
rows = st.fixed_dictionaries({"id": st.integers(0, 3), "k": st.sampled_from(["a", "b", None]), "x": values_x})


@st.composite
def histories(draw):
    """A first batch of inserts (duplicates among them), then batches of inserts and
    retractions (picks of live rows by position; an update is a retraction and an
    insert in one batch)."""
    first = [{**draw(rows), "id": i % 7} for i in range(SETTLED_ROWS)]
    inserts, picks = st.lists(rows, max_size=3), st.lists(st.integers(0, 10**6), min_size=1, max_size=3)
    later = [(draw(inserts), draw(picks)) for _ in range(draw(st.integers(1, 3)))]
    return first, later


class Source:
    """A fresh source in storage and its live rows."""

    def __init__(self, env) -> None:
        self.storage: Storage = env["storage"]
        self.id = self.storage.create_source(f"s{next(env['sources'])}", SCHEMA).id
        self.live: list[dict] = []
        self.reader = StorageReader(self.storage, self.id)

    def append(self, session, inserts: list[dict], picks: list[int] = ()) -> int:
        changes = []
        for pick in picks:
            if self.live:
                changes.append({**self.live.pop(pick % len(self.live)), "_diff": -1})
        self.live.extend(inserts)
        changes.extend({**row, "_diff": 1} for row in inserts)
        time = self.storage.append(self.id, changes)
        self.reader.refresh(session)
        return time


def snapshot(source: Source, session, t: int, *, patch_max_rows: int, monkeypatch) -> tuple[pa.Table, str]:
    """The snapshot's rows and physical plan, with `PATCH_MAX_ROWS` set."""
    monkeypatch.setattr(_reader, "PATCH_MAX_ROWS", patch_max_rows)
    frame: DataFrame = source.reader.snapshot(session, t)
    return frame.toArrow(), frame._jdf.queryExecution().executedPlan().toString()


def bits(table: pa.Table) -> list[tuple]:
    """The rows with each float as its bits, in a fixed order."""
    return sorted(
        (tuple(struct.pack(">d", v).hex() if isinstance(v, float) else v for v in row.values()) for row in table.to_pylist()),
        key=repr,
    )


def normalized_bits(table: pa.Table) -> list[tuple]:
    """`bits` of the rows with -0.0 as 0.0 and any NaN as Python's: what Spark's
    grouping gives."""
    def norm(v):
        if isinstance(v, float):
            return float("nan") if math.isnan(v) else (0.0 if v == 0 else v)
        return v

    return bits(pa.Table.from_pylist([{k: norm(v) for k, v in row.items()} for row in table.to_pylist()], schema=table.schema))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(histories())
def test_few_retractions_patch_the_settled_rows_with_the_bits_of_a_full_consolidation(env, monkeypatch, history):
    session = env["session"]
    source = Source(env)
    first, later = history
    times = [source.append(session, first)]
    for inserts, picks in later:
        times.append(source.append(session, inserts, picks))
        patched, patched_plan = snapshot(source, session, times[-1], patch_max_rows=10**6, monkeypatch=monkeypatch)
        full, full_plan = snapshot(source, session, times[-1], patch_max_rows=-1, monkeypatch=monkeypatch)
        assert "LeftAnti" in patched_plan and "BroadcastExchange" in patched_plan, patched_plan
        assert "LeftAnti" not in full_plan
        assert bits(patched) == bits(full) == normalized_bits(source.storage.read_snapshot(source.id, times[-1]))
    # Before the first retraction: the rows as they are, and the same bits.
    settled, plan = snapshot(source, session, times[0], patch_max_rows=10**6, monkeypatch=monkeypatch)
    assert "Exchange" not in plan
    assert bits(settled) == normalized_bits(source.storage.read_snapshot(source.id, times[0]))


def test_many_retractions_are_consolidated_with_everything(env, monkeypatch):
    session = env["session"]
    source = Source(env)
    source.append(session, [{"id": i, "k": "a", "x": 1.0} for i in range(4)])
    t = source.append(session, [{"id": 9, "k": None, "x": -0.0}], picks=[0, 0, 0])  # 4 updates, 4 settled rows
    rows, plan = snapshot(source, session, t, patch_max_rows=10**6, monkeypatch=monkeypatch)
    assert "LeftAnti" not in plan
    assert bits(rows) == normalized_bits(source.storage.read_snapshot(source.id, t))


def test_a_patched_snapshot_that_retracts_a_missing_row_fails_naming_it(env, monkeypatch):
    session = env["session"]
    source = Source(env)
    source.append(session, [{"id": i, "k": "a", "x": 1.0} for i in range(10)])
    t = source.storage.append(source.id, [{"id": 42, "k": "z", "x": 2.0, "_diff": -1}])
    source.reader.refresh(session)
    with pytest.raises(Exception, match=rf"negative count in {source.id} at {t}: row .*\"id\":42.* has net count -1"):
        snapshot(source, session, t, patch_max_rows=10**6, monkeypatch=monkeypatch)


def test_a_snapshot_several_dataflows_recompute_over_is_computed_once_with_the_same_rows(env):
    """Asked under a lease: the second ask of the same rows persists them, later asks
    (any session) read them; a collection that did not change keeps its snapshot; after
    a change that had several asks, the first ask persists at once, and the old rows are
    released; an ask behind the newest reads without displacing it."""
    session, other = env["session"], env["session"].newSession()
    source = Source(env)
    t1 = source.append(session, [{"id": i % 3, "k": "a", "x": -0.0 if i else 1.5} for i in range(6)])
    expected = bits(source.reader.snapshot(session, t1).toArrow())

    def ask(s, t):  # as a recompute's step does
        lease = Lease()
        frame = source.reader.snapshot(s, t, lease=lease)
        rows = bits(frame.toArrow())
        lease.release()
        return frame, rows

    first, rows = ask(session, t1)
    assert not first.storageLevel.useDisk and rows == expected  # asked once: not worth keeping
    second, rows = ask(other, t1)
    assert second.storageLevel.useDisk and rows == expected
    third, rows = ask(session, t1)
    assert "InMemoryTableScan" in third._jdf.queryExecution().executedPlan().toString() and rows == expected
    # A later time with no batch between has the same rows: the same persisted snapshot.
    t2 = source.append(session, [{"id": 7, "k": "b", "x": 2.0}], picks=[0])
    assert t2 - 1 > t1 and ask(session, t2 - 1)[0].storageLevel.useDisk

    # The change had several asks before: its first ask persists; the old rows go.
    after, rows = ask(other, t2)
    assert after.storageLevel.useDisk and rows == bits(source.reader.snapshot(session, t2).toArrow())
    assert not second.storageLevel.useDisk
    # Behind the newest: read as usual, the newest stays.
    behind, rows = ask(session, t1)
    assert not behind.storageLevel.useDisk and rows == expected
    assert ask(session, t2)[0].storageLevel.useDisk


def test_a_shared_snapshot_is_released_when_its_batches_are_compacted_and_when_the_reader_closes(env):
    session = env["session"]
    source = Source(env)
    source.append(session, [{"id": 1, "k": "a", "x": 1.0}])
    source.append(session, [{"id": 2, "k": "b", "x": 2.0}])
    t = source.append(session, [{"id": 3, "k": None, "x": -0.0}], picks=[0])
    lease = Lease()
    source.reader.snapshot(session, t, lease=lease)  # a first ask: nothing to hold
    persisted = source.reader.snapshot(session, t, lease=lease)
    expected = normalized_bits(source.storage.read_snapshot(source.id, t))
    assert persisted.storageLevel.useDisk and bits(persisted.toArrow()) == expected

    source.storage.acquire_read_hold(source.id, "test", Frontier(t))
    assert source.storage.compact(source.id) == 2
    source.reader.refresh(session)
    assert persisted.storageLevel.useDisk  # its files are no longer the collection's, but a lease holds it
    lease.release()
    assert not persisted.storageLevel.useDisk
    lease = Lease()
    source.reader.snapshot(session, t, lease=lease)
    again = source.reader.snapshot(session, t, lease=lease)
    assert again.storageLevel.useDisk and bits(again.toArrow()) == expected

    source.reader.close()
    assert again.storageLevel.useDisk  # held
    lease.release()
    assert not again.storageLevel.useDisk


def _persisted(session) -> set[int]:
    return set(session.sparkContext._jsc.getPersistentRDDs().keySet())


@pytest.mark.parametrize("retire", ["close", "compaction"])
def test_rows_retired_while_a_step_holds_them_are_released_once_it_ends(env, retire):
    """A query planned over a base or a shared snapshot, which is then retired (the
    reader closed, its batches compacted) before the query runs: without a lease, the
    query built the blocks again, owned by nothing (Spark's cleaner drops them only
    once the JVM collects their RDD). Its lease keeps them persisted until it ends,
    and they are released then."""
    session = env["session"]
    source = Source(env)
    source.append(session, [{"id": 1, "k": "a", "x": 1.0}])
    source.append(session, [{"id": 2, "k": "b", "x": 2.0}])
    t = source.append(session, [{"id": 3, "k": "c", "x": 3.0}])
    before = _persisted(session)
    lease = Lease()
    base = source.reader.updates(session, t, lease=lease).groupBy().count()
    source.reader.snapshot(session, t, lease=Lease())  # a first ask: the next one persists
    snapshot = source.reader.snapshot(session, t, lease=lease).groupBy().count()
    for planned in (base, snapshot):
        assert "InMemoryRelation" in planned._jdf.queryExecution().optimizedPlan().toString()

    if retire == "close":
        source.reader.close()
    else:
        source.storage.acquire_read_hold(source.id, "test", Frontier(t))
        assert source.storage.compact(source.id) == 2
        source.reader.refresh(session)
        source.reader.updates(session, t, lease=Lease())  # a new base: the old one is retired
    assert base.collect()[0][0] == snapshot.collect()[0][0] == 3
    lease.release()
    assert _persisted(session) - before == set()


def _step_rows(source: Source, session, t: int) -> list[tuple]:
    """The rows through `t` as a step of a join reads them: under a lease, from the base."""
    lease = Lease()
    rows = _net_rows(source.reader.updates(session, t, lease=lease))
    lease.release()
    return rows


def _net_rows(frame: DataFrame) -> list[tuple]:
    """The rows updates amount to: `_diff` summed per row, zero sums gone."""
    table = frame.toArrow().group_by(["id", "k", "x"]).aggregate([("_diff", "sum")])
    return sorted((row["id"], row["k"], row["x"], row["_diff_sum"]) for row in table.to_pylist() if row["_diff_sum"])


def test_a_base_serves_every_step_until_compaction_replaces_its_batches(env):
    """The persisted base of an input read whole at every step is kept while its batches
    are the collection's, newer batches read beside it, and rebuilt once compaction has
    replaced them (their files will be collected), with the same rows."""
    session = env["session"]
    source = Source(env)
    source.append(session, [{"id": 1, "k": "a", "x": 1.0}])
    t = source.append(session, [{"id": 2, "k": "b", "x": 2.0}])
    _step_rows(source, session, t)
    base = source.reader._base
    t = source.append(session, [{"id": 3, "k": None, "x": 3.0}], picks=[0])
    before = _step_rows(source, session, t)
    assert source.reader._base is base and base.frame.storageLevel.useDisk

    source.storage.acquire_read_hold(source.id, "test", Frontier(t))
    assert source.storage.compact(source.id) == 2  # the base's two batches
    source.reader.refresh(session)
    after = _step_rows(source, session, t)
    assert source.reader._base is not base and not base.frame.storageLevel.useDisk
    assert after == before == [(2, "b", 2.0, 1), (3, None, 3.0, 1)]
    source.reader.close()


def test_a_base_outlives_a_compaction_of_the_newer_batches_beside_it(env):
    """Compaction merges small batches, not a large one behind them (`merge_run`), and a
    base covers the batches older than those it would merge, so the base over a load,
    built after a change, survives the merging of the changes read beside it."""
    session = env["session"]
    source = Source(env)
    load = source.append(session, [{"id": i, "k": "a", "x": float(i)} for i in range(10)])
    t = source.append(session, [{"id": 10, "k": "b", "x": 1.0}])
    first = _step_rows(source, session, t)
    base = source.reader._base
    assert base.through == load and len(base.batches) == 1  # the change is read beside it
    assert first == [(i, "a", float(i), 1) for i in range(10)] + [(10, "b", 1.0, 1)]
    source.append(session, [{"id": 11, "k": None, "x": 2.0}], picks=[0])
    t = source.append(session, [{"id": 12, "k": "c", "x": 3.0}])
    before = _step_rows(source, session, t)
    assert source.reader._base is base

    source.storage.acquire_read_hold(source.id, "test", Frontier(t))
    assert source.storage.compact(source.id) == 2  # the changes below since, not the load
    source.reader.refresh(session)
    assert _step_rows(source, session, t) == before
    assert source.reader._base is base and base.frame.storageLevel.useDisk
    source.reader.close()


def test_a_rehearsal_batch_retracts_rows_the_newest_batch_inserted_and_inserts_as_many_again(env, tmp_path):
    """A rehearsal's made-up batch (`rehearsal_batch`) holds `rows` rows the newest batch
    inserted, retracted, and as many of its other inserted rows again; `updates` reads
    it beside the stored batches, never into the base a lease holds. A collection
    that holds no rows has none."""
    session = env["session"]
    source = Source(env)
    assert source.reader.rehearsal_batch(session, tmp_path, 2) is None
    source.append(session, [{"id": i, "k": "a", "x": float(i)} for i in range(10)])
    t = source.append(session, [{"id": 10 + i, "k": "b", "x": 1.0} for i in range(5)], picks=[0])
    stored = _step_rows(source, session, t)

    made_up = source.reader.rehearsal_batch(session, tmp_path, 2)
    updates = session.read.parquet(made_up.uri).toArrow().to_pylist()
    retracted = {row["id"] for row in updates if row["_diff"] == -1}
    inserted = {row["id"] for row in updates if row["_diff"] == 1}
    assert len(updates) == 4 and len(retracted) == len(inserted) == 2
    assert retracted | inserted <= set(range(10, 15)) and not retracted & inserted

    lease = Lease()
    read = _net_rows(source.reader.updates(session, t, lease=lease, made_up=made_up))
    lease.release()
    expected = {(id, k, x): n for id, k, x, n in stored}
    for id in retracted | inserted:
        expected[(id, "b", 1.0)] += 1 if id in inserted else -1
    assert read == sorted((*row, n) for row, n in expected.items() if n)
    assert _step_rows(source, session, t) == stored  # from the same base, without it
    source.reader.close()


def test_a_change_over_many_small_batches_is_read_by_the_driver_with_the_bits_spark_reads(env, monkeypatch):
    """A change spread over more than `DRIVER_READ_MIN_BATCHES` batches is read by the
    replica's driver and handed to Spark as one relation (no file scan): the same
    updates, bit for bit, in the same Spark schema, as Spark reading every file, for a
    range cut inside the batches too. Fewer batches, or too many rows, Spark reads."""
    session = env["session"]
    source = Source(env)
    start = source.append(session, [{"id": i, "k": "a", "x": float(i)} for i in range(5)])
    values = [0.0, -0.0, float("nan"), 1.5, None, -2.25]
    times = [source.append(session, [{"id": 100 + n, "k": None if n % 3 else "b", "x": values[n % len(values)]}], picks=[n]) for n in range(12)]

    def read(after: int, through: int, *, driver: bool) -> tuple[list[tuple], str, str]:
        if not driver:
            monkeypatch.setattr(_reader, "DRIVER_READ_MAX_ROWS", 0)
        frame = source.reader.updates(session, through, after=after)
        monkeypatch.undo()
        return bits(frame.toArrow()), frame.schema.simpleString(), frame._jdf.queryExecution().executedPlan().toString()

    for after, through in ((start, times[-1]), (times[1], times[-2])):
        driven, spark = read(after, through, driver=True), read(after, through, driver=False)
        assert "FileScan" not in driven[2] and "LocalTableScan" in driven[2]
        assert "FileScan parquet" in spark[2]
        assert driven[:2] == spark[:2] and len(driven[0]) > 12
    assert "FileScan parquet" in read(times[-5], times[-1], driver=True)[2]  # four batches
    source.reader.close()


def test_a_manifest_read_before_a_compaction_plans_reads_of_files_garbage_collection_deleted(env):
    """Why a replica reads an idle collection's manifest again (`MANIFEST_MAX_AGE_S`):
    compaction replaces its batches without moving its upper, and once the retired
    files are collected a reader that kept the old batch list fails; read again, it
    reads the compacted batch, with the same rows."""
    session = env["session"]
    source = Source(env)
    source.append(session, [{"id": 1, "k": "a", "x": 1.0}])
    source.append(session, [{"id": 2, "k": "b", "x": 2.0}])
    t = source.append(session, [{"id": 3, "k": "c", "x": 3.0}], picks=[0])
    upper = source.storage.upper(source.id)
    source.storage.acquire_read_hold(source.id, "test", Frontier(t))
    assert source.storage.compact(source.id) == 2
    retired = source.storage.collect_garbage(0).retired  # other tests' sources' too
    assert sum(path.startswith(f"{source.id}/") for path in retired) == 2
    assert source.storage.upper(source.id) == upper  # nothing a poller of uppers sees

    with pytest.raises(Exception, match="(?i)does not exist|not found|FileNotFound"):
        source.reader.snapshot(session, t).collect()
    source.reader.refresh(session)
    assert bits(source.reader.snapshot(session, t).toArrow()) == bits(source.storage.read_snapshot(source.id, t))
    source.reader.close()


@st.composite
def manifests(draw):
    """Disjoint batches by `lower`, as a manifest lists them: each spans a few times,
    holds some of them, and the last may be the append that closed the collection."""
    batches, lower = [], draw(st.integers(0, 3))
    for _ in range(draw(st.integers(0, 10))):
        span = draw(st.integers(1, 4))
        times = draw(st.sets(st.integers(lower, lower + span - 1), min_size=1))
        batches.append(_reader.BatchFile(lower, Frontier(lower + span), f"b{lower}", tuple(sorted(times)), True, len(times)))
        lower += span + draw(st.integers(0, 2))  # a gap: no updates there
    if batches and draw(st.booleans()):
        last = batches[-1]
        batches[-1] = _reader.BatchFile(last.lower, Frontier.empty(), last.uri, last.times, True, last.rows)
    return batches


@settings(max_examples=300, deadline=None, derandomize=True)
@given(manifests(), st.none() | st.integers(-1, 45), st.integers(-1, 45) | st.just(math.inf))
def test_the_batches_holding_updates_in_a_range_are_those_a_scan_finds(batches, after, through):
    """`_overlapping` bisects on the batches' bounds; it finds what testing every batch's
    times finds."""
    scanned = [b for b in batches if any((after is None or t > after) and t <= through for t in b.times)]
    assert _reader._overlapping(batches, after, through) == scanned


class _Probed(StorageReader):
    """A reader that, while it plans a base, asks for its change times from another
    thread, as the replica's event loop does for heartbeats and peeks, and records how
    long that took."""

    waits: list[float]

    def _new_base(self, session, batches, through):
        asked = threading.Thread(target=self.change_times, args=(0, Frontier.empty()), daemon=True)
        start = time.monotonic()
        asked.start()
        asked.join(timeout=10)
        self.waits.append(time.monotonic() - start)
        return super()._new_base(session, batches, through)


def test_a_base_is_planned_outside_the_reader_lock_the_event_loop_takes(env):
    """Planning a base lists its batch files (long on an object store with many
    batches): the reader's lock, which `change_times` takes on the event loop, must not
    be held meanwhile."""
    session = env["session"]
    source = Source(env)
    source.reader = _Probed(source.storage, source.id)
    source.reader.waits = []
    source.append(session, [{"id": 1, "k": "a", "x": 1.0}])
    t = source.append(session, [{"id": 2, "k": "b", "x": 2.0}])
    assert _step_rows(source, session, t) == [(1, "a", 1.0, 1), (2, "b", 2.0, 1)]
    assert len(source.reader.waits) == 1 and source.reader.waits[0] < 5
    source.reader.close()
