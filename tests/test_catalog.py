"""Catalog records: instances, replicas, collections, dataflows; ids, names and drops.

Every test runs on SQLite and on PostgreSQL (the `catalog_url` fixture). Each refusal is
checked to have written nothing, by comparing every row of the database before and after.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from catalog import (
    DETERMINISTIC_SPARK_CONF,
    AlreadyExists,
    Catalog,
    ControllerSpec,
    FailedPrecondition,
    HoldOwner,
    InvalidArgument,
    NotFound,
    _collections,
    make_engine,
)
from catalog._engine import IDLE_IN_TRANSACTION_MS, normalize_url
from history import ComputeParameters, Frontier, Import, IndexExport, SinkExport

SCHEMA = "id BIGINT NOT NULL, region STRING"


def refused(dump, error: type[Exception], call, match: str | None = None) -> None:  # type: ignore[no-untyped-def]
    """`call()` raises `error` and leaves every row of the catalog as it was."""
    before = dump()
    with pytest.raises(error, match=match):
        call()
    assert dump() == before


# --- Opening ------------------------------------------------------------------------------


def test_open_migrates_and_seeds_the_singletons(catalog: Catalog) -> None:
    assert catalog.controller_epoch() == 0
    assert catalog.read_ts() == 0
    assert catalog.epoch is None and not catalog.is_controller
    assert catalog.list_instances() == []
    assert catalog.list_collections(include_dropped=True) == []


def test_reopening_keeps_the_data(catalog_url: str) -> None:
    with Catalog.open(catalog_url) as first:
        first.become_controller()
        first.create_instance("main")
    with Catalog.open(catalog_url) as second:
        assert [i.name for i in second.list_instances()] == ["main"]


def test_default_url_is_a_sqlite_file_in_wal_mode(tmp_path: Path) -> None:
    url = Catalog.default_url(tmp_path / "data")
    assert url == f"sqlite:///{tmp_path / 'data' / 'catalog.db'}"
    with Catalog.open(url) as opened:
        assert opened.dialect == "sqlite"
    assert (tmp_path / "data" / "catalog.db").exists()
    engine = make_engine(url)
    with engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000
    engine.dispose()


def test_in_memory_sqlite_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a SQLite file"):
        Catalog.open("sqlite://")


def test_a_bare_postgresql_url_gets_psycopg_3() -> None:
    assert normalize_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    assert normalize_url("postgresql+psycopg://u@h/db").drivername == "postgresql+psycopg"


def test_foreign_keys_are_enforced(controller: Catalog, catalog_url: str) -> None:
    engine = make_engine(catalog_url)
    insert = "INSERT INTO read_holds (collection_id, holder, frontier, owner) VALUES ('u404', 'h', 0, 'caller')"
    with pytest.raises(Exception, match="(?i)foreign key"), engine.begin() as connection:
        connection.execute(text(insert))
    engine.dispose()


def test_a_writer_hung_inside_a_transaction_does_not_lock_a_standby_out_for_long(catalog: Catalog, catalog_url: str) -> None:
    """A leader stopped mid-transaction holds its locks: on SQLite a standby's write waits
    only its own `busy_ms` for the lock; PostgreSQL ends the hung session itself."""
    standby = ControllerSpec("b", "x:2", "h1", 1, None)
    if catalog.dialect == "sqlite":
        hung = sqlite3.connect(catalog_url.removeprefix("sqlite:///"), isolation_level=None)
        hung.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        with pytest.raises(Exception, match="locked"):
            catalog.register_standby(standby, busy_ms=200)
        assert time.monotonic() - started < 5
        hung.execute("ROLLBACK")
    else:
        engine = make_engine(catalog_url)
        hung = engine.connect()
        hung.begin()
        hung.execute(text("SELECT epoch FROM controller_epoch WHERE id = 1 FOR UPDATE"))
        started = time.monotonic()
        catalog.register_standby(standby)
        catalog.become_controller()  # waits for the row lock until the server ends `hung`
        assert IDLE_IN_TRANSACTION_MS / 1000 - 0.5 < time.monotonic() - started < IDLE_IN_TRANSACTION_MS / 1000 + 10
        with pytest.raises(Exception, match="(?i)idle-in-transaction|terminat|closed"):
            hung.execute(text("SELECT 1"))
        engine.dispose()
    assert [s.id for s in catalog.register_standby(standby).standbys] == ["b"]


# --- Instances ----------------------------------------------------------------------------


def test_an_instance_starts_from_the_deterministic_spark_conf(controller: Catalog) -> None:
    info = controller.create_instance(
        "main",
        spark_conf={"spark.sql.shuffle.partitions": "8", "spark.sql.caseSensitive": "true"},
        min_in_sync=2,
        max_lag_ms=100,
        replica_timeout_ms=2_000,
        max_hold_back_ms=9_000,
        replace_slow=True,
        parameters=ComputeParameters(max_result_rows=10),
    )
    expected = {
        **DETERMINISTIC_SPARK_CONF,
        "spark.sql.shuffle.partitions": "8",
        "spark.sql.caseSensitive": "true",
    }
    assert info.config.name == "main"
    assert info.config.conf() == expected
    assert (info.min_in_sync, info.max_lag_ms, info.replica_timeout_ms) == (2, 100, 2_000)
    assert (info.max_hold_back_ms, info.replace_slow) == (9_000, True)
    assert info.parameters == ComputeParameters(max_result_rows=10)
    assert controller.get_instance("main") == info
    assert controller.list_instances() == [info]


def test_instance_parameters_merge_like_update_configuration(controller: Catalog) -> None:
    controller.create_instance("main", parameters=ComputeParameters(max_result_rows=10))
    controller.update_instance("main", parameters=ComputeParameters(heartbeat_interval_ms=500))
    info = controller.update_instance("main", max_lag_ms=7)
    assert info.parameters == ComputeParameters(max_result_rows=10, heartbeat_interval_ms=500)
    assert info.max_lag_ms == 7


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "2fast"}, "instance name"),
        ({"name": "has space"}, "instance name"),
        ({"name": "main", "spark_conf": {"spark.executor.memory": "4g"}}, "resource setting"),
        ({"name": "main", "spark_conf": {"spark.driver.host": "10.0.0.2"}}, "resource setting"),
        ({"name": "main", "spark_conf": {"spark.x": 1}}, "pair of strings"),
        ({"name": "main", "min_in_sync": 0}, "min_in_sync"),
        ({"name": "main", "max_lag_ms": -1}, "max_lag_ms"),
        ({"name": "main", "replica_timeout_ms": 0}, "replica_timeout_ms"),
        ({"name": "main", "max_hold_back_ms": 0}, "max_hold_back_ms"),
        ({"name": "main", "replace_slow": "yes"}, "replace_slow"),
        ({"name": "main", "parameters": ComputeParameters(max_result_rows=0)}, "max_result_rows"),
    ],
)
def test_bad_instances_are_refused(controller: Catalog, dump, kwargs, match) -> None:  # type: ignore[no-untyped-def]
    refused(dump, InvalidArgument, lambda: controller.create_instance(**kwargs), match)


def test_instance_names_are_unique(controller: Catalog, dump) -> None:  # type: ignore[no-untyped-def]
    controller.create_instance("main")
    refused(dump, AlreadyExists, lambda: controller.create_instance("main"), "already exists")
    refused(dump, NotFound, lambda: controller.get_instance("other"), "does not exist")
    refused(dump, NotFound, lambda: controller.update_instance("other", max_lag_ms=1))
    refused(dump, InvalidArgument, lambda: controller.update_instance("main", min_in_sync=0))


# --- Replicas -----------------------------------------------------------------------------


def test_managed_and_external_replicas(controller: Catalog) -> None:
    controller.create_instance("main")
    managed = controller.create_replica(
        "main", "r1", size="small", spark_conf={"spark.driver.memory": "1g"}
    )
    external = controller.create_replica(
        "main", "r2", size="large", spark_master="spark://h:7077", address="10.0.0.2:7000"
    )
    assert managed.managed and managed.address is None and managed.pid is None
    assert managed.spark_master == "local[1]" and managed.conf() == {"spark.driver.memory": "1g"}
    assert not external.managed and external.address == "10.0.0.2:7000"
    assert managed.incarnation == external.incarnation == 0

    running = controller.update_replica("main", "r1", address="127.0.0.1:5001", pid=4242, process_start="b/77")
    assert (running.address, running.pid, running.process_start, running.incarnation) == ("127.0.0.1:5001", 4242, "b/77", 0)
    readied = controller.update_replica("main", "r1", address="127.0.0.1:5002")
    assert (readied.pid, readied.process_start) == (4242, "b/77")
    again = controller.update_replica("main", "r1", incarnation=1, pid=None)  # a new pid clears the start
    assert (again.address, again.pid, again.process_start, again.incarnation) == ("127.0.0.1:5002", None, None, 1)
    assert controller.list_replicas("main") == [again, external]
    assert controller.get_replica("main", "r2") == external

    controller.drop_replica("main", "r1")
    assert controller.list_replicas() == [external]


def test_bad_replica_changes_are_refused(controller: Catalog, dump) -> None:  # type: ignore[no-untyped-def]
    controller.create_instance("main", spark_conf={"spark.sql.caseSensitive": "true"})
    controller.create_replica("main", "r1", size="small")
    controller.create_replica("main", "ext", size="small", address="h:1")
    controller.update_replica("main", "r1", incarnation=3)
    cases = [
        (AlreadyExists, lambda: controller.create_replica("main", "r1", size="small")),
        (NotFound, lambda: controller.create_replica("nope", "r1", size="small")),
        (InvalidArgument, lambda: controller.create_replica("main", "r-2", size="small")),
        (InvalidArgument, lambda: controller.create_replica("main", "r3", size="")),
        (
            InvalidArgument,  # results must not depend on the replica
            lambda: controller.create_replica(
                "main", "r3", size="s", spark_conf={"spark.sql.shuffle.partitions": "64"}
            ),
        ),
        (
            InvalidArgument,
            lambda: controller.create_replica(
                "main", "r3", size="s", spark_conf={"spark.sql.caseSensitive": "false"}
            ),
        ),
        (InvalidArgument, lambda: controller.update_replica("main", "r1", incarnation=2)),
        (InvalidArgument, lambda: controller.update_replica("main", "r1", pid=0)),
        (InvalidArgument, lambda: controller.update_replica("main", "r1", process_start="b/1")),  # no pid
        (InvalidArgument, lambda: controller.update_replica("main", "r1", pid=7, process_start="")),
        (InvalidArgument, lambda: controller.update_replica("main", "ext", address="h:2")),
        (NotFound, lambda: controller.update_replica("main", "r9", pid=1)),
        (NotFound, lambda: controller.drop_replica("main", "r9")),
        (NotFound, lambda: controller.list_replicas("nope")),
    ]
    for error, call in cases:
        refused(dump, error, call)


# --- Collections and ids ------------------------------------------------------------------


def test_sources_get_fresh_ids_and_unique_names(controller: Catalog, dump) -> None:  # type: ignore[no-untyped-def]
    orders = controller.create_source("orders", SCHEMA)
    users = controller.create_source("users", SCHEMA, since=Frontier(10))
    assert (orders.id, users.id) == ("u1", "u2")
    assert orders.kind == "source" and orders.namespace == "storage"
    assert (orders.since, orders.upper) == (Frontier(0), Frontier(0))
    assert (users.since, users.upper) == (Frontier(10), Frontier(10))
    assert controller.collection_by_name("orders") == orders
    refused(dump, AlreadyExists, lambda: controller.create_source("orders", SCHEMA), "orders")
    refused(dump, InvalidArgument, lambda: controller.create_source("o-1", SCHEMA))
    refused(dump, InvalidArgument, lambda: controller.create_source("o", " "))
    refused(
        dump, InvalidArgument, lambda: controller.create_source("o", SCHEMA, since=Frontier.empty())
    )
    refused(dump, NotFound, lambda: controller.collection_by_name("nope"))


def test_a_new_collection_is_held_in_the_transaction_that_creates_it(controller: Catalog, dump) -> None:  # type: ignore[no-untyped-def]
    """`holders` (a source's) and `sink_holders` (a materialized view's) hold the new
    collection at its since from the transaction that creates it: a hold that cannot be
    taken leaves nothing created."""
    controller.create_instance("main")
    orders = controller.create_source("orders", SCHEMA, since=Frontier(3), holders=["keeper"])
    assert dict(controller.manifest(orders.id).holds) == {"keeper": Frontier(3)}

    def view(name: str, holders: list[str]):  # type: ignore[no-untyped-def]
        return controller.create_dataflow(
            "main", name, sql="SELECT * FROM o", imports=[Import("o", orders.id)], schema=SCHEMA,
            as_of=Frontier(3), materialized=True, sink_holders=holders,
        )

    assert dict(controller.manifest(view("v", ["keeper"]).sink_id or "").holds) == {"keeper": Frontier(3)}
    refused(dump, InvalidArgument, lambda: controller.create_source("users", SCHEMA, holders=[""]))
    refused(dump, InvalidArgument, lambda: view("w", [""]))


def test_a_dropped_name_may_be_reused_but_never_its_id(catalog_url: str) -> None:
    with Catalog.open(catalog_url) as first:
        first.become_controller()
        old = first.create_source("orders", SCHEMA)
        first.drop_source(old.id)
        dropped = first.get_collection(old.id)
        assert dropped.dropped and dropped.since.is_empty
        assert first.list_collections() == []
        assert first.list_collections(include_dropped=True) == [dropped]
    with Catalog.open(catalog_url) as second:
        second.become_controller()
        new = second.create_source("orders", SCHEMA)
        assert new.id == "u2"
        assert second.collection_by_name("orders") == new
        with pytest.raises(NotFound, match="was dropped"):
            second.drop_source(old.id)


def test_concurrent_creations_of_one_name_leave_one_winner(
    controller: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the friendly pre-check, the partial unique index alone refuses the losers,
    and they get AlreadyExists too."""
    monkeypatch.setattr(_collections, "_check_storage_name_free", lambda *args: None)
    barrier = threading.Barrier(6)
    outcomes: list[str] = []

    def create() -> None:
        barrier.wait()
        try:
            outcomes.append(controller.create_source("orders", SCHEMA).id)
        except AlreadyExists:
            outcomes.append("refused")

    threads = [threading.Thread(target=create) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes).count("refused") == 5
    assert [c.name for c in controller.list_collections()] == ["orders"]


def test_uppers_names_each_asked_collection_that_exists(controller: Catalog) -> None:
    orders, items = controller.create_source("orders", SCHEMA), controller.create_source("items", SCHEMA)
    controller.append_batch(items.id, Frontier(0), Frontier(7), None)
    assert controller.uppers([orders.id, items.id, "s999"]) == {orders.id: Frontier(0), items.id: Frontier(7)}
    assert controller.uppers([items.id]) == {items.id: Frontier(7)}
    assert controller.uppers([]) == {}


def test_advance_sources_moves_live_open_sources_below_the_frontier(controller: Catalog, dump) -> None:  # type: ignore[no-untyped-def]
    """Sources below 9 move to 9 in one transaction. Not a source already past it, nor
    a closed or dropped one, nor a materialized view (its replicas write its upper)."""
    behind, ahead, closed, gone = (controller.create_source(name, SCHEMA) for name in ("behind", "ahead", "closed", "gone"))
    controller.append_batch(ahead.id, Frontier(0), Frontier(12), None)
    controller.append_batch(closed.id, Frontier(0), Frontier.empty(), None)
    controller.drop_source(gone.id)
    controller.create_instance("main")
    view = controller.create_dataflow(
        "main", "copy", sql="SELECT * FROM b", imports=[Import("b", behind.id)], schema=SCHEMA,
        as_of=Frontier(0), materialized=True,
    ).sink_id
    assert controller.advance_sources(Frontier(9)) == [behind.id]
    uppers = {id: controller.get_collection(id).upper for id in (behind.id, ahead.id, closed.id, gone.id, view)}
    assert uppers == {
        behind.id: Frontier(9), ahead.id: Frontier(12), closed.id: Frontier.empty(),
        gone.id: Frontier(0), view: Frontier(0),
    }
    assert controller.advance_sources(Frontier(9)) == []
    refused(dump, InvalidArgument, lambda: controller.advance_sources(Frontier.empty()))


# --- Dataflows ----------------------------------------------------------------------------


@pytest.fixture
def world(controller: Catalog) -> dict[str, str]:
    """Instance `main` (and `other`) with source `orders`, dataflow `totals` exporting
    an index and a materialized view, and dataflow `other_idx` on `other`."""
    controller.create_instance("main")
    controller.create_instance("other")
    orders = controller.create_source("orders", SCHEMA)
    totals = controller.create_dataflow(
        "main",
        "totals",
        sql="SELECT region, count(*) AS n FROM o GROUP BY region",
        imports=[Import("o", orders.id)],
        schema="region STRING, n BIGINT NOT NULL",
        as_of=Frontier(5),
        index_key=["region"],
        materialized=True,
        compaction_window_ms=1_000,
    )
    other = controller.create_dataflow(
        "other",
        "other_idx",
        sql="SELECT * FROM o",
        imports=[Import("o", orders.id)],
        schema=SCHEMA,
        as_of=Frontier(5),  # totals' hold moved the since of orders there
        index_key=[],
    )
    return {
        "orders": orders.id,
        "totals": totals.id,
        "index": totals.index_id or "",
        "view": totals.sink_id or "",
        "other_idx": other.index_id or "",
        "other": other.id,
    }


def test_a_dataflow_records_its_exact_description(controller: Catalog, world) -> None:  # type: ignore[no-untyped-def]
    assert (world["orders"], world["totals"], world["index"], world["view"]) == (
        "u1",
        "u2",
        "u3",
        "u4",
    )
    info = controller.get_dataflow(world["totals"])
    desc = info.description()
    assert desc.name == "totals"
    assert desc.imports == (Import("o", "u1", "storage"),)
    assert desc.index_exports == (IndexExport("u3", ("region",)),)
    assert desc.sink_exports == (SinkExport("u4"),)
    assert desc.as_of == Frontier(5) and desc.until == Frontier.empty()
    assert desc.schema == "region STRING, n BIGINT NOT NULL"
    assert info.compaction_window_ms == 1_000
    assert info.export_ids == ("u3", "u4")
    assert controller.dataflow_by_name("main", "totals") == info
    assert [d.id for d in controller.list_dataflows("main")] == ["u2"]

    index = controller.get_collection(controller.dataflow_by_name("main", "totals").index_id)
    view = controller.collection_by_name("totals")
    assert (index.id, index.kind, index.dataflow_id) == ("u3", "index", "u2")
    assert (view.id, view.kind, view.since, view.upper) == (
        "u4",
        "materialized_view",
        Frontier(5),
        Frontier(5),
    )


def test_bad_dataflows_are_refused(controller: Catalog, world, dump) -> None:  # type: ignore[no-untyped-def]
    def create(name: str = "fresh", **overrides):  # type: ignore[no-untyped-def]
        args = {
            "sql": "SELECT 1",
            "imports": [Import("o", world["orders"])],
            "schema": "x INT",
            "as_of": Frontier(5),
            "index_key": ["x"],
        }
        args.update(overrides)
        instance = args.pop("instance", "main")
        return lambda: controller.create_dataflow(instance, name, **args)

    controller.drop_dataflow(world["other"])
    dropped_index = world["other_idx"]
    cases = [
        (NotFound, create(instance="nope")),
        (AlreadyExists, create("totals")),
        (AlreadyExists, create("orders", index_key=None, materialized=True)),
        (InvalidArgument, create(index_key=None)),
        (InvalidArgument, create(index_key=["x", "x"])),
        (InvalidArgument, create(as_of=Frontier.empty())),
        (InvalidArgument, create(until=Frontier(5))),
        (InvalidArgument, create(compaction_window_ms=-1)),
        (InvalidArgument, create(sql="")),
        (NotFound, create(imports=[Import("o", "u404")])),
        (NotFound, create(imports=[Import("o", dropped_index, "index")])),
        (
            InvalidArgument,
            create(imports=[Import("o", world["orders"]), Import("o", world["view"])]),
        ),
        (InvalidArgument, create(imports=[Import("o", world["index"])])),  # index as storage
        (InvalidArgument, create(imports=[Import("o", world["view"], "index")])),
        (InvalidArgument, create(instance="other", imports=[Import("t", world["index"], "index")])),
        (InvalidArgument, create(imports=[Import("bad name", world["orders"])])),
    ]
    for error, call in cases:
        refused(dump, error, call)


def test_an_import_must_be_readable_at_as_of(controller: Catalog, world, dump) -> None:  # type: ignore[no-untyped-def]
    controller.record_frontiers(world["index"], since=Frontier(8))
    call = lambda: controller.create_dataflow(
        "main",
        "late",
        sql="SELECT * FROM t",
        imports=[Import("t", world["index"], "index")],
        schema="x INT",
        as_of=Frontier(7),
        index_key=[],
    )
    refused(dump, InvalidArgument, call, "since is 8")


def test_index_and_view_of_one_dataflow_share_its_name_across_namespaces(
    controller: Catalog, world
) -> None:  # type: ignore[no-untyped-def]
    # An index named like a source is fine: the namespaces are separate.
    info = controller.create_dataflow(
        "main",
        "orders",
        sql="SELECT * FROM o",
        imports=[Import("o", world["orders"])],
        schema=SCHEMA,
        as_of=Frontier(5),
        index_key=["id"],
    )
    assert controller.dataflow_by_name("main", "orders").index_id == info.index_id
    assert controller.collection_by_name("orders").id == world["orders"]


def test_index_names_are_unique_per_instance(controller: Catalog, world, dump) -> None:  # type: ignore[no-untyped-def]
    """Both instances may have a dataflow `totals` with an index; one instance may not
    have two. An index is found through its instance."""
    mine = controller.get_dataflow(world["totals"])
    theirs = controller.create_dataflow(
        "other",
        "totals",
        sql="SELECT * FROM o",
        imports=[Import("o", world["orders"])],
        schema=SCHEMA,
        as_of=Frontier(5),
        index_key=["id"],
    )
    assert theirs.index_id is not None and theirs.index_id != mine.index_id
    assert controller.dataflow_by_name("main", "totals").index_id == mine.index_id
    other_index = controller.get_collection(controller.dataflow_by_name("other", "totals").index_id)
    assert (other_index.name, other_index.kind, other_index.dataflow_id) == (
        "totals",
        "index",
        theirs.id,
    )
    assert controller.dataflow_by_name("other", "totals") == theirs

    for instance in ("main", "other"):
        again = lambda instance=instance: controller.create_dataflow(  # noqa: E731
            instance,
            "totals",
            sql="SELECT * FROM o",
            imports=[Import("o", world["orders"])],
            schema=SCHEMA,
            as_of=Frontier(5),
            index_key=["id"],
        )
        match = f"instance '{instance}' already has a dataflow named 'totals'"
        refused(dump, AlreadyExists, again, match)

    refused(dump, NotFound, lambda: controller.dataflow_by_name("nope", "totals"))
    refused(dump, NotFound, lambda: controller.dataflow_by_name("other", "missing"))
    controller.drop_dataflow(theirs.id)
    refused(dump, NotFound, lambda: controller.dataflow_by_name("other", "totals"))
    assert controller.dataflow_by_name("main", "totals").index_id == mine.index_id


@pytest.mark.parametrize("name", ["orders", "totals"])
def test_a_view_name_stays_unique_across_instances(
    controller: Catalog, world, dump, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:  # type: ignore[no-untyped-def]
    """A materialized view may not take the name of a live source (`orders`) or view
    (`totals`, on `main`), from any instance; an index alone may."""

    def create(materialized: bool):  # type: ignore[no-untyped-def]
        return lambda: controller.create_dataflow(
            "other",
            name,
            sql="SELECT * FROM o",
            imports=[Import("o", world["orders"])],
            schema=SCHEMA,
            as_of=Frontier(5),
            index_key=["id"],
            materialized=materialized,
        )

    refused(dump, AlreadyExists, create(True), "source or materialized view")
    # Without the pre-check, the partial unique index refuses it just the same.
    monkeypatch.setattr(_collections, "_check_storage_name_free", lambda *args: None)
    refused(dump, AlreadyExists, create(True), "source or materialized view")
    index_only = create(False)()
    assert controller.dataflow_by_name("other", name).index_id == index_only.index_id


def test_frontiers_of_an_index_only_advance(controller: Catalog, world, dump) -> None:  # type: ignore[no-untyped-def]
    index = world["index"]
    assert controller.record_frontiers(
        index, since=Frontier(7), upper=Frontier(20)
    ).upper == Frontier(20)
    info = controller.record_frontiers(index, since=Frontier(6), upper=Frontier(10))
    assert (info.since, info.upper) == (Frontier(7), Frontier(20))
    assert controller.record_frontiers(index, upper=Frontier.empty()).upper.is_empty
    refused(
        dump,
        InvalidArgument,
        lambda: controller.record_frontiers(world["orders"], upper=Frontier(9)),
    )
    refused(
        dump, InvalidArgument, lambda: controller.record_frontiers(index, since=Frontier.empty())
    )
    refused(dump, NotFound, lambda: controller.record_frontiers("u404", since=Frontier(1)))


def test_nothing_is_dropped_while_imported(controller: Catalog, world, dump) -> None:  # type: ignore[no-untyped-def]
    user = controller.create_dataflow(
        "other",
        "reader",
        sql="SELECT * FROM v",
        imports=[Import("v", world["view"])],
        schema="region STRING, n BIGINT NOT NULL",
        as_of=Frontier(5),
        index_key=[],
    )
    refused(
        dump, FailedPrecondition, lambda: controller.drop_source(world["orders"]), "imported by"
    )
    refused(dump, FailedPrecondition, lambda: controller.drop_dataflow(world["totals"]), "reader")
    refused(dump, FailedPrecondition, lambda: controller.drop_instance("main"), "reader")
    refused(
        dump, InvalidArgument, lambda: controller.drop_source(world["view"]), "drop that dataflow"
    )
    refused(dump, NotFound, lambda: controller.drop_dataflow("u404"))

    controller.drop_dataflow(user.id)
    controller.drop_instance("main")
    assert [i.name for i in controller.list_instances()] == ["other"]
    for id in (world["index"], world["view"]):
        gone = controller.get_collection(id)
        assert gone.dropped and gone.since.is_empty and gone.dataflow_id is None
    with pytest.raises(NotFound):
        controller.get_dataflow(world["totals"])
    assert [d.name for d in controller.list_dataflows()] == ["other_idx"]


# --- Events ---------------------------------------------------------------------------


def test_events_are_kept_in_order_bounded_and_fenced(controller: Catalog, catalog_url: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from catalog import Fenced, NewEvent
    from catalog import _events

    controller.record_events([NewEvent(10, "main", "replica_failed", "r1 lost its stream", replica="r1"), NewEvent(11, "other", "diverged", "x")])
    controller.record_events([NewEvent(12, "main", "rehydrating", "r1 replays 4 commands", replica="r1")])
    events = controller.list_events("main")
    assert [(e.kind, e.replica, e.at_ms) for e in events] == [("replica_failed", "r1", 10), ("rehydrating", "r1", 12)]
    assert [e.message for e in controller.list_events(after=events[0].id)] == ["x", "r1 replays 4 commands"]
    assert [e.kind for e in controller.list_events(limit=1)] == ["rehydrating"]  # the latest, not the first
    with pytest.raises(InvalidArgument):
        controller.list_events(limit=0)

    monkeypatch.setattr(_events, "EVENTS_RETAINED", 3)
    controller.record_events([NewEvent(20 + n, "main", "slow", f"n{n}") for n in range(4)])
    assert [e.message for e in controller.list_events()] == ["n1", "n2", "n3"]

    successor = Catalog.open(catalog_url)
    successor.become_controller()
    with pytest.raises(Fenced):
        controller.record_events([NewEvent(30, "main", "slow", "from a fenced controller")])
    assert [e.message for e in successor.list_events()][-1] == "n3"
    successor.close()


# --- Layering -------------------------------------------------------------------------

ALLOWED = {
    "catalog": {"catalog", "history"},
    "storage": {"storage", "catalog", "history"},
    "migrations": {"migrations", "catalog"},
}
OURS = {"history", "protocol", "catalog", "migrations", "storage", "replica_service", "controller"}
FORBIDDEN = {"pyspark", "grpc", "asyncio"}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_follow_the_layering(package: str) -> None:
    """DESIGN section 1: catalog imports history; storage imports catalog and history;
    migrations imports catalog; none of them pyspark, grpc or asyncio."""
    import ast

    root = Path(__file__).resolve().parent.parent
    for path in (root / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top not in FORBIDDEN, f"{path} imports {name}"
                assert top not in OURS or top in ALLOWED[package], f"{path} imports {name}"


def test_holds_whose_owner_is_gone_are_removed_and_never_taken_again(controller: Catalog) -> None:
    """A dropped dataflow's input holds go with its drop, and moving them later (the
    instance still winding the dataflow down) does not bring them back. A feed's hold
    is an orphan once its controller no longer has the feed open, or a newer controller
    runs; the caller's and the retention window's never are."""
    controller.create_instance("main")
    orders = controller.create_source("orders", SCHEMA, holders=["tandem/retention"])
    flow = controller.create_dataflow(
        "main", "idx", sql="SELECT * FROM o", imports=[Import("o", orders.id)], schema=SCHEMA, as_of=Frontier(0), index_key=[]
    )
    holder = f"main/{flow.export_ids[0]}"
    assert {h.holder: str(h.owner) for h in controller.list_holds()}[holder] == f"dataflow of {flow.export_ids[0]}"
    controller.drop_dataflow(flow.id)
    controller.record_compute_frontiers({}, [(orders.id, holder, Frontier(1))])
    assert holder not in dict(controller.manifest(orders.id).holds)

    controller.acquire_read_hold(orders.id, "subscribe:open", Frontier(0), HoldOwner.feed(controller.epoch or 0))
    controller.acquire_read_hold(orders.id, "subscribe:closed", Frontier(0), HoldOwner.feed(controller.epoch or 0))
    controller.acquire_read_hold(orders.id, "tool", Frontier(0))
    removed = controller.remove_orphaned_holds(lambda: {"subscribe:open"})
    assert [(h.holder, str(h.owner)) for h in removed] == [("subscribe:closed", f"feed of controller epoch {controller.epoch}")]
    assert controller.remove_orphaned_holds(lambda: {"subscribe:open"}) == []
    controller.become_controller()  # a newer controller: the old one's feeds are gone
    assert [h.holder for h in controller.remove_orphaned_holds(frozenset)] == ["subscribe:open"]
    assert sorted(dict(controller.manifest(orders.id).holds)) == ["tandem/retention", "tool"]
    with pytest.raises(NotFound):
        controller.acquire_read_hold(orders.id, "late", Frontier(0), HoldOwner.dataflow(flow.export_ids[0]))


def test_one_reconfiguration_per_instance_is_recorded_until_it_ends(controller: Catalog, dump) -> None:  # type: ignore[no-untyped-def]
    controller.create_instance("main")
    deadline = controller.now_ms() + 1_000
    record = controller.begin_reconfiguration("main", size="small", old=["r1"], new=["small_1"], deadline_ms=deadline, on_timeout="commit")
    assert controller.list_reconfigurations() == [record] and record.new == ("small_1",)
    refused(dump, AlreadyExists, lambda: controller.begin_reconfiguration("main", size="large", old=["r1"], new=["large_1"], deadline_ms=deadline, on_timeout="commit"), "being resized")
    refused(dump, InvalidArgument, lambda: controller.begin_reconfiguration("main", size="s", old=[], new=[], deadline_ms=deadline, on_timeout="commit"))
    controller.end_reconfiguration("main")
    controller.end_reconfiguration("main")
    assert controller.list_reconfigurations() == []
    refused(dump, InvalidArgument, lambda: controller.begin_reconfiguration("main", size="s", old=[], new=["s_1"], deadline_ms=deadline, on_timeout="later"))
    controller.begin_reconfiguration("main", size="small", old=[], new=["small_1"], deadline_ms=deadline, on_timeout="rollback")
    controller.drop_instance("main")
    assert controller.list_reconfigurations() == []
