"""Recovery: the controller killed with SIGKILL and restarted, and nothing recomputed.

The catalog records what is needed to rebuild each instance's command history. Replicas
run in processes of their own and survive the controller. A restarted controller
rebuilds the history and reconnects; each live replica reconciles: it keeps every
dataflow whose definition is unchanged instead of computing it again.

    .venv/bin/python examples/recovery.py
"""

from controller._process import embedded_controller, wait_until
from controller.client import Client


def replica(client, name):
    return {r.name: r for r in client.status("shop")[0].replicas}[name]


with embedded_controller() as controller:
    with Client.connect(controller.address) as client:
        client.create_instance("shop")
        client.add_replica("shop", "r1", size="xsmall")
        client.create_source("orders", "id BIGINT NOT NULL, region STRING, amount DOUBLE")
        client.append("orders", [{"id": 1, "region": "eu", "amount": 10.0}])
        client.create_dataflow(
            "shop",
            "totals",
            "SELECT region, sum(amount) AS total FROM orders GROUP BY region",
            index_key=["region"],
        )
        print(client.peek("shop", "totals", consistency="strict", timeout_ms=120_000).rows)
        before = wait_until(lambda: (r := replica(client, "r1")).in_sync and r, 300, "in sync")
        print(f"r1: pid {before.pid}, dataflows built {before.dataflows_built}")

    controller.kill()
    print(f"killed the controller with SIGKILL; r1 (pid {before.pid}) keeps running")
    controller.start()
    print(f"restarted the controller: epoch {controller.epoch}")

    with Client.connect(controller.address) as client:
        print(f"dataflows back: {[d.name for d in client.list_dataflows('shop')]}")
        after = wait_until(
            lambda: (r := replica(client, "r1")).in_sync and r.dataflows_kept > 0 and r,
            300,
            "r1 to reconcile",
        )
        print(
            f"r1 reconciled: pid {after.pid}, dataflows kept {after.dataflows_kept}, "
            f"built {after.dataflows_built}"
        )
        if after.pid != before.pid or after.dataflows_built != before.dataflows_built:
            raise SystemExit("r1 was restarted or recomputed its dataflows")
        client.append("orders", [{"id": 2, "region": "eu", "amount": 5.0}])
        print(client.peek("shop", "totals", key="eu", consistency="strict").rows)
