"""Commands the controller sends to a replica, and the descriptions they carry.

Every command is a frozen dataclass built from tuples, strings, ints and frontiers only,
so commands are hashable, comparable and safe to share between the history, the codec and
the replicas. Each docstring states the command's preconditions and what the replica must
answer (in the manner of Materialize's `protocol/command.rs`).

This module may not import anything beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Mapping, Union

from history._frontier import Frontier, Timestamp

# A literal value in a key lookup or a predicate. Temporal values travel as ISO strings
# and are compared after a cast to the column's type.
Scalar = Union[None, bool, int, float, str]


def _pairs(mapping: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in mapping.items()))


@dataclass(frozen=True, slots=True)
class InstanceConfig:
    """Instance-wide settings, identical on every replica of the instance.

    `spark_conf` holds the settings that decide *results* (partitioning, ANSI mode, time
    zone), so every replica computes bit-identical rows whatever its size. Settings that
    only decide resources (master, cores, memory) belong to a replica, never here.
    Invariant: `spark_conf` is sorted by key and has no duplicate keys.
    """

    name: str
    spark_conf: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        keys = [key for key, _ in self.spark_conf]
        if keys != sorted(set(keys)):
            raise ValueError("InstanceConfig.spark_conf must be sorted by key without duplicates; use InstanceConfig.of")

    @staticmethod
    def of(name: str, spark_conf: Mapping[str, str]) -> InstanceConfig:
        return InstanceConfig(name, _pairs(spark_conf))

    def conf(self) -> dict[str, str]:
        return dict(self.spark_conf)


@dataclass(frozen=True, slots=True)
class ComputeParameters:
    """Tunable replica parameters. A `None` field means "keep the current value".

    `update` merges a newer set of parameters into this one; merging is associative, so
    a run of `UpdateConfiguration`s can be folded into one.
    """

    max_result_rows: int | None = None
    heartbeat_interval_ms: int | None = None
    input_poll_interval_ms: int | None = None

    def update(self, newer: ComputeParameters) -> ComputeParameters:
        return ComputeParameters(
            **{
                name: getattr(self, name) if getattr(newer, name) is None else getattr(newer, name)
                for name in self.__dataclass_fields__
            }
        )


@dataclass(frozen=True, slots=True)
class Import:
    """A collection a dataflow reads, under the `name` its SQL uses.

    `kind` is "storage" (a durable source or materialized view, read from the storage
    manifest) or "index" (an arrangement exported by another dataflow of the same
    instance, read from replica memory).
    """

    name: str
    id: str
    kind: Literal["storage", "index"] = "storage"


@dataclass(frozen=True, slots=True)
class IndexExport:
    """An arrangement of the dataflow's output in replica memory, keyed by `key`.

    An empty key arranges by the whole row.
    """

    id: str
    key: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SinkExport:
    """A materialized view: the dataflow's output written to storage collection `id`."""

    id: str


@dataclass(frozen=True, slots=True)
class DataflowDescription:
    """What a replica needs to build one dataflow.

    Invariants: at least one export; export ids are distinct and disjoint from import
    ids; `as_of` is not empty (a dataflow with an empty `as_of` has been dropped). The
    dataflow computes `sql` over `imports` at `as_of` and at every later time where an
    input changed, up to (excluding) `until`. `schema` is the output schema as Spark DDL.

    `strategy` says how a replica maintains the output: "incremental" (each change
    costs what changed; the planner found the query maintainable) or "recompute" (the
    whole query at every change time). Both give the same versions.
    """

    name: str
    sql: str
    imports: tuple[Import, ...]
    index_exports: tuple[IndexExport, ...]
    sink_exports: tuple[SinkExport, ...] = ()
    as_of: Frontier = field(default_factory=Frontier.minimum)
    until: Frontier = field(default_factory=Frontier.empty)
    schema: str = ""
    strategy: Literal["incremental", "recompute"] = "recompute"

    def __post_init__(self) -> None:
        if self.strategy not in ("incremental", "recompute"):
            raise ValueError(f"a dataflow's strategy is 'incremental' or 'recompute', not {self.strategy!r}")

    @property
    def export_ids(self) -> tuple[str, ...]:
        return tuple(e.id for e in self.index_exports) + tuple(e.id for e in self.sink_exports)

    @property
    def import_ids(self) -> tuple[str, ...]:
        return tuple(i.id for i in self.imports)

    @property
    def reads_storage_only(self) -> bool:
        """No import is an index: every input is durable, held by storage read holds the
        catalog records (a takeover can keep such a dataflow on a lagging replica)."""
        return all(i.kind == "storage" for i in self.imports)

    def with_as_of(self, as_of: Frontier) -> DataflowDescription:
        return replace(self, as_of=as_of)

    def same_definition(self, other: DataflowDescription) -> bool:
        """True iff both build the same collections from the same inputs.

        `as_of` is deliberately left out: reconciliation keeps a running dataflow whose
        definition is identical and whose old `as_of` is not beyond the new one.
        """
        return replace(self, as_of=other.as_of) == other


@dataclass(frozen=True, slots=True)
class Predicate:
    """`column op value`, evaluated on a peek's rows. `in` takes a tuple of values."""

    column: str
    op: Literal["=", "!=", "<", "<=", ">", ">=", "in", "is_null", "is_not_null"]
    value: Scalar | tuple[Scalar, ...] = None

    def __post_init__(self) -> None:
        if self.op not in _PREDICATE_OPS:
            raise ValueError(f"unknown predicate op {self.op!r}; expected one of {', '.join(_PREDICATE_OPS)}")
        if (self.op == "in") != isinstance(self.value, tuple):
            raise ValueError(f"predicate op {self.op!r} {'needs' if self.op == 'in' else 'cannot take'} a tuple of values")
        if self.op in ("is_null", "is_not_null") and self.value is not None:
            raise ValueError(f"predicate op {self.op!r} takes no value")


_PREDICATE_OPS = ("=", "!=", "<", "<=", ">", ">=", "in", "is_null", "is_not_null")


@dataclass(frozen=True, slots=True)
class OrderBy:
    column: str
    descending: bool = False
    nulls_last: bool = True


@dataclass(frozen=True, slots=True)
class RowSetFinishing:
    """What a replica does to the rows of a peek before answering, in this order:
    key lookup, filter, order by, offset, limit, projection.

    `key` holds one literal per key column of the target index. Without `order_by` the
    rows are sorted on all columns, so every replica answers the same rows in the same
    order.
    """

    key: tuple[Scalar, ...] | None = None
    filter: tuple[Predicate, ...] = ()
    order_by: tuple[OrderBy, ...] = ()
    offset: int = 0
    limit: int | None = None
    projection: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class IndexTarget:
    """Peek the arrangement of index `id`."""

    id: str

    @property
    def collection_ids(self) -> tuple[str, ...]:
        return (self.id,)


@dataclass(frozen=True, slots=True)
class SqlTarget:
    """Peek the result of `sql` over indexes of the instance (`imports`), run by the
    replica on Spark over the arranged versions at the peek's timestamp."""

    sql: str
    imports: tuple[Import, ...]

    @property
    def collection_ids(self) -> tuple[str, ...]:
        return tuple(i.id for i in self.imports)


PeekTarget = Union[IndexTarget, SqlTarget]


# --- Commands -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Resume:
    """A request to continue a replica's session instead of starting a new one.

    The session is the one whose current connection was opened with `nonce` by the same
    controller epoch. The replica resumes it only if it has received at least
    `min_applied` commands in it: below that, the controller no longer holds the
    commands that followed (a reduction rewrote them), and a new session replays the
    reduced history instead (far-horizon rehydration).
    """

    nonce: str
    min_applied: int


@dataclass(frozen=True, slots=True)
class Hello:
    """Opens a connection. Never stored in a history.

    The replica refuses an epoch lower than the highest it has seen (a stale controller)
    and tags every response on this connection with `nonce`. Its first response is a
    `HelloAck` (protocol.codec): whether it resumed the session named by `resume`, and
    how many commands that session has received, so that the controller sends only the
    rest (near-horizon rehydration). Without `resume`, or when the replica cannot
    resume, a new session starts and the controller replays the reduced history.

    `costliest_first`: the order in which the replica takes the steps waiting for its
    workers (else the cheapest first). Not a command's meaning, only its timing: the
    controller has replicas of an instance take opposite orders (each replica added
    takes the order fewer take), so that the first answer to each dataflow comes sooner
    (`replica_service._step_pool`).
    """

    controller_epoch: int
    nonce: str
    resume: Resume | None = None
    costliest_first: bool = False


@dataclass(frozen=True, slots=True)
class CreateInstance:
    """Instance-wide settings. Exactly once per connection, right after `Hello`.

    The replica answers nothing; it applies `config` to its Spark session.
    """

    config: InstanceConfig


@dataclass(frozen=True, slots=True)
class InitializationComplete:
    """Ends the replay of a history. The replica reconciles: it keeps the dataflows it
    was already running whose definition matches, drops the rest, builds the new ones,
    and answers `canceled` to pending peeks of an earlier connection."""


@dataclass(frozen=True, slots=True)
class UpdateConfiguration:
    """New tunable parameters; `None` fields keep their value. Answers nothing."""

    params: ComputeParameters


@dataclass(frozen=True, slots=True)
class CreateDataflow:
    """Build a dataflow. Precondition: its imports exist and are readable at `as_of`;
    no live collection has one of its export ids.

    The replica answers `Frontiers` for every export as its write frontier advances:
    never below `as_of`, never regressing.
    """

    desc: DataflowDescription


@dataclass(frozen=True, slots=True)
class Schedule:
    """Start computing the dataflow that exports `id`. Precondition: a `CreateDataflow`
    for it came earlier. Idempotent: a second `Schedule` for the same id is a no-op."""

    id: str


@dataclass(frozen=True, slots=True)
class AllowCompaction:
    """The controller will not read collection `id` at times before `frontier`.

    The replica may merge versions below it. Never regresses for an id. Canonical form:
    an `AllowCompaction` to the empty frontier *is* a drop; the replica answers a final
    `Frontiers{id, []}` and nothing more for `id`.
    """

    id: str
    frontier: Frontier


@dataclass(frozen=True, slots=True)
class Peek:
    """Read `target` at `timestamp`, finished by `finishing`.

    Precondition: the controller holds every target collection at `timestamp`, so
    `since <= timestamp` until the peek is answered or canceled. The replica answers
    exactly one `PeekResponse` for `uuid`: rows, an error (`timestamp < since`, a
    dataflow in error, a timeout), or `canceled`.
    """

    uuid: str
    target: PeekTarget
    timestamp: Timestamp
    finishing: RowSetFinishing = field(default_factory=RowSetFinishing)
    timeout_ms: int = 30_000

    def __post_init__(self) -> None:
        if self.timestamp < 0:
            raise ValueError(f"a peek timestamp must be non-negative, not {self.timestamp}")


@dataclass(frozen=True, slots=True)
class CancelPeek:
    """Withdraw peek `uuid`. The replica answers `canceled` unless it already answered
    the peek; a cancel for an unknown uuid is ignored."""

    uuid: str


@dataclass(frozen=True, slots=True)
class Subscribe:
    """Report the changes of index export `id` at every time after `as_of` (with
    `snapshot`, its contents at `as_of` first) until `CancelSubscribe`.

    The replica answers `SubscribeResponse`s for `uuid` whose ranges `[lower, upper)`
    follow one another on a connection; a replica that can no longer compute some times
    (it was rebuilt at a later `as_of`, or compacted) starts its next range where it can.
    A `Subscribe` for an open uuid (the controller sends one when a session resumes, as
    reports in flight may be lost) restarts its reports at the new `as_of`.
    Precondition: the controller holds `id` readable at the time its feed has reached
    (`as_of` at first), so every time the feed still needs stays computable.
    """

    uuid: str
    id: str
    as_of: Timestamp
    snapshot: bool = True

    def __post_init__(self) -> None:
        if self.as_of < 0:
            raise ValueError(f"a subscription's as_of must be non-negative, not {self.as_of}")


@dataclass(frozen=True, slots=True)
class CancelSubscribe:
    """End subscription `uuid`: the replica reports nothing more for it. A cancel for an
    unknown uuid is ignored."""

    uuid: str


ComputeCommand = Union[
    CreateInstance,
    InitializationComplete,
    UpdateConfiguration,
    CreateDataflow,
    Schedule,
    AllowCompaction,
    Peek,
    CancelPeek,
    Subscribe,
    CancelSubscribe,
]
"""The commands a history may hold (everything but `Hello`)."""
