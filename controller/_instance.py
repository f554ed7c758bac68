"""The compute instance as a sans-I/O state machine.

One `ComputeInstance` holds an instance's command history, its replicas, the frontiers
and read holds of its collections, and its pending peeks. Methods take a client command,
a replica response, a replica failure or a clock tick, change the state, and return the
effects the driver must carry out (messages to send, peeks to answer, holds to record).
Nothing here does I/O or awaits, and every method leaves the instance consistent, so the
instance can be driven by simulated replicas with seeded faults.

Rules (DESIGN section 6):
- A command is pushed to the history *before* it is sent, so the history exists with
  zero replicas and a (re)connecting replica is brought up by replaying it.
- A subscription's changes are forwarded once per time: a replica's report of the
  times `[lower, upper)` is taken when it reaches past what was forwarded and starts at
  or before it, and only its times not yet forwarded go on; its index is held at the
  last forwarded time, so every replica can always compute what is still to forward.
- The first response to a peek with rows wins: the caller gets it, `CancelPeek` goes to
  every replica (and into the history), then the peek's read holds are released. An
  error never wins while another replica may still answer: errors answer a peek only
  once every active replica has answered it with an error (or reported its dataflow
  failed), or no active replica is left, and then together, naming each replica.
- `W(c)` is the max of the replicas' write frontiers; a report below the known value is
  ignored. `since(c)` is the min of the holds on c and only advances; when it does, it
  is recorded (`SinceAdvanced`) and c's holds on its inputs follow; once the driver
  reports it durable (`sinces_recorded`), `AllowCompaction{c, since}` is sent. Record
  first, then act: a controller restarted after a crash rebuilds each dataflow at its
  recorded since, which replicas must still be able to serve.
- A replica is hydrated for c once `w_r(c) > as_of(c)`, in sync when active, free of
  replica-wide errors, and for every dataflow: not reported failed, hydrated, and within
  `max_lag_ms` of `W`. A dataflow that no replica serves (failed or unhydrated on each)
  makes the instance degraded, not unavailable, while others serve.
- A failed replica comes back as a new incarnation. If its process kept the session this
  controller opened, and the commands it missed are still among the last
  `resume_window` pushed, it gets just those (near-horizon); otherwise a new session and
  the reduced history (far-horizon), which a live process reconciles. After failures in
  a row it backs off (`InstanceOptions.retry_delay_ms`): time enters only through
  `tick`, so a waiting replica connects on the first tick past its retry time.

Health (hydration, lag, in-sync replicas, gray failure) is read off this state by the
base class `InstanceHealth`, in `_health.py`.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Collection, Iterable, Literal, Mapping, Union

from catalog import DEFAULT_MAX_HOLD_BACK_MS, DEFAULT_MAX_LAG_MS, DEFAULT_MIN_IN_SYNC, DEFAULT_REPLICA_TIMEOUT_MS, dataflow_holder
from controller._health import InstanceHealth, LosingStreak
from history import (
    AllowCompaction,
    CancelPeek,
    CancelSubscribe,
    CommandHistory,
    ComputeCommand,
    ComputeParameters,
    ComputeResponse,
    CreateDataflow,
    CreateInstance,
    DataflowDescription,
    DataflowStatus,
    Frontier,
    FrontiersResponse,
    InitializationComplete,
    RECENT_COMMANDS,
    InstanceConfig,
    Peek,
    PeekCanceled,
    PeekError,
    PeekResponse,
    PeekResult,
    PeekTarget,
    Resume,
    Schedule,
    StatusResponse,
    Subscribe,
    SubscribeChanges,
    SubscribeResponse,
    UpdateConfiguration,
    meet_all,
    reduce_commands,
)

# --- Effects --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Send `commands`, in order, on replica `replica`'s connection of epoch `epoch`."""

    replica: str
    epoch: int
    commands: tuple[ComputeCommand, ...]


@dataclass(frozen=True, slots=True)
class Connect:
    """Open a connection to `replica` for incarnation `epoch` (retrying with backoff),
    offering to `resume` its session, and report `replica_connected` with the replica's
    answer to the `Hello`. `failures` counts the replica's incarnations that failed in a
    row before this one: the connection numbers its attempts on from there, so that a
    process that keeps failing is replaced (see `runtime._replica_address`).
    `costliest_first`: the order in which the replica takes its waiting steps (`Hello`)."""

    replica: str
    epoch: int
    resume: Resume | None = None
    failures: int = 0
    costliest_first: bool = False


@dataclass(frozen=True, slots=True)
class Disconnect:
    """Close `replica`'s connection of epoch `epoch`, if it is still open."""

    replica: str
    epoch: int


@dataclass(frozen=True, slots=True)
class PeekDone:
    """Answer the client's peek `uuid`: `result` from `replica` (None: the controller's own
    answer, e.g. a timeout)."""

    uuid: str
    result: PeekResult
    replica: str | None


@dataclass(frozen=True, slots=True)
class StorageHold:
    """Hold storage collection `id` at `frontier` on behalf of `holder` (empty: release)."""

    id: str
    holder: str
    frontier: Frontier


@dataclass(frozen=True, slots=True)
class SinceAdvanced:
    """Compute collection `id` may no longer be read before `since`: record it, so that
    recovery rebuilds the dataflow with that `as_of`, then report it with
    `ComputeInstance.sinces_recorded` (replicas may compact only then)."""

    id: str
    since: Frontier


@dataclass(frozen=True, slots=True)
class Arbitrate:
    """Replicas disagree on dataflow `key`'s version at `time` with no majority:
    recompute it from storage and report its digest with `ComputeInstance.arbitrated`."""

    key: str
    time: int


@dataclass(frozen=True, slots=True)
class SubscribeForward:
    """Deliver subscription `uuid`'s `changes` (each time once, ascending), then its
    `progress`: every change at a time at or before it has now been delivered."""

    uuid: str
    changes: tuple[SubscribeChanges, ...]
    progress: int


@dataclass(frozen=True, slots=True)
class SubscribeEnded:
    """Subscription `uuid` ended: nothing more will be delivered; `code` and `message`
    say why (a gRPC status code name)."""

    uuid: str
    code: str
    message: str


Effect = Union[Send, Connect, Disconnect, PeekDone, StorageHold, SinceAdvanced, Arbitrate, SubscribeForward, SubscribeEnded]


class InstanceError(Exception):
    """A refused client command; the instance is unchanged."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # a gRPC status name: NOT_FOUND, FAILED_PRECONDITION, ...


# --- State ----------------------------------------------------------------------------

DIGEST_TIMES_KEPT = 16  # per dataflow: the version times whose digests are compared
EVENTS_KEPT = 100
HOLD_BACK_DOUBLINGS = 3  # a replica failing again and again is held back by at most 8x max_hold_back_ms


@dataclass(frozen=True, slots=True)
class InstanceOptions:
    # The defaults are the catalog's, which records every instance's options.
    min_in_sync: int = DEFAULT_MIN_IN_SYNC
    max_lag_ms: int = DEFAULT_MAX_LAG_MS
    replica_timeout_ms: int = DEFAULT_REPLICA_TIMEOUT_MS
    # Commands kept as pushed: a replica that missed no more than these since its stream
    # broke is caught up with just those (near-horizon).
    resume_window: int = RECENT_COMMANDS
    # Backoff across incarnations (see `retry_delay_ms`); a replica in sync for
    # `stable_ms` has its consecutive failures forgotten.
    retry_base_ms: int = 500
    retry_max_ms: int = 30_000
    stable_ms: int = 60_000
    # A replica further than this behind W on any collection (or that has not reported
    # one for this long past its as_of) no longer holds compaction back: its session
    # is given up and it is rehydrated at the current sinces.
    max_hold_back_ms: int = DEFAULT_MAX_HOLD_BACK_MS
    # Gray failure: a replica that loses at least `slow_min_races` peek races in a row,
    # each by more than `slow_after_ms`, over at least `slow_period_ms`, is reported
    # slow; with `replace_slow`, it is rehydrated (see `InstanceHealth._slow`).
    slow_after_ms: int = 1_000
    slow_period_ms: int = 10_000
    slow_min_races: int = 5
    replace_slow: bool = False

    def retry_delay_ms(self, failures: int) -> int:
        """How long a replica that failed `failures` times in a row waits before its next
        incarnation connects: not at all after one failure (a live process resumes its
        session at once), then `retry_base_ms` doubling per failure, at most
        `retry_max_ms`. A pure schedule: the instance waits for `tick` to pass it."""
        if failures <= 1:
            return 0
        return min(self.retry_max_ms, self.retry_base_ms * 2 ** min(failures - 2, 32))


# failed: waiting (until `retry_at_ms`) to connect its next incarnation.
ReplicaPhase = Literal["connecting", "active", "failed"]


@dataclass(slots=True, eq=False)  # one object per session: identity is what matters
class Session:
    """A replica session this controller opened, through its current connection `nonce`.

    When it had received `replay_length` commands, it stood at absolute history position
    `replay_position`: after the replay that opened it, or (reset by each resume) after
    the peeks a resume sends again, which the history does not count, where the resume's
    suffix starts. Every command pushed later was sent to it, in order, while it was
    active or in a resume's suffix. So a session that has received `applied` commands
    stands at `replay_position + applied - replay_length`, even partway through a resume.
    `detached_ms` is when it last stopped being active (None while it is): a resume
    offer expires `replica_timeout_ms` after it, however many incarnations try.
    """

    nonce: str
    replay_position: int
    replay_length: int
    detached_ms: int | None = None

    def position(self, applied: int) -> int | None:
        """The history position after `applied` commands; None inside the replay."""
        return None if applied < self.replay_length else self.replay_position + applied - self.replay_length


@dataclass(slots=True)
class ReplicaState:
    """What the controller knows of one replica, for its current incarnation `epoch`.

    Lifecycle of `frontiers`: filled by `Frontiers` responses of the current session;
    kept while a failed replica may resume it (they hold its inputs), cleared when a new
    session starts or the resume offer is withdrawn. Lifecycle of `as_ofs`:
    the `as_of` each collection was built from in the current session, filled when its
    `CreateDataflow` is sent (in the replay, a resume's suffix, or live), reset when a new
    session starts (`given_ms`: when). `session` outlives a failure, so that the next incarnation can offer
    to resume it; it is forgotten when a resume is refused or cannot be served.
    """

    name: str
    epoch: int = 1
    phase: ReplicaPhase = "connecting"
    costliest_first: bool = False  # the order of its waiting steps, for every incarnation
    frontiers: dict[str, Frontier] = field(default_factory=dict)
    as_ofs: dict[str, Frontier] = field(default_factory=dict)
    given_ms: dict[str, int] = field(default_factory=dict)  # when each as_of was sent
    hydration_ms: dict[str, int] = field(default_factory=dict)  # from given_ms to hydrated
    last_heard_ms: int = 0
    peeks_won: int = 0
    failures: int = 0
    consecutive_failures: int = 0  # since it last stayed in sync for `stable_ms`
    retry_at_ms: int = 0  # while failed: when its next incarnation connects
    in_sync_since_ms: int | None = None  # while active with failures, and in sync where served (`tick`)
    last_failure: str = ""
    status: StatusResponse | None = None
    dataflow_status: dict[str, DataflowStatus] = field(default_factory=dict)
    session: Session | None = None
    # Why its answers are not trusted (its digest disagreed with a majority); None once
    # it agrees again. A diverged replica answers no read and is not in sync.
    diverged: str | None = None
    losing: LosingStreak | None = None  # the races it lost by far, in a row (gray failure)
    reported_slow: bool = False  # a `slow` event was recorded for the current stretch
    reconciled: tuple[int, int, int] = (0, 0, 0)  # (pid, kept, built) last reported
    resumes: int = 0  # incarnations brought up near-horizon (just the missed suffix)
    replays: int = 0  # incarnations brought up far-horizon (the reduced history)


@dataclass(slots=True)
class CollectionState:
    """A compute collection (an export of a dataflow) of this instance.

    Lifecycle of `holds`: `implied` from creation until the dataflow is dropped;
    `peek:<uuid>` while a peek is pending; `subscribe:<uuid>` while a subscription is
    open, at the last time it forwarded; `dataflow:<id>` while a dependent dataflow
    lives; `reserve:<token>` while a dependent is being recorded (`reserve`). The
    collection leaves the instance once its since is empty.
    """

    id: str
    dataflow: str  # the first export id of the dataflow that exports it
    as_of: Frontier
    compaction_window_ms: int
    write_frontier: Frontier  # W: the max over replicas
    since: Frontier
    holds: dict[str, Frontier] = field(default_factory=dict)
    # What replicas were told they may compact to: the since, once it is recorded.
    compaction_allowed: Frontier = field(default_factory=Frontier.minimum)


@dataclass(slots=True)
class DataflowState:
    desc: DataflowDescription
    compaction_window_ms: int
    export_ids: tuple[str, ...]  # desc.export_ids, computed once: holds are recomputed often
    scheduled: bool = False
    input_holds: dict[str, Frontier] = field(default_factory=dict)  # import id -> hold
    # Recovered: its input holds stay where the catalog had them (where its slowest
    # replica stood) until every replica reported it, or until this time.
    replicas_awaited_until_ms: int | None = None


@dataclass(slots=True)
class PendingPeek:
    """A peek no one has answered yet.

    Lifecycle of `errors`: replica name -> (its epoch, the message) of each `PeekError`
    answer, added as they come. An entry of an earlier epoch (epoch 0 once the replica
    was dropped) no longer stands for that replica's answer (its next incarnation gets
    the peek again), but still names it in the error that answers the peek.
    """

    peek: Peek
    issued_ms: int
    errors: dict[str, tuple[int, str]] = field(default_factory=dict)


@dataclass(slots=True)
class SubscriptionState:
    """An open subscription. `frontier`: every change at a time below it was forwarded
    (`as_of` at first with a snapshot, as the snapshot is the changes at `as_of`;
    `as_of + 1` without). Its index is held at `hold()`, the last forwarded time.

    Lifecycle of `errors`: replica name -> (its epoch, the message) of each replica that
    reported it cannot serve the subscription; the subscription ends once every active
    replica has, in its current incarnation.
    """

    command: Subscribe
    frontier: int
    errors: dict[str, tuple[int, str]] = field(default_factory=dict)

    def hold(self) -> Frontier:
        return Frontier(max(self.frontier - 1, self.command.as_of))

    def resend(self) -> Subscribe:
        """The command that asks a replica for what is still to forward: as first sent
        until the snapshot is forwarded, then the changes after the last forwarded time."""
        command = self.command
        if self.frontier <= command.as_of:
            return command
        return Subscribe(command.uuid, command.id, self.frontier - 1, snapshot=False)


@dataclass(frozen=True, slots=True)
class Event:
    """Something an operator should see, at `at_ms` on the instance's clock. Kinds:
    `replica_failed`, `rehydrating` (a new session replays the history), `resumed`,
    `hydrated` (a replica computed a dataflow past its as_of), `reconciled` (a replica
    kept or rebuilt dataflows it had), `slow`, `dataflow_failed`, `diverged`, `agreed`
    (a diverged replica agrees again) and `arbitration` (settling a tie by recompute)."""

    at_ms: int
    kind: str
    message: str
    replica: str = ""


# --- The instance ---------------------------------------------------------------------


class ComputeInstance(InstanceHealth):
    """One compute instance: history, replicas, collections, peeks.

    Every public method returns the list of effects to carry out, in order.
    """

    def __init__(
        self, config: InstanceConfig, options: InstanceOptions = InstanceOptions(), parameters: ComputeParameters | None = None, now_ms: int = 0
    ) -> None:
        self.config = config
        self.options = options
        self.history = CommandHistory(recent=options.resume_window)
        self.replicas: dict[str, ReplicaState] = {}
        self.collections: dict[str, CollectionState] = {}
        self.dataflows: dict[str, DataflowState] = {}  # first export id -> dataflow
        # Live (not dropped) dataflow name -> first export id, so a peek by name needs no
        # catalog read. A dropped dataflow leaves at once, though it lingers in
        # `dataflows` while peeks still hold it.
        self.names: dict[str, str] = {}
        self.peeks: dict[str, PendingPeek] = {}
        self.late_peek_responses = 0
        self.subscriptions: dict[str, SubscriptionState] = {}
        # Changes of a time some replica had forwarded already, dropped (one per time).
        self.subscribe_duplicates = 0
        # The clock starts where the driver is: a replica added before the first tick
        # would otherwise look silent since 1970 and fail at that tick.
        self.now_ms = now_ms
        # Dataflow key -> version time -> replica -> its digest (the latest few times).
        self.digests: dict[str, dict[int, dict[str, str]]] = {}
        self.divergences = 0
        self.arbitrations: set[tuple[str, int]] = set()  # (dataflow key, time) being recomputed
        self.events: deque[Event] = deque(maxlen=EVENTS_KEPT)
        self.events_total = 0
        self.history.push(CreateInstance(config))
        if parameters is not None:
            self.history.push(UpdateConfiguration(parameters))
        self.history.push(InitializationComplete())

    # --- Sending ----------------------------------------------------------------------

    def _send(self, command: ComputeCommand) -> list[Effect]:
        """Record `command` in the history, then fan it out to connected replicas."""
        self.history.push(command)
        return [Send(r.name, r.epoch, (command,)) for r in self.replicas.values() if r.phase == "active"]

    # --- Replicas ---------------------------------------------------------------------

    def add_replica(self, name: str, incarnation: int = 1) -> list[Effect]:
        """Add replica `name`, to connect as `incarnation`: a replica recovered after a
        controller restart goes on from its recorded one (its number fell back to 1)."""
        if name in self.replicas:
            raise InstanceError("ALREADY_EXISTS", f"replica {name!r} already exists in instance {self.config.name!r}")
        # The order fewer replicas take (the cheapest first on a tie), so that replicas
        # take opposite orders however many were dropped: the first answer to each
        # dataflow then comes from whichever reaches it first.
        costliest = sum(r.costliest_first for r in self.replicas.values())
        replica = ReplicaState(name, epoch=incarnation, last_heard_ms=self.now_ms, costliest_first=2 * costliest < len(self.replicas))
        self.replicas[name] = replica
        return [Connect(name, incarnation, costliest_first=replica.costliest_first)]

    def check_drop_replica(self, name: str, *, force: bool = False) -> None:
        """Raise unless `drop_replica(name, force=force)` would be accepted: unforced, an
        in-sync replica may go only if `min_in_sync` others stay in sync.

        What counts is being in sync for every dataflow *some* replica serves
        (`ReplicaHealth.in_sync_where_served`): a dataflow that failed on every replica
        (or is not hydrated anywhere yet) would otherwise put every replica out of sync,
        and the guard would let the last replicas serving everything else go unforced."""
        self._replica(name)
        health = {h.name: h for h in self.health()}
        remaining = sum(1 for h in health.values() if h.in_sync_where_served and h.name != name)
        if not force and self.options.min_in_sync > 0 and remaining < self.options.min_in_sync and health[name].in_sync_where_served:
            raise InstanceError(
                "FAILED_PRECONDITION",
                f"dropping replica {name!r} would leave {remaining} in-sync replica(s), below "
                f"min_in_sync = {self.options.min_in_sync}; add a replica first or pass force",
            )

    def drop_replica(self, name: str, *, force: bool = False) -> list[Effect]:
        self.check_drop_replica(name, force=force)
        replica = self.replicas.pop(name)
        for pending in self.peeks.values():
            if name in pending.errors:  # epoch 0: no answer of a replica added later as `name`
                pending.errors[name] = (0, pending.errors[name][1])
        # maintain: its holds go, and peeks it was the last hope for are answered.
        return [Disconnect(name, replica.epoch), *self.maintain()]

    def replica_connected(self, name: str, epoch: int, nonce: str, resumed: bool = False, applied: int = 0) -> list[Effect]:
        """The driver's connection of `epoch` (opened with `nonce`) is up: the replica
        `resumed` the session offered in `Connect` after receiving `applied` of its
        commands, or started a new one. Send it what it lacks."""
        replica = self.replicas.get(name)
        if replica is None or replica.epoch != epoch or replica.phase != "connecting":
            return []
        if resumed:
            return self._resume(replica, nonce, applied)
        replica.phase = "active"
        replica.last_heard_ms = self.now_ms
        replica.replays += 1
        # The history itself is not reduced here: that would move its horizon under
        # other replicas whose resumes are in flight.
        replay = reduce_commands(self.history.commands)
        replica.session = Session(nonce, self.history.position, len(replay))
        replica.as_ofs, replica.given_ms, replica.hydration_ms = {}, {}, {}
        self._event("rehydrating", f"replica {name} (incarnation {epoch}) starts a new session: replaying {len(replay)} commands", replica=name)
        self._note_as_ofs(replica, replay)
        # The old session's frontiers held its inputs for a resume that did not come.
        # (The new session holds them at its as_ofs until it reports.)
        replica.frontiers.clear()
        return [Send(name, epoch, tuple(replay))]

    def _resume(self, replica: ReplicaState, nonce: str, applied: int) -> list[Effect]:
        session = replica.session
        position = None if session is None else session.position(applied)
        suffix = None if position is None else self.history.suffix_since(position)
        if session is None or suffix is None:
            # Not offered, or the missed commands left the resume window after the
            # offer: the next incarnation starts a new session.
            replica.session = None
            return self.replica_failed(replica.name, replica.epoch, f"cannot resume its session after {applied} commands")
        # Answers in flight on the broken stream are lost: send the pending peeks it had
        # again (it answers each once more; one it still works on is not restarted), and
        # each open subscription again from what was forwarded (it reports from there).
        in_suffix = {c.uuid for c in suffix if isinstance(c, (Peek, Subscribe))}
        resent: list[ComputeCommand] = [p.peek for p in self.peeks.values() if p.peek.uuid not in in_suffix]
        resent += [s.resend() for s in self.subscriptions.values() if s.command.uuid not in in_suffix]
        replica.phase = "active"
        replica.last_heard_ms = self.now_ms
        replica.resumes += 1
        # The resent peeks are commands the history does not count: re-base the mapping
        # on where the suffix starts, so that a session cut again partway through it can
        # still resume.
        session.nonce, session.detached_ms = nonce, None
        session.replay_position, session.replay_length = position, applied + len(resent)
        self._note_as_ofs(replica, suffix)
        commands = (*resent, *suffix)
        self._event(
            "resumed",
            f"replica {replica.name} (incarnation {replica.epoch}) resumed its session after {applied} commands; {len(commands)} sent",
            replica=replica.name,
        )
        return [Send(replica.name, replica.epoch, commands)] if commands else []

    def _note_as_ofs(self, replica: ReplicaState, commands: Iterable[ComputeCommand]) -> None:
        for command in commands:
            if isinstance(command, CreateDataflow):
                for id in command.desc.export_ids:
                    replica.as_ofs[id] = command.desc.as_of
                    replica.given_ms[id] = self.now_ms

    def replica_failed(self, name: str, epoch: int, reason: str) -> list[Effect]:
        """A broken stream, a refused send or `Hello`, or silence: rehydrate the replica
        as a new incarnation (epoch + 1), which offers to resume its session. It connects
        at once after a first failure, and backs off after more in a row
        (`InstanceOptions.retry_delay_ms`), so that a replica that keeps refusing or
        dying is not retried in a hot loop.

        While that offer stands, the replica's write frontiers keep holding its inputs:
        a resumed session carries on from them and must still find its inputs readable.
        They are forgotten (and the holds released) when a new session starts instead, or
        when the offer expires after `replica_timeout_ms` (see `tick`)."""
        replica = self.replicas.get(name)
        if replica is None or replica.epoch != epoch:
            return []
        replica.failures += 1
        replica.consecutive_failures += 1
        replica.retry_at_ms = self.now_ms + self.options.retry_delay_ms(replica.consecutive_failures)
        replica.in_sync_since_ms = replica.losing = None
        replica.last_failure = reason
        self._event(
            "replica_failed",
            f"replica {name} (incarnation {epoch}) failed: {reason}; next attempt in {replica.retry_at_ms - self.now_ms} ms",
            replica=name,
        )
        if replica.session is None:
            replica.frontiers.clear()
        elif replica.phase == "active":
            replica.session.detached_ms = self.now_ms
        replica.phase = "failed"
        replica.status = None
        replica.dataflow_status = {}
        return [Disconnect(name, epoch), *self.maintain()]

    def _replica(self, name: str) -> ReplicaState:
        replica = self.replicas.get(name)
        if replica is None:
            raise InstanceError("NOT_FOUND", f"no replica {name!r} in instance {self.config.name!r}")
        return replica

    # --- Responses --------------------------------------------------------------------

    def handle_response(self, name: str, epoch: int, response: ComputeResponse) -> list[Effect]:
        """Apply one response from replica `name`'s connection of `epoch`; responses of
        an earlier incarnation are ignored."""
        replica = self.replicas.get(name)
        if replica is None or replica.epoch != epoch or replica.phase != "active":
            return []
        replica.last_heard_ms = self.now_ms
        if isinstance(response, FrontiersResponse):
            return self._frontiers(replica, response)
        if isinstance(response, PeekResponse):
            return self._peek_response(replica, response)
        if isinstance(response, SubscribeResponse):
            return self._subscribe_response(replica, response)
        self._note_status(replica, response)
        replica.status = response
        replica.dataflow_status = {d.id: d for d in response.dataflows}
        effects: list[Effect] = []
        for status in response.dataflows:
            if status.digest_time is not None and status.digest and status.id in self.dataflows:
                effects += self._compare_digests(replica, status.id, status.digest_time, status.digest)
        # A dataflow reported failed answers no read: peeks that waited for this replica
        # may now be answered by errors.
        if any(d.error is not None for d in response.dataflows):
            effects += self._answer_failed_peeks()
        stuck = [d for d in response.dataflows if d.needs_new_session is not None and d.id in self.dataflows]
        if stuck and replica.phase == "active":
            # Its inputs were compacted past it (it fell behind what the holds keep for
            # it): no retry of this session can go on, a new one rebuilds at the sinces.
            name = self.dataflows[stuck[0].id].desc.name
            replica.session = None
            effects += self.replica_failed(replica.name, replica.epoch, f"dataflow {name} cannot go on: {stuck[0].needs_new_session}")
        return effects

    def _note_status(self, replica: ReplicaState, response: StatusResponse) -> None:
        """Events for what a status report shows changed: dataflows kept or rebuilt by
        reconciliation (its process's counters; a new process starts from zero), and
        dataflows that failed. The first report this instance has of a replica is the
        baseline: its counters say what its process did before (for a controller just
        restarted, what the previous controller's sessions did), which a `reconciled`
        event would have told as news, and then again as the reconciliation's. (A
        replica sends its first status as it acknowledges the `Hello`, before the replay
        it reconciles with can reach it.)"""
        pid, kept, built = replica.reconciled
        new_process = response.pid != pid
        if not pid:
            kept, built = response.dataflows_kept, response.dataflows_built
        elif new_process:
            kept = built = 0
        if response.dataflows_kept > kept or response.dataflows_built > built:
            what = f"replica {replica.name} kept {response.dataflows_kept - kept} and built {response.dataflows_built - built} dataflows"
            self._event("reconciled", what + (" since its process started" if new_process else ""), replica=replica.name)
        replica.reconciled = (response.pid, response.dataflows_kept, response.dataflows_built)
        for status in response.dataflows:
            before = replica.dataflow_status.get(status.id)
            if status.error is not None and status.id in self.dataflows and (before is None or before.error != status.error):
                name = self.dataflows[status.id].desc.name
                self._event("dataflow_failed", f"dataflow {name} failed on replica {replica.name}: {status.error}", replica=replica.name)

    def _compare_digests(self, replica: ReplicaState, key: str, time: int, digest: str) -> list[Effect]:
        """Record `replica`'s digest of dataflow `key`'s version at `time` and compare it
        with the other replicas' for that time. Where they differ and a strict majority
        agrees, each replica outside it has diverged: it answers no read from then on
        and is rehydrated (a new session), until it agrees with the others again.
        Without a majority (two replicas), once every active replica has reported that
        time, the version is recomputed from storage (`Arbitrate`) to decide."""
        versions = self.digests.setdefault(key, {})
        reports = versions.setdefault(time, {})
        if reports.get(replica.name) == digest:
            return []
        reports[replica.name] = digest
        self._forget_old_digests(key)
        reports = {name: d for name, d in reports.items() if name in self.replicas}
        name = self.dataflows[key].desc.name
        if len(reports) < 2:
            return []
        majority, votes = Counter(reports.values()).most_common(1)[0]
        if len(set(reports.values())) == 1:
            for agreeing in sorted(reports):
                if self.replicas[agreeing].diverged is not None:
                    self.replicas[agreeing].diverged = None
                    self._event("agreed", f"replica {agreeing} agrees with the others again on dataflow {name} at {time}", replica=agreeing)
            return []
        if votes * 2 <= len(reports):
            if len(reports) < sum(r.phase == "active" for r in self.replicas.values()):
                return []  # another replica's report may yet make a majority
            if (key, time) in self.arbitrations:
                return []
            self.arbitrations.add((key, time))
            self._event(
                "arbitration",
                f"replicas disagree on dataflow {name} at {time} with no majority: {dict(sorted(reports.items()))}; "
                "recomputing that version from storage",
                divergence=True,
            )
            return [Arbitrate(key, time)]
        return self._distrust(key, time, majority, f"{votes} of {len(reports)} replicas have {majority}")

    def arbitrated(self, key: str, time: int, digest: str | None, why: str = "") -> list[Effect]:
        """The digest of a fresh recompute of dataflow `key`'s version at `time` from
        storage (an `Arbitrate`), or None and `why` it could not be made: a replica
        that reported another digest for that time is distrusted, as a minority is."""
        self.arbitrations.discard((key, time))
        dataflow = self.dataflows.get(key)
        if dataflow is None:
            return []
        if digest is None:
            self._event("arbitration", f"could not recompute dataflow {dataflow.desc.name} at {time} to settle a disagreement: {why}")
            return []
        reports = {n: d for n, d in self.digests.get(key, {}).get(time, {}).items() if n in self.replicas}
        if digest not in reports.values():
            self._event("arbitration", f"no replica matches a fresh recompute of dataflow {dataflow.desc.name} at {time} ({digest})")
        # The disagreement was counted when it was found.
        effects = self._distrust(key, time, digest, f"a fresh recompute from storage has {digest}", counted=True)
        self._forget_old_digests(key)
        return effects

    def _forget_old_digests(self, key: str) -> None:
        """Keep the digests of dataflow `key`'s newest `DIGEST_TIMES_KEPT` times, and of
        every time whose recompute from storage has not answered yet: replicas may report
        many newer times while it runs, and its answer must still find who disagreed."""
        versions = self.digests.get(key, {})
        undisputed = sorted(t for t in versions if (key, t) not in self.arbitrations)
        for time in undisputed[: max(0, len(undisputed) - DIGEST_TIMES_KEPT)]:
            del versions[time]

    def _distrust(self, key: str, time: int, right: str, because: str, *, counted: bool = False) -> list[Effect]:
        """Every replica whose digest of `key` at `time` is not `right` has diverged: it
        answers no read and is rehydrated (a new session computes everything again).
        Each is counted as a divergence unless `counted` already."""
        name = self.dataflows[key].desc.name
        effects: list[Effect] = []
        for dissenter, theirs in sorted(self.digests.get(key, {}).get(time, {}).items()):
            other = self.replicas.get(dissenter)
            if other is None or theirs == right or other.diverged is not None:
                continue
            other.diverged = f"dataflow {name} at {time}: digest {theirs}, {because}"
            self._event("diverged", f"replica {dissenter} diverged on {other.diverged}; rehydrating it", replica=dissenter, divergence=not counted)
            if other.phase == "active":
                other.session = None
                effects += self.replica_failed(dissenter, other.epoch, f"diverged on {other.diverged}")
        return effects

    def note(self, kind: str, message: str, replica: str = "") -> list[Effect]:
        """Record an event seen outside the instance (a replica added or dropped, a
        controller taking over), in order with the instance's own."""
        self._event(kind, message, replica=replica)
        return []

    def _event(self, kind: str, message: str, *, replica: str = "", divergence: bool = False) -> None:
        """Note something an operator should see (status; the driver logs and records it)."""
        self.divergences += divergence
        self.events.append(Event(self.now_ms, kind, message, replica))
        self.events_total += 1

    def _frontiers(self, replica: ReplicaState, response: FrontiersResponse) -> list[Effect]:
        collection = self.collections.get(response.id)
        if collection is None:
            return []
        known = replica.frontiers.get(response.id, Frontier.minimum())
        if response.write_frontier <= known:
            return []  # a regression (or a repeat) is ignored
        replica.frontiers[response.id] = response.write_frontier
        collection.write_frontier = collection.write_frontier.join(response.write_frontier)
        given = replica.given_ms.get(response.id)
        if given is not None and response.id not in replica.hydration_ms and self.hydrated(replica, response.id):
            replica.hydration_ms[response.id] = self.now_ms - given
            dataflow = self.dataflows.get(collection.dataflow)
            if dataflow is not None and response.id == collection.dataflow:  # once per dataflow, not per export
                # "Serves", not "hydrated": a dataflow reconciliation kept serves at once.
                what = f"replica {replica.name} serves dataflow {dataflow.desc.name}, {self.now_ms - given} ms after it was given it"
                self._event("hydrated", what, replica=replica.name)
        # W moves c's implied hold; the replica's frontier moves its dataflow's input holds.
        return self._update_holds([collection.id], [collection.dataflow])

    def _peek_response(self, replica: ReplicaState, response: PeekResponse) -> list[Effect]:
        pending = self.peeks.get(response.uuid)
        if pending is None or isinstance(response.result, PeekCanceled):
            self.late_peek_responses += pending is None
            return []
        if isinstance(response.result, PeekError):
            pending.errors[replica.name] = (replica.epoch, response.result.message)
            return self._answer_failed_peeks([response.uuid])
        if replica.diverged is not None:
            return []  # its rows are not trusted: another replica answers
        replica.peeks_won += 1
        self._note_race(pending.peek, replica)
        return self._finish_peek(response.uuid, response.result, replica.name)

    def _subscribe_response(self, replica: ReplicaState, response: SubscribeResponse) -> list[Effect]:
        subscription = self.subscriptions.get(response.uuid)
        if subscription is None or replica.diverged is not None:
            return []  # canceled meanwhile, or its changes are not trusted
        if response.error is not None:
            subscription.errors[replica.name] = (replica.epoch, response.error)
            return self._end_failed_subscription(response.uuid)
        forwarded = subscription.frontier
        if response.upper <= forwarded:
            self.subscribe_duplicates += len(response.changes)
            return []
        if response.lower > forwarded:
            return []  # it cannot say what changed from `forwarded` on: another replica will
        fresh = tuple(c for c in response.changes if c.time >= forwarded)
        self.subscribe_duplicates += len(response.changes) - len(fresh)
        subscription.frontier = response.upper
        id = subscription.command.id
        self.collections[id].holds[f"subscribe:{response.uuid}"] = subscription.hold()
        return [SubscribeForward(response.uuid, fresh, response.upper - 1)] + self._update_holds([id], ())

    def _end_failed_subscription(self, uuid: str) -> list[Effect]:
        """End subscription `uuid` if every active replica reported, in its current
        incarnation, that it cannot serve it; naming each replica's error."""
        errors = self.subscriptions[uuid].errors
        active = [r for r in self.replicas.values() if r.phase == "active"]
        if any(errors.get(r.name, (0, ""))[0] != r.epoch for r in active):
            return []
        message = "; ".join(f"replica {name}: {error}" for name, (_, error) in sorted(errors.items()))
        return self._end_subscription(uuid, "FAILED_PRECONDITION", message)

    def _end_subscription(self, uuid: str, code: str, message: str) -> list[Effect]:
        return [SubscribeEnded(uuid, code, message)] + self.cancel_subscribe(uuid)

    def _peek_failure(self, pending: PendingPeek) -> str | None:
        """The error that answers `pending` now, naming each replica and its error; None
        while an active replica may still answer with rows: one that has neither
        answered this peek with an error in its current incarnation nor reports a
        target's dataflow failed. Failed, connecting and dropped replicas do not count
        (a replica that becomes active gets the peek through the history), but the
        errors they answered are named."""
        errors = {name: message for name, (_, message) in pending.errors.items()}
        for replica in self.replicas.values():
            if replica.phase != "active":
                continue
            answered = pending.errors.get(replica.name)
            if answered is not None and answered[0] == replica.epoch:
                continue
            if replica.diverged is not None:
                errors[replica.name] = f"diverged on {replica.diverged}"
                continue
            failed = self._target_failure(replica, pending.peek.target)
            if failed is None:
                return None
            errors[replica.name] = failed
        return "; ".join(f"replica {name}: {message}" for name, message in sorted(errors.items())) or None

    def _target_failure(self, replica: ReplicaState, target: PeekTarget) -> str | None:
        """Why `replica` can only answer a read of `target` with an error: it reports a
        target's dataflow failed (worded as the replica words its peek errors)."""
        for id in target.collection_ids:
            key = self.collections[id].dataflow
            error = self._dataflow_error(replica, key)
            if error is not None:
                return f"dataflow {self.dataflows[key].desc.name} failed: {error}"
        return None

    def _answer_failed_peeks(self, uuids: Iterable[str] | None = None) -> list[Effect]:
        """Answer each pending peek of `uuids` (None: all) that only errors can answer."""
        effects: list[Effect] = []
        for uuid in list(self.peeks if uuids is None else uuids):
            pending = self.peeks.get(uuid)
            failure = None if pending is None else self._peek_failure(pending)
            if failure is not None:
                effects += self._finish_peek(uuid, PeekError(failure), None)
        return effects

    def _finish_peek(self, uuid: str, result: PeekResult, replica: str | None) -> list[Effect]:
        """Answer, then cancel everywhere, then release the read holds: in that order."""
        pending = self.peeks.pop(uuid)
        effects: list[Effect] = [PeekDone(uuid, result, replica)]
        effects += self._send(CancelPeek(uuid))
        targets = pending.peek.target.collection_ids
        for id in targets:
            self.collections[id].holds.pop(f"peek:{uuid}", None)
        return effects + self._update_holds(targets, ())

    # --- Client commands --------------------------------------------------------------

    def reserve(self, token: str, ids: Iterable[str], at_least: Frontier) -> Frontier:
        """Hold compute collections `ids` readable from the time returned on, for a
        dataflow about to be recorded: the join of `at_least` and their sinces. While the
        reservation stands their sinces cannot pass that time, so a `create_dataflow` at
        it cannot be refused for compaction after the catalog recorded it. Refused
        (NOT_FOUND) for a collection that is not live."""
        ids = list(ids)
        as_of = at_least
        for id in ids:
            collection = self._collection(id)
            if collection.since.is_empty:
                raise InstanceError("NOT_FOUND", f"collection {id} has been dropped")
            as_of = as_of.join(collection.since)
        for id in ids:
            self.collections[id].holds[f"reserve:{token}"] = as_of
        return as_of

    def release_reservation(self, token: str) -> list[Effect]:
        """End reservation `token` (see `reserve`)."""
        held = [id for id, c in self.collections.items() if c.holds.pop(f"reserve:{token}", None) is not None]
        return self._update_holds(held, ())

    def create_dataflow(
        self, desc: DataflowDescription, compaction_window_ms: int = 0, sinces: Mapping[str, Frontier] | None = None
    ) -> list[Effect]:
        """Add a dataflow. Preconditions (checked): its export ids are new, its index
        imports are live collections of this instance readable at `as_of`. Its storage
        imports are held at `as_of` already: `Catalog.create_dataflow` took those holds
        with the record; the instance moves them on (`StorageHold`).

        `sinces` restores, after a controller restart, each export's recorded since: the
        dataflow comes back at one `as_of` (the meet), but an export that surviving
        replicas already compacted further must not be read below its own since."""
        for id in desc.export_ids:
            if id in self.collections:
                raise InstanceError("ALREADY_EXISTS", f"collection {id} already exists in instance {self.config.name!r}")
        for source in desc.imports:
            if source.kind == "index":
                upstream = self.collections.get(source.id)
                if upstream is None:
                    raise InstanceError("NOT_FOUND", f"index {source.id} ({source.name}) is not in instance {self.config.name!r}")
                if not (upstream.since <= desc.as_of):
                    raise InstanceError("FAILED_PRECONDITION", f"index {source.name} is compacted to {upstream.since}, past as_of {desc.as_of}")
        if desc.name in self.names:
            raise InstanceError("ALREADY_EXISTS", f"a dataflow named {desc.name!r} already exists in instance {self.config.name!r}")
        key = desc.export_ids[0]
        dataflow = DataflowState(desc, compaction_window_ms, desc.export_ids)
        if sinces is not None and desc.reads_storage_only:  # as `catalog._recovery` lowers it
            dataflow.replicas_awaited_until_ms = self.now_ms + self.options.replica_timeout_ms
        self.dataflows[key] = dataflow
        self.names[desc.name] = key
        for id in desc.export_ids:
            implied = desc.as_of.join((sinces or {}).get(id, desc.as_of))
            self.collections[id] = CollectionState(
                id,
                key,
                desc.as_of,
                compaction_window_ms,
                write_frontier=desc.as_of,
                since=desc.as_of,
                holds={"implied": implied},
                compaction_allowed=desc.as_of,
            )
        for source in desc.imports:
            dataflow.input_holds[source.id] = desc.as_of
            if source.kind == "index":
                self.collections[source.id].holds[f"dataflow:{key}"] = desc.as_of
        effects = self._send(CreateDataflow(desc))
        # A restored since is on record already: replicas (a surviving one reconciling
        # its kept arrangements too) may be compacted to it at once.
        for id, since in (sinces or {}).items():
            if desc.as_of < since:
                effects += self._allow_compaction(self.collections[id], since)
        for replica in self.replicas.values():
            if replica.phase == "active":
                self._note_as_ofs(replica, [CreateDataflow(desc)])
        return effects + self.maintain()

    def check_drop_dataflow(self, id: str) -> None:
        """Raise unless `drop_dataflow(id)` would be accepted."""
        dataflow = self.dataflows.get(id)
        if dataflow is None:
            raise InstanceError("NOT_FOUND", f"no dataflow {id} in instance {self.config.name!r}")
        dependents = [
            d.desc.name
            for k, d in self.dataflows.items()
            if k != id
            and any(i.id in dataflow.export_ids for i in d.desc.imports)
            and any("implied" in self.collections[e].holds for e in d.export_ids)  # not dropped itself
        ]
        if dependents:
            raise InstanceError("FAILED_PRECONDITION", f"dataflow {dataflow.desc.name} is used by {', '.join(sorted(dependents))}; drop those first")

    def drop_dataflow(self, id: str) -> list[Effect]:
        """Release the dataflow's implied holds; it vanishes once nothing else holds it."""
        self.check_drop_dataflow(id)
        dataflow = self.dataflows[id]
        if self.names.get(dataflow.desc.name) == id:
            del self.names[dataflow.desc.name]
        for export_id in dataflow.export_ids:
            self.collections[export_id].holds.pop("implied", None)
        effects: list[Effect] = []
        for uuid, subscription in list(self.subscriptions.items()):
            if subscription.command.id in dataflow.export_ids:
                effects += self._end_subscription(uuid, "NOT_FOUND", f"dataflow {dataflow.desc.name} was dropped")
        return effects + self.maintain()

    def dataflow_named(self, name: str) -> DataflowState:
        """The live dataflow called `name`; NOT_FOUND once it has been dropped."""
        key = self.names.get(name)
        if key is None:
            raise InstanceError("NOT_FOUND", f"instance {self.config.name!r} has no dataflow named {name!r}")
        return self.dataflows[key]

    def update_configuration(self, parameters: ComputeParameters) -> list[Effect]:
        return self._send(UpdateConfiguration(parameters))

    def readable_time(self, id: str) -> int:
        """The serializable read time of `id`: the largest it can serve now (`W - 1`),
        but not below `since`."""
        collection = self._collection(id)
        if collection.since.is_empty:
            raise InstanceError("NOT_FOUND", f"collection {id} has been dropped")
        write = collection.write_frontier
        # A closed collection (empty W) reads the same at every time from its since on.
        return collection.since.time if write.is_empty else max(write.step_back().time, collection.since.time)

    def peek(self, peek: Peek) -> list[Effect]:
        """Issue a peek. Preconditions (checked): every target is readable at its time,
        and not every active replica reports a target's dataflow failed (that read could
        only fail: it is refused at once, naming each replica's error)."""
        if peek.uuid in self.peeks:
            raise InstanceError("ALREADY_EXISTS", f"peek {peek.uuid} is already pending")
        for id in peek.target.collection_ids:
            collection = self._collection(id)
            if collection.since.is_empty or peek.timestamp < collection.since.time:
                raise InstanceError(
                    "FAILED_PRECONDITION", f"cannot read {id} at {peek.timestamp}: it is compacted to since {collection.since}"
                )
        pending = PendingPeek(peek, self.now_ms)
        failure = self._peek_failure(pending)
        if failure is not None:
            raise InstanceError("FAILED_PRECONDITION", failure)
        for id in peek.target.collection_ids:
            self.collections[id].holds[f"peek:{peek.uuid}"] = Frontier(peek.timestamp)
        self.peeks[peek.uuid] = pending
        return self._send(peek)

    def cancel_peek(self, uuid: str, reason: str) -> list[Effect]:
        """Give up on a pending peek (the client's deadline passed): answer it with an
        error; a replica's answer after this is a late response."""
        if uuid not in self.peeks:
            return []
        return self._finish_peek(uuid, PeekError(reason), None)

    def subscribe(self, command: Subscribe) -> list[Effect]:
        """Open a subscription to index export `command.id`. Preconditions (checked): it
        is a live index of this instance, readable at `as_of`, and the uuid is new."""
        if command.uuid in self.subscriptions:
            raise InstanceError("ALREADY_EXISTS", f"subscription {command.uuid} is already open")
        collection = self._collection(command.id)
        if collection.since.is_empty or not any(e.id == command.id for e in self.dataflows[collection.dataflow].desc.index_exports):
            raise InstanceError("NOT_FOUND", f"no index {command.id} in instance {self.config.name!r}")
        if command.as_of < collection.since.time:
            raise InstanceError(
                "FAILED_PRECONDITION",
                f"cannot subscribe to {command.id} as of {command.as_of}: its since is {collection.since.time} (times before it were compacted away)",
            )
        subscription = SubscriptionState(command, command.as_of if command.snapshot else command.as_of + 1)
        self.subscriptions[command.uuid] = subscription
        collection.holds[f"subscribe:{command.uuid}"] = subscription.hold()
        return self._send(command)

    def cancel_subscribe(self, uuid: str) -> list[Effect]:
        """Close subscription `uuid` (the client went away): replicas stop reporting it and
        its hold is released. Closing one that is not open does nothing."""
        subscription = self.subscriptions.pop(uuid, None)
        if subscription is None:
            return []
        id = subscription.command.id
        self.collections[id].holds.pop(f"subscribe:{uuid}", None)
        return self._send(CancelSubscribe(uuid)) + self._update_holds([id], ())

    def _collection(self, id: str) -> CollectionState:
        collection = self.collections.get(id)
        if collection is None:
            raise InstanceError("NOT_FOUND", f"no collection {id} in instance {self.config.name!r}")
        return collection

    def _holder(self, dataflow: str) -> str:
        return dataflow_holder(self.config.name, dataflow)

    # --- Time -------------------------------------------------------------------------

    def tick(self, now_ms: int) -> list[Effect]:
        """Advance the clock: replicas silent past `replica_timeout_ms` have failed;
        replicas held back past `max_hold_back_ms` are rehydrated; resume offers expire;
        replicas in sync (where served) for `stable_ms` have their consecutive failures
        forgotten; failed replicas whose retry time passed connect again.

        Stability counts from being in sync, not from connecting: a replica whose
        hydration outlasted `stable_ms` had its failures forgotten while still hydrating,
        its hold-back bound fell back to `max_hold_back_ms`, and it was evicted again and
        again."""
        self.now_ms = max(self.now_ms, now_ms)
        effects: list[Effect] = []
        # Only a replica with failures to forget needs its time in sync tracked.
        recovering = any(r.phase == "active" and r.consecutive_failures for r in self.replicas.values())
        excused = self._unservable() if recovering else {}
        for replica in list(self.replicas.values()):
            silent = self.now_ms - replica.last_heard_ms
            session = replica.session
            if replica.phase == "active":
                held_back = self._held_back(replica)
                if silent > self.options.replica_timeout_ms:
                    effects += self.replica_failed(replica.name, replica.epoch, f"no message for {silent} ms")
                elif held_back is not None:
                    # A new session, not a resume: the old one would hold the inputs again.
                    replica.session = None
                    effects += self.replica_failed(replica.name, replica.epoch, held_back)
                elif self.options.replace_slow and self._slow(replica):
                    why = self._slowness(replica)
                    replica.session = None
                    effects += self.replica_failed(replica.name, replica.epoch, f"slow: {why}")
                elif replica.consecutive_failures:
                    self._count_stability(replica, excused)
                slow = self._slow(replica)
                if slow and not replica.reported_slow:
                    self._event("slow", f"replica {replica.name} is slow: {self._slowness(replica)}", replica=replica.name)
                replica.reported_slow = slow
            elif session is not None and session.detached_ms is not None:
                detached = self.now_ms - session.detached_ms
                if detached > self.options.replica_timeout_ms:
                    # Withdraw the resume offer, and with it the holds kept for that
                    # session (maintain releases them). An incarnation connecting with
                    # the offer fails; one still waiting to connect will offer none.
                    replica.session = None
                    if replica.phase == "connecting":
                        effects += self.replica_failed(replica.name, replica.epoch, f"did not resume its session within {detached} ms")
                    else:
                        replica.frontiers.clear()
        return effects + self.maintain()

    def _count_stability(self, replica: ReplicaState, excused: Collection[str]) -> None:
        """Track since when `replica` (active, with failures) has been in sync where
        served; after `stable_ms` its consecutive failures are forgotten."""
        if not self._in_sync(replica, excused):
            replica.in_sync_since_ms = None
        elif replica.in_sync_since_ms is None:
            replica.in_sync_since_ms = self.now_ms
        elif self.now_ms - replica.in_sync_since_ms >= self.options.stable_ms:
            replica.consecutive_failures = 0

    def _held_back(self, replica: ReplicaState) -> str | None:
        """Why `replica` holds compaction back too far, if it does: on some collection
        it reported a write frontier (or, not having reported, was given an as_of) more
        than `max_hold_back_ms` behind W, or W itself is that far behind the clock
        while it has not reported (a replica that ignored the dataflow).

        The bound doubles with each of the replica's consecutive failures, up to
        HOLD_BACK_DOUBLINGS times: a replica whose hydration takes longer than the bound
        was otherwise evicted again and again, never in sync (a drill on a slow day:
        8 evictions of an `xsmall` replica hydrating 7 dataflows under a 10 s bound)."""
        doublings = min(replica.consecutive_failures, HOLD_BACK_DOUBLINGS)
        limit = self.options.max_hold_back_ms << doublings
        for id, collection in self.collections.items():
            write = collection.write_frontier
            if collection.since.is_empty or write.is_empty:
                continue
            reported = replica.frontiers.get(id)
            if reported is not None:
                behind = 0 if reported.is_empty else write.time - reported.time
                what = f"it is {behind} ms behind W on {id}"
            elif id in replica.given_ms:
                behind = self.now_ms - replica.given_ms[id]
                what = f"it has not reported {id} for {behind} ms"
            else:
                continue
            if behind > limit:
                doubled = f", doubled for {doublings} consecutive failures" if doublings else ""
                return f"{what}, more than {limit} ms (max_hold_back_ms = {self.options.max_hold_back_ms}{doubled}): rehydrating it"
        return None

    # --- Maintenance ------------------------------------------------------------------

    def maintain(self) -> list[Effect]:
        """Idempotent steps that bring the instance to where its state says it should be."""
        effects: list[Effect] = []
        for step in (self._rehydrate_failed, self._answer_failed_peeks, self._update_holds, self._schedule, self._clean_up):
            effects += step()
        return effects

    def _rehydrate_failed(self) -> list[Effect]:
        """Connect the next incarnation of every failed replica whose retry time passed."""
        effects: list[Effect] = []
        for replica in self.replicas.values():
            if replica.phase == "failed" and replica.retry_at_ms <= self.now_ms:
                replica.epoch += 1
                replica.phase = "connecting"
                replica.last_heard_ms = self.now_ms
                effects.append(
                    Connect(
                        replica.name,
                        replica.epoch,
                        self._resume_offer(replica),
                        replica.consecutive_failures,
                        replica.costliest_first,
                    )
                )
        return effects

    def _resume_offer(self, replica: ReplicaState) -> Resume | None:
        """Resume the replica's session if it received every command before the history's
        horizon: the ones after it are still kept as pushed."""
        session = replica.session
        if session is None:
            return None
        before_horizon = max(0, self.history.horizon - session.replay_position)
        return Resume(session.nonce, session.replay_length + before_horizon)

    def _schedule(self) -> list[Effect]:
        effects: list[Effect] = []
        for key, dataflow in self.dataflows.items():
            if not dataflow.scheduled:
                dataflow.scheduled = True
                effects += self._send(Schedule(key))
        return effects

    def _clean_up(self) -> list[Effect]:
        """Forget dataflows whose every export has been compacted to the empty frontier."""
        effects: list[Effect] = []
        for key, dataflow in list(self.dataflows.items()):
            if all(self.collections[id].since.is_empty for id in dataflow.export_ids):
                del self.dataflows[key]
                self.digests.pop(key, None)
                for id in dataflow.export_ids:
                    del self.collections[id]
                    for replica in self.replicas.values():
                        replica.frontiers.pop(id, None)
                        replica.as_ofs.pop(id, None)
                        replica.given_ms.pop(id, None)
                        replica.hydration_ms.pop(id, None)
                for source in dataflow.desc.imports:
                    if source.kind == "storage":
                        effects.append(StorageHold(source.id, self._holder(key), Frontier.empty()))
                    elif source.id in self.collections:
                        self.collections[source.id].holds.pop(f"dataflow:{key}", None)
                        effects += self._update_holds([source.id], ())
        return effects

    def _update_holds(self, collections: Iterable[str] | None = None, dataflows: Iterable[str] | None = None) -> list[Effect]:
        """Forward implied holds, recompute sinces, and let inputs' holds follow, starting
        from `collections` and `dataflows` (None: all of them).

        A worklist run to a fixed point: a collection whose since advances dirties its
        dataflow (which holds its inputs at that since); a dataflow whose hold on an index
        advances dirties that index. Holds only move forward, so it ends. Callers name
        what their change can affect: a frontier report touches one collection and its
        dataflow, not the whole instance.
        """
        dirty_collections = dict.fromkeys(self.collections if collections is None else collections)
        dirty_dataflows = dict.fromkeys(self.dataflows if dataflows is None else dataflows)
        effects: list[Effect] = []
        while dirty_collections or dirty_dataflows:
            while dirty_collections:
                collection = self.collections.get(dirty_collections.popitem()[0])
                if collection is not None and self._advance_since(collection, effects):
                    dirty_dataflows[collection.dataflow] = None
            while dirty_dataflows:
                key = dirty_dataflows.popitem()[0]
                dataflow = self.dataflows.get(key)
                if dataflow is not None:
                    effects += self._forward_input_holds(key, dataflow, dirty_collections)
        return effects

    def _advance_since(self, collection: CollectionState, effects: list[Effect]) -> bool:
        """Forward `collection`'s implied hold to its W and its since to the meet of its
        holds; True (and the effects appended) iff the since advanced."""
        implied = collection.holds.get("implied")
        write = collection.write_frontier
        if implied is not None and not write.is_empty:
            collection.holds["implied"] = implied.join(write.step_back(1 + collection.compaction_window_ms))
        since = meet_all(collection.holds.values()).join(collection.since)
        if since == collection.since:
            return False
        collection.since = since
        if since.is_empty:  # dropped: the catalog recorded the drop before the instance saw it
            effects += self._allow_compaction(collection, since)
        else:
            effects.append(SinceAdvanced(collection.id, since))
        return True

    def sinces_recorded(self, sinces: Mapping[str, Frontier]) -> list[Effect]:
        """The sinces of one durable batch of `SinceAdvanced`s (collection id -> since):
        replicas may now compact there. A batch is one consistent cut of the instance
        (no upstream since past a dependent's), so compaction allowed batch by batch
        keeps the reduced history consistent for a replica replaying it. A collection
        gone meanwhile, or a since already allowed, needs nothing."""
        effects: list[Effect] = []
        moved = {}
        for id, since in sinces.items():
            collection = self.collections.get(id)
            if collection is not None and collection.compaction_allowed < since:
                effects += self._allow_compaction(collection, since)
                moved[collection.dataflow] = None
        return effects + self._update_holds((), moved)

    def _allow_compaction(self, collection: CollectionState, since: Frontier) -> list[Effect]:
        collection.compaction_allowed = since
        return self._send(AllowCompaction(collection.id, since))

    def _forward_input_holds(self, key: str, dataflow: DataflowState, dirty_collections: dict[str, None]) -> list[Effect]:
        """A dataflow holds its inputs at the since its replicas may compact it to (the
        recorded one: a replica replaying the history starts there), and each replica
        holds them at the last time it computed (its write frontier less one), so a
        replica that lags can still read what it needs: an incremental step at t after
        t' reads its inputs as of t' too (a join's other sides as they were). An index
        input whose hold moved is marked in `dirty_collections`.

        A recovered dataflow's holds wait for its replicas (`replicas_awaited_until_ms`):
        they join the new controller one by one, and a replica that lagged behind the
        since must find its inputs still readable where it stands, not moved up to the
        since (or to a faster replica's frontier) before it reported."""
        if dataflow.replicas_awaited_until_ms is not None:
            reported = all(any(id in r.frontiers for id in dataflow.export_ids) for r in self.replicas.values())
            if self.now_ms < dataflow.replicas_awaited_until_ms and not (self.replicas and reported):
                return []
            dataflow.replicas_awaited_until_ms = None
        hold = meet_all(self.collections[id].compaction_allowed for id in dataflow.export_ids)
        for replica in self.replicas.values():
            for id in dataflow.export_ids:
                if id in replica.frontiers:
                    hold = hold.meet(replica.frontiers[id].step_back(1))
                elif replica.session is not None:
                    # Not reported yet, by a live session or one that may resume: it
                    # starts at the as_of it was given (a resume's suffix gives the
                    # original one), which the input holds have not passed. Hold them
                    # there until it reports.
                    return []
        effects: list[Effect] = []
        for source in dataflow.desc.imports:
            current = dataflow.input_holds[source.id]
            new = current.join(hold)
            if new == current:
                continue
            dataflow.input_holds[source.id] = new
            if source.kind == "index":
                upstream = self.collections.get(source.id)
                if upstream is not None:
                    upstream.holds[f"dataflow:{key}"] = new
                    dirty_collections[source.id] = None
            else:
                effects.append(StorageHold(source.id, self._holder(key), new))
        return effects
