"""Prometheus metrics of one replica process: `/metrics` on `python -m replica_service
--http-listen` (the controller shows the address in `tandem status`).

Steps and reads are observed as they happen; dataflows, frontiers, hydration and the
reconciliation counters are read from the replica's state at scrape time, on its event
loop (`protocol.metrics.LoopCollector`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from protocol.metrics import LoopCollector, Sample
from replica_service import _spark

if TYPE_CHECKING:
    from replica_service._dataflow import Dataflow
    from replica_service._replica import Replica

_FAMILIES = {
    "tandem_replica_dataflows": (GaugeMetricFamily, "Dataflows on this replica", []),
    "tandem_replica_dataflow_failed": (GaugeMetricFamily, "1 when the dataflow failed here", ["dataflow"]),
    "tandem_replica_hydrated": (GaugeMetricFamily, "1 once the dataflow computed past its as_of", ["dataflow"]),
    "tandem_replica_write_frontier_ms": (GaugeMetricFamily, "The dataflow's write frontier (a time in ms)", ["dataflow"]),
    "tandem_replica_hydration_tasks_done": (GaugeMetricFamily, "Spark tasks done of the hydrating step's jobs", ["dataflow"]),
    "tandem_replica_hydration_tasks": (GaugeMetricFamily, "Spark tasks of the hydrating step's jobs so far", ["dataflow"]),
    "tandem_replica_pending_times": (GaugeMetricFamily, "Change times the dataflow's inputs reached that it has not computed yet", ["dataflow"]),
    "tandem_replica_pending_rows": (GaugeMetricFamily, "Input updates those pending times hold (a bound)", ["dataflow"]),
    "tandem_replica_last_step_times": (GaugeMetricFamily, "Times the dataflow's latest step computed in one pass", ["dataflow"]),
    "tandem_replica_step_retries": (GaugeMetricFamily, "Rounds in a row the dataflow's steps failed for a passing reason", ["dataflow"]),
    "tandem_replica_dataflows_kept": (CounterMetricFamily, "Dataflows reconciliation kept", []),
    "tandem_replica_dataflows_built": (CounterMetricFamily, "Dataflows built", []),
    "tandem_replica_heartbeats": (CounterMetricFamily, "Status reports sent", []),
    "tandem_replica_peeks_pending": (GaugeMetricFamily, "Reads not answered yet", []),
    "tandem_replica_spark_state_bytes": (GaugeMetricFamily, "Bytes of persisted and checkpointed blocks Spark keeps: dataflow state, input bases", []),
}


class ReplicaMetrics(LoopCollector):
    families = _FAMILIES

    def __init__(self, replica: Replica) -> None:
        super().__init__()
        self.replica = replica
        self.address = ""  # host:port of /metrics once served
        self.step_seconds = Histogram(
            "tandem_replica_step_seconds",
            "Duration of a dataflow's step",
            ["dataflow"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.rows_changed = Counter("tandem_replica_rows_changed", "Rows a dataflow's steps changed", ["dataflow"], registry=self.registry)
        self.times_computed = Counter("tandem_replica_times_computed", "Versions a dataflow's steps computed", ["dataflow"], registry=self.registry)
        self.peeks = Counter("tandem_replica_peeks", "Reads answered, by outcome", ["outcome"], registry=self.registry)
        self._server = None

    def observe_step(self, dataflow: Dataflow, elapsed_ms: int, rows_changed: int, times: int) -> None:
        self.step_seconds.labels(dataflow.desc.name).observe(elapsed_ms / 1000)
        self.rows_changed.labels(dataflow.desc.name).inc(rows_changed)
        self.times_computed.labels(dataflow.desc.name).inc(times)

    def observe_peek(self, outcome: str) -> None:
        self.peeks.labels(outcome).inc()

    def serve(self, listen: str) -> str:
        """Serve `/metrics` on `listen` ("host:port", port 0 picks one); the bound
        "host:port". Call on the replica's event loop. ValueError or OSError when it
        cannot."""
        host, _, port = listen.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"expected host:port or off, not {listen!r}")
        self.bind(asyncio.get_running_loop())
        self._server, _ = start_http_server(int(port), addr=host or "127.0.0.1", registry=self.registry)
        self.address = f"{host or '127.0.0.1'}:{self._server.server_port}"
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    async def samples(self) -> list[Sample]:
        replica = self.replica
        status = {d.id: d for d in replica.status().dataflows}
        samples = [
            Sample("tandem_replica_dataflows", (), len(replica.dataflows)),
            Sample("tandem_replica_dataflows_kept", (), replica.dataflows_kept),
            Sample("tandem_replica_dataflows_built", (), replica.dataflows_built),
            Sample("tandem_replica_heartbeats", (), replica.heartbeats),
            Sample("tandem_replica_peeks_pending", (), len(replica.peeks)),
            Sample("tandem_replica_spark_state_bytes", (), _spark.state_bytes()),
        ]
        for dataflow in replica.dataflows.values():
            name = (dataflow.desc.name,)
            reported = status[dataflow.id]
            samples += [
                Sample("tandem_replica_dataflow_failed", name, float(dataflow.error is not None)),
                Sample("tandem_replica_hydrated", name, float(dataflow.hydrated)),
                Sample("tandem_replica_hydration_tasks_done", name, reported.hydration_tasks_done),
                Sample("tandem_replica_hydration_tasks", name, reported.hydration_tasks_total),
                Sample("tandem_replica_pending_times", name, reported.pending_times),
                Sample("tandem_replica_pending_rows", name, reported.pending_rows),
                Sample("tandem_replica_last_step_times", name, reported.last_step_times),
                Sample("tandem_replica_step_retries", name, reported.retries),
            ]
            if not dataflow.frontier.is_empty:
                samples.append(Sample("tandem_replica_write_frontier_ms", name, dataflow.frontier.time))
        return samples
