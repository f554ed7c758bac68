"""Resize: replace an instance's replicas by bigger ones, with reads going on throughout.

`resize` starts replicas of the new size next to the old ones, waits until they are in
sync (they rebuild every dataflow from the command history), then drops the old ones.
A thread peeks all the while: since every peek goes to every replica and the first
answer wins, none fails.

    .venv/bin/python examples/resize.py
"""

from controller._process import PeekLoop, embedded_controller
from controller.client import Client

with embedded_controller() as controller, Client.connect(controller.address) as client:
    client.create_instance("shop")
    client.add_replica("shop", "r1", size="xsmall")
    client.create_source("orders", "id BIGINT NOT NULL, region STRING, amount DOUBLE")
    client.append(
        "orders", [{"id": i, "region": ["eu", "us"][i % 2], "amount": 1.0} for i in range(100)]
    )
    client.create_dataflow(
        "shop",
        "counts",
        "SELECT region, count(*) AS orders FROM orders GROUP BY region",
        index_key=["region"],
    )
    expected = client.peek("shop", "counts", key="eu", consistency="strict", timeout_ms=120_000)
    print(f"peek key=eu: {expected.rows}, from {expected.replica} (xsmall)")

    with PeekLoop(controller.address, "shop", "counts", key="eu", expect=expected.rows) as peeks:
        replicas = client.resize("shop", "small")
    for r in replicas:
        print(f"after the resize: replica {r.name}, {r.size}, in sync {r.in_sync}, pid {r.pid}")

    print(f"peeks during the resize: {peeks.summary()}")
    if peeks.failures:
        raise SystemExit(f"a peek failed: {peeks.failures[0]}")
