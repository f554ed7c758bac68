"""What the controller's and the replica's Prometheus metrics share: a collector whose
samples are read on the process's event loop, where its state lives.

A scrape arrives on the HTTP server's thread; reading asyncio-owned dicts there could see
them change mid-iteration. `LoopCollector.collect` instead runs the subclass's `samples`
coroutine on the loop (one step, so one consistent cut) and waits for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

SNAPSHOT_TIMEOUT_S = 5.0

# name -> (family class: GaugeMetricFamily or CounterMetricFamily, help, label names)
Families = Mapping[str, tuple[type, str, list[str]]]


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: tuple[str, ...]
    value: float


class LoopCollector(Collector):
    """A registry (`self.registry`) holding this collector, whose scrape-time samples
    (`samples`, of the `families` declared) are read on the loop given to `bind`;
    nothing is collected before."""

    families: Families = {}

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.registry.register(self)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the state on `loop` (the one that owns it) at each scrape."""
        self._loop = loop

    async def samples(self) -> list[Sample]:
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        if self._loop is None:
            return
        samples = asyncio.run_coroutine_threadsafe(self.samples(), self._loop).result(SNAPSHOT_TIMEOUT_S)
        families: dict[str, Metric] = {}
        for sample in samples:
            family = families.get(sample.name)
            if family is None:
                kind, help, labels = self.families[sample.name]
                family = families[sample.name] = kind(sample.name, help, labels=labels)
            family.add_metric(list(sample.labels), sample.value)
        yield from families.values()
