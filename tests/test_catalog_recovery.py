"""`recover_history`: the history a restarted controller rebuilds from the catalog."""

from __future__ import annotations

import pytest

from catalog import (
    DETERMINISTIC_SPARK_CONF,
    Catalog,
    DataflowInfo,
    NotFound,
    dataflow_holder,
    dependency_order,
    sink_holder,
)
from history import (
    ComputeParameters,
    CreateDataflow,
    CreateInstance,
    Frontier,
    Import,
    IndexExport,
    InitializationComplete,
    InstanceConfig,
    Schedule,
    UpdateConfiguration,
    apply,
    reduce_commands,
)

SCHEMA = "id BIGINT NOT NULL"


def dataflow(id: str, exports: list[str], imports: list[str]) -> DataflowInfo:
    return DataflowInfo(
        id=id,
        instance="main",
        name=f"d{id}",
        sql="SELECT 1",
        imports=tuple(Import(f"i{n}", i, "index") for n, i in enumerate(imports)),
        index_exports=tuple(IndexExport(e) for e in exports),
        sink_id=None,
        schema=SCHEMA,
        as_of=Frontier(0),
        until=Frontier.empty(),
        compaction_window_ms=None,
        strategy="recompute: not planned",
    )


def test_dependency_order_is_topological_not_by_id() -> None:
    # u20 imports u11 (exported by u10), u9 imports u21 (exported by u20): ids alone,
    # as numbers or as strings, would put u9 first.
    flows = [
        dataflow("u9", ["u8"], ["u21"]),
        dataflow("u20", ["u21"], ["u11", "u1"]),  # u1: a source, not a dataflow
        dataflow("u10", ["u11"], []),
        dataflow("u3", ["u4"], []),
    ]
    assert [d.id for d in dependency_order(flows)] == ["u3", "u10", "u20", "u9"]


def test_a_dataflow_of_storage_comes_back_where_its_inputs_are_held_so_a_lagging_replica_is_kept(controller: Catalog) -> None:
    """Its since moved past a replica that lags (the fastest one's frontier sets it); the
    controller holds the inputs at the slowest one's, and recovery comes back there."""
    controller.create_instance("main")
    orders = controller.create_source("orders", SCHEMA)
    df = controller.create_dataflow(
        "main", "d", sql="SELECT * FROM o", imports=[Import("o", orders.id)], schema=SCHEMA, as_of=Frontier(3), index_key=["id"]
    )
    controller.record_frontiers(df.index_id, since=Frontier(9), upper=Frontier(12))
    controller.downgrade_read_hold(orders.id, dataflow_holder("main", df.export_ids[0]), Frontier(5))
    (create,) = [c for c in controller.recover_history("main") if isinstance(c, CreateDataflow)]
    assert create.desc.as_of == Frontier(5)


def test_dependency_order_refuses_a_cycle() -> None:
    with pytest.raises(RuntimeError, match="cycle"):
        dependency_order([dataflow("u1", ["u2"], ["u4"]), dataflow("u3", ["u4"], ["u2"])])


def test_recover_history_rebuilds_the_instance(controller: Catalog) -> None:
    controller.create_instance(
        "main",
        spark_conf={"spark.sql.shuffle.partitions": "2"},
        parameters=ComputeParameters(max_result_rows=5),
    )
    controller.update_instance("main", parameters=ComputeParameters(heartbeat_interval_ms=50))
    controller.create_instance("other")
    orders = controller.create_source("orders", SCHEMA)
    # A chain longer than nine links, so string order of ids would differ.
    previous = controller.create_dataflow(
        "main",
        "d0",
        sql="SELECT * FROM o",
        imports=[Import("o", orders.id)],
        schema=SCHEMA,
        as_of=Frontier(3),
        index_key=["id"],
        materialized=True,
    )
    chain = [previous]
    for n in range(1, 11):
        previous = controller.create_dataflow(
            "main",
            f"d{n}",
            sql="SELECT * FROM p",
            imports=[Import("p", previous.index_id, "index")],
            schema=SCHEMA,
            as_of=Frontier(3),
            index_key=["id"],
        )
        chain.append(previous)
    # Another instance's dataflow stays out, even named like one of main's (index names
    # are unique per instance only).
    elsewhere = controller.create_dataflow(
        "other",
        "d0",
        sql="SELECT * FROM o",
        imports=[Import("o", orders.id)],
        schema=SCHEMA,
        as_of=Frontier(3),
        index_key=[],
    )
    dropped = controller.create_dataflow(
        "main",
        "gone",
        sql="SELECT * FROM o",
        imports=[Import("o", orders.id)],
        schema=SCHEMA,
        as_of=Frontier(3),
        index_key=[],
    )
    controller.drop_dataflow(dropped.id)
    # Recorded sinces: the index of d0 advanced to 8, its view is held back at 6.
    controller.record_frontiers(chain[0].index_id, since=Frontier(8), upper=Frontier(12))
    controller.acquire_read_hold(chain[0].sink_id, "controller", Frontier(6))
    controller.record_frontiers(chain[5].index_id, since=Frontier(9))
    # d0 holds its input where its slowest replica stands (the controller moves it).
    controller.downgrade_read_hold(orders.id, dataflow_holder("main", chain[0].export_ids[0]), Frontier(7))

    history = controller.recover_history("main")

    expected_as_of = {d.id: Frontier(3) for d in chain}
    expected_as_of[chain[0].id] = Frontier(6)  # meet of index (8) and view (6); its input held at 7
    expected_as_of[chain[5].id] = Frontier(9)
    conf = {**DETERMINISTIC_SPARK_CONF, "spark.sql.shuffle.partitions": "2"}
    assert history[0] == CreateInstance(InstanceConfig.of("main", conf))
    assert history[1] == UpdateConfiguration(
        ComputeParameters(max_result_rows=5, heartbeat_interval_ms=50)
    )
    assert history[2:13] == [CreateDataflow(d.description(expected_as_of[d.id])) for d in chain]
    assert history[13:24] == [Schedule(d.export_ids[0]) for d in chain]
    assert history[24:] == [InitializationComplete()]

    assert reduce_commands(history) == history  # already in reduced form
    state = apply(history)
    assert state.initialized and len(state.dataflows) == 11
    assert all(live.scheduled for live in state.dataflows.values())
    assert controller.recover_history("other")[1:] == [
        CreateDataflow(elsewhere.description()),
        Schedule(elsewhere.export_ids[0]),
        InitializationComplete(),
    ]


def test_a_view_is_recovered_at_its_sink_hold_not_at_its_storage_since(
    controller: Catalog,
) -> None:
    """The view's storage since lags its dataflow's (readers and the retention hold keep
    it lower); the inputs are held only as far back as the dataflow's own since."""
    controller.create_instance("main")
    orders = controller.create_source("orders", SCHEMA)
    view = controller.create_dataflow(
        "main", "v", sql="SELECT * FROM o", imports=[Import("o", orders.id)],
        schema=SCHEMA, as_of=Frontier(3), materialized=True,
    )
    controller.acquire_read_hold(view.sink_id, "tandem/retention", Frontier(4))
    controller.acquire_read_hold(view.sink_id, sink_holder(view.id), Frontier(9))
    controller.downgrade_read_hold(orders.id, f"main/{view.sink_id}", Frontier(9))  # taken at as_of
    assert controller.get_collection(view.sink_id).since == Frontier(4)
    history = controller.recover_history("main")
    assert history[1] == CreateDataflow(view.description(Frontier(9)))
    controller.release_read_hold(view.sink_id, sink_holder(view.id))
    assert controller.recover_history("main")[1] == CreateDataflow(view.description(Frontier(4)))


def test_recover_history_of_a_bare_instance(controller: Catalog) -> None:
    info = controller.create_instance("main")
    assert controller.recover_history("main") == [
        CreateInstance(info.config),
        InitializationComplete(),
    ]
    with pytest.raises(NotFound):
        controller.recover_history("nope")


def test_a_replica_catalog_can_recover_too(controller: Catalog, catalog: Catalog) -> None:
    controller.create_instance("main")
    assert catalog.recover_history("main") == controller.recover_history("main")
