"""Storage collections: compare-and-append, reads, read holds, compaction and garbage,
on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
import decimal
import math
import os
import struct
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from catalog import BatchInfo, Catalog, FailedPrecondition, Fenced, InvalidArgument, NotFound
from history import Frontier, Import
from storage import NegativeCount, Storage, UpperMismatch, merge_run

F = Frontier
SCHEMA = "id BIGINT NOT NULL, region STRING"


def files(blob_dir: Path) -> set[str]:
    return {p.relative_to(blob_dir).as_posix() for p in blob_dir.rglob("*.parquet")}


def manifest_paths(storage: Storage, id: str) -> set[str]:
    return {b.path for b in storage.catalog.manifest(id).batches}


def rows(*ids: int, region: str | None = "eu") -> list[dict[str, object]]:
    return [{"id": i, "region": region} for i in ids]


def ids(table: pa.Table) -> list[int]:
    return table["id"].to_pylist()


@pytest.fixture
def source(storage: Storage) -> str:
    return storage.create_source("orders", "id bigint not null, region string").id


# --- compare_and_append ---------------------------------------------------------------


def test_create_source_stores_the_normal_schema(storage: Storage, source: str) -> None:
    assert storage.catalog.get_collection(source).schema == SCHEMA
    assert storage.schema(source).names == ["id", "region"]
    with pytest.raises(InvalidArgument, match="unsupported type"):
        storage.create_source("bad", "id UUID")
    assert [c.name for c in storage.catalog.list_collections()] == ["orders"]


def test_compare_and_append_moves_the_upper_with_or_without_data(
    storage: Storage, source: str, blob_dir: Path
) -> None:
    info = storage.compare_and_append(source, F(0), F(5))
    assert info.upper == F(5) and storage.upper(source) == F(5)
    assert files(blob_dir) == set()  # no data, no file
    storage.compare_and_append(source, F(5), F(9), pa.table({"id": [1, 2], "_time": [5, 8]}))
    storage.compare_and_append(source, F(9), F(10), [])  # no rows: no batch either
    (batch,) = storage.catalog.manifest(source).batches
    assert (batch.lower, batch.upper, batch.rows) == (5, F(9), 2)
    assert files(blob_dir) == {batch.path}
    assert batch.bytes == (blob_dir / batch.path).stat().st_size
    stored = pq.read_table(blob_dir / batch.path)
    assert stored.schema.names == ["id", "region", "_time", "_diff"]
    assert stored.to_pylist() == [
        {"id": 1, "region": None, "_time": 5, "_diff": 1},
        {"id": 2, "region": None, "_time": 8, "_diff": 1},
    ]


def test_the_loser_gets_the_current_upper_and_leaves_no_file(
    storage: Storage, source: str, blob_dir: Path, dump
) -> None:  # type: ignore[no-untyped-def]
    storage.compare_and_append(source, F(0), F(3), rows(1))
    before, kept = dump(), files(blob_dir)
    with pytest.raises(UpperMismatch) as lost:
        storage.compare_and_append(source, F(0), F(2), rows(2))
    assert (lost.value.current, lost.value.expected) == (F(3), F(0))
    assert "upper of u1 is 3, not the expected 0" in str(lost.value)
    assert dump() == before and files(blob_dir) == kept


def test_a_loser_past_the_quick_check_removes_its_file(
    storage: Storage, source: str, blob_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race lost between writing the file and committing: the commit refuses, and
    the file goes."""
    real_upper = storage.upper
    monkeypatch.setattr(storage, "upper", lambda id: F(0))  # a stale view of the upper
    storage.catalog.append_batch(source, F(0), F(4), None)  # another writer wins
    with pytest.raises(UpperMismatch) as lost:
        storage.compare_and_append(source, F(0), F(2), rows(1))
    assert lost.value.current == F(4)
    assert files(blob_dir) == set()
    assert real_upper(source) == F(4)


@pytest.mark.parametrize(
    ("expected", "new", "data", "message"),
    [
        (F(0), F(0), None, "must be beyond"),
        (F(3), F(2), None, "must be beyond"),
        (F.empty(), F.empty(), None, "closed collection"),
        (
            F(0),
            F(5),
            pa.table({"id": [1, 2], "_time": [4, 5]}),
            r"row index 1: _time 5 .* outside \[0, 5\)",
        ),
        (F(0), F(5), pa.table({"id": [1], "_time": [-1]}), "outside"),
        (F(0), F(5), rows(1, 2) + [{"id": None}], "row index 2: column 'id'"),
        (F(0), F(5), [{"id": 1, "extra": 2}], "unknown column 'extra'"),
    ],
)
def test_bad_appends_write_nothing(
    storage: Storage, source: str, blob_dir: Path, dump, expected, new, data, message
) -> None:  # type: ignore[no-untyped-def]
    before = dump()
    with pytest.raises(InvalidArgument, match=message):
        storage.compare_and_append(source, expected, new, data)
    assert dump() == before and files(blob_dir) == set()


def test_appends_to_what_cannot_take_them_are_refused(storage: Storage, source: str) -> None:
    catalog = storage.catalog
    catalog.create_instance("main")
    df = catalog.create_dataflow(
        "main",
        "idx",
        sql="SELECT * FROM o",
        imports=[Import("o", source)],
        schema=SCHEMA,
        as_of=F(0),
        index_key=[],
    )
    with pytest.raises(InvalidArgument, match="is an index"):
        storage.compare_and_append(df.index_id, F(0), F(1), rows(1))
    with pytest.raises(NotFound):
        storage.compare_and_append("u404", F(0), F(1))
    catalog.drop_dataflow(df.id)
    other = storage.create_source("other", SCHEMA)
    catalog.drop_source(other.id)
    with pytest.raises(NotFound, match="was dropped"):
        storage.compare_and_append(other.id, F(0), F(1), rows(1))
    with pytest.raises(NotFound, match="was dropped"):
        storage.snapshot(other.id, 0)


def test_closing_a_collection(storage: Storage, source: str) -> None:
    storage.compare_and_append(
        source, F(0), F.empty(), pa.table({"id": [1, 2], "_time": [3, 10**12]})
    )
    assert storage.upper(source).is_empty
    assert ids(storage.read_snapshot(source, 10**13)) == [1, 2]
    with pytest.raises(InvalidArgument, match="closed"):
        storage.compare_and_append(source, F.empty(), F.empty())


def test_every_type_survives_parquet(storage: Storage) -> None:
    ddl = (
        "b BOOLEAN, i8 TINYINT, i16 SMALLINT, i32 INT, i64 BIGINT NOT NULL, f FLOAT, "
        "d DOUBLE, dec DECIMAL(20,4), s STRING, v VARCHAR(4), c CHAR(2), day DATE, "
        "ts TIMESTAMP, ntz TIMESTAMP_NTZ, bin BINARY"
    )
    id = storage.create_source("typed", ddl).id
    row = {
        "b": False,
        "i8": -1,
        "i16": 300,
        "i32": -70_000,
        "i64": 2**62,
        "f": 0.5,
        "d": float("inf"),
        "dec": decimal.Decimal("-1234567890123456.7891"),
        "s": "ünï",
        "v": "abcd",
        "c": "z",
        "day": dt.date(1, 1, 1),
        "ts": dt.datetime(2024, 5, 1, 1, 2, 3, 456789, tzinfo=dt.UTC),
        "ntz": dt.datetime(2024, 5, 1, 1, 2, 3),
        "bin": b"\xff",
    }
    nulls = {name: None for name in row} | {"i64": 0}
    ts = storage.append(id, [row, nulls], ts=7)
    snapshot = storage.read_snapshot(id, ts)
    assert snapshot.schema.equals(storage.schema(id), check_metadata=True)
    assert snapshot.to_pylist() == [{**row, "c": "z "}, nulls]  # sorted, nulls last


# --- append ---------------------------------------------------------------------------


def test_append_stamps_rows_with_a_write_timestamp(storage: Storage, source: str) -> None:
    ts = storage.append(source, rows(1, 2))
    assert ts == storage.catalog.read_ts() and storage.upper(source) == F(ts + 1)
    later = storage.append(source, [{"id": 1, "region": "eu", "_diff": -1}])
    assert later > ts
    assert ids(storage.read_snapshot(source, ts)) == [1, 2]
    assert ids(storage.read_snapshot(source, later)) == [2]


def test_append_at_a_time_below_the_upper_is_refused(
    storage: Storage, source: str, blob_dir: Path
) -> None:
    storage.append(source, rows(1), ts=10)
    assert storage.append(source, rows(2), ts=11) == 11  # right at the upper
    with pytest.raises(InvalidArgument, match="upper is already 12"):
        storage.append(source, rows(3), ts=11)
    assert ids(storage.read_snapshot(source, 11)) == [1, 2]
    assert files(blob_dir) == manifest_paths(storage, source)
    with pytest.raises(InvalidArgument, match="_time' is not allowed"):
        storage.append(source, [{"id": 1, "_time": 40}], ts=40)


# --- Reads ----------------------------------------------------------------------------


@pytest.fixture
def history(storage: Storage, source: str) -> str:
    """Updates at times 0..5: +1 @0, +2 @1, +3 and -1 @3, +1 (again) @5; upper 6."""
    storage.compare_and_append(source, F(0), F(2), pa.table({"id": [1, 2], "_time": [0, 1]}))
    storage.compare_and_append(
        source, F(2), F(4), pa.table({"id": [3, 1], "_time": [3, 3], "_diff": [1, -1]})
    )
    storage.compare_and_append(source, F(4), F(6), pa.table({"id": [1], "_time": [5]}))
    return source


def test_snapshots_consolidate_updates(storage: Storage, history: str) -> None:
    expected = {0: [1], 1: [1, 2], 2: [1, 2], 3: [2, 3], 4: [2, 3], 5: [1, 2, 3]}
    for t, contents in expected.items():
        assert ids(storage.read_snapshot(history, t)) == contents, t


def test_a_snapshot_plan_lists_the_files_and_the_filter(
    storage: Storage, history: str, blob_dir: Path
) -> None:
    batches = storage.catalog.manifest(history).batches
    plan = storage.snapshot(history, 1)
    assert plan.paths == (str(blob_dir / batches[0].path),)  # later batches start after 1
    assert (plan.time_after, plan.time_through) == (None, 1)
    assert plan.time_filter == "_time <= 1"
    assert plan.file_ddl == f"{SCHEMA}, _time BIGINT NOT NULL, _diff BIGINT NOT NULL"
    assert (plan.since, plan.upper) == (F(0), F(6))
    changes = storage.changes(history, 3, 5)  # the batch [2, 4) has nothing after 3
    assert changes.paths == tuple(str(blob_dir / b.path) for b in batches[2:])
    assert changes.time_filter == "_time > 3 AND _time <= 5"


def test_changes_are_the_consolidated_updates_in_a_range(storage: Storage, history: str) -> None:
    table = storage.read_changes(history, 0, 5)
    assert table.to_pylist() == [
        {"id": 2, "region": None, "_time": 1, "_diff": 1},
        {"id": 1, "region": None, "_time": 3, "_diff": -1},
        {"id": 3, "region": None, "_time": 3, "_diff": 1},
        {"id": 1, "region": None, "_time": 5, "_diff": 1},
    ]
    assert storage.read_changes(history, 3, 3).num_rows == 0


def test_reads_outside_since_and_upper_are_refused(storage: Storage, history: str) -> None:
    with pytest.raises(FailedPrecondition, match="at 6 yet: its upper is 6"):
        storage.snapshot(history, 6)
    with pytest.raises(InvalidArgument, match="a <= b"):
        storage.changes(history, 4, 3)
    storage.acquire_read_hold(history, "reader", F(2))
    with pytest.raises(InvalidArgument, match="at 1: its since is 2"):
        storage.snapshot(history, 1)
    with pytest.raises(InvalidArgument, match="its since is 2"):
        storage.changes(history, 0, 4)
    assert storage.changes(history, 1, 4).time_after == 1  # the changes after since - 1


def test_counts_expand_and_negative_counts_are_errors(storage: Storage, source: str) -> None:
    storage.compare_and_append(
        source,
        F(0),
        F(3),
        pa.table({"id": [7, 8, 7], "_time": [0, 1, 2], "_diff": [3, -1, -1]}),
    )
    assert ids(storage.read_snapshot(source, 0)) == [7, 7, 7]
    with pytest.raises(
        NegativeCount, match=r"u1 at 1: row \{'id': 8, 'region': None\} has net count -1"
    ):
        storage.read_snapshot(source, 1)
    assert storage.read_changes(source, 0, 2)["_diff"].to_pylist() == [-1, -1]


# --- Read holds and since -------------------------------------------------------------


def test_since_is_the_least_hold_and_never_regresses(storage: Storage, history: str, dump) -> None:  # type: ignore[no-untyped-def]
    assert storage.since(history) == F(0)
    assert storage.acquire_read_hold(history, "a", F(2)) == F(2)
    assert storage.acquire_read_hold(history, "b", F(3)) == F(2)
    assert storage.downgrade_read_hold(history, "a", F(4)) == F(3)
    assert storage.release_read_hold(history, "b") == F(4)
    assert storage.release_read_hold(history, "a") == F(4)  # no holds: since stays
    assert storage.since(history) == F(4)

    storage.acquire_read_hold(history, "c", F(4))
    cases = [
        (
            InvalidArgument,
            lambda: storage.acquire_read_hold(history, "d", F(3)),
            "since is already 4",
        ),
        (
            InvalidArgument,
            lambda: storage.downgrade_read_hold(history, "c", F(3)),
            "only moves forward",
        ),
        (InvalidArgument, lambda: storage.acquire_read_hold(history, "d", F.empty()), "empty"),
        (InvalidArgument, lambda: storage.acquire_read_hold(history, "", F(5)), "holder"),
        (Exception, lambda: storage.acquire_read_hold(history, "c", F(5)), "already holds"),
        (NotFound, lambda: storage.downgrade_read_hold(history, "zz", F(5)), "holds no read hold"),
        (NotFound, lambda: storage.release_read_hold(history, "zz"), "holds no read hold"),
    ]
    for error, call, message in cases:
        before = dump()
        with pytest.raises(error, match=message):
            call()
        assert dump() == before
    assert storage.downgrade_read_hold(history, "c", F.empty()) == F(4)  # released
    assert storage.catalog.manifest(history).holds == ()


def test_holds_are_controller_writes(
    catalog: Catalog, storage: Storage, history: str, blob_dir: Path
) -> None:
    replica = Storage(catalog, blob_dir)
    for call in (
        lambda: replica.acquire_read_hold(history, "r", F(1)),
        lambda: replica.compact(history),
        lambda: replica.collect_garbage(0),
    ):
        with pytest.raises(Fenced, match="not the controller"):
            call()
    assert ids(replica.read_snapshot(history, 5)) == [1, 2, 3]  # reads are fine


# --- Compaction -----------------------------------------------------------------------


def test_compaction_rewrites_the_batches_below_since(
    storage: Storage, history: str, blob_dir: Path
) -> None:
    before = {t: storage.read_snapshot(history, t) for t in range(4, 6)}
    changes_before = storage.read_changes(history, 4, 5)
    old = storage.catalog.manifest(history).batches
    assert storage.compact(history) == 0  # since 0: nothing below it
    storage.acquire_read_hold(history, "controller", F(4))

    assert storage.compact(history) == 2
    after = storage.catalog.manifest(history).batches
    assert [(b.lower, b.upper, b.rows) for b in after] == [(0, F(4), 2), (4, F(6), 1)]
    merged = pq.read_table(blob_dir / after[0].path).to_pylist()
    assert merged == [
        {"id": 2, "region": None, "_time": 3, "_diff": 1},
        {"id": 3, "region": None, "_time": 3, "_diff": 1},
    ]
    for t, table in before.items():
        assert storage.read_snapshot(history, t).equals(table)
    assert storage.read_changes(history, 4, 5).equals(changes_before)
    assert storage.compact(history) == 0  # one batch below since: nothing to merge

    # The old files stay (retired) for readers holding an older plan, until collected.
    assert {b.path for b in old[:2]} <= files(blob_dir)
    report = storage.collect_garbage(grace_ms=60_000)
    assert report.retired == () and report.orphans == ()
    report = storage.collect_garbage(grace_ms=0)
    assert set(report.retired) == {b.path for b in old[:2]} and report.orphans == ()
    assert files(blob_dir) == manifest_paths(storage, history)


def test_compaction_merges_the_newest_batches_not_a_large_one_behind_them(
    storage: Storage, source: str
) -> None:
    # A large load, then small changes: merging them must not rewrite the load.
    storage.compare_and_append(source, F(0), F(1), rows(*range(100)))
    for t in range(1, 4):
        storage.compare_and_append(source, F(t), F(t + 1), rows(1000 + t))
    storage.compare_and_append(source, F(4), F(5), rows(2000))
    before = storage.read_snapshot(source, 4)
    storage.acquire_read_hold(source, "h", F(4))
    assert storage.compact(source) == 3
    assert [(b.lower, b.upper, b.rows) for b in storage.catalog.manifest(source).batches] == [
        (0, F(1), 100), (1, F(4), 3), (4, F(5), 1)
    ]
    assert storage.read_snapshot(source, 4).equals(before)
    assert storage.compact(source) == 0  # the load holds more than twice the rest

    # Once what came after it is large enough, it is merged too.
    for t in range(5, 9):
        storage.compare_and_append(source, F(t), F(t + 1), rows(*range(3000 + 10 * t, 3010 + 10 * t)))
    storage.downgrade_read_hold(source, "h", F(9))
    assert storage.compact(source) == 6  # 44 rows after it: the load (100) stays
    assert [b.rows for b in storage.catalog.manifest(source).batches] == [100, 44]
    storage.compare_and_append(source, F(9), F(10), rows(*range(4000, 4100)))
    storage.downgrade_read_hold(source, "h", F(10))
    assert storage.compact(source) == 3
    assert [(b.lower, b.upper, b.rows) for b in storage.catalog.manifest(source).batches] == [(0, F(10), 244)]


def test_merge_run_takes_the_newest_batches_while_each_older_one_is_at_most_twice_the_rest() -> None:
    def run(*sizes: int) -> list[int]:
        batches = [BatchInfo(i, "c", i, F(i + 1), f"b{i}", rows, 0) for i, rows in enumerate(sizes)]
        return [b.rows for b in merge_run(batches)]

    assert run(100, 1, 1, 1) == [1, 1, 1]
    assert run(5, 3, 1, 1) == [5, 3, 1, 1]  # 1 <= 2, 3 <= 2 * 2, 5 <= 2 * 5
    assert run(12, 3, 1, 1) == [3, 1, 1]  # 12 > 2 * 5
    assert run(6, 6, 6) == [6, 6, 6]
    assert run(9, 1) == [1]
    assert run(1) == [1]
    assert run(5, 2, 0) == [2, 0]  # an empty batch counts as one row


def test_compaction_that_cancels_out_leaves_no_batch(
    storage: Storage, source: str, blob_dir: Path
) -> None:
    storage.compare_and_append(source, F(0), F(1), rows(1))
    storage.compare_and_append(source, F(1), F(2), [{"id": 1, "region": "eu", "_diff": -1}])
    storage.compare_and_append(source, F(2), F(3), rows(5))
    storage.acquire_read_hold(source, "h", F(2))
    assert storage.compact(source) == 2
    assert [b.lower for b in storage.catalog.manifest(source).batches] == [2]
    assert ids(storage.read_snapshot(source, 2)) == [5]
    storage.collect_garbage(0)
    assert files(blob_dir) == manifest_paths(storage, source)


def test_floats_equal_in_sql_are_one_row_to_compaction_and_reads(storage: Storage) -> None:
    # As Spark groups them: a row inserted with 0.0 is retracted with -0.0, and NaNs of
    # any bits are one value. Compaction used to keep both signs (+1 and -1), and a
    # snapshot read of the compacted batch then failed with a negative count.
    id = storage.create_source("readings", "x DOUBLE, y FLOAT").id
    nan, other_nan = float("nan"), struct.unpack(">d", bytes.fromhex("fff8000000000001"))[0]
    storage.compare_and_append(id, F(0), F(1), [{"x": 0.0, "y": -0.0}, {"x": nan, "y": 1.0}, {"x": 2.5, "y": None}])
    retract = [{"x": -0.0, "y": 0.0, "_diff": -1}, {"x": other_nan, "y": 1.0, "_diff": -1}]
    storage.compare_and_append(id, F(1), F(2), retract)
    storage.compare_and_append(id, F(2), F(3), [{"x": -0.0, "y": -0.0}])
    assert storage.read_snapshot(id, 1).to_pylist() == [{"x": 2.5, "y": None}]
    changes = [(str(r["x"]), r["y"], r["_time"], r["_diff"]) for r in storage.read_changes(id, 0, 2).to_pylist()]
    assert changes == [("0.0", 0.0, 1, -1), ("nan", 1.0, 1, -1), ("0.0", 0.0, 2, 1)]
    storage.acquire_read_hold(id, "h", F(2))
    assert storage.compact(id) == 2
    assert [b.rows for b in storage.catalog.manifest(id).batches] == [1, 1]  # 2.5, then -0.0
    contents = storage.read_snapshot(id, 2).to_pylist()
    assert contents == [{"x": 0.0, "y": 0.0}, {"x": 2.5, "y": None}]
    assert [math.copysign(1, row["x"]) for row in contents] == [1, 1]  # 0.0, not -0.0


def test_a_compaction_that_lost_the_race_removes_its_file(
    storage: Storage, history: str, blob_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage.acquire_read_hold(history, "h", F(4))
    stale = storage.catalog.manifest(history)
    assert storage.compact(history) == 2
    monkeypatch.setattr(storage.catalog, "manifest", lambda id: stale)
    assert storage.compact(history) == 0
    monkeypatch.undo()
    storage.collect_garbage(0)
    assert files(blob_dir) == manifest_paths(storage, history)


# --- Garbage --------------------------------------------------------------------------


def test_orphans_older_than_the_grace_period_are_collected(
    storage: Storage, history: str, blob_dir: Path
) -> None:
    live = files(blob_dir)
    (blob_dir / "u1").mkdir(exist_ok=True)
    old_orphan = blob_dir / "u1" / ("a" * 32 + ".parquet")
    new_orphan = blob_dir / "u1" / ("b" * 32 + ".parquet")
    unrelated = blob_dir / "u1" / "notes.txt"
    for path in (old_orphan, new_orphan, unrelated):
        path.write_bytes(b"x")
    an_hour_ago = time.time() - 3600
    os.utime(old_orphan, (an_hour_ago, an_hour_ago))
    for path in live:  # referenced files are never collected, however old
        os.utime(blob_dir / path, (an_hour_ago, an_hour_ago))

    report = storage.collect_garbage(grace_ms=60_000)
    assert report.orphans == (f"u1/{'a' * 32}.parquet",)
    assert not old_orphan.exists() and new_orphan.exists() and unrelated.exists()
    assert files(blob_dir) == live | {f"u1/{'b' * 32}.parquet"}
    assert ids(storage.read_snapshot(history, 5)) == [1, 2, 3]


def test_a_dropped_source_has_its_files_retired_then_collected(
    storage: Storage, history: str, blob_dir: Path
) -> None:
    paths = manifest_paths(storage, history)
    storage.catalog.drop_source(history)
    assert files(blob_dir) == paths  # retired, not yet deleted
    report = storage.collect_garbage(0)
    assert set(report.retired) == paths and files(blob_dir) == set()
    assert storage.catalog.retired_paths(storage.catalog.now_ms() + 1) == []


def test_grace_must_be_a_non_negative_int(storage: Storage) -> None:
    with pytest.raises(InvalidArgument):
        storage.collect_garbage(-1)


# --- Materialized views -----------------------------------------------------------------


def test_a_replica_writes_a_materialized_view(
    controller: Catalog, catalog: Catalog, catalog_url: str, blob_dir: Path
) -> None:
    """Replicas write views through a catalog that never became controller: the upper
    check is their only fence, so two replicas writing the same version are idempotent."""
    storage = Storage(controller, blob_dir)
    orders = storage.create_source("orders", SCHEMA)
    controller.create_instance("main")
    view = controller.create_dataflow(
        "main",
        "totals",
        sql="SELECT count(*) AS n FROM o",
        imports=[Import("o", orders.id)],
        schema="n BIGINT NOT NULL",
        as_of=F(10),
        materialized=True,
    )
    first, second = Storage(catalog, blob_dir), Storage(Catalog.open(catalog_url), blob_dir)
    first.compare_and_append(view.sink_id, F(10), F(11), [{"n": 3}])
    with pytest.raises(UpperMismatch) as lost:
        second.compare_and_append(view.sink_id, F(10), F(11), [{"n": 3}])
    assert lost.value.current == F(11)  # already written: skip
    assert storage.read_snapshot(view.sink_id, 10).to_pylist() == [{"n": 3}]
    with pytest.raises(InvalidArgument, match="since is 10"):
        storage.snapshot(view.sink_id, 9)
    second.catalog.close()
