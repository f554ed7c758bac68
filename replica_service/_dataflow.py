"""One dataflow on a replica: which times to compute, and computing one of them.

A dataflow computes its SQL at `as_of` once every input's upper is past it, then at each
later time where an input changed; between changes its frontier just follows the meet
of its inputs' uppers (capped at `until`). Each computed result becomes a version of
every index export and a diff written to every sink export.

Nothing here awaits; `Replica` decides when to call what, and runs `compute` on a worker
thread because it blocks on Spark.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import pyarrow as pa

from history import DataflowDescription, Frontier
from replica_service._arrangement import Arrangement, canonical_sort
from replica_service._inputs import StorageTrace
from replica_service._sink import SinkWriter


def times_to_compute(
    as_of: int, last_computed: int | None, input_upper: Frontier, change_times: Sequence[int], since: Frontier
) -> list[int]:
    """The times at which the dataflow must compute next, ascending.

    `as_of` first (once the inputs are complete there), then the `change_times` (input
    changes after the last computed time, all below `input_upper`). Of several times at
    or below `since` only the latest is needed: no read will ask for the ones before it.
    """
    if not input_upper.is_complete(as_of):
        return []
    times = ([as_of] if last_computed is None else []) + list(change_times)
    if since.is_empty:
        return times[-1:]
    superseded = sum(1 for t in times if t <= since.time) - 1
    return times[max(superseded, 0) :]


@dataclass(slots=True)
class DataflowInputs:
    """What one step reads: storage traces and upstream arrangements, by SQL name."""

    storage: dict[str, StorageTrace]
    indexes: dict[str, Arrangement]

    def upper(self) -> Frontier:
        upper = Frontier.empty()
        for trace in self.storage.values():
            upper = upper.meet(trace.upper)
        for arrangement in self.indexes.values():
            upper = upper.meet(arrangement.upper)
        return upper

    def change_times(self, after: int, before: Frontier) -> list[int]:
        limit = before.time if before.time is not None else float("inf")
        times = set()
        for trace in self.storage.values():
            times.update(trace.change_times(after, limit))
        for arrangement in self.indexes.values():
            times.update(v.time for v in arrangement.versions if after < v.time < limit)
        return sorted(times)

    def tables_at(self, time: int) -> dict[str, pa.Table]:
        tables = {name: trace.snapshot(time) for name, trace in self.storage.items()}
        for name, arrangement in self.indexes.items():
            version = arrangement.version_at(time)
            if version is None:
                raise RuntimeError(f"index {arrangement.id} has no version at {time} (since {arrangement.since})")
            tables[name] = version.table
        return tables


@dataclass(slots=True)
class Dataflow:
    """A dataflow's live state on one replica.

    Lifecycles: created by `CreateDataflow` (or kept by reconciliation), started by
    `Schedule`, stopped when every export was compacted to the empty frontier or when
    reconciliation drops it. `error` is set once, by the first failed step, and the
    dataflow then stops advancing.
    """

    desc: DataflowDescription
    inputs: DataflowInputs
    arrangements: dict[str, Arrangement]  # index export id -> arrangement
    sinks: dict[str, SinkWriter]  # sink export id -> writer
    frontier: Frontier = field(init=False)
    last_computed: int | None = None
    scheduled: bool = False
    error: str | None = None
    digest: str = ""  # of the latest computed version
    dropped: set[str] = field(default_factory=set)  # exports compacted to the empty frontier
    steps: int = 0  # versions computed, ever

    def __post_init__(self) -> None:
        self.frontier = self.desc.as_of

    @property
    def id(self) -> str:
        return self.desc.export_ids[0]

    @property
    def since(self) -> Frontier:
        """The meet of the index exports' compaction frontiers (empty without indexes)."""
        since = Frontier.empty()
        for arrangement in self.arrangements.values():
            since = since.meet(arrangement.since)
        return since.join(self.desc.as_of) if self.arrangements else since

    def input_upper(self) -> Frontier:
        """The meet of the inputs' uppers, capped at `until`: the frontier the dataflow
        reaches once it has computed every change time below it."""
        return self.inputs.upper().meet(self.desc.until)

    def next_times(self, upper: Frontier) -> list[int]:
        """The times still to compute below `upper` (a value of `input_upper()`)."""
        as_of = self.desc.as_of.time
        floor = as_of if self.last_computed is None else self.last_computed
        change_times = self.inputs.change_times(floor, upper)
        return times_to_compute(as_of, self.last_computed, upper, change_times, self.since)

    def compute(self, time: int, run_sql: Callable[[str, dict[str, pa.Table]], pa.Table]) -> pa.Table:
        """The result at `time`, canonically sorted (blocking: runs Spark)."""
        return canonical_sort(run_sql(self.desc.sql, self.inputs.tables_at(time)))
