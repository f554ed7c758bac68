"""Responses a replica sends to the controller.

Rows are opaque here: Arrow IPC bytes that only `protocol/` and the replica decode, so the
pure model never depends on pyarrow.

This module may not import anything beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from history._frontier import Frontier


@dataclass(frozen=True, slots=True)
class FrontiersResponse:
    """The write frontier of collection `id` on this replica.

    Rules: never regresses; never below the dataflow's `as_of`; after a drop, one final
    empty frontier and nothing more for `id`.
    """

    id: str
    write_frontier: Frontier


@dataclass(frozen=True, slots=True)
class PeekRows:
    """A peek's answer: the rows as Arrow IPC stream bytes, their count and digest."""

    arrow_ipc: bytes
    row_count: int
    digest: str


@dataclass(frozen=True, slots=True)
class PeekError:
    message: str


@dataclass(frozen=True, slots=True)
class PeekCanceled:
    pass


PeekResult = Union[PeekRows, PeekError, PeekCanceled]


@dataclass(frozen=True, slots=True)
class PeekResponse:
    """The one answer to peek `uuid`."""

    uuid: str
    result: PeekResult


@dataclass(frozen=True, slots=True)
class DataflowStatus:
    """One export's state on a replica: hydrated once its frontier passed `as_of`;
    `error` is set when the dataflow failed (and stays failed).

    `last_step_ms` and `rows_changed` describe the latest step (the time it took, and
    the rows its output changed by: insertions plus retractions); `steps` counts the
    versions computed since the dataflow was built on this replica. `digest` is the
    digest of its latest index version and `digest_time` that version's time (None
    before the first): correct replicas report equal digests for equal times.

    While it hydrates, `hydration_tasks_done` of `hydration_tasks_total` are the Spark
    tasks of its first step's jobs so far (the total grows as the step starts more
    jobs); both 0 when not known or once hydrated.

    Its backlog: `pending_times` change times its inputs reached that it has not
    computed yet (those a step is computing included), holding `pending_rows` updates
    of its inputs (a bound: every update of the storage batches that hold them);
    `last_step_times` the times its latest step computed in one pass.

    `retries` counts its rounds in a row that failed for a passing reason (a storage or
    catalog hiccup, a lost executor), `retry_error` the latest one's error; both reset
    by a round that succeeds. `needs_new_session` says why this session cannot compute
    it any further (its inputs were compacted past its frontier): the controller
    rehydrates the replica.
    """

    id: str
    hydrated: bool
    error: str | None = None
    digest: str = ""
    last_step_ms: int = 0
    rows_changed: int = 0
    steps: int = 0
    digest_time: int | None = None
    hydration_tasks_done: int = 0
    hydration_tasks_total: int = 0
    pending_times: int = 0
    pending_rows: int = 0
    last_step_times: int = 0
    retries: int = 0
    retry_error: str | None = None
    needs_new_session: str | None = None


@dataclass(frozen=True, slots=True)
class StatusResponse:
    """A heartbeat, sent at least once a second, with what the controller reports.

    `heartbeat` counts the heartbeats this replica process has sent (a sequence number,
    not a time).

    `dataflows_kept` and `dataflows_built` count, since the replica process started, the
    dataflows reconciliation kept running and the ones it had to build.

    `errors` are problems of the replica as a whole that stop it from making progress
    (e.g. its Spark cluster has no live executors); empty when it is fine.
    """

    heartbeat: int
    dataflows: tuple[DataflowStatus, ...] = ()
    dataflows_kept: int = 0
    dataflows_built: int = 0
    pid: int = 0
    errors: tuple[str, ...] = ()
    metrics_address: str = ""  # where the replica serves /metrics ("" when it does not)


@dataclass(frozen=True, slots=True)
class SubscribeChanges:
    """The changes of one time: Arrow IPC stream bytes of the index's columns plus
    `_time` (this time) and `_diff`, consolidated (no zero diffs, each row once) and in
    canonical order, so replicas report identical bytes."""

    time: int
    arrow_ipc: bytes
    row_count: int


@dataclass(frozen=True, slots=True)
class SubscribeResponse:
    """Subscription `uuid`'s changes at every time in `[lower, upper)`: `changes` holds
    one entry per time in that range that changed, ascending. With a snapshot, the first
    range is `[as_of, as_of + 1)` and its changes are the contents at `as_of`.

    Rules: on one connection the ranges of a subscription never overlap and only move
    forward; `error` (with no changes) says the replica cannot report this
    subscription at all, and it reports nothing more for it.
    """

    uuid: str
    lower: int
    upper: int
    changes: tuple[SubscribeChanges, ...] = ()
    error: str | None = None


ComputeResponse = Union[FrontiersResponse, PeekResponse, StatusResponse, SubscribeResponse]
