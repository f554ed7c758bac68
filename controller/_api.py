"""What the controller offers its clients, independent of the wire.

`ControllerApi` is the set of operations the gRPC servicer delegates to; the views are
plain frozen values it returns. Every refusal is a `ControllerError` carrying the gRPC
status name that fits (DESIGN section 9): the servicer maps it to a status in one place
and never chooses a code itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Mapping, Protocol, Sequence

import pyarrow as pa

from history import OrderBy, Predicate, Scalar
from protocol import ipc_to_table

StatusCode = Literal[
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "INVALID_ARGUMENT",
    "FAILED_PRECONDITION",
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "INTERNAL",
]

Consistency = Literal["serializable", "strict"]


class ControllerError(Exception):
    """A refused or failed request, with the gRPC status name that fits and a message a
    user can act on. Nothing was changed by the request."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class CollectionView:
    """A compute collection of an instance: `since` and `write_frontier` (W) are the
    times as ints, None for the empty frontier."""

    id: str
    name: str
    since: int | None
    write_frontier: int | None
    wallclock_lag_ms: int | None = None  # now - W by the controller's clock; None once W is empty


@dataclass(frozen=True, slots=True)
class DataflowStatusView:
    """A dataflow on one replica, as the replica last reported it: `error` once it failed
    (it stays failed); `last_step_ms` and `rows_changed` describe its latest step (rows
    inserted plus rows retracted); `steps` counts the versions it computed since it was
    built there. While it hydrates, `hydration_tasks_done` of `hydration_tasks_total`
    are the Spark tasks of its first step's jobs so far (both 0 when not known). Its
    backlog there: `pending_times` change times not computed yet, holding
    `pending_rows` input updates (a bound), and `last_step_times` the times its latest
    step computed in one pass. `retries` counts its rounds in a row that failed for a
    passing reason (it backs off and retries), `retry_error` the latest's error."""

    hydrated: bool
    error: str | None
    digest: str
    last_step_ms: int
    rows_changed: int
    steps: int
    hydration_tasks_done: int = 0
    hydration_tasks_total: int = 0
    pending_times: int = 0
    pending_rows: int = 0
    last_step_times: int = 0
    retries: int = 0
    retry_error: str | None = None


@dataclass(frozen=True, slots=True)
class ReplicaView:
    name: str
    size: str
    spark_master: str
    address: str | None
    managed: bool
    state: str  # connecting | active | failed (waiting until next_retry_ms)
    epoch: int
    pid: int | None
    in_sync: bool
    hydrated: bool
    lag_ms: int | None  # None while not hydrated
    peeks_won: int
    dataflows_kept: int
    dataflows_built: int
    resumes: int  # incarnations that resumed their session: sent only what they missed
    replays: int  # incarnations that started a new session: replayed the reduced history
    # Problems of the replica as a whole that stop its progress (e.g. no live executors).
    errors: tuple[str, ...] = ()
    # Its dataflows by name, from its latest status (none while it is not active).
    dataflows: Mapping[str, DataflowStatusView] = field(default_factory=dict)
    consecutive_failures: int = 0  # failed incarnations in a row
    last_failure: str | None = None
    # While it waits to connect again: when, in ms since the Unix epoch (controller clock).
    next_retry_ms: int | None = None
    # Now minus its write frontier, at worst over the collections; None while not hydrated.
    wallclock_lag_ms: int | None = None
    # Why its answers are not trusted (its digest disagreed with a majority); None: trusted.
    diverged: str | None = None
    slow: bool = False  # a gray failure: it has lost every read race by a lot for a while
    metrics_address: str | None = None  # host:port of the replica's own /metrics, when served


@dataclass(frozen=True, slots=True)
class InstanceView:
    """`health`: healthy when at least `min_in_sync` replicas are in sync; degraded
    when fewer are, or when some dataflows serve nowhere (`unavailable_dataflows`) while
    others serve; unavailable when no replica is in sync and nothing serves."""

    name: str
    health: str  # healthy | degraded | unavailable
    min_in_sync: int
    max_lag_ms: int
    replica_timeout_ms: int
    max_hold_back_ms: int
    history_length: int
    history_reductions: int
    commands_pushed: int
    replicas: tuple[ReplicaView, ...]
    collections: tuple[CollectionView, ...]
    # Dataflows no replica can serve now, by name, and why (each replica's reason).
    unavailable_dataflows: Mapping[str, str] = field(default_factory=dict)
    divergences: int = 0  # digest disagreements seen since this controller started
    events: tuple[str, ...] = ()  # the latest events, oldest first ("<ms> <kind>: <what>")
    replace_slow: bool = False  # a slow replica is rehydrated, not only reported


@dataclass(frozen=True, slots=True)
class SourceView:
    id: str
    name: str
    schema: str  # Spark DDL
    since: int | None
    upper: int | None


@dataclass(frozen=True, slots=True)
class DataflowView:
    id: str
    instance: str
    name: str
    sql: str
    schema: str  # Spark DDL of the output
    index_id: str | None
    index_key: tuple[str, ...] | None
    sink_id: str | None  # the materialized view's storage collection
    compaction_window_ms: int
    strategy: str  # "incremental", or "recompute: <why it is not maintained incrementally>"
    # Its status on each replica that reports it, by replica name.
    replicas: Mapping[str, DataflowStatusView] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SubscribeBatch:
    """Part of a feed: updates (the collection's columns, then `_time` and `_diff`; times
    ascending) and the progress they bring it to: every update at a time at or before
    it has been delivered, so the feed consolidated through it is the collection then
    (None: more updates of the same time follow). A batch may hold no updates:
    progress alone, when the client asked for it."""

    updates: pa.Table
    progress: int | None


@dataclass(frozen=True, slots=True)
class HoldView:
    """A read hold on a storage collection: `holder` may still read it at `frontier`
    and later, on behalf of `owner` ("dataflow of u6", "feed of controller epoch 3",
    "retention", "caller"); `held_back_ms` is how far behind the collection's latest
    complete time (its upper less one) it holds it, None once the collection is closed."""

    holder: str
    owner: str
    frontier: int
    held_back_ms: int | None


@dataclass(frozen=True, slots=True)
class StorageView:
    """A storage collection with what holds its since back: `holds`, least frontier
    first (the first sets the since, unless it is older)."""

    id: str
    name: str
    kind: str
    since: int | None
    upper: int | None
    holds: tuple[HoldView, ...]


@dataclass(frozen=True, slots=True)
class EventView:
    """A recorded event (see `ControllerApi.events`); `replica` is "" when none is
    concerned. Ids increase in the order events were recorded."""

    id: int
    at_ms: int
    instance: str
    kind: str
    replica: str
    message: str


@dataclass(frozen=True, slots=True)
class ControllerView:
    """A `tandem serve` process taking part in leadership: its role ('leader' or
    'standby'), where it serves, and how long ago the catalog last heard from it."""

    role: str
    address: str
    host: str
    pid: int
    heard_ms_ago: int


@dataclass(frozen=True, slots=True)
class LeadershipView:
    """Which controller leads (None: none holds a lease), at which epoch, how long its
    lease still runs by the catalog's clock (negative: lapsed), and the standbys."""

    epoch: int
    leader: ControllerView | None
    lease_remaining_ms: int | None
    lease_renewals: int
    standbys: tuple[ControllerView, ...]


@dataclass(frozen=True, slots=True)
class HandoverView:
    """A planned move of the lead: from the controller at `previous` to the one at
    `leader`, which leads from `epoch`; new calls waited `unavailable_ms` from the old
    leader's last one to the new leader's first."""

    previous: str
    leader: str
    epoch: int
    unavailable_ms: int


@dataclass(frozen=True, slots=True)
class ReadResult:
    """The rows of a peek or query, the time they are correct at, and the replica that
    answered first.

    The rows stay the Arrow IPC stream the replica sent: the gRPC service forwards those
    bytes as they are, and only an in-process caller decodes them (`rows`)."""

    arrow_ipc: bytes
    timestamp: int
    replica: str | None

    @property
    def rows(self) -> pa.Table:
        return ipc_to_table(self.arrow_ipc)


class Feed(Protocol):
    """An open subscription: its batches in order; `close` ends it and releases what
    it holds."""

    def __aiter__(self) -> AsyncIterator[SubscribeBatch]: ...

    async def close(self) -> None: ...


class ControllerApi(Protocol):
    """The operations of a running controller. All are coroutines; all raise
    `ControllerError` on refusal, after changing nothing."""

    @property
    def epoch(self) -> int: ...

    async def create_instance(
        self,
        name: str,
        *,
        min_in_sync: int = 1,
        max_lag_ms: int | None = None,
        replica_timeout_ms: int | None = None,
        spark_conf: Mapping[str, str] | None = None,
        max_hold_back_ms: int | None = None,
        replace_slow: bool | None = None,
    ) -> InstanceView: ...

    async def drop_instance(self, name: str) -> None: ...

    async def list_instances(self) -> list[InstanceView]: ...

    async def add_replica(
        self,
        instance: str,
        name: str,
        *,
        size: str | None = None,
        spark_master: str | None = None,
        spark_conf: Mapping[str, str] | None = None,
        address: str | None = None,
        driver_host: str | None = None,
        driver_bind_address: str | None = None,
        wait: bool = False,
        timeout_ms: int | None = None,
    ) -> ReplicaView:
        """A managed replica of a named size (or an explicit Spark master and conf), or
        an external one already running at `address`.

        `driver_host` is where executors on other hosts reach a managed replica's Spark
        driver, `driver_bind_address` the interface it listens on (default: the host);
        both loopback when absent, and recorded in its `spark_conf`.

        With `wait`, it answers only once the replica is in sync, within `timeout_ms`
        (default: the instance's replica timeout): else DEADLINE_EXCEEDED, or
        UNAVAILABLE when its process could not start (e.g. its Spark master is
        unreachable), both naming why; the replica is then dropped, record and process.
        Without `wait`, a process that could not start is refused the same way."""
        ...

    async def drop_replica(self, instance: str, name: str, *, force: bool = False) -> None: ...

    async def resize(self, instance: str, size: str, *, timeout_ms: int = 600_000, on_timeout: str = "rollback") -> list[ReplicaView]:
        """Add replicas of `size`, wait until they are in sync, drop the old ones; returns
        the instance's replicas after. One durable reconfiguration: recorded first,
        carried on by the next controller if this one dies. New replicas not in sync
        within `timeout_ms` are dropped ("rollback": DEADLINE_EXCEEDED) or replace the
        old ones all the same ("commit"). FAILED_PRECONDITION while another resize of
        the instance runs."""
        ...

    async def create_source(self, name: str, schema: str) -> SourceView: ...

    async def append(self, source: str, rows: pa.Table | Sequence[Mapping[str, object]], *, idempotency_key: str | None = None) -> int:
        """Append rows (an optional `_diff` column retracts with -1) at one new timestamp,
        returned. Rows that do not match the schema refuse the whole append. An append
        whose `idempotency_key` was committed before (within 10 minutes) appends nothing
        and returns that one's timestamp; FAILED_PRECONDITION if it was another
        source's."""
        ...

    async def drop_source(self, name: str) -> None: ...

    async def list_sources(self) -> list[SourceView]: ...

    async def create_dataflow(
        self,
        instance: str,
        name: str,
        sql: str,
        *,
        index_key: Sequence[str] | None = None,
        materialize: bool = False,
        compaction_window_ms: int = 0,
        strategy: str = "auto",
    ) -> DataflowView: ...

    async def drop_dataflow(self, instance: str, name: str) -> None: ...

    async def list_dataflows(self, instance: str | None = None) -> list[DataflowView]: ...

    async def peek(
        self,
        instance: str,
        name: str,
        *,
        key: Sequence[Scalar] | None = None,
        where: Sequence[Predicate] = (),
        order_by: Sequence[OrderBy] = (),
        limit: int | None = None,
        offset: int = 0,
        columns: Sequence[str] | None = None,
        timestamp: int | None = None,
        consistency: Consistency = "serializable",
        timeout_ms: int = 30_000,
    ) -> ReadResult: ...

    async def query(
        self,
        instance: str,
        sql: str,
        *,
        timestamp: int | None = None,
        consistency: Consistency = "serializable",
        timeout_ms: int = 30_000,
    ) -> ReadResult: ...

    async def status(self, instance: str | None = None) -> list[InstanceView]: ...

    async def subscribe(
        self,
        instance: str | None,
        name: str,
        *,
        as_of: int | None = None,
        up_to: int | None = None,
        snapshot: bool = True,
        progress: bool = False,
    ) -> Feed:
        """The open feed of `name` (see `SubscribeBatch`); the caller closes it."""
        ...

    async def storage_holds(self) -> list[StorageView]:
        """Every live storage collection with its read holds (what pins its since)."""
        ...

    async def events(self, instance: str | None = None, *, after: int | None = None, limit: int = 100) -> list[EventView]:
        """Events oldest first, of `instance` or of all: those after id `after`, or the
        latest `limit`. NOT_FOUND for an instance that neither exists nor left events."""
        ...

    async def leadership(self) -> LeadershipView:
        """Who leads, as the catalog records it; a standby answers it too."""
        ...

    async def handover(self, to: str | None = None) -> HandoverView:
        """Move the lead to the standby at address `to` (None: the one heard from last):
        the leader stops taking calls, finishes those in flight, hands the epoch over in
        the catalog and stops once the standby serves. NOT_FOUND for no standby at `to`,
        FAILED_PRECONDITION with none to hand over to."""
        ...

    async def take_lead(self, epoch: int) -> LeadershipView:
        """Sent by a leader that handed the lead (as `epoch`) to this standby: take it
        now rather than at the next poll; answered once this controller serves."""
        ...
