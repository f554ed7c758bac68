"""Prometheus metrics of a running controller: `/metrics` on `tandem serve --http-listen`
(served by `controller._http`).

Two kinds, in one registry per controller:
- **Read at scrape time** from the instances' state (`ControllerMetrics.collect`): the
  history, frontiers and wallclock lag, hydration, health and the counters the state
  already keeps (failures, replays, resumes). The state belongs to the event loop, so
  a scrape (on the HTTP server's thread) takes its snapshot there, in one step.
- **Observed as they happen**: peeks (outcome, winner, latency), the replicas' steps
  (from their status reports: each newly counted step observes its duration) and the
  orphaned read holds storage upkeep removed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from history import ComputeResponse, StatusResponse
from protocol.metrics import LoopCollector, Sample

if TYPE_CHECKING:
    from controller.runtime import Controller


_COLLECTION = ["instance", "replica", "collection"]  # replica "" for the instance's W

log = logging.getLogger(__name__)

_FAMILIES = {
    "tandem_append_commits": (CounterMetricFamily, "Group commits of appends (the advancer's ticks included)", []),
    "tandem_appends_committed": (CounterMetricFamily, "Appends committed by group commits", []),
    "tandem_append_group": (GaugeMetricFamily, "Appends in the latest group commit", []),
    "tandem_controller_epoch": (GaugeMetricFamily, "The epoch this controller leads at", []),
    "tandem_standbys": (GaugeMetricFamily, "Standby controllers registered in the catalog", []),
    "tandem_lease_remaining_seconds": (GaugeMetricFamily, "Until the leader's lease ends, by the catalog's clock", []),
    "tandem_history_commands": (GaugeMetricFamily, "Commands in the instance's history", ["instance"]),
    "tandem_history_reductions": (CounterMetricFamily, "Reductions of the history", ["instance"]),
    "tandem_history_pushes": (CounterMetricFamily, "Commands pushed to the history", ["instance"]),
    "tandem_durable_backlog": (GaugeMetricFamily, "Sinces and holds waiting to be recorded", ["instance"]),
    "tandem_divergences": (CounterMetricFamily, "Digest disagreements between replicas", ["instance"]),
    "tandem_subscriptions": (GaugeMetricFamily, "Open subscriptions to the instance's indexes", ["instance"]),
    "tandem_subscribe_duplicates": (CounterMetricFamily, "Changes of a time a replica reported after another's were forwarded", ["instance"]),
    "tandem_write_frontier_ms": (GaugeMetricFamily, "Write frontier (a time in ms), of the instance (replica \"\") or a replica", _COLLECTION),
    "tandem_wallclock_lag_seconds": (GaugeMetricFamily, "Now minus the write frontier", _COLLECTION),
    "tandem_replica_in_sync": (GaugeMetricFamily, "1 when the replica is in sync", ["instance", "replica"]),
    "tandem_replica_failures": (CounterMetricFamily, "Failed incarnations of the replica", ["instance", "replica"]),
    "tandem_rehydrations": (CounterMetricFamily, "Incarnations brought up, by replay or resume", ["instance", "replica"]),
    "tandem_resumes": (CounterMetricFamily, "Incarnations that resumed their session", ["instance", "replica"]),
    "tandem_hydrated": (GaugeMetricFamily, "1 when the replica has computed the collection past its as_of", _COLLECTION),
    "tandem_hydration_seconds": (GaugeMetricFamily, "From the dataflow sent to the replica to hydrated", _COLLECTION),
    "tandem_pending_times": (GaugeMetricFamily, "Change times the dataflow has not computed yet on the replica", _COLLECTION),
    "tandem_pending_rows": (GaugeMetricFamily, "Input updates those pending times hold (a bound)", _COLLECTION),
    "tandem_last_step_times": (GaugeMetricFamily, "Times the dataflow's latest step on the replica computed in one pass", _COLLECTION),
    "tandem_step_retries": (GaugeMetricFamily, "Rounds in a row the dataflow's steps on the replica failed for a passing reason", _COLLECTION),
}


class ControllerMetrics(LoopCollector):
    """The metrics of `controller`; `observe_peek` and `observe_status` are called by
    the runtime and the drivers, `samples` by a scrape."""

    families = _FAMILIES

    def __init__(self, controller: Controller) -> None:
        super().__init__()
        self.controller = controller
        self.peeks = Counter(
            "tandem_peeks", "Reads answered, by instance, winning replica and outcome", ["instance", "replica", "outcome"], registry=self.registry
        )
        self.peek_seconds = Histogram("tandem_peek_seconds", "Time to answer a read", ["instance"], registry=self.registry)
        self.step_seconds = Histogram(
            "tandem_step_seconds",
            "Duration of a dataflow's step on a replica, from its status",
            ["instance", "replica", "dataflow"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.orphaned_holds = Counter(
            "tandem_orphaned_holds_removed",
            "Read holds removed because their owner was gone (a dropped dataflow, a closed or dead controller's feed), by owner",
            ["owner"],
            registry=self.registry,
        )
        self._steps_seen: dict[tuple[str, str, str], int] = {}

    # --- Observations (on the event loop) ------------------------------------------------

    def observe_peek(self, instance: str, replica: str | None, outcome: str, seconds: float) -> None:
        self.peeks.labels(instance, replica or "", outcome).inc()
        self.peek_seconds.labels(instance).observe(seconds)

    def observe_status(self, instance: str, replica: str, response: ComputeResponse) -> None:
        """A replica's status report: each step it counted since its last one observes
        the latest step's duration (a report covers every step since the previous)."""
        if not isinstance(response, StatusResponse):
            return
        names = {key: d.desc.name for key, d in self.controller.drivers[instance].instance.dataflows.items()}
        for status in response.dataflows:
            key = (instance, replica, status.id)
            seen = self._steps_seen.get(key, 0)
            new = status.steps - seen if status.steps >= seen else status.steps  # fewer: built again
            for _ in range(new):
                self.step_seconds.labels(instance, replica, names.get(status.id, status.id)).observe(status.last_step_ms / 1000)
            self._steps_seen[key] = status.steps

    # --- Scrapes (on the HTTP server's thread) -------------------------------------------

    async def samples(self) -> list[Sample]:
        """Every scrape-time sample, read in one go on the event loop."""
        now_s = time.time()
        samples: list[Sample] = []

        def add(name: str, labels: tuple[str, ...], value: float) -> None:
            samples.append(Sample(name, labels, value))

        ingest = self.controller.ingest
        add("tandem_append_commits", (), ingest.commits)
        add("tandem_appends_committed", (), ingest.appends)
        add("tandem_append_group", (), ingest.last_group)
        add("tandem_controller_epoch", (), self.controller.epoch)
        try:
            leadership = await asyncio.to_thread(self.controller.catalog.leadership)
        except Exception as error:  # an unreachable catalog: the rest of the scrape still answers
            log.warning("metrics: cannot read the leadership: %s", error)
        else:
            add("tandem_standbys", (), len(leadership.standbys))
            if leadership.lease_expires_ms is not None:
                add("tandem_lease_remaining_seconds", (), (leadership.lease_expires_ms - self.controller.catalog.now_ms()) / 1000)
        for name, driver in sorted(self.controller.drivers.items()):
            instance = driver.instance
            history = instance.history
            add("tandem_history_commands", (name,), len(history))
            add("tandem_history_reductions", (name,), history.reductions)
            add("tandem_history_pushes", (name,), history.pushed)
            add("tandem_durable_backlog", (name,), driver.durable_backlog)
            add("tandem_divergences", (name,), instance.divergences)
            add("tandem_subscriptions", (name,), len(instance.subscriptions))
            add("tandem_subscribe_duplicates", (name,), instance.subscribe_duplicates)
            for id, collection in instance.collections.items():
                if collection.since.is_empty or collection.write_frontier.is_empty:
                    continue
                add("tandem_write_frontier_ms", (name, "", id), collection.write_frontier.time)
                add("tandem_wallclock_lag_seconds", (name, "", id), max(0.0, now_s - collection.write_frontier.time / 1000))
            healths = {h.name: h for h in instance.health()}
            for replica in instance.replicas.values():
                labels = (name, replica.name)
                add("tandem_replica_in_sync", labels, float(healths[replica.name].in_sync))
                add("tandem_replica_failures", labels, replica.failures)
                add("tandem_rehydrations", labels, replica.replays + replica.resumes)
                add("tandem_resumes", labels, replica.resumes)
                for id, collection in instance.collections.items():
                    if collection.since.is_empty:
                        continue
                    hydrated = replica.phase == "active" and instance.hydrated(replica, id)
                    add("tandem_hydrated", (*labels, id), float(hydrated))
                    if id in replica.hydration_ms:
                        add("tandem_hydration_seconds", (*labels, id), replica.hydration_ms[id] / 1000)
                    status = replica.dataflow_status.get(id)
                    if status is not None:
                        add("tandem_pending_times", (*labels, id), status.pending_times)
                        add("tandem_pending_rows", (*labels, id), status.pending_rows)
                        add("tandem_last_step_times", (*labels, id), status.last_step_times)
                        add("tandem_step_retries", (*labels, id), status.retries)
                    frontier = replica.frontiers.get(id)
                    if frontier is not None and not frontier.is_empty:
                        add("tandem_write_frontier_ms", (*labels, id), frontier.time)
                        add("tandem_wallclock_lag_seconds", (*labels, id), max(0.0, now_s - frontier.time / 1000))
        return samples
