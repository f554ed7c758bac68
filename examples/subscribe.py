"""Subscribe: follow a maintained aggregate's changes as they happen, and resume a lost
feed from its last progress.

Starts an embedded controller in a temporary directory, an instance with one replica,
a source and a dataflow kept as a materialized view (what a feed reads). A subscriber
thread prints every update (time, diff, row) while the main thread appends inserts and
a retraction; then the feed is dropped and resumed from the last progress it saw, with
no snapshot: only what changed after it arrives.

    .venv/bin/python examples/subscribe.py
"""

import threading

from controller._process import embedded_controller, wait_until
from controller.client import Client, TandemError

with embedded_controller() as controller, Client.connect(controller.address) as client:
    client.create_instance("shop")
    client.add_replica("shop", "r1", size="xsmall")
    client.create_source("orders", "id BIGINT NOT NULL, region STRING, amount DOUBLE")
    client.append("orders", [{"id": 1, "region": "eu", "amount": 10.0}, {"id": 2, "region": "us", "amount": 25.5}])
    client.create_dataflow(
        "shop",
        "totals",
        "SELECT region, sum(amount) AS total, count(*) AS orders FROM orders GROUP BY region",
        index_key=["region"],
        materialize=True,  # a feed reads the view's batches: durable, so each time comes once
    )
    client.peek("shop", "totals", key="eu", consistency="strict", timeout_ms=120_000)

    progress = []  # the last progress the subscriber saw: every update at or before it arrived

    def follow(feed) -> None:
        try:
            for batch in feed:
                for row in batch.updates.to_pylist():
                    time, diff = row.pop("_time"), row.pop("_diff")
                    print(f"  {time}  {diff:+d}  {row}")
                progress.append(batch.progress)
        except TandemError as error:  # the client closed its channel: the stream ends
            print(f"feed ended: {error.code.name}")

    # The first batch is the snapshot (all diffs +1), then each change in time order.
    print("subscribed to shop/totals:")
    with Client.connect(controller.address) as own:
        feed = own.subscribe("shop", "totals", progress=True)
        follower = threading.Thread(target=follow, args=(feed,), daemon=True)
        follower.start()
        wait_until(lambda: progress, 60, "the snapshot")
        eu_order = {"id": 3, "region": "eu", "amount": 4.5}
        last = client.append("orders", [eu_order])
        last = client.append("orders", [{**eu_order, "_diff": -1}, {"id": 4, "region": "apac", "amount": 7.0}])
        wait_until(lambda: progress[-1] >= last, 120, "the feed to reach the last append")
    follower.join(timeout=30)  # the client closed: the feed ended
    resume_at = progress[-1]
    print(f"feed closed at progress {resume_at}")

    later = client.append("orders", [{"id": 5, "region": "us", "amount": 12.0}])
    print(f"resumed after {resume_at} (no snapshot):")
    for batch in client.subscribe("shop", "totals", as_of=resume_at, snapshot=False, up_to=later + 1):
        for row in batch.updates.to_pylist():
            time, diff = row.pop("_time"), row.pop("_diff")
            print(f"  {time}  {diff:+d}  {row}")
    print("the resumed feed ended at up_to")
