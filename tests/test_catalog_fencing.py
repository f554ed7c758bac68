"""The controller epoch, fencing, and the timestamp oracle, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from catalog import Catalog, Fenced, NewBatch
from history import ComputeParameters, Frontier, Import

SCHEMA = "id BIGINT NOT NULL"


def mutations(catalog: Catalog) -> dict[str, Callable[[], object]]:
    """One call of every controller mutation, valid in the world `populate` makes."""
    return {
        "check_epoch": catalog.check_epoch,
        "write_ts": catalog.write_ts,
        "create_instance": lambda: catalog.create_instance("second"),
        "update_instance": lambda: catalog.update_instance(
            "main", parameters=ComputeParameters(max_result_rows=1)
        ),
        "drop_instance": lambda: catalog.drop_instance("main"),
        "create_replica": lambda: catalog.create_replica("main", "r2", size="s"),
        "update_replica": lambda: catalog.update_replica("main", "r1", pid=7),
        "drop_replica": lambda: catalog.drop_replica("main", "r1"),
        "create_source": lambda: catalog.create_source("users", SCHEMA),
        "drop_source": lambda: catalog.drop_source("u1"),
        "record_frontiers": lambda: catalog.record_frontiers("u3", upper=Frontier(9)),
        "create_dataflow": lambda: catalog.create_dataflow(
            "main",
            "more",
            sql="SELECT * FROM o",
            imports=[Import("o", "u1")],
            schema=SCHEMA,
            as_of=Frontier(0),
            index_key=[],
        ),
        "drop_dataflow": lambda: catalog.drop_dataflow("u2"),
        "append_batch": lambda: catalog.append_batch("u1", Frontier(0), Frontier(5), None),
        "advance_sources": lambda: catalog.advance_sources(Frontier(5)),
        "replace_batches": lambda: catalog.replace_batches("u1", [], None),
        "acquire_read_hold": lambda: catalog.acquire_read_hold("u1", "peek", Frontier(0)),
        "downgrade_read_hold": lambda: catalog.downgrade_read_hold("u1", "held", Frontier(1)),
        "release_read_hold": lambda: catalog.release_read_hold("u1", "held"),
        "forget_retired": lambda: catalog.forget_retired([]),
    }


def populate(catalog: Catalog) -> None:
    catalog.create_instance("main")
    catalog.create_replica("main", "r1", size="s")
    source = catalog.create_source("orders", SCHEMA)
    catalog.create_dataflow(
        "main",
        "idx",
        sql="SELECT * FROM o",
        imports=[Import("o", source.id)],
        schema=SCHEMA,
        as_of=Frontier(0),
        index_key=[],
    )
    catalog.acquire_read_hold(source.id, "held", Frontier(0))


def test_become_controller_bumps_the_epoch(catalog_url: str) -> None:
    with Catalog.open(catalog_url) as first, Catalog.open(catalog_url) as second:
        assert first.controller_epoch() == 0
        assert first.become_controller() == 1
        assert second.become_controller() == 2
        assert (first.epoch, second.epoch, first.controller_epoch()) == (1, 2, 2)


def test_a_second_controller_fences_the_first(catalog_url: str, dump) -> None:  # type: ignore[no-untyped-def]
    old = Catalog.open(catalog_url)
    old.become_controller()
    populate(old)
    new = Catalog.open(catalog_url)
    new.become_controller()

    calls = mutations(old)
    before = dump()
    for name, call in calls.items():
        with pytest.raises(Fenced, match="superseded by epoch 2") as raised:
            call()
        assert (raised.value.epoch, raised.value.current) == (1, 2), name
    assert dump() == before

    # The new controller is not disturbed, and reads still work for the old one.
    new.create_source("users", SCHEMA)
    assert [c.name for c in old.list_collections() if c.kind == "source"] == ["orders", "users"]
    old.close()
    new.close()


def test_a_catalog_that_is_not_controller_may_not_write(
    controller: Catalog, catalog: Catalog, dump
) -> None:  # type: ignore[no-untyped-def]
    populate(controller)
    calls = mutations(catalog)
    del calls["append_batch"]  # a replica's write: guarded by the upper alone
    before = dump()
    for name, call in calls.items():
        with pytest.raises(Fenced, match="not the controller") as raised:
            call()
        assert raised.value.epoch is None, name
    assert dump() == before
    assert catalog.append_batch("u1", Frontier(0), Frontier(5), None).upper == Frontier(5)


def test_a_replica_append_is_not_fenced_by_the_epoch(controller: Catalog, catalog: Catalog) -> None:
    source = controller.create_source("orders", SCHEMA)
    controller.become_controller()  # bumps again: a replica never cares
    batch = NewBatch(f"{source.id}/x.parquet", rows=1, bytes=10)
    assert catalog.append_batch(source.id, Frontier(0), Frontier(3), batch).upper == Frontier(3)


def test_a_takeover_waits_for_or_fences_a_write_in_flight(catalog_url: str) -> None:
    """The old controller is inside a write transaction (past its epoch check) when the
    new one takes over. Either the takeover waits until that write commits, or the write
    is fenced; it must never commit after the takeover. A write that did would show as a
    timestamp beyond the one the new controller reads right after taking over."""
    in_flight, taken_over = threading.Event(), threading.Event()
    slow = [False]

    def slow_clock() -> int:
        if slow[0]:
            in_flight.set()
            taken_over.wait(1.0)  # long enough for a takeover that does not wait for us
        return 1_000

    old = Catalog.open(catalog_url, now_ms=slow_clock)
    old.become_controller()
    new = Catalog.open(catalog_url)
    outcome: list[object] = []

    def write() -> None:
        try:
            outcome.append(old.write_ts())
        except Fenced as error:
            outcome.append(error)

    slow[0] = True
    thread = threading.Thread(target=write)
    thread.start()
    assert in_flight.wait(10)
    new.become_controller()
    latest = new.read_ts()
    taken_over.set()
    thread.join()
    assert isinstance(outcome[0], Fenced) or outcome[0] <= latest
    assert new.read_ts() == latest
    with pytest.raises(Fenced):
        old.write_ts()
    old.close()
    new.close()


# --- Timestamp oracle ---------------------------------------------------------------------


class Clock:
    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def test_write_ts_follows_the_clock_and_never_repeats(catalog_url: str) -> None:
    clock = Clock(1_000)
    with Catalog.open(catalog_url, now_ms=clock) as oracle:
        oracle.become_controller()
        assert oracle.read_ts() == 0
        assert oracle.write_ts() == 1_000
        assert oracle.write_ts() == 1_001  # the clock stood still
        clock.now = 500  # and went backwards
        assert oracle.write_ts() == 1_002
        clock.now = 5_000
        assert oracle.write_ts() == 5_000
        assert oracle.read_ts() == 5_000


def test_write_ts_is_monotone_across_restarts(catalog_url: str) -> None:
    with Catalog.open(catalog_url, now_ms=Clock(9_000)) as first:
        first.become_controller()
        assert first.write_ts() == 9_000
    with Catalog.open(catalog_url, now_ms=Clock(10)) as second:
        assert second.read_ts() == 9_000
        second.become_controller()
        assert second.write_ts() == 9_001


def test_write_ts_is_never_behind_the_wall_clock(controller: Catalog) -> None:
    before = controller.now_ms()
    ts = controller.write_ts()
    assert before <= ts
    assert controller.read_ts() == ts


def test_concurrent_write_ts_are_distinct(controller: Catalog) -> None:
    results: list[list[int]] = [[] for _ in range(4)]

    def draw(out: list[int]) -> None:
        out.extend(controller.write_ts() for _ in range(25))

    threads = [threading.Thread(target=draw, args=(out,)) for out in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [ts for out in results for ts in out]
    assert len(set(every)) == 100
    assert all(out == sorted(out) for out in results)
    assert controller.read_ts() == max(every)
