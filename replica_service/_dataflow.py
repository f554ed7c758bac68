"""One dataflow on a replica: which times to compute, and what it has computed.

A dataflow computes its SQL at `as_of` once every input's upper is past it, then at each
later time where an input changed; between changes its frontier just follows the meet
of its inputs' uppers (capped at `until`). Each computed version becomes a version of
every index export and a batch written to every sink export. How a version is computed
(incrementally or by recompute) is the data plane's business (`dataplane.Maintainer`,
built on the first step).

Nothing here awaits or touches Spark; `Replica` decides when to call what.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Sequence, Union

from history import DataflowDescription, Frontier
from replica_service._arrangement import Arrangement
from replica_service.dataplane import Maintainer, SinkWriter, StorageReader

Input = Union[StorageReader, Arrangement]


def times_to_compute(
    as_of: int,
    last_computed: int | None,
    input_upper: Frontier,
    change_times: Sequence[int],
    since: Frontier,
    *,
    every_time: bool,
) -> list[int]:
    """The times at which the dataflow must compute next, ascending.

    `as_of` first (once the inputs are complete there), then the `change_times` (input
    changes after the last computed time, all below `input_upper`). Of several times at
    or below `since` only the latest is needed, as no read will ask for the ones before
    it, unless `every_time`: a materialized view is a storage collection, readable at
    every time it holds, so each of its versions is written.
    """
    if not input_upper.is_complete(as_of):
        return []
    times = ([as_of] if last_computed is None else []) + list(change_times)
    if every_time:
        return times
    if since.is_empty:
        return times[-1:]
    superseded = sum(1 for t in times if t <= since.time) - 1
    return times[max(superseded, 0) :]


def input_upper(inputs: dict[str, Input]) -> Frontier:
    """The meet of the inputs' uppers: every input is complete below it."""
    upper = Frontier.empty()
    for source in inputs.values():
        upper = upper.meet(source.upper)
    return upper


def change_times(inputs: dict[str, Input], after: int, before: Frontier) -> list[int]:
    """The distinct times in (after, before) at which some input changed."""
    limit = before.time if before.time is not None else float("inf")
    times: set[int] = set()
    for source in inputs.values():
        if isinstance(source, StorageReader):
            times.update(source.change_times(after, before))
        else:
            times.update(t for t in source.times if after < t < limit)
    return sorted(times)


@dataclass(slots=True)
class Dataflow:
    """A dataflow's live state on one replica.

    Lifecycles: created by `CreateDataflow` (or kept by reconciliation), started by
    `Schedule`, stopped when every export was compacted to the empty frontier or when
    reconciliation drops it. `error` is set once, by the first failed step, and the
    dataflow then stops advancing. `maintainer` is built by the first step and kept
    while the dataflow steps; its Spark state is released once it stops (dropped,
    failed, at `until`) and when a failure rebuilds it. `stepping` is its step on a
    worker while it runs, which a drop that cancels the dataflow's task does not stop.
    """

    desc: DataflowDescription
    inputs: dict[str, Input]  # by the name the SQL reads
    arrangements: dict[str, Arrangement]  # index export id -> arrangement
    sinks: dict[str, SinkWriter]  # sink export id -> writer
    frontier: Frontier = field(init=False)
    maintainer: Maintainer | None = None
    last_computed: int | None = None
    scheduled: bool = False
    error: str | None = None
    digest: str = ""  # of the latest computed version
    digest_time: int | None = None  # that version's time
    dropped: set[str] = field(default_factory=set)  # exports compacted to the empty frontier
    steps: int = 0  # versions computed, ever
    job_group: str | None = None  # the Spark job group of the step running, if one is
    stepping: Future | None = None
    last_step_ms: int = 0
    rows_changed: int = 0  # by the latest step
    last_step_times: int = 0  # the times the latest step computed
    # Rounds in a row that failed for a passing reason, and the latest one's error.
    retries: int = 0
    retry_error: str | None = None
    # Why this session cannot compute it any further (its inputs were compacted past
    # its frontier): reported, for the controller to rehydrate the replica.
    needs_new_session: str | None = None
    # What its next step is expected to take: the last one's time, or after its
    # hydration, its rehearsal's (`Replica._rehearse`).
    expected_step_ms: int = 0
    # Built from a session's replayed history (a replica added, restarted or
    # reconnected, catching up), not created live: its hydration rehearses nothing.
    replayed: bool = False

    def __post_init__(self) -> None:
        self.frontier = self.desc.as_of

    @property
    def id(self) -> str:
        return self.desc.export_ids[0]

    @property
    def hydrated(self) -> bool:
        return self.frontier > self.desc.as_of

    @property
    def light(self) -> bool:
        """Its next step reads the inputs' changes, not the inputs (`Maintainer.light`)."""
        return self.maintainer is not None and self.maintainer.light

    @property
    def since(self) -> Frontier:
        """The meet of the index exports' compaction frontiers (empty without indexes)."""
        since = Frontier.empty()
        for arrangement in self.arrangements.values():
            since = since.meet(arrangement.since)
        return since.join(self.desc.as_of) if self.arrangements else since

    def changes_waiting(self, after: int) -> bool:
        """Some input changed after `after`, as far as this replica has read it (the
        storage poller reads manifests in the background): a step is due. Safe on a
        step worker: readers lock their batches, and an arrangement's versions are only
        appended to or trimmed."""
        return bool(change_times(self.inputs, after, Frontier.empty()))

    def input_upper(self) -> Frontier:
        """The meet of the inputs' uppers, capped at `until`: the frontier the dataflow
        reaches once it has computed every change time below it."""
        return input_upper(self.inputs).meet(self.desc.until)

    def backlog(self) -> tuple[int, int]:
        """The change times its inputs reached that it has not computed yet, and a
        bound on the input updates they hold (every update of the storage batches that
        hold one; an index's changes). Safe on the event loop: readers lock their
        batches."""
        times = self.next_times(self.input_upper())
        if not times:
            return 0, 0
        after = self.last_computed
        rows = 0
        for source in self.inputs.values():
            if isinstance(source, StorageReader):
                rows += source.change_rows(after, times[-1])
            else:
                rows += source.change_rows(-1 if after is None else after, times[-1])
        return len(times), rows

    def next_times(self, upper: Frontier) -> list[int]:
        """The times still to compute below `upper` (a value of `input_upper()`)."""
        as_of = self.desc.as_of.time
        floor = as_of if self.last_computed is None else self.last_computed
        changes = change_times(self.inputs, floor, upper)
        return times_to_compute(as_of, self.last_computed, upper, changes, self.since, every_time=bool(self.sinks))
