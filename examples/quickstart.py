"""Quickstart: the client API once through, on a controller of its own.

Starts an embedded controller (SQLite catalog, local files, local Spark) in a temporary
directory, then: an instance with one replica, a source with a few rows, a dataflow
indexed on `region`, peeks (by key; with a filter, an order and a limit), a SQL query
over the index, and the instance's status. Everything it started is stopped at the end.

    .venv/bin/python examples/quickstart.py
"""

from controller._process import embedded_controller
from controller.client import Client

with embedded_controller() as controller, Client.connect(controller.address) as client:
    print(f"controller listening on {controller.address}")

    # An instance is a set of replicas that all compute the same dataflows.
    client.create_instance("shop")
    replica = client.add_replica("shop", "r1", size="xsmall")
    print(f"replica r1 started (pid {replica.pid})")

    # A source is a durable collection the client writes to; each append gets a timestamp.
    client.create_source("orders", "id BIGINT NOT NULL, region STRING, amount DOUBLE")
    rows = [
        {"id": 1, "region": "eu", "amount": 10.0},
        {"id": 2, "region": "us", "amount": 25.5},
        {"id": 3, "region": "eu", "amount": 4.5},
        {"id": 4, "region": "apac", "amount": 7.0},
        {"id": 5, "region": "us", "amount": 12.0},
    ]
    timestamp = client.append("orders", rows)
    print(f"appended {len(rows)} orders at timestamp {timestamp}")

    # A dataflow is Spark SQL kept up to date on every replica; an index makes it peekable.
    client.create_dataflow(
        "shop",
        "totals",
        "SELECT region, sum(amount) AS total, count(*) AS orders FROM orders GROUP BY region",
        index_key=["region"],
    )

    # "strict" reads the latest write (waiting for the replica to get there): read-your-writes.
    # The first read also waits for the replica to build the dataflow.
    eu = client.peek("shop", "totals", key="eu", consistency="strict", timeout_ms=120_000)
    print(f"peek key=eu: {eu.rows} (at {eu.timestamp}, from {eu.replica})")

    top = client.peek("shop", "totals", where=[("orders", ">=", 1)], order_by=["-total"], limit=2)
    print(f"peek orders >= 1, by total descending, limit 2: {top.rows}")

    some = client.peek("shop", "totals", where={"region": ["eu", "apac"]}, columns=["region"])
    print(f"peek region in (eu, apac), column region only: {some.rows}")

    # A query runs SQL over the instance's indexes, at one time.
    result = client.query("shop", "SELECT sum(total) AS revenue, sum(orders) AS n FROM totals")
    print(f"query over the index: {result.rows}")

    status = client.status("shop")[0]
    print(f"status: instance {status.name} is {status.health}")
    for r in status.replicas:
        print(f"  replica {r.name}: {r.size}, in sync {r.in_sync}, lag {r.lag_ms} ms, pid {r.pid}")

print("done: the controller and its replica are stopped")
