"""Blob locations as URIs, and directory batches written as Spark writes them, on SQLite
and PostgreSQL: reserve, commit (footers checked, losers clean up after themselves),
discard, reads, compaction and garbage collection of directories."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from catalog import Catalog, FailedPrecondition, InvalidArgument, NotFound
from history import Frontier, Import
from storage import Storage, UpperMismatch
from storage._location import BlobLocation

F = Frontier
SCHEMA = "id BIGINT NOT NULL, region STRING"


@pytest.fixture
def source(storage: Storage) -> str:
    return storage.create_source("orders", SCHEMA).id


def updates(ids: list[int], time: int, diff: int = 1) -> pa.Table:
    """Rows of the source's file schema, all at `time`."""
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "region": pa.array(["eu"] * len(ids), pa.string()),
            "_time": pa.array([time] * len(ids), pa.int64()),
            "_diff": pa.array([diff] * len(ids), pa.int64()),
        }
    )


def write_like_spark(storage: Storage, relative: str, parts: list[pa.Table]) -> None:
    """What a Spark job leaves in its output directory: part files, `_SUCCESS` and
    checksum files (hidden), written through the location's own filesystem."""
    fs, directory = storage.filesystem, storage.fs_path(relative).rstrip("/")
    fs.create_dir(directory)
    for number, table in enumerate(parts):
        name = f"part-{number:05d}-{uuid.uuid4()}-c000.snappy.parquet"
        with fs.open_output_stream(f"{directory}/{name}") as stream:
            pq.write_table(table, stream)
        with fs.open_output_stream(f"{directory}/.{name}.crc") as stream:
            stream.write(b"crc")
    with fs.open_output_stream(f"{directory}/_SUCCESS"):
        pass


def exists(storage: Storage, relative: str) -> bool:
    return os.path.exists(storage.fs_path(relative))


def ids(table: pa.Table) -> list[int]:
    return table["id"].to_pylist()


# --- Locations --------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["path", "str", "file_uri", "hadoop_file_uri"])
def test_a_local_location_in_every_form(controller: Catalog, tmp_path: Path, form: str) -> None:
    directory = tmp_path / "new" / "blobs"  # missing parents are created
    location = {
        "path": directory,
        "str": str(directory),
        "file_uri": directory.as_uri(),
        "hadoop_file_uri": f"file:{directory}",
    }[form]
    storage = Storage(controller, location)
    assert storage.blob_uri == directory.as_uri() == f"file://{directory}"
    assert storage.fs_path("u5/a.parquet") == f"{directory}/u5/a.parquet"
    assert storage.spark_uri("u5/a.parquet") == f"file:{directory}/u5/a.parquet"
    assert Storage(controller, storage.blob_uri).blob_uri == storage.blob_uri  # round trip

    id = storage.create_source("orders", SCHEMA).id
    storage.compare_and_append(id, F(0), F(2), updates([1, 2], 1))
    plan = storage.snapshot(id, 1)
    (batch,) = storage.catalog.manifest(id).batches
    assert plan.paths == (storage.fs_path(batch.path),)
    assert plan.uris == (storage.spark_uri(batch.path),)
    assert ids(storage.read_snapshot(id, 1)) == [1, 2]
    footer = pq.read_metadata(storage.filesystem.open_input_file(plan.paths[0]))
    assert footer.num_rows == 2  # a reader opens footers through the location's filesystem


def test_an_s3_location_maps_to_s3a_for_spark() -> None:
    """No S3 here: the mapping only (with a region, pyarrow asks no server for it)."""
    location = BlobLocation._s3("s3://bucket/tandem/blobs/?region=eu-west-1")
    assert location.uri == "s3://bucket/tandem/blobs?region=eu-west-1"
    assert location.local is None
    assert location.fs_path("u5/a.parquet") == "bucket/tandem/blobs/u5/a.parquet"
    assert location.spark_uri("u5/b/") == "s3a://bucket/tandem/blobs/u5/b/"


@pytest.mark.parametrize(
    ("location", "message"),
    [
        ("ftp://host/blobs", r"unsupported blob location 'ftp://host/blobs': the scheme 'ftp'"),
        ("gs://bucket/blobs", "the scheme 'gs' is not one of"),
        ("file://otherhost/blobs", "a file URI names a local absolute directory"),
        ("s3://", "names no bucket"),
    ],
)
def test_an_unknown_scheme_is_refused_naming_it(
    controller: Catalog, location: str, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        Storage(controller, location)


def test_a_location_that_cannot_be_created_is_refused_naming_it(
    controller: Catalog, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    blobs = tmp_path / "a-file" / "blobs"
    with pytest.raises(InvalidArgument, match=f"blob location {blobs.as_uri()} is unusable"):
        Storage(controller, blobs)


@pytest.fixture
def unwritable_dir(tmp_path: Path) -> Path:
    """A directory nobody may create files in: read-only by its mode, or (for root, whom
    modes do not stop) sysfs, which refuses new files to everyone."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    directory.chmod(0o555)
    for candidate in (directory, Path("/sys/kernel")):
        try:
            (candidate / "probe").touch()
        except OSError:
            return candidate
        (candidate / "probe").unlink()
    pytest.skip("no directory here refuses new files")


def test_an_unwritable_location_is_refused_naming_it(
    controller: Catalog, unwritable_dir: Path
) -> None:
    message = f"{unwritable_dir.as_uri()} is unusable: cannot write"
    with pytest.raises(InvalidArgument, match=message):
        Storage(controller, unwritable_dir)


def test_an_unreachable_object_store_is_refused_naming_it() -> None:
    """What `Storage(...)` raises, without a catalog: the S3 client retries for seconds."""
    location = "s3://bucket/blobs?region=us-east-1&endpoint_override=127.0.0.1:1&scheme=http"
    with pytest.raises(InvalidArgument, match=r"s3://bucket/blobs\?region=.* is unusable"):
        BlobLocation.open(location)


def test_paths_must_stay_inside_the_location(storage: Storage) -> None:
    for bad in ("/etc/passwd", "../x.parquet", "u1/../../x", ""):
        with pytest.raises(InvalidArgument, match="not a path relative"):
            storage.fs_path(bad)


# --- Directory batches ------------------------------------------------------------------


def test_reserve_names_a_fresh_directory_and_creates_nothing(storage: Storage, source: str) -> None:
    first, uri = storage.reserve_batch(source)
    second, _ = storage.reserve_batch(source)
    assert first != second and first.startswith(f"{source}/") and first.endswith("/")
    assert len(first) == len(f"{source}/") + 33
    assert uri == storage.spark_uri(first)
    assert not exists(storage, first)
    with pytest.raises(NotFound):
        storage.reserve_batch("u99")


def test_a_committed_directory_is_read_by_every_reader(storage: Storage, source: str) -> None:
    relative, _ = storage.reserve_batch(source)
    write_like_spark(storage, relative, [updates([1, 2], 3), updates([3], 4)])
    info = storage.commit_batch(source, F(0), F(5), relative)
    assert info.upper == F(5)
    (batch,) = storage.catalog.manifest(source).batches
    parts = storage.batch_files(storage.fs_path(relative))
    assert [Path(p).name.startswith("part-") for p in parts] == [True, True]
    assert (batch.path, batch.lower, batch.upper, batch.rows) == (relative, 0, F(5), 3)
    assert batch.bytes == sum(os.path.getsize(p) for p in parts)

    plan = storage.snapshot(source, 4)
    assert plan.paths == (storage.fs_path(relative),) and plan.paths[0].endswith("/")
    assert plan.uris == (storage.spark_uri(relative),)
    assert ids(storage.read_snapshot(source, 3)) == [1, 2]
    assert ids(storage.read_snapshot(source, 4)) == [1, 2, 3]
    assert storage.read_changes(source, 3, 4)["id"].to_pylist() == [3]

    storage.append(source, [{"id": 9}], ts=7)  # file and directory batches mix
    assert ids(storage.read_snapshot(source, 7)) == [1, 2, 3, 9]


def test_a_directory_without_rows_only_moves_the_upper(storage: Storage, source: str) -> None:
    relative, _ = storage.reserve_batch(source)
    write_like_spark(storage, relative, [updates([], 0)])  # Spark's output of no rows
    assert storage.commit_batch(source, F(0), F(3), relative).upper == F(3)
    assert storage.catalog.manifest(source).batches == ()
    assert not exists(storage, relative)


def test_a_directory_never_written_is_refused(
    storage: Storage, source: str, dump
) -> None:  # type: ignore[no-untyped-def]
    relative, uri = storage.reserve_batch(source)
    before = dump()
    with pytest.raises(InvalidArgument, match=f"no batch was written at {uri}"):
        storage.commit_batch(source, F(0), F(3), relative)
    assert dump() == before


def bad_type() -> pa.Table:
    return updates([1], 0).set_column(0, "id", pa.array(["1"], pa.string()))


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (bad_type, r"has the columns \(id string, region string, _time int64, _diff int64\), "
         r"not the collection's file schema \(id int64, region string"),
        (lambda: updates([1], 0).drop_columns(["_diff"]), "not the collection's file schema"),
        (lambda: updates([1], 0).select(["region", "id", "_time", "_diff"]), "file schema"),
        (lambda: updates([1], 0).append_column("x", pa.array([1])), "file schema"),
        (lambda: updates([1, 2], 5), r"_time from 5 to 5 lies outside the batch's range \[0, 5\)"),
        (lambda: updates([1], 0).set_column(0, "id", pa.array([None], pa.int64())),
         "the NOT NULL column 'id' holds nulls"),
    ],
)
def test_a_bad_directory_is_refused_and_removed(
    storage: Storage, source: str, dump, part, message
) -> None:  # type: ignore[no-untyped-def]
    relative, _ = storage.reserve_batch(source)
    write_like_spark(storage, relative, [updates([7], 1), part()])
    before = dump()
    with pytest.raises(InvalidArgument, match=message):
        storage.commit_batch(source, F(0), F(5), relative)
    assert dump() == before and not exists(storage, relative)
    assert storage.upper(source) == F(0)


def test_stray_files_in_a_directory_are_refused(storage: Storage, source: str) -> None:
    relative, _ = storage.reserve_batch(source)
    write_like_spark(storage, relative, [updates([1], 0)])
    Path(storage.fs_path(relative), "notes.txt").write_text("Spark would read this too")
    with pytest.raises(InvalidArgument, match=r"notes.txt: a directory batch holds only \*"):
        storage.commit_batch(source, F(0), F(5), relative)
    assert not exists(storage, relative)


def test_commit_takes_only_directories_reserved_for_the_collection(
    storage: Storage, source: str
) -> None:
    other = storage.create_source("other", SCHEMA).id
    relative, _ = storage.reserve_batch(other)
    write_like_spark(storage, relative, [updates([1], 0)])
    for path in (relative, f"{source}/{'a' * 32}.parquet", f"{source}/../{relative}", "u1/x/"):
        with pytest.raises(InvalidArgument, match="is not a directory batch of"):
            storage.commit_batch(source, F(0), F(5), path)
    assert exists(storage, relative)  # not ours to remove


def test_a_stale_writer_removes_only_its_own_directory(storage: Storage, source: str) -> None:
    mine, _ = storage.reserve_batch(source)
    theirs, _ = storage.reserve_batch(source)
    write_like_spark(storage, theirs, [updates([1], 0)])
    storage.commit_batch(source, F(0), F(2), theirs)
    write_like_spark(storage, mine, [updates([2], 0)])
    with pytest.raises(UpperMismatch) as lost:
        storage.commit_batch(source, F(0), F(2), mine)
    assert lost.value.current == F(2)
    assert not exists(storage, mine) and exists(storage, theirs)


def test_a_retried_commit_that_had_gone_through_keeps_the_batch(
    storage: Storage, source: str
) -> None:
    """A writer that cannot tell whether its commit happened retries it: the refusal
    must not delete the batch the first attempt recorded."""
    relative, _ = storage.reserve_batch(source)
    write_like_spark(storage, relative, [updates([1], 0)])
    storage.commit_batch(source, F(0), F(2), relative)
    with pytest.raises(UpperMismatch):
        storage.commit_batch(source, F(0), F(2), relative)
    assert exists(storage, relative) and ids(storage.read_snapshot(source, 1)) == [1]


def test_two_writers_race_and_the_loser_removes_only_its_directory(
    storage: Storage, catalog: Catalog, source: str, blob_dir: Path
) -> None:
    """Two replicas writing the same materialized-view version, each through its own
    catalog connection, on threads released together."""
    writers = [storage, Storage(catalog, blob_dir)]  # the controller's and a replica's
    reserved = [w.reserve_batch(source)[0] for w in writers]
    for writer, relative in zip(writers, reserved):
        write_like_spark(writer, relative, [updates([1, 2], 0), updates([3], 1)])
    start, outcomes = threading.Barrier(2), {}

    def commit(number: int) -> None:
        start.wait()
        try:
            writers[number].commit_batch(source, F(0), F(2), reserved[number])
            outcomes[number] = "won"
        except UpperMismatch as lost:
            outcomes[number] = lost.current

    threads = [threading.Thread(target=commit, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(outcomes.values(), key=str) == [F(2), "won"]
    winner = next(n for n, outcome in outcomes.items() if outcome == "won")
    (batch,) = storage.catalog.manifest(source).batches
    assert batch.path == reserved[winner]
    assert exists(storage, reserved[winner]) and not exists(storage, reserved[1 - winner])
    assert ids(storage.read_snapshot(source, 1)) == [1, 2, 3]


def test_discard_removes_a_directory_never_committed(storage: Storage, source: str) -> None:
    relative, _ = storage.reserve_batch(source)
    write_like_spark(storage, relative, [updates([1], 0)])
    storage.discard_batch(relative)
    assert not exists(storage, relative)
    storage.discard_batch(relative)  # idempotent
    committed, _ = storage.reserve_batch(source)
    write_like_spark(storage, committed, [updates([1], 0)])
    storage.commit_batch(source, F(0), F(1), committed)
    with pytest.raises(FailedPrecondition, match="is a committed batch"):
        storage.discard_batch(committed)
    for path in (f"{source}/notes/", f"{source}/{'a' * 32}.parquet", "../u1/" + "a" * 32 + "/"):
        with pytest.raises(InvalidArgument, match="not a directory batch path"):
            storage.discard_batch(path)
    assert exists(storage, committed)


def test_a_replica_commits_a_materialized_view_directory(
    controller: Catalog, catalog: Catalog, storage: Storage, source: str, blob_dir: Path
) -> None:
    """A replica's catalog never became controller: the upper check is its only fence."""
    controller.create_instance("main")
    view = controller.create_dataflow(
        "main", "copy", sql="SELECT * FROM o", imports=[Import("o", source)],
        schema=SCHEMA, as_of=F(0), materialized=True,
    )
    replica = Storage(catalog, blob_dir.as_uri())
    relative, _ = replica.reserve_batch(view.sink_id)
    write_like_spark(replica, relative, [updates([4], 0)])
    replica.commit_batch(view.sink_id, F(0), F(1), relative)
    assert ids(storage.read_snapshot(view.sink_id, 0)) == [4]


# --- Compaction and garbage -------------------------------------------------------------


def test_directory_batches_compact_and_are_collected_whole(storage: Storage, source: str) -> None:
    directories = []
    for t, batch_ids in enumerate([[1, 2], [3], [4]]):
        relative, _ = storage.reserve_batch(source)
        write_like_spark(storage, relative, [updates(batch_ids, t)])
        storage.commit_batch(source, F(t), F(t + 1), relative)
        directories.append(relative)
    storage.compare_and_append(source, F(3), F(4), updates([1], 3, diff=-1))
    storage.compare_and_append(source, F(4), F(5))
    before = storage.read_snapshot(source, 4)
    storage.acquire_read_hold(source, "h", F(4))

    assert storage.compact(source, min_batches=5) == 0  # only 4 below since
    assert storage.compact(source) == 4
    (merged,) = storage.catalog.manifest(source).batches
    assert merged.path.endswith(".parquet") and merged.rows == 3 and merged.upper == F(4)
    assert storage.read_snapshot(source, 4).equals(before) and ids(before) == [2, 3, 4]
    assert all(exists(storage, d) for d in directories)  # retired: readers may still hold them

    report = storage.collect_garbage(0)
    assert set(directories) <= set(report.retired) and report.orphans == ()
    assert not any(exists(storage, d) for d in directories)
    assert ids(storage.read_snapshot(source, 4)) == [2, 3, 4]


def test_min_batches_must_be_at_least_two(storage: Storage, source: str) -> None:
    with pytest.raises(InvalidArgument, match="min_batches"):
        storage.compact(source, min_batches=1)


def age(path: Path, seconds: float) -> None:
    """Make `path` and everything in it look `seconds` old."""
    then = time.time() - seconds
    for item in [path, *path.rglob("*")]:
        os.utime(item, (then, then), follow_symlinks=False)


def test_orphan_directories_are_collected_once_older_than_the_grace(
    storage: Storage, source: str, blob_dir: Path
) -> None:
    committed, _ = storage.reserve_batch(source)
    write_like_spark(storage, committed, [updates([1], 0)])
    storage.commit_batch(source, F(0), F(1), committed)
    old, fresh, busy = (storage.reserve_batch(source)[0] for _ in range(3))
    for relative in (old, fresh, busy):
        write_like_spark(storage, relative, [updates([2], 1)])
    # A writer still at work deep inside its directory, the rest of which looks old.
    (blob_dir / busy / "_temporary" / "0").mkdir(parents=True)
    for relative in (old, busy, committed):
        age(blob_dir / relative, 3600)
    (blob_dir / busy / "_temporary" / "0" / "part-1.parquet").write_bytes(b"in progress")
    not_a_batch = blob_dir / source / "notes"
    not_a_batch.mkdir()
    (not_a_batch / "keep.parquet").write_bytes(b"x")
    age(not_a_batch, 3600)

    report = storage.collect_garbage(grace_ms=60_000)
    assert report == type(report)(retired=(), orphans=(old,))
    assert not exists(storage, old)
    assert all(exists(storage, r) for r in (fresh, busy, committed))
    assert (not_a_batch / "keep.parquet").exists()
    assert ids(storage.read_snapshot(source, 0)) == [1]
