"""The replica's pure parts, without Spark: arrangements, finishing, step planning, the
Arrow side of index changes, and the checks of a `spark://` master before Spark starts."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import socket
from types import SimpleNamespace

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import history as h
from replica_service._arrangement import Arrangement, Version, canonical_sort, digest, finish
from replica_service._dataflow import times_to_compute
from replica_service._replica import MANIFEST_MAX_AGE_S, manifests_due
from replica_service._spark import SparkUnavailable, check_reachable, standalone_masters
from replica_service._arrangement import difference
from replica_service.dataplane._maintain import _apply
from storage import DIFF, NegativeCount

ROWS = pa.table(
    {
        "region": ["north", "south", None, "north", "east", "south"],
        "n": [3, 1, 7, 3, None, 2],
        "total": [1.5, 2.0, 0.25, 1.5, 9.0, -1.0],
    }
)


def test_canonical_sort_ignores_input_order_and_digest_follows_rows():
    shuffled = ROWS.take(random.Random(7).sample(range(ROWS.num_rows), ROWS.num_rows))
    assert canonical_sort(shuffled).equals(canonical_sort(ROWS))
    assert digest(canonical_sort(shuffled)) == digest(canonical_sort(ROWS))
    assert digest(canonical_sort(ROWS.slice(1))) != digest(canonical_sort(ROWS))


def test_a_digest_covers_values_and_types_not_layout():
    """Found by the divergence check: two replicas computed the same version, one at
    once and one step by step, and their digests differed in nullability flags and
    buffers alone. Values and column types decide a digest; nothing else does."""
    table = canonical_sort(ROWS)
    strict = table.cast(pa.schema([field.with_nullable(False) if field.name == "total" else field for field in table.schema]))
    rechunked = pa.concat_tables([table.slice(0, 2), table.slice(2)])
    with_nulls = pa.table({"k": pa.array([1, None, 3]).fill_null(0)})  # a validity buffer, no nulls left
    assert digest(strict) == digest(rechunked) == digest(table)
    assert digest(with_nulls) == digest(pa.table({"k": pa.array([1, 0, 3])}))
    assert digest(table.set_column(table.schema.get_field_index("total"), "total", pa.compute.cast(table["total"], pa.float32()))) != digest(table)
    assert digest(table.rename_columns([*table.column_names[:-1], "other"])) != digest(table)


def test_key_lookup_returns_every_row_of_the_key():
    version = Version.build(5, ROWS, ("region",))
    assert version.lookup(("north",)).to_pylist() == [{"region": "north", "n": 3, "total": 1.5}] * 2
    assert version.lookup((None,)).column("n").to_pylist() == [7]
    assert version.lookup(("west",)).num_rows == 0


def test_key_lookup_casts_literals_and_refuses_bad_keys():
    version = Version.build(5, ROWS, ("n",))
    assert version.lookup((2.0,)).column("region").to_pylist() == ["south"]
    with pytest.raises(ValueError, match="needs 1 value"):
        version.lookup((1, 2))
    with pytest.raises(ValueError, match="does not fit column n"):
        version.lookup(("many",))


def test_arrangement_reads_the_latest_version_at_or_before_a_time():
    arrangement = Arrangement("u1", (), h.Frontier(10), h.Frontier(10))
    for time in (10, 20, 30):
        arrangement.insert(Version.build(time, ROWS.slice(0, time // 10), ()))
    assert arrangement.version_at(9) is None
    assert arrangement.version_at(10).time == 10
    assert arrangement.version_at(29).time == 20
    with pytest.raises(ValueError, match="not after"):
        arrangement.insert(Version.build(30, ROWS, ()))


def test_compaction_keeps_what_reads_at_or_after_since_need():
    arrangement = Arrangement("u1", (), h.Frontier(10), h.Frontier(40))
    for time in (10, 20, 30):
        arrangement.insert(Version.build(time, ROWS.slice(0, time // 10), ()))
    arrangement.compact(h.Frontier(25))
    assert arrangement.times == [20, 30]
    assert arrangement.version_at(25).time == 20
    arrangement.compact(h.Frontier(5))  # since never regresses
    assert arrangement.since == h.Frontier(25)
    arrangement.compact(h.Frontier.empty())
    assert arrangement.times == []


def test_versions_a_step_computed_at_once_are_kept_as_their_changes_and_read_whole():
    """A step over several times leaves each time's changes: the versions between the
    first and the latest are made whole only when read, a few of them kept so, and
    compaction makes its new first version whole."""
    from replica_service import _arrangement

    tables = {time: ROWS.slice(0, time // 10) for time in (10, 20, 30, 40, 50, 60)}
    arrangement = Arrangement("u1", ("region",), h.Frontier(10), h.Frontier(61), [Version.build(10, tables[10], ("region",))])
    earlier = [(t, difference(tables[t - 10], tables[t])) for t in (20, 30, 40, 50)]
    arrangement.extend(earlier, Version.build(60, tables[60], ("region",)), difference(tables[50], tables[60]))
    assert arrangement.times == [10, 20, 30, 40, 50, 60]
    whole = [t for t in arrangement.times if arrangement.whole_at(t)]
    assert whole == [10, 60], "the first and the latest are whole, the others their changes"
    for time in (20, 35, 50):
        read = arrangement.version_at(time)
        assert read.time == time // 10 * 10 and read.digest == Version.build(read.time, tables[read.time], ("region",)).digest
        arrangement.keep(read)
    assert [t for t in arrangement.times if arrangement.whole_at(t)] == [10, 30, 50, 60][: 2 + _arrangement.CACHED_VERSIONS]
    assert arrangement.changes_between(20, 40) == earlier[1:3]
    arrangement.compact(h.Frontier(45))
    assert arrangement.times == [40, 50, 60] and arrangement.whole_at(40)
    assert arrangement.version_at(40).digest == Version.build(40, tables[40], ("region",)).digest
    older = Version.build(20, tables[20], ("region",))
    lumped = arrangement.changes_between(20, 60, older)  # the versions after 20 were compacted away
    assert [t for t, _ in lumped] == [40, 50, 60] and lumped[0][1].equals(difference(tables[20], tables[40]))
    assert arrangement.change_rows(40, 60) == sum(rows.num_rows for _, rows in lumped[1:])
    with pytest.raises(ValueError, match="first version must be whole"):
        Arrangement("u2", (), h.Frontier(0), h.Frontier(0)).extend(earlier[:1], Version.build(60, tables[60], ()))


def test_changes_by_time_consolidates_each_time_in_difference_order():
    from replica_service._arrangement import changes_by_time

    updates = pa.table({"k": ["b", "a", "a", "b", "c"], "_diff": [1, 1, -1, 1, 1], "_time": [7, 5, 5, 7, 9]})
    by_time = changes_by_time(updates)
    assert [t for t, _ in by_time] == [7, 9], "time 5's updates cancel out"
    assert by_time[0][1].to_pylist() == [{"k": "b", "_diff": 2}]
    assert by_time[1][1].equals(difference(None, pa.table({"k": ["c"]})))


def test_finishing_filters_orders_slices_and_projects():
    rows = canonical_sort(ROWS)
    finishing = h.RowSetFinishing(
        filter=(h.Predicate("n", ">", 1), h.Predicate("region", "in", ("north", "south", None))),
        order_by=(h.OrderBy("total", descending=True),),
        offset=1,
        limit=2,
        projection=("region", "total"),
    )
    assert finish(rows, finishing).to_pylist() == [{"region": "north", "total": 1.5}, {"region": "south", "total": -1.0}]
    nulls_first = h.RowSetFinishing(order_by=(h.OrderBy("region", nulls_last=False),), limit=2, projection=("region",))
    assert finish(rows, nulls_first).column("region").to_pylist() == [None, "east"]
    assert finish(rows, h.RowSetFinishing(filter=(h.Predicate("n", "is_null"),))).column("region").to_pylist() == ["east"]


@pytest.mark.parametrize(
    "finishing, message",
    [
        (h.RowSetFinishing(filter=(h.Predicate("nope", "=", 1),)), "unknown column 'nope' in filter"),
        (h.RowSetFinishing(order_by=(h.OrderBy("nope"),)), "unknown column 'nope' in order by"),
        (h.RowSetFinishing(projection=("region", "nope")), "unknown column"),
        (h.RowSetFinishing(filter=(h.Predicate("n", "=", "x"),)), "does not fit column n"),
        (h.RowSetFinishing(key=("north",)), "needs an index"),
    ],
)
def test_finishing_refuses_what_does_not_fit(finishing, message):
    with pytest.raises(ValueError, match=message):
        finish(ROWS, finishing)


def test_times_to_compute():
    never = h.Frontier.minimum()
    index = dict(every_time=False)
    assert times_to_compute(10, None, h.Frontier(10), [], never, **index) == []  # inputs not past as_of
    assert times_to_compute(10, None, h.Frontier(25), [12, 20], never, **index) == [10, 12, 20]
    assert times_to_compute(10, 12, h.Frontier(25), [20], never, **index) == [20]
    # Of the times at or below since only the latest is needed.
    assert times_to_compute(10, None, h.Frontier(25), [12, 20, 22], h.Frontier(21), **index) == [20, 22]
    assert times_to_compute(10, None, h.Frontier(25), [12, 20], h.Frontier.empty(), **index) == [20]


def test_a_materialized_view_computes_every_time():
    """A storage collection is readable at every time it holds: no version is skipped,
    not even with the empty `since` of a dataflow without indexes."""
    assert times_to_compute(10, None, h.Frontier(25), [12, 20], h.Frontier.empty(), every_time=True) == [10, 12, 20]
    assert times_to_compute(10, 12, h.Frontier(25), [20, 22], h.Frontier(21), every_time=True) == [20, 22]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=12), st.lists(st.integers(0, 4), max_size=12))
def test_index_changes_turn_the_old_version_into_the_new(old_values, new_values):
    schema = pa.schema([pa.field("v", pa.int64())])
    old = pa.table({"v": sorted(old_values)}, schema=schema)
    new = pa.table({"v": sorted(new_values)}, schema=schema)
    changes = difference(old, new)
    assert changes.num_rows == len(set(old_values) ^ set(new_values)) + sum(
        1 for v in set(old_values) & set(new_values) if old_values.count(v) != new_values.count(v)
    )
    assert _apply(old, [changes], "test", 7).column("v").to_pylist() == sorted(new_values)
    assert _apply(None, [difference(old.slice(0, 0), new)], "test", 7).column("v").to_pylist() == sorted(new_values)


def test_a_change_that_retracts_a_missing_row_is_an_error():
    schema = pa.schema([pa.field("v", pa.int64())])
    old = pa.table({"v": [1]}, schema=schema)
    retract_two = pa.table({"v": [2], DIFF: pa.array([-1], pa.int64())})
    with pytest.raises(NegativeCount, match=r"dataflow test at 7: row \{'v': 2\} has net count -1"):
        _apply(old, [retract_two], "test", 7)


def test_standalone_master_urls():
    assert standalone_masters("spark://10.0.0.1:7077") == [("10.0.0.1", 7077)]
    assert standalone_masters("spark://a:7077,b:7078") == [("a", 7077), ("b", 7078)]
    assert standalone_masters("spark://[::1]:7077") == [("::1", 7077)]
    for bad in ("spark://host", "spark://:7077", "spark://h:0", "spark://h:x", "local[2]"):
        with pytest.raises(ValueError):
            standalone_masters(bad)


def test_a_master_is_reachable_when_one_of_its_addresses_accepts():
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refuses connections
        up, down = listening.getsockname()[1], closed.getsockname()[1]
        check_reachable(f"spark://127.0.0.1:{down},127.0.0.1:{up}")
        with pytest.raises(SparkUnavailable, match=rf"^spark master spark://127.0.0.1:{down} is not reachable \(Connection refused\)$"):
            check_reachable(f"spark://127.0.0.1:{down}")


def test_a_spark_error_is_reported_by_its_cause_not_by_py4j_or_the_jvm_stack():
    from replica_service._steps import spark_error_message

    py4j = RuntimeError(
        "An error occurred while calling o1119.localCheckpoint.\n"
        ": org.apache.spark.SparkException: Job aborted due to stage failure: [AGGREGATE_OUT_OF_MEMORY] No enough memory\n"
        "\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:2898)\n"
    )
    assert spark_error_message(py4j) == "org.apache.spark.SparkException: Job aborted due to stage failure: [AGGREGATE_OUT_OF_MEMORY] No enough memory"
    analysis = RuntimeError("[CAST_INVALID_INPUT] The value 'x' of the type \"STRING\" cannot be cast to \"INT\".\n== SQL ==\n")
    assert spark_error_message(analysis).startswith("[CAST_INVALID_INPUT]")
    assert spark_error_message(RuntimeError("")) == "RuntimeError"


def test_a_reader_reads_its_manifest_again_when_its_upper_moves_and_when_it_is_old():
    """An upper that moved wakes the dataflows; an old manifest is read again even when
    nothing moved: compaction replaces batches without moving the upper (a source loaded
    once and then idle), and after the garbage grace their files are gone."""
    now = 1_000.0
    readers = {
        "moved": SimpleNamespace(refreshed_at=now, upper=h.Frontier(5)),
        "fresh": SimpleNamespace(refreshed_at=now - 1, upper=h.Frontier(5)),
        "idle": SimpleNamespace(refreshed_at=now - MANIFEST_MAX_AGE_S, upper=h.Frontier(5)),
        "sealed": SimpleNamespace(refreshed_at=now - 2 * MANIFEST_MAX_AGE_S, upper=h.Frontier.empty()),
        "unread": SimpleNamespace(refreshed_at=None, upper=h.Frontier.minimum()),  # its first read is the dataflow's
    }
    uppers = {"moved": h.Frontier(6), "fresh": h.Frontier(5), "idle": h.Frontier(5), "sealed": h.Frontier.empty(), "unread": h.Frontier(9)}
    assert manifests_due(readers, uppers, now) == ({"moved"}, {"idle", "sealed"})


def test_a_hello_sets_the_order_in_which_the_step_pools_take_waiting_steps(tmp_path):
    from replica_service._replica import Replica

    async def orders() -> list[tuple[bool, bool]]:
        replica = Replica(None, None, tmp_path, None)
        seen = []
        try:
            for epoch, costliest_first in ((1, True), (2, False)):
                replica.connect(h.Hello(epoch, f"n{epoch}", costliest_first=costliest_first))
                seen.append((replica._step_pool.cheapest_first, replica._light_step_pool.cheapest_first))
        finally:
            replica.connection.close()
            for pool in (replica._step_pool, replica._light_step_pool, replica._peek_pool, replica._io_pool):
                pool.shutdown(wait=False)
        return seen

    assert asyncio.run(orders()) == [(False, False), (True, True)]


def test_a_hydration_rehearses_only_when_no_change_came_during_it(tmp_path):
    """A rehearsal (`Replica._rehearse`) compiles what the first step would; when a
    change came during the hydration, that step is due at once and compiles it itself,
    so a rehearsal first would only delay it: none runs."""
    from replica_service._dataflow import Dataflow
    from replica_service._replica import Replica

    rehearsed = []
    upstream = Arrangement("u1", ("region",), h.Frontier(0), h.Frontier(6), [Version.build(5, ROWS, ("region",))])
    desc = h.DataflowDescription(
        "warm", "select * from up", (h.Import("up", "u1", "index"),), (h.IndexExport("u2", ("region",)),), as_of=h.Frontier(5), strategy="incremental"
    )
    dataflow = Dataflow(desc, {"up": upstream}, {}, {}, maintainer=SimpleNamespace(rehearse=lambda directory: rehearsed.append(directory) or True))
    replica = Replica(None, None, tmp_path, None)
    try:
        assert not dataflow.changes_waiting(5)
        assert replica._rehearse(dataflow, 5) is not None and rehearsed == [tmp_path / "rehearsals"]
        upstream.insert(Version.build(7, ROWS.slice(1), ("region",)))  # a change while it hydrated
        upstream.upper = h.Frontier(8)
        assert dataflow.changes_waiting(5) and not dataflow.changes_waiting(7)
        assert replica._rehearse(dataflow, 5) is None and len(rehearsed) == 1
    finally:
        for pool in (replica._step_pool, replica._light_step_pool, replica._peek_pool, replica._io_pool):
            pool.shutdown(wait=False)


def test_reconciliation_keeps_a_lagging_dataflow_of_storage_while_its_inputs_are_readable_where_it_stands():
    """A replica behind the replayed as_of (its since followed a faster replica) goes on
    from its own frontier when every input is storage still readable at the last time it
    computed; otherwise, or reading an index, it is built again."""
    from replica_service._dataflow import Dataflow
    from replica_service._replica import _why_not_kept

    def dataflow(imports: tuple, frontier: int) -> Dataflow:
        desc = h.DataflowDescription("d", "select * from s", imports, (h.IndexExport("u2", ("id",)),), as_of=h.Frontier(3))
        old = Dataflow(desc, {}, {}, {})
        old.frontier = h.Frontier(frontier)
        return old

    storage = (h.Import("s", "u1"),)
    replayed = dataclasses.replace(dataflow(storage, 0).desc, as_of=h.Frontier(9))
    sinces = {"u1": h.Frontier(6)}
    assert _why_not_kept(dataflow(storage, 7), replayed, {}, {}, {}, sinces.__getitem__) is None  # computed 6: readable
    assert _why_not_kept(dataflow(storage, 10), replayed, {}, {}, {}, sinces.__getitem__) is None  # not lagging
    lagging = _why_not_kept(dataflow(storage, 6), replayed, {}, {}, {}, sinces.__getitem__)
    assert lagging == "it has computed the times before Frontier([6]) only, not all before the replayed as_of Frontier([9]), and its inputs are compacted past them"
    index = (h.Import("up", "u0", "index"),)
    indexed = dataclasses.replace(replayed, imports=index)
    assert "not all before the replayed as_of" in _why_not_kept(dataflow(index, 7), indexed, {}, {}, {}, sinces.__getitem__)
