"""Failover: a replica killed with SIGKILL while reads go on, and not one read fails.

Two replicas compute the same dataflow; every peek goes to both and the first answer
wins. One is killed (kill -9 of its process group: the replica and its Spark JVM) while
a thread keeps peeking: the other replica answers every peek, and the controller brings
the killed one back (a new process, epoch + 1) by replaying the instance's command
history to it, until it is in sync again.

    .venv/bin/python examples/failover.py
"""

import os
import signal
import time

from controller._process import PeekLoop, embedded_controller, wait_until
from controller.client import Client

with embedded_controller() as controller, Client.connect(controller.address) as client:
    client.create_instance("shop")
    client.add_replica("shop", "r1", size="xsmall")
    client.add_replica("shop", "r2", size="xsmall")
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
    print(f"peek key=eu: {expected.rows}")

    def replica(name):
        return {r.name: r for r in client.status("shop")[0].replicas}[name]

    wait_until(lambda: replica("r1").in_sync and replica("r2").in_sync, 300, "both in sync")
    print("r1 and r2 are in sync")

    victim = replica("r1")
    with PeekLoop(controller.address, "shop", "counts", key="eu", expect=expected.rows) as peeks:
        time.sleep(1)
        os.killpg(victim.pid, signal.SIGKILL)
        print(f"killed r1 (pid {victim.pid}) with SIGKILL")
        back = wait_until(
            lambda: (r := replica("r1")).epoch > victim.epoch and r.in_sync and r,
            300,
            "r1 to be back in sync",
        )
        print(f"r1 is back and in sync: epoch {victim.epoch} -> {back.epoch}, pid {back.pid}")

    print(f"peeks meanwhile: {peeks.summary()}")
    if peeks.failures:
        raise SystemExit(f"a peek failed: {peeks.failures[0]}")
