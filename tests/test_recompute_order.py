"""A recomputed query's result is a function of its inputs alone (DESIGN section 7,
"Determinism"), also where it keeps the first rows of an order: replicas compare
digests, so two that cut a tie differently disagree, and with two replicas the
arbitrating recompute may side with neither. On real Spark, with the replicas' own
maintainer: one replica reads the uncompacted batches, one is rehydrated after a
compaction merged them."""

from __future__ import annotations

import pytest
from incremental_cases import Flow, spark_env

from history import Frontier
from replica_service.dataplane import StorageReader

pytestmark = pytest.mark.spark

SCHEMA = "id BIGINT, region STRING, amount DOUBLE"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    yield from spark_env(tmp_path_factory)


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT id FROM sales ORDER BY amount LIMIT 2",  # the order's column is not selected
        "SELECT id, amount FROM sales ORDER BY amount DESC LIMIT 3 OFFSET 1",
        "SELECT * FROM (SELECT id, region FROM sales WHERE amount < 5 ORDER BY region LIMIT 2) JOIN (SELECT 1 AS one)",
    ],
)
def test_replicas_agree_on_ties_at_the_cut_before_and_after_a_compaction(env, sql):
    storage = env["storage"]
    id = storage.create_source(f"sales{next(env['sources'])}", SCHEMA).id
    # Ties at every cut, spread over batches so that the order rows are read in differs
    # between the batches as appended and the one file compaction makes of them.
    for rows in (
        [{"id": 9, "region": "b", "amount": 1.0}, {"id": 4, "region": "a", "amount": 7.0}],
        [{"id": 2, "region": "b", "amount": 1.0}, {"id": 8, "region": "a", "amount": 7.0}],
        [{"id": 5, "region": "b", "amount": 1.0}, {"id": 1, "region": "a", "amount": 7.0}],
        [{"id": 7, "region": "b", "amount": 1.0}, {"id": 3, "region": "a", "amount": 7.0}],
    ):
        last = storage.append(id, rows)
    time = last + 1  # a time after the last batch, which compaction may merge it below
    storage.compare_and_append(id, storage.upper(id), Frontier(time + 1))
    running = StorageReader(storage, id)
    running.refresh(env["session"])
    first = Flow(env, "top", sql, "recompute", {"sales": running})
    first.step(time)

    storage.acquire_read_hold(id, "test", Frontier(time))
    assert storage.compact(id) == 4
    rehydrated = StorageReader(storage, id)
    rehydrated.refresh(env["session"])
    assert len(rehydrated._batches) == 1
    second = Flow(env, "top", sql, "recompute", {"sales": rehydrated})
    second.step(time)
    assert second.digests[time] == first.digests[time], (first.table.to_pylist(), second.table.to_pylist())
    for flow in (first, second):
        flow.maintainer.close()
