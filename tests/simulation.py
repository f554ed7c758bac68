"""A deterministic simulator for `ComputeInstance`: replicas, network, client and faults,
all driven by one seeded `random.Random`.

What is modelled:
- **Data.** One storage source (`u1`) whose contents at time t are the integers appended
  at every time <= t (the simulator appends at its own clock, and the source's upper is
  always `now + 1`). A dataflow's SQL is ignored: the rows of export `e` at time t are a
  fixed function of `e` and of its inputs' rows at t (`Reference`), so any correct replica
  answers a peek at t with exactly the reference answer at t, byte for byte.
- **Replicas** (`SimReplica`) apply each connection's commands in order to a
  `history.ReplicaModel`, reconcile on `InitializationComplete` (keep a running dataflow
  whose definition is identical and whose old `as_of` is not beyond the new one), then
  follow the model after every command. Dataflows hydrate after a delay, compute a version
  at `as_of` and at every later input change (times at or below `since` collapse into
  the latest one, as in `replica_service`), read imported indexes from their own retained
  versions (so a replica whose input was compacted too far computes a wrong version, and
  that is reported), report write frontiers (never regressing, never below `as_of`, one
  empty frontier after a drop), answer peeks once their frontier passes the peek time
  (`PeekError` below `since`), answer `CancelPeek` with `canceled` only if not yet
  answered, report each open subscription's changes per time from the versions they
  computed (starting where they can: past their own since; now and then in two
  reports), and send heartbeats.
- **Network.** One FIFO queue per direction per connection, with delays drawn from the
  seeded generator. A closed connection loses what is in flight.
- **Driver.** Carries out the effects: `Connect` (after a delay, retried while the replica
  is down or hung) then `replica_connected` with the replica's answer (it resumes the
  offered session when it still has it and has received enough of its commands, as in
  `replica_service`); `Send` onto the current connection of that
  epoch; `Disconnect`; `PeekDone` to the client; `StorageHold` and `SinceAdvanced` to a
  catalog record. A broken stream is reported with `replica_failed`.
- **Faults** (seeded): crash (state and connection lost, back after a while), hang (no
  messages at all, heartbeats included), slow (every delay 10x), duplicate responses,
  peek errors (for a while, half the peeks it answers get an error instead), refusals
  (it crashes, then refuses every `Hello` for a while, as a process that keeps dying at
  start-up or a fenced controller sees), late responses (what was in flight on a closed connection arrives after the reconnect,
  tagged with the old epoch) and controller restart (a new `ComputeInstance` rebuilt from
  the catalog record: live dataflows with `as_of` = their last recorded since, then the
  replicas, which keep their state and reconcile).
- **Client.** Creates dataflows (some importing other dataflows' indexes), peeks
  (serializable at `readable_time`, at explicit times, SQL over two indexes), drops,
  adds and drops replicas, subscribes and unsubscribes (after a controller restart it
  resumes every feed from its last progress), and tries refused commands, checking that
  a refusal changes nothing.

Checks (`Simulation.check()`, after every call into the instance; a failure raises
`SimulationFailure` naming the seed, the step and the invariant, with the recent events):
W, every replica's reported frontier and every since never regress (sinces across
controller restarts too); every since equals the meet of its holds; an input's since (or
storage hold) never passes the write frontier an active replica reported for a dataflow
reading it, nor the last time that replica computed it (its next step reads there
too); the history stays within twice the live bound at the last reduction, and its
reduction within `3 + pending peeks + open subscriptions + sum over dataflows of (1 +
exports)`; health is one of healthy/degraded/unavailable; a replica called hydrated has computed every live
dataflow; no replica ever computes from an over-compacted input or refuses a peek; every
answer equals the reference answer and no peek is answered twice; an error answers a peek
only if every active replica answered it with an error in its current incarnation, and
it names each replica that did; a feed delivers each time once, in order, and
consolidated through each progress it is the reference (less the contents at `as_of`
without a snapshot), across controller restarts too; no replica is connected more than
three times in any second (failed incarnations back off). At the end (`check_final`):
every open feed caught up with its index; every peek answered exactly once (none, for
peeks pending when the controller restarted: their client saw the connection fail), the
instance healthy, every replica connected at its epoch and running exactly the live
dataflows, and every storage hold of a forgotten dataflow released.

Nothing here reads a clock or global randomness: a seed replays exactly.
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import random
import zlib
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from controller._instance import (
    ComputeInstance,
    Connect,
    Disconnect,
    InstanceError,
    InstanceOptions,
    PeekDone,
    Send,
    SinceAdvanced,
    StorageHold,
    SubscribeEnded,
    SubscribeForward,
)
from history import (
    AllowCompaction,
    CancelPeek,
    ComputeCommand,
    ComputeParameters,
    ComputeResponse,
    CreateDataflow,
    CreateInstance,
    DataflowDescription,
    Frontier,
    FrontiersResponse,
    Import,
    IndexExport,
    IndexTarget,
    InstanceConfig,
    Peek,
    PeekCanceled,
    PeekError,
    PeekResponse,
    PeekRows,
    PeekTarget,
    ReplicaModel,
    Resume,
    Schedule,
    SqlTarget,
    StatusResponse,
    Subscribe,
    SubscribeChanges,
    SubscribeResponse,
    meet_all,
    reduce_commands,
)

SOURCE = "u1"
CONFIG = InstanceConfig.of("sim", {"spark.sql.shuffle.partitions": "2"})
EMPTY = Frontier.empty()
HEALTH_STATES = ("healthy", "degraded", "unavailable")
# With the default backoff (at once, then 500 ms, 1 s, ...), a replica that fails again
# and again connects at most three times in any second.
MAX_CONNECTS_PER_S = 3
_INFINITY = float("inf")


def _key(frontier: Frontier) -> float:
    """A frontier as a number (the empty frontier is infinity), for fast comparisons."""
    return _INFINITY if frontier.time is None else frontier.time


class SimulationFailure(AssertionError):
    """An invariant broke. The message names the seed, the step and the recent events."""


# --- Data -----------------------------------------------------------------------------


class Source:
    """The storage collection `u1`: integers appended at strictly increasing times.

    Its contents at time t are every value appended at a time <= t; its upper is the
    clock plus one (the advancer), so every time below the clock is complete.
    """

    def __init__(self) -> None:
        self.times: list[int] = []  # append times, strictly increasing
        self.ends: list[int] = []  # len(values) after each append
        self.values: list[int] = []
        self.upper = 0

    def append(self, time: int, values: list[int]) -> None:
        if time < self.upper:
            raise ValueError(f"append at {time} below the upper {self.upper}")
        self.times.append(time)
        self.values.extend(values)
        self.ends.append(len(self.values))
        self.upper = time + 1

    def advance(self, upper: int) -> None:
        self.upper = max(self.upper, upper)

    def version(self, time: int) -> int:
        """How many appends the contents at `time` hold: the version index at `time`."""
        return bisect.bisect_right(self.times, time)

    def rows(self, version: int) -> list[int]:
        return self.values[: self.ends[version - 1]] if version else []

    def change_times(self, after: int, before: int) -> list[int]:
        """Append times t with after < t < before."""
        lo = bisect.bisect_right(self.times, after)
        hi = bisect.bisect_left(self.times, before)
        return self.times[lo:hi]


def _coefficients(id: str) -> tuple[int, int]:
    crc = zlib.crc32(id.encode())
    return 1 + crc % 53, crc % 61


class Reference:
    """The reference answer: rows of every export at every source version.

    The rows of export `e` are the counts of `(x * a_e + b_e) % 61` over its inputs'
    values (the source's integers; an upstream index's rows `(k, n)` as `k * 1000 + n`),
    so they stay small and change whenever an input does.
    """

    def __init__(self, source: Source) -> None:
        self.source = source
        self.descs: dict[str, DataflowDescription] = {}  # export id -> description
        self._memo: dict[tuple[str, int], tuple[tuple[int, int], ...]] = {}

    def register(self, desc: DataflowDescription) -> None:
        for id in desc.export_ids:
            self.descs[id] = desc

    def rows(self, id: str, version: int) -> tuple[tuple[int, int], ...]:
        key = (id, version)
        rows = self._memo.get(key)
        if rows is None:
            values: list[int] = []
            for source in self.descs[id].imports:
                if source.kind == "storage":
                    values.extend(self.source.rows(version))
                else:
                    values.extend(k * 1000 + n for k, n in self.rows(source.id, version))
            a, b = _coefficients(id)
            rows = tuple(sorted(Counter((x * a + b) % 61 for x in values).items()))
            self._memo[key] = rows
        return rows

    def encode(self, target: PeekTarget, versions: tuple[int, ...]) -> bytes:
        """The answer bytes for `target` when its collections are read at `versions`."""
        if isinstance(target, IndexTarget):
            return repr(self.rows(target.id, versions[0])).encode()
        return repr(
            tuple((i.name, self.rows(i.id, v)) for i, v in zip(target.imports, versions))
        ).encode()

    def answer(self, target: PeekTarget, time: int) -> bytes:
        version = self.source.version(time)
        return self.encode(target, tuple(version for _ in target.collection_ids))


def row_changes(before: tuple[tuple[int, int], ...], after: tuple[tuple[int, int], ...]) -> dict[tuple[int, int], int]:
    """What changed from rows `before` to rows `after`: row -> diff, no zero diffs."""
    diffs = dict.fromkeys(before, -1)
    for row in after:
        if diffs.pop(row, None) is None:
            diffs[row] = 1
    return diffs


def encode_changes(changes: dict[tuple[int, int], int]) -> bytes:
    return repr(tuple(sorted(changes.items()))).encode()


def peek_rows(payload: bytes, row_count: int) -> PeekRows:
    return PeekRows(payload, row_count, hashlib.sha256(payload).hexdigest()[:16])


# --- Replicas ---------------------------------------------------------------------------


class SimConnection:
    """One controller-to-replica stream: a FIFO queue in each direction.

    `open` turns False for good when either side closes it; what is in flight is lost
    (unless a late-response fault carries it over).
    """

    def __init__(self, replica: str, epoch: int, nonce: str) -> None:
        self.replica = replica
        self.epoch = epoch
        self.nonce = nonce
        self.open = True
        self.inbound: deque[tuple[int, ComputeCommand]] = deque()
        self.outbound: deque[tuple[int, ComputeResponse]] = deque()
        self._inbound_at = 0
        self._outbound_at = 0
        # Replica-side state of the session this connection carries (a resume hands it on):
        self.model = ReplicaModel()
        self.reconciled = False
        self.applied = 0  # commands the session received
        self.reported: dict[str, Frontier] = {}  # of this connection only
        self.pending: dict[str, Peek] = {}  # uuid -> peek, received and not yet answered
        self.feeds: dict[str, int] = {}  # subscription uuid -> the upper it reported up to

    def take_over(self, old: SimConnection) -> None:
        """Continue `old`'s session on this connection."""
        self.model, self.reconciled, self.applied, self.pending = old.model, old.reconciled, old.applied, old.pending
        self.feeds = old.feeds

    def push_command(self, at: int, command: ComputeCommand) -> None:
        self._inbound_at = max(at, self._inbound_at)
        self.inbound.append((self._inbound_at, command))

    def push_response(self, at: int, response: ComputeResponse) -> None:
        self._outbound_at = max(at, self._outbound_at)
        self.outbound.append((self._outbound_at, response))


@dataclass(slots=True)
class Running:
    """A dataflow as one simulated replica runs it.

    `versions` are (time, source version index read), strictly increasing in time; the
    one that answers a read at t is the latest at or before t. Only versions a read at or
    after the meet of the exports' sinces can need are kept.
    """

    desc: DataflowDescription
    as_of: int
    frontier: Frontier
    sinces: dict[str, Frontier]
    scheduled: bool
    ready_at: int  # when hydration can start computing
    last_computed: int | None = None
    versions: list[tuple[int, int]] = field(default_factory=list)

    def since(self) -> Frontier:
        return meet_all(self.sinces.values())

    def version_at(self, time: int) -> int | None:
        position = bisect.bisect_right(self.versions, time, key=lambda v: v[0])
        return self.versions[position - 1][1] if position else None

    def compact(self) -> None:
        since = self.since()
        if since.is_empty:
            self.versions.clear()
            return
        position = bisect.bisect_right(self.versions, since.time, key=lambda v: v[0])
        if position > 1:
            del self.versions[: position - 1]


class SimReplica:
    """A replica process. It survives its connections; a crash loses everything."""

    def __init__(self, name: str, sim: Simulation) -> None:
        rng = sim.rng
        self.name = name
        self.sim = sim
        self.base_delay = rng.randint(1, 20)
        self.base_lag = rng.randint(0, 150)
        self.base_hydrate = rng.randint(20, 400)
        self.tick_ms = rng.randint(100, 300)  # how often its dataflows look at their inputs
        self.next_tick = 0
        self.down_until: int | None = None  # crashed while set
        self.hung_until = 0
        self.slow_until = 0
        self.duplicate_until = 0
        self.late_until = 0
        self.erring_until = 0  # answers peeks with errors, now and then, while set
        self.refusing_until = 0  # refuses every Hello while set
        self.retired = False  # dropped from the instance: the process is gone
        self.running: dict[str, Running] = {}  # first export id -> dataflow
        self.owner: dict[str, str] = {}  # export id -> first export id
        self.conn: SimConnection | None = None
        self.heartbeats = 0
        self.next_heartbeat = 0
        self.kept = 0
        self.built = 0
        self.incarnation = 1

    # --- Faults and availability ------------------------------------------------------

    def available(self, now: int) -> bool:
        return not self.retired and self.down_until is None and now >= self.hung_until

    def slow(self, now: int) -> bool:
        return now < self.slow_until

    def delay(self, now: int) -> int:
        delay = self.sim.rng.randint(1, self.base_delay)
        return delay * 10 if self.slow(now) else delay

    def crash(self, now: int, until: int) -> None:
        if self.conn is not None:
            self.conn.open = False
        self.conn = None
        self.running.clear()
        self.owner.clear()
        self.down_until = until
        self.heartbeats = self.kept = self.built = 0
        self.incarnation += 1

    def connect(self, epoch: int, now: int, nonce: str, resume: Resume | None) -> tuple[SimConnection, bool]:
        """A new connection (a Hello) supersedes the current one. It continues the session
        `resume` names if that is the current one and received at least `min_applied`
        commands (True); else a new session starts and the old one's pending peeks die."""
        old = self.conn
        conn = SimConnection(self.name, epoch, nonce)
        resumed = (
            resume is not None and old is not None and old.nonce == resume.nonce and old.applied >= resume.min_applied
        )
        if resumed:
            conn.take_over(old)
        if old is not None:
            old.open = False
        self.conn = conn
        self.next_heartbeat = now
        return conn, resumed

    # --- The process's loop -----------------------------------------------------------

    def step(self, now: int) -> None:
        if self.retired:
            return
        if self.down_until is not None:
            if now < self.down_until:
                return
            self.down_until = None  # back up as a fresh process
        if now < self.hung_until:
            return
        conn = self.conn
        if conn is not None and conn.open:
            while conn.open and conn.inbound and conn.inbound[0][0] <= now:
                _, command = conn.inbound.popleft()
                conn.applied += 1
                self._apply(conn, command, now)
        ticked = now >= self.next_tick
        if ticked:
            self.next_tick = now + self.tick_ms
            for run in list(self.running.values()):
                self._advance(run, now)
        if conn is not None and conn.open:
            if conn.reconciled and ticked:
                for run in self.running.values():
                    self._report(conn, run)
                self._report_subscriptions(conn, now)
                self._answer_peeks(conn, now)
            if now >= self.next_heartbeat:
                self.heartbeats += 1
                self._send(
                    conn,
                    now,
                    StatusResponse(self.heartbeats, (), self.kept, self.built, self.incarnation),
                )
                self.next_heartbeat = now + self.sim.options.heartbeat_ms

    def _send(self, conn: SimConnection, now: int, response: ComputeResponse) -> None:
        congested = self.sim.rng.randint(100, 400) if now < self.late_until else 0
        conn.push_response(now + self.delay(now) + congested, response)
        if now < self.duplicate_until and self.sim.rng.random() < 0.3:
            conn.push_response(now + self.delay(now), response)
            self.sim.stats["duplicated"] += 1

    def _violation(self, message: str) -> None:
        self.sim.violations.append(f"replica {self.name}: {message}")

    # --- Commands -----------------------------------------------------------------------

    def _apply(self, conn: SimConnection, command: ComputeCommand, now: int) -> None:
        created = conn.model.instance is not None
        if isinstance(command, CreateInstance) == created:
            self._violation(
                f"{type(command).__name__} {'twice' if created else 'before CreateInstance'} "
                f"on epoch {conn.epoch}"
            )
        conn.model.apply(command)
        if isinstance(command, Peek):
            conn.pending[command.uuid] = command
        elif isinstance(command, Subscribe):
            conn.feeds.pop(command.uuid, None)  # a resent one: report again from its as_of
        elif isinstance(command, CancelPeek) and conn.pending.pop(command.uuid, None) is not None:
            self._send(conn, now, PeekResponse(command.uuid, PeekCanceled()))
        if not conn.model.initialized:
            return
        if not conn.reconciled:
            self._reconcile(conn, now)
        elif isinstance(command, CreateDataflow):
            self._follow(conn, command.desc.export_ids[0], now, created=True)
        elif isinstance(command, (Schedule, AllowCompaction)) and command.id in self.owner:
            self._follow(conn, self.owner[command.id], now)

    def _reconcile(self, conn: SimConnection, now: int) -> None:
        """On `InitializationComplete`: keep each running dataflow whose definition is
        identical, whose old `as_of` is not beyond the new one and whose index inputs were
        kept; drop the rest; build the new ones."""
        conn.reconciled = True
        state = conn.model.state()
        kept: set[str] = set()
        for key, live in state.dataflows.items():
            desc = live.desc
            run = self.running.get(key)
            if run is not None:
                if (
                    run.desc.same_definition(desc)
                    and run.as_of <= desc.as_of.time
                    and all(self.owner.get(i.id) in kept for i in desc.imports if i.kind == "index")
                ):
                    kept.add(key)
                    run.desc = desc
                    run.as_of = desc.as_of.time
                    run.frontier = run.frontier.join(desc.as_of)
                    self.kept += 1
                else:
                    self._drop(key)
                    run = None
            if run is None:
                run = self._build(key, desc, now)
            for id, since in live.sinces:
                run.sinces[id] = run.sinces[id].join(since)
            run.scheduled = live.scheduled
            run.compact()
        for key in [k for k in self.running if k not in state.dataflows]:
            self._drop(key)

    def _follow(self, conn: SimConnection, key: str, now: int, created: bool = False) -> None:
        """After reconciliation: bring dataflow `key` to the model's state."""
        model = conn.model
        desc = model.dataflows.get(key)
        run = self.running.get(key)
        if desc is None:  # every export compacted to the empty frontier: dropped
            if run is not None:
                for id in run.desc.export_ids:
                    self._report_one(conn, id, EMPTY)
                self._drop(key)
            return
        if run is None:
            run = self._build(key, desc, now)
        elif created and not run.desc.same_definition(desc):
            self._violation(f"CreateDataflow {desc.name} for live id {key} with another definition")
        for id in desc.export_ids:
            run.sinces[id] = run.sinces[id].join(model.sinces[id])
        run.scheduled = key in model.scheduled
        run.compact()

    def _build(self, key: str, desc: DataflowDescription, now: int) -> Running:
        for source in desc.imports:
            if source.kind == "index" and self.owner.get(source.id) not in self.running:
                self._violation(f"dataflow {desc.name} imports {source.id}, which is not running")
        run = Running(
            desc,
            desc.as_of.time,
            desc.as_of,
            {e: desc.as_of for e in desc.export_ids},
            False,
            now + self.base_hydrate * (10 if self.slow(now) else 1),
        )
        self.running[key] = run
        for id in desc.export_ids:
            self.owner[id] = key
        self.built += 1
        return run

    def _drop(self, key: str) -> None:
        run = self.running.pop(key)
        for id in run.desc.export_ids:
            self.owner.pop(id, None)

    # --- Computing ----------------------------------------------------------------------

    def _input_upper(self, run: Running, now: int) -> int | None:
        lag = self.base_lag * (10 if self.slow(now) else 1)
        upper: int | None = None
        for source in run.desc.imports:
            if source.kind == "storage":
                bound = min(self.sim.source.upper, max(now - lag, 0) + 1)
            else:
                upstream = self.running.get(self.owner.get(source.id, ""))
                if upstream is None or upstream.frontier.is_empty:
                    return None
                bound = upstream.frontier.time
            upper = bound if upper is None else min(upper, bound)
        return upper

    def _advance(self, run: Running, now: int) -> None:
        """Compute every version below the inputs' upper, as `replica_service` does."""
        if not run.scheduled or now < run.ready_at or run.frontier.is_empty:
            return
        upper = self._input_upper(run, now)
        if upper is None or upper <= run.frontier.time or upper <= run.as_of:
            return
        floor = run.as_of if run.last_computed is None else run.last_computed
        changes: set[int] = set()
        for source in run.desc.imports:
            if source.kind == "storage":
                changes.update(self.sim.source.change_times(floor, upper))
            else:
                upstream = self.running[self.owner[source.id]]
                changes.update(t for t, _ in upstream.versions if floor < t < upper)
        times = ([run.as_of] if run.last_computed is None else []) + sorted(changes)
        since = run.since()
        if since.is_empty:
            times = times[-1:]
        else:
            superseded = sum(1 for t in times if t <= since.time) - 1
            times = times[max(superseded, 0) :]
        for time in times:
            run.versions.append((time, self._compute(run, time)))
            run.last_computed = time
        run.frontier = Frontier(upper)
        run.compact()

    def _compute(self, run: Running, time: int) -> int:
        """The source version index the dataflow reads at `time`: from the source, or
        from an upstream index's retained versions on this replica."""
        truth = self.sim.source.version(time)
        read = truth
        for source in run.desc.imports:
            if source.kind == "index":
                upstream = self.running[self.owner[source.id]]
                version = upstream.version_at(time)
                if version is None:
                    self._violation(
                        f"dataflow {run.desc.name} reads {source.id} at {time}: no version left "
                        f"(input since {upstream.since()}, its own since {run.since()})"
                    )
                    return -1
                if version != truth:
                    read = version
        if read != truth:
            self._violation(
                f"dataflow {run.desc.name} computed a wrong version at {time}: "
                "an input was compacted "
                f"past what it needed (since {run.since()}, frontier {run.frontier})"
            )
        return read

    def _report(self, conn: SimConnection, run: Running) -> None:
        for id in run.desc.export_ids:
            self._report_one(conn, id, EMPTY if run.sinces[id].is_empty else run.frontier)

    def _report_one(self, conn: SimConnection, id: str, frontier: Frontier) -> None:
        if conn.reported.get(id) != frontier:
            conn.reported[id] = frontier
            self._send(conn, self.sim.now, FrontiersResponse(id, frontier))

    # --- Subscriptions --------------------------------------------------------------------

    def _report_subscriptions(self, conn: SimConnection, now: int) -> None:
        """Report each open subscription's changes up to the dataflow's frontier, as
        `replica_service` does: the snapshot at `as_of` first if asked for and still
        computable, then from the last reported upper, or from the own since where this
        replica compacted (or was built) past it."""
        for uuid, command in conn.model.subscriptions.items():
            run = self.running.get(self.owner.get(command.id, ""))
            if run is None or run.last_computed is None or run.frontier.is_empty:
                continue
            upper = run.frontier.time
            since = run.sinces[command.id]
            if since.is_empty:
                continue
            if uuid not in conn.feeds:
                conn.feeds[uuid] = command.as_of + 1
                if command.snapshot and since.time <= command.as_of < upper:
                    rows = self.sim.reference.rows(command.id, run.version_at(command.as_of))
                    changes = dict.fromkeys(rows, 1)
                    snapshot = SubscribeChanges(command.as_of, encode_changes(changes), len(changes))
                    self._send(conn, now, SubscribeResponse(uuid, command.as_of, command.as_of + 1, (snapshot,) if changes else ()))
            base = max(conn.feeds[uuid] - 1, since.time)
            if upper <= base + 1:
                continue
            changes = []
            rows = self.sim.reference.rows(command.id, run.version_at(base))
            for time, version in run.versions:
                if base < time < upper:
                    after = self.sim.reference.rows(command.id, version)
                    diffs = row_changes(rows, after)
                    if diffs:
                        changes.append(SubscribeChanges(time, encode_changes(diffs), len(diffs)))
                    rows = after
            lower = base + 1
            if upper - lower > 1 and self.sim.rng.random() < 0.3:  # in two reports
                middle = self.sim.rng.randint(lower + 1, upper - 1)
                first = tuple(c for c in changes if c.time < middle)
                self._send(conn, now, SubscribeResponse(uuid, lower, middle, first))
                changes, lower = [c for c in changes if c.time >= middle], middle
            self._send(conn, now, SubscribeResponse(uuid, lower, upper, tuple(changes)))
            conn.feeds[uuid] = upper

    # --- Peeks ----------------------------------------------------------------------------

    def _answer_peeks(self, conn: SimConnection, now: int) -> None:
        for uuid, peek in list(conn.pending.items()):
            if now < self.erring_until and self.sim.rng.random() < 0.5:
                result: PeekRows | PeekError | None = PeekError(f"simulated failure on {self.name}")
            else:
                result = self._peek_result(peek)
            if result is not None:
                del conn.pending[uuid]
                self._send(conn, now, PeekResponse(uuid, result))

    def _peek_result(self, peek: Peek) -> PeekRows | PeekError | None:
        versions = []
        for id in peek.target.collection_ids:
            run = self.running.get(self.owner.get(id, ""))
            if run is None:
                self._violation(f"peek {peek.uuid} reads {id}, which is not running")
                return PeekError(f"unknown collection {id}")
            since = run.sinces[id]
            if since.is_empty or peek.timestamp < since.time:
                self._violation(
                    f"peek {peek.uuid} at {peek.timestamp} below the since {since} of {id}"
                )
                return PeekError(f"cannot read {id} at {peek.timestamp}: compacted to {since}")
            if not run.frontier.is_complete(peek.timestamp):
                return None  # wait until the frontier passes the peek time
            version = run.version_at(peek.timestamp)
            if version is None:
                self._violation(f"peek {peek.uuid}: no version of {id} at {peek.timestamp}")
                return PeekError(f"no version of {id} at {peek.timestamp}")
            versions.append(version)
        payload = self.sim.reference.encode(peek.target, tuple(versions))
        return peek_rows(payload, len(versions))


# --- The driver, client and checks ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SimOptions:
    seed: int
    steps: int = 400
    faults: bool = True
    restarts: bool = True
    replicas: int = 2
    min_in_sync: int = 1
    max_lag_ms: int = 3_000
    replica_timeout_ms: int = 2_000
    heartbeat_ms: int = 300
    resume_window: int = 10_000  # commands the history keeps as pushed, for resumes
    fault_rate: float = 0.03
    restart_rate: float = 0.004
    action_rate: float = 0.4
    quiesce_limit_ms: int = 60_000


@dataclass(slots=True)
class DataflowRecord:
    """What the catalog holds of a dataflow: its description, window, and whether it was
    dropped (a drop is committed before the instance hears of it)."""

    desc: DataflowDescription
    window: int
    dropped: bool = False


@dataclass(slots=True)
class IssuedPeek:
    peek: Peek
    generation: int
    issued_ms: int
    answers: list[PeekDone] = field(default_factory=list)
    cancelled: bool = False  # the client gave up (the controller answers with an error)
    lost: bool = False  # pending when the controller restarted: the client saw UNAVAILABLE


@dataclass(slots=True)
class ClientFeed:
    """A client's feed of index `id`: its first subscription's `as_of` and `snapshot`,
    the subscription it reads now (resumed under a new uuid after a controller restart),
    and what it received: the consolidated changes, the last progress, every time."""

    id: str
    as_of: int
    snapshot: bool
    uuid: str
    consolidated: dict[tuple[int, int], int] = field(default_factory=dict)
    progress: int | None = None
    times: set[int] = field(default_factory=set)
    ended: str | None = None  # the code it ended with
    closed: bool = False  # the client unsubscribed

    @property
    def open(self) -> bool:
        return self.ended is None and not self.closed


class Simulation:
    """Drives one `ComputeInstance` (replaced on a controller restart) with simulated
    replicas, a client workload and seeded faults, checking invariants as it goes."""

    def __init__(self, options: SimOptions) -> None:
        self.options = options
        self.rng = random.Random(options.seed)
        self.now = 0
        self.next_tick = 0
        self.step_number = 0
        self.generation = 1
        self.source = Source()
        self.reference = Reference(self.source)
        self.instance_options = InstanceOptions(
            min_in_sync=options.min_in_sync,
            max_lag_ms=options.max_lag_ms,
            replica_timeout_ms=options.replica_timeout_ms,
            resume_window=options.resume_window,
        )
        self.instance = ComputeInstance(CONFIG, self.instance_options)
        self.faults_on = options.faults
        self.workload_on = True
        # Catalog record: dataflows in creation order, last recorded since per export,
        # the replicas of the instance, storage holds (this generation's).
        self.dataflows: dict[str, DataflowRecord] = {}
        self.recorded_since: dict[str, Frontier] = {}
        self.replica_names: list[str] = []
        self.storage_holds: dict[tuple[str, str], Frontier] = {}
        # Processes and network.
        self.replicas: dict[str, SimReplica] = {}
        self.conns: dict[str, SimConnection] = {}  # the driver's current connection per replica
        self.pending_connects: dict[str, tuple[int, int]] = {}  # name -> (epoch, when)
        # (generation, name) -> the times of its Connects in the last second.
        self.connects: dict[tuple[int, str], deque[int]] = {}
        self.resume_offers: dict[str, Resume | None] = {}  # name -> the pending Connect's offer
        self.next_nonce = 1
        self.broken: list[tuple[int, str, int]] = []  # (when, name, epoch) to report
        self.link_breaks: list[tuple[int, str]] = []  # (when, name): a late-response fault
        self.late: list[tuple[int, str, int, ComputeResponse]] = []  # (when, name, epoch, response)
        # Sinces recorded since the last report to the instance, due at `recorded_due`.
        self.recorded: dict[str, Frontier] = {}
        self.recorded_due: int | None = None
        # Client.
        self.peeks: dict[str, IssuedPeek] = {}
        # Peek uuid -> (replica, epoch) of each error answer the instance took.
        self.peek_errors: dict[str, set[tuple[str, int]]] = {}
        self.next_id = 2  # u1 is the source
        self.floor: dict[str, int] = {}  # export id -> its since before a controller restart
        self.next_replica = 1
        self.next_peek = 1
        self.feeds: dict[str, ClientFeed] = {}  # by the uuid of its current subscription
        # Checks.
        self.violations: list[str] = []
        self.events: deque[str] = deque(maxlen=60)
        self.stats: Counter[str] = Counter()
        self._seen_w: dict[str, float] = {}
        self._seen_since: dict[str, float] = {}  # across controller restarts
        self._seen_replica: dict[tuple[str, object, str], float] = {}
        self._reductions = self.instance.history.reductions
        self._bound = 0
        self._peak_bound = 0
        self._reduced_checked = (0, -1)
        for _ in range(options.replicas):
            self.add_replica()

    # --- Running ------------------------------------------------------------------------

    def run(self) -> Simulation:
        for _ in range(self.options.steps):
            self.step()
        self.quiesce()
        return self

    def step(self) -> None:
        self.step_number += 1
        self.now += self.rng.randint(10, 50)
        now = self.now
        if self.rng.random() < 0.3:
            self.source.append(
                now, [self.rng.randrange(1_000_000) for _ in range(self.rng.randint(1, 3))]
            )
        self.source.advance(now + 1)
        if self.faults_on:
            self._inject_fault()
        self._break_links()
        self._deliver_broken()
        self._deliver_connects()
        for replica in list(self.replicas.values()):
            replica.step(now)
        self._deliver_responses()
        self._deliver_late()
        self._deliver_recorded()
        if now >= self.next_tick:  # the driver's clock ticks every 100 ms
            self.next_tick = now + 100
            self.call(self.instance.tick, now)
        if self.workload_on and self.rng.random() < self.options.action_rate:
            self._client_action()
        self.check(full=True)

    def quiesce(self) -> None:
        """Faults stop, the workload stops, every replica comes back; run until every
        peek is answered and every replica is in sync, then check the final state."""
        self.faults_on = False
        self.workload_on = False
        self.event("quiesce")
        for replica in self.replicas.values():
            replica.hung_until = replica.slow_until = replica.duplicate_until = (
                replica.late_until
            ) = replica.erring_until = replica.refusing_until = 0
            if replica.down_until is not None:
                replica.down_until = self.now
        while len(self.instance.replicas) < max(1, self.options.min_in_sync):
            self.add_replica()
        deadline = self.now + self.options.quiesce_limit_ms
        while self.now < deadline and not self._settled():
            self.step()
        if not self._settled():
            self.fail(
                f"did not settle within {self.options.quiesce_limit_ms} ms: {self._describe()}"
            )
        self.check_final()

    def _settled(self) -> bool:
        instance = self.instance
        return (
            not instance.peeks
            and not self._lagging_feeds()
            and not self.pending_connects
            and all(h.in_sync for h in instance.health())
            and instance.state() == "healthy"
            and all(
                self.conns.get(r.name) is not None and self.conns[r.name].epoch == r.epoch
                for r in instance.replicas.values()
            )
            and all(
                set(self.replicas[name].running) == set(instance.dataflows)
                for name in instance.replicas
            )
        )

    # --- Calling the instance -------------------------------------------------------------

    def call(self, method: Callable, *args, **kwargs) -> list:
        try:
            effects = method(*args, **kwargs)
        except InstanceError as error:
            self.fail(f"{method.__name__}{args} was refused ({error.code}): {error}")
        self.execute(effects)
        self.check()
        return effects

    def refused(self, code: str, method: Callable, *args, **kwargs) -> None:
        """`method` must refuse with `code` and change nothing."""
        before = self.snapshot()
        try:
            effects = method(*args, **kwargs)
        except InstanceError as error:
            if error.code != code:
                self.fail(
                    f"{method.__name__}{args} refused with {error.code}, expected {code}: {error}"
                )
            if self.snapshot() != before:
                self.fail(f"{method.__name__}{args} was refused but changed the instance")
            self.stats[f"refused {method.__name__}"] += 1
            return
        self.execute(effects)
        self.fail(f"{method.__name__}{args} was accepted, expected {code}")

    def snapshot(self) -> tuple:
        """Everything a refused command must leave as it was."""
        instance = self.instance
        return (
            tuple(instance.history.commands),
            instance.history.pushed,
            tuple(
                (id, c.since, c.write_frontier, tuple(c.holds.items()))
                for id, c in instance.collections.items()
            ),
            tuple(
                (k, d.scheduled, tuple(d.input_holds.items()))
                for k, d in instance.dataflows.items()
            ),
            tuple(instance.peeks),
            tuple((uuid, s.frontier) for uuid, s in instance.subscriptions.items()),
            tuple(
                (r.name, r.epoch, r.phase, tuple(r.frontiers.items()))
                for r in instance.replicas.values()
            ),
        )

    # --- Effects ----------------------------------------------------------------------------

    def execute(self, effects: list) -> None:
        for effect in effects:
            _EFFECTS[type(effect)](self, effect)

    def _send(self, effect: Send) -> None:
        conn = self.conns.get(effect.replica)
        if conn is None or conn.epoch != effect.epoch or not conn.open:
            self.stats["sends to a closed connection"] += 1
            return
        replica = self.replicas[effect.replica]
        for command in effect.commands:
            conn.push_command(self.now + replica.delay(self.now), command)

    def _connect(self, effect: Connect) -> None:
        self.event(f"Connect {effect.replica} epoch {effect.epoch}" + (f" resume {effect.resume}" if effect.resume else ""))
        recent = self.connects.setdefault((self.generation, effect.replica), deque())
        recent.append(self.now)
        while recent[0] <= self.now - 1_000:
            recent.popleft()
        if len(recent) > MAX_CONNECTS_PER_S:
            self.fail(f"{effect.replica} connected {len(recent)} times within 1000 ms: no backoff")
        self.pending_connects[effect.replica] = (effect.epoch, self.now + self.rng.randint(1, 60))
        self.resume_offers[effect.replica] = effect.resume

    def _disconnect(self, effect: Disconnect) -> None:
        self.event(f"Disconnect {effect.replica} epoch {effect.epoch}")
        conn = self.conns.get(effect.replica)
        if conn is not None and conn.epoch == effect.epoch:
            self.close(conn)
        pending = self.pending_connects.get(effect.replica)
        if pending is not None and pending[0] == effect.epoch:
            del self.pending_connects[effect.replica]

    def _peek_done(self, effect: PeekDone) -> None:
        issued = self.peeks.get(effect.uuid)
        if issued is None:
            self.fail(f"PeekDone for {effect.uuid}, which the client never issued")
        issued.answers.append(effect)
        if len(issued.answers) > 1:
            self.fail(f"peek {effect.uuid} answered twice: {issued.answers}")
        result = effect.result
        if isinstance(result, PeekRows):
            expected = self.reference.answer(issued.peek.target, issued.peek.timestamp)
            if result.arrow_ipc != expected:
                self.fail(
                    f"peek {effect.uuid} at {issued.peek.timestamp} on {issued.peek.target} "
                    "answered by "
                    f"{effect.replica}: {result.arrow_ipc[:200]!r}, expected {expected[:200]!r}"
                )
            self.stats["peeks answered"] += 1
            if effect.uuid in self.peek_errors:
                self.stats["peeks answered with rows after an error"] += 1
        elif isinstance(result, PeekError) and effect.replica is None and issued.cancelled:
            self.stats["peeks cancelled by the client"] += 1
        elif isinstance(result, PeekError) and effect.replica is None:
            self._check_error_answer(effect.uuid, result.message)
            self.stats["peeks answered with errors"] += 1
        else:
            self.fail(f"peek {effect.uuid} answered with {result!r} from {effect.replica}")

    def _subscribe_forward(self, effect: SubscribeForward) -> None:
        feed = self.feeds.get(effect.uuid)
        if feed is None or not feed.open:
            self.fail(f"changes for subscription {effect.uuid}, which no client reads: {effect}")
        floor = feed.as_of if feed.progress is None else feed.progress + 1
        times = [c.time for c in effect.changes]
        if times != sorted(set(times)) or (times and (times[0] < floor or times[-1] > effect.progress)):
            self.fail(f"subscription {effect.uuid} got times {times} after progress {feed.progress}, up to {effect.progress}")
        if feed.progress is not None and effect.progress <= feed.progress:
            self.fail(f"subscription {effect.uuid}: progress {effect.progress} after {feed.progress}")
        twice = feed.times.intersection(times)
        if twice:
            self.fail(f"subscription {effect.uuid}: times {sorted(twice)} delivered twice")
        feed.times.update(times)
        for change in effect.changes:
            for row, diff in ast.literal_eval(change.arrow_ipc.decode()):  # what encode_changes wrote
                total = feed.consolidated.get(row, 0) + diff
                if total:
                    feed.consolidated[row] = total
                else:
                    del feed.consolidated[row]
        feed.progress = effect.progress
        expected = dict.fromkeys(self.reference.rows(feed.id, self.source.version(effect.progress)), 1)
        if not feed.snapshot:
            for row in self.reference.rows(feed.id, self.source.version(feed.as_of)):
                if expected.pop(row, None) is None:
                    expected[row] = -1
        if feed.consolidated != expected:
            self.fail(f"feed of {feed.id} consolidated through {effect.progress} is {feed.consolidated}, expected {expected}")
        self.stats["feed progress"] += 1
        self.stats["feed changes"] += len(effect.changes)

    def _subscribe_ended(self, effect: SubscribeEnded) -> None:
        feed = self.feeds.get(effect.uuid)
        record = self.dataflows.get(self.reference.descs[feed.id].export_ids[0]) if feed else None
        if feed is None or not feed.open or effect.code != "NOT_FOUND" or record is None or not record.dropped:
            self.fail(f"subscription {effect.uuid} ended ({effect.code}: {effect.message}), but its dataflow lives")
        feed.ended = effect.code
        self.stats["feeds ended by a drop"] += 1

    def _lagging_feeds(self) -> list[str]:
        """Open feeds that have not delivered everything their index has computed."""
        lagging = []
        for uuid, feed in self.feeds.items():
            collection = self.instance.collections.get(feed.id)
            if feed.open and collection is not None and not collection.write_frontier.is_empty:
                if feed.progress is None or feed.progress < collection.write_frontier.time - 1:
                    lagging.append(uuid)
        return lagging

    def _check_error_answer(self, uuid: str, message: str) -> None:
        """An error answers a peek only if every active replica answered it with an
        error (in its current incarnation), and the answer names each replica that did."""
        errored = self.peek_errors.get(uuid, set())
        if not errored:
            self.fail(f"peek {uuid} answered with errors no replica gave: {message}")
        for replica in self.instance.replicas.values():
            if replica.phase == "active" and (replica.name, replica.epoch) not in errored:
                self.fail(
                    f"peek {uuid} answered with errors ({message}) while replica "
                    f"{replica.name} (epoch {replica.epoch}) could still answer it"
                )
        for name, _ in errored:
            if f"replica {name}: " not in message:
                self.fail(f"peek {uuid}: the error answer does not name {name}: {message}")

    def _storage_hold(self, effect: StorageHold) -> None:
        key = (effect.id, effect.holder)
        previous = self.storage_holds.get(key)
        if previous is not None and effect.frontier < previous:
            self.fail(f"storage hold {key} regressed from {previous} to {effect.frontier}")
        self.storage_holds[key] = effect.frontier

    def _since_advanced(self, effect: SinceAdvanced) -> None:
        previous = self.recorded_since.get(effect.id)
        if effect.id in self.floor and previous is not None and effect.since < previous:
            return  # the open question above: keep the higher since on record
        if previous is not None and effect.since < previous:
            self.fail(f"recorded since of {effect.id} regressed from {previous} to {effect.since}")
        self.recorded_since[effect.id] = effect.since
        # The catalog write takes a while; replicas may compact only after it. As the
        # driver does, everything recorded by then is reported durable together.
        self.recorded_due = self.recorded_due or self.now + self.rng.randint(1, 80)
        self.recorded[effect.id] = effect.since

    # --- Network ------------------------------------------------------------------------------

    def close(self, conn: SimConnection) -> None:
        """Close a connection from the driver's side; what is in flight is lost, unless
        the replica is in a late-response window: then it arrives later anyway."""
        conn.open = False
        if self.conns.get(conn.replica) is conn:
            del self.conns[conn.replica]
        replica = self.replicas[conn.replica]
        if self.now < replica.late_until:
            for at, response in conn.outbound:
                self.late.append(
                    (at + self.rng.randint(50, 1500), conn.replica, conn.epoch, response)
                )
                self.stats["late responses"] += 1
            self.late.sort(key=lambda item: item[0])
        conn.outbound.clear()

    def _break_links(self) -> None:
        due = [b for b in self.link_breaks if b[0] <= self.now]
        self.link_breaks = [b for b in self.link_breaks if b[0] > self.now]
        for _, name in due:
            conn = self.conns.get(name)
            if conn is not None:
                self.event(f"link broken {name} epoch {conn.epoch}")
                self.close(conn)
                self.broken.append((self.now + self.rng.randint(1, 30), name, conn.epoch))

    def _deliver_broken(self) -> None:
        due = [b for b in self.broken if b[0] <= self.now]
        self.broken = [b for b in self.broken if b[0] > self.now]
        for _, name, epoch in due:
            self.event(f"stream broken {name} epoch {epoch}")
            self.call(self.instance.replica_failed, name, epoch, "stream broken")

    def _deliver_connects(self) -> None:
        for name, (epoch, at) in list(self.pending_connects.items()):
            if at > self.now or self.pending_connects.get(name) != (epoch, at):
                continue
            replica = self.replicas[name]
            if not replica.available(self.now):  # down or hung: retry with backoff
                self.pending_connects[name] = (epoch, self.now + self.rng.randint(50, 250))
                continue
            del self.pending_connects[name]
            if self.now < replica.refusing_until:  # answers Hello with a refusal
                self.resume_offers.pop(name, None)
                self.event(f"refused {name} epoch {epoch}")
                self.stats["connections refused"] += 1
                self.call(self.instance.replica_failed, name, epoch, "refused (simulated)")
                continue
            old = self.conns.get(name)
            if old is not None:
                self.close(old)
            nonce = f"n{self.next_nonce}"
            self.next_nonce += 1
            conn, resumed = replica.connect(epoch, self.now, nonce, self.resume_offers.pop(name, None))
            self.conns[name] = conn
            self.event(f"connected {name} epoch {epoch}" + (f", resumed after {conn.applied} commands" if resumed else ""))
            self.stats["sessions resumed" if resumed else "sessions started"] += 1
            self.call(self.instance.replica_connected, name, epoch, nonce, resumed, conn.applied)
            state = self.instance.replicas.get(name)
            if state is None or state.epoch != epoch or state.phase != "active":
                self.close(conn)  # the instance did not take this connection

    def _deliver_responses(self) -> None:
        for name, conn in list(self.conns.items()):
            while conn.open and conn.outbound and conn.outbound[0][0] <= self.now:
                _, response = conn.outbound.popleft()
                self._note_peek_error(name, conn.epoch, response)
                self.call(self.instance.handle_response, name, conn.epoch, response)

    def _note_peek_error(self, name: str, epoch: int, response: ComputeResponse) -> None:
        """Record a peek error the instance takes as replica `name`'s answer in `epoch`."""
        replica = self.instance.replicas.get(name)
        if (
            isinstance(response, PeekResponse)
            and isinstance(response.result, PeekError)
            and replica is not None
            and (replica.epoch, replica.phase) == (epoch, "active")
        ):
            self.peek_errors.setdefault(response.uuid, set()).add((name, epoch))

    def _deliver_recorded(self) -> None:
        if self.recorded_due is not None and self.recorded_due <= self.now:
            batch, self.recorded, self.recorded_due = self.recorded, {}, None
            self.call(self.instance.sinces_recorded, batch)

    def _deliver_late(self) -> None:
        while self.late and self.late[0][0] <= self.now:
            _, name, epoch, response = self.late.pop(0)
            current = self.instance.replicas.get(name)
            if current is not None and current.epoch == epoch and current.phase == "active":
                # The controller has not noticed the broken stream yet: for it, this is
                # an ordinary response of the current connection.
                self._note_peek_error(name, epoch, response)
                self.call(self.instance.handle_response, name, epoch, response)
                continue
            self.stats["late responses delivered"] += 1
            before = self.snapshot()
            self.call(self.instance.handle_response, name, epoch, response)
            if self.snapshot() != before:
                self.fail(
                    f"a late response of {name} epoch {epoch} changed the instance: {response}"
                )

    # --- Faults -------------------------------------------------------------------------------

    def _inject_fault(self) -> None:
        rng = self.rng
        if self.options.restarts and rng.random() < self.options.restart_rate:
            self.restart_controller()
            return
        if rng.random() >= self.options.fault_rate or not self.replica_names:
            return
        replica = self.replicas[rng.choice(self.replica_names)]
        kind = rng.choices(
            ("crash", "hang", "slow", "duplicate", "late", "peek errors", "refuse"),
            (3, 3, 3, 2, 2, 3, 2),
        )[0]
        self.stats[f"fault {kind}"] += 1
        self.event(f"fault {kind} {replica.name}")
        if kind == "crash":
            self.crash(replica, self.now + rng.randint(300, 4_000))
        elif kind == "hang":
            replica.hung_until = self.now + rng.randint(500, 6_000)
        elif kind == "slow":
            replica.slow_until = self.now + rng.randint(1_000, 8_000)
        elif kind == "duplicate":
            replica.duplicate_until = self.now + rng.randint(1_000, 5_000)
        elif kind == "peek errors":
            replica.erring_until = self.now + rng.randint(500, 4_000)
        elif kind == "refuse":
            # Refuses every Hello (a process that keeps dying at start-up, or fenced) and
            # is failed now, so that the instance retries: it must back off.
            replica.refusing_until = self.now + rng.randint(1_000, 8_000)
            self.crash(replica, self.now)
        else:
            # A congested link that then breaks: what was in flight arrives after the
            # reconnect, tagged with the old epoch.
            replica.late_until = self.now + rng.randint(1_000, 3_000)
            self.link_breaks.append((self.now + rng.randint(100, 600), replica.name))

    def crash(self, replica: SimReplica, until: int) -> None:
        conn = replica.conn
        replica.crash(self.now, until)
        if conn is not None and self.conns.get(replica.name) is conn:
            self.close(conn)
            self.broken.append((self.now + self.rng.randint(1, 100), replica.name, conn.epoch))

    def restart_controller(self) -> None:
        """The controller process dies: its connections die with it and pending client
        peeks fail. A new instance is rebuilt from the catalog record, and the replicas
        (which keep their state) are added again."""
        self.stats["controller restarts"] += 1
        self.event("controller restart")
        for conn in list(self.conns.values()):
            conn.open = False
            conn.outbound.clear()
        self.conns.clear()
        self.pending_connects.clear()
        self.resume_offers.clear()
        self.broken.clear()
        self.link_breaks.clear()
        self.late.clear()
        self.recorded, self.recorded_due = {}, None
        for issued in self.peeks.values():
            if not issued.answers and issued.generation == self.generation:
                issued.lost = True
        self.generation += 1
        self.storage_holds.clear()
        self._seen_w.clear()
        self._seen_replica.clear()
        self.instance = ComputeInstance(CONFIG, self.instance_options)
        self._reductions = self.instance.history.reductions
        self._peak_bound = self._bound = 0
        for record in self.dataflows.values():
            if record.dropped:
                continue
            sinces = {
                id: self.recorded_since.get(id, record.desc.as_of) for id in record.desc.export_ids
            }
            since = meet_all(sinces.values())
            if since.is_empty:
                continue
            # Open question (see test_recovery_keeps_each_exports_since): one as_of per
            # dataflow puts every export back at the meet of their sinces, below what
            # surviving replicas compacted the others to. The client keeps to the
            # recorded sinces, and the since checks start again from the new one.
            for id, recorded in sinces.items():
                if recorded > since:
                    self.floor[id] = recorded.time
                self._seen_since[id] = since.time
            self.call(self.instance.create_dataflow, record.desc.with_as_of(since), record.window, sinces)
        for name in self.replica_names:
            self.call(self.instance.add_replica, name)
        # Each client saw its stream break, and resumes from the last progress it got.
        for uuid, feed in list(self.feeds.items()):
            if feed.open:
                resumed = self._new_uuid()
                as_of, snapshot = (feed.as_of, feed.snapshot) if feed.progress is None else (feed.progress, False)
                del self.feeds[uuid]
                feed.uuid = resumed
                self.feeds[resumed] = feed
                self.event(f"resume subscription {resumed} to {feed.id} as of {as_of}")
                self.call(self.instance.subscribe, Subscribe(resumed, feed.id, as_of, snapshot))

    # --- Client -------------------------------------------------------------------------------

    def add_replica(self) -> str:
        name = f"r{self.next_replica}"
        self.next_replica += 1
        self.replicas[name] = SimReplica(name, self)
        self.replica_names.append(name)
        self.event(f"add_replica {name}")
        self.call(self.instance.add_replica, name)
        return name

    def live_dataflows(self) -> list[str]:
        return [k for k, r in self.dataflows.items() if not r.dropped]

    def live_exports(self) -> list[str]:
        return [id for k in self.live_dataflows() for id in self.dataflows[k].desc.export_ids]

    def _client_action(self) -> None:
        actions = (
            (self._peek_serializable, 30),
            (self._peek_at, 20),
            (self._peek_sql, 8),
            (self._create_dataflow, 12),
            (self._drop_dataflow, 6),
            (self._add_replica, 3),
            (self._drop_replica, 3),
            (self._update_configuration, 2),
            (self._give_up_on_peeks, 3),
            (self._subscribe, 3),
            (self._unsubscribe, 1),
        )
        action = self.rng.choices([a for a, _ in actions], [w for _, w in actions])[0]
        action()

    def _new_id(self) -> str:
        id = f"u{self.next_id}"
        self.next_id += 1
        return id

    def _create_dataflow(self) -> None:
        rng = self.rng
        live = self.live_exports()
        if len(self.live_dataflows()) >= 6:
            return
        shape = rng.choices(("storage", "index", "both"), (5, 3, 2))[0] if live else "storage"
        imports: list[Import] = []
        if shape in ("storage", "both"):
            imports.append(Import("src", SOURCE, "storage"))
        if shape in ("index", "both"):
            for n, id in enumerate(rng.sample(live, min(len(live), rng.randint(1, 2)))):
                imports.append(Import(f"in{n}", id, "index"))
        floor = max((self.readable_floor(i.id) for i in imports if i.kind == "index"), default=0)
        exports = tuple(
            IndexExport(self._new_id(), ("k",)) for _ in range(rng.choices((1, 2), (4, 1))[0])
        )
        name = f"df_{exports[0].id}"
        if floor > 0 and rng.random() < 0.15:
            bad = DataflowDescription(
                name,
                "SELECT ...",
                tuple(imports),
                exports,
                as_of=Frontier(floor - rng.randint(1, floor)),
            )
            self.refused("FAILED_PRECONDITION", self.instance.create_dataflow, bad)
            return
        as_of = floor if shape != "storage" else max(0, self.now - rng.randint(0, 500))
        desc = DataflowDescription(
            name,
            f"SELECT k, count(*) FROM ... /* {name} */",
            tuple(imports),
            exports,
            as_of=Frontier(as_of),
        )
        window = rng.choice((0, 0, 50, 300))
        if rng.random() < 0.05:
            clash = DataflowDescription(
                name,
                desc.sql,
                desc.imports,
                (IndexExport(rng.choice(live) if live else SOURCE),),
                as_of=desc.as_of,
            )
            if live:
                self.refused("ALREADY_EXISTS", self.instance.create_dataflow, clash)
        self.reference.register(desc)
        self.dataflows[exports[0].id] = DataflowRecord(desc, window)
        self.event(
            f"create_dataflow {name} imports {[i.id for i in imports]} "
            f"exports {desc.export_ids} as_of {as_of}"
        )
        self.call(self.instance.create_dataflow, desc, window)

    def _drop_dataflow(self) -> None:
        live = self.live_dataflows()
        if not live:
            return
        key = self.rng.choice(live)
        exports = set(self.dataflows[key].desc.export_ids)
        users = [
            k
            for k in live
            if k != key and any(i.id in exports for i in self.dataflows[k].desc.imports)
        ]
        if users:
            self.refused("FAILED_PRECONDITION", self.instance.drop_dataflow, key)
            return
        self.dataflows[key].dropped = True  # the catalog commits the drop first
        self.event(f"drop_dataflow {key}")
        self.call(self.instance.drop_dataflow, key)

    def _issue(self, peek: Peek, kind: str) -> None:
        self.peeks[peek.uuid] = IssuedPeek(peek, self.generation, self.now)
        self.event(f"peek {peek.uuid} ({kind}) {peek.target} at {peek.timestamp}")
        self.call(self.instance.peek, peek)

    def _new_uuid(self) -> str:
        uuid = f"p{self.next_peek}"
        self.next_peek += 1
        return uuid

    def readable_floor(self, id: str) -> int:
        """The lowest time the client reads `id` at: its since (see `floor`)."""
        return max(self.instance.collections[id].since.time, self.floor.get(id, 0))

    def readable_time(self, id: str) -> int:
        return max(self.instance.readable_time(id), self.floor.get(id, 0))

    def _peek_serializable(self) -> None:
        live = self.live_exports()
        if live:
            id = self.rng.choice(live)
            self._issue(
                Peek(self._new_uuid(), IndexTarget(id), self.readable_time(id)), "serializable"
            )

    def _peek_at(self) -> None:
        live = self.live_exports()
        if not live:
            return
        id = self.rng.choice(live)
        collection = self.instance.collections[id]
        since = collection.since.time
        # After a controller restart an export's restored since can lie above its W.
        top = max(collection.write_frontier.time, since) + 300
        time = self.rng.randint(max(0, since - 30), top)
        peek = Peek(self._new_uuid(), IndexTarget(id), time)
        if time < since:
            self.refused("FAILED_PRECONDITION", self.instance.peek, peek)
        elif time >= self.floor.get(id, 0):
            self._issue(peek, "explicit time")

    def _peek_sql(self) -> None:
        live = self.live_exports()
        if len(live) < 2:
            return
        ids = self.rng.sample(live, 2)
        time = max(self.readable_time(id) for id in ids)
        target = SqlTarget(
            "SELECT * FROM a JOIN b USING (k)",
            (Import("a", ids[0], "index"), Import("b", ids[1], "index")),
        )
        self._issue(Peek(self._new_uuid(), target, time), "sql")

    def _subscribe(self) -> None:
        live = self.live_exports()
        if not live:
            return
        id = self.rng.choice(live)
        since = self.instance.collections[id].since.time
        if since > 0 and self.rng.random() < 0.1:
            self.refused("FAILED_PRECONDITION", self.instance.subscribe, Subscribe(self._new_uuid(), id, since - 1))
            return
        as_of = self.rng.randint(self.readable_floor(id), max(self.readable_floor(id), self.readable_time(id)))
        feed = ClientFeed(id, as_of, self.rng.random() < 0.7, self._new_uuid())
        self.feeds[feed.uuid] = feed
        self.event(f"subscribe {feed.uuid} to {id} as of {as_of}" + (" with a snapshot" if feed.snapshot else ""))
        self.call(self.instance.subscribe, Subscribe(feed.uuid, id, as_of, feed.snapshot))

    def _unsubscribe(self) -> None:
        open_feeds = [uuid for uuid, feed in self.feeds.items() if feed.open]
        if open_feeds:
            uuid = self.rng.choice(open_feeds)
            self.feeds[uuid].closed = True
            self.event(f"unsubscribe {uuid}")
            self.call(self.instance.cancel_subscribe, uuid)

    def _add_replica(self) -> None:
        if len(self.replica_names) < 3:
            self.add_replica()

    def _drop_replica(self) -> None:
        if not self.replica_names or (len(self.replica_names) == 1 and self.rng.random() < 0.8):
            return
        name = self.rng.choice(self.replica_names)
        force = self.rng.random() < 0.3
        # min_in_sync counts replicas in sync for every dataflow some replica serves.
        health = self.instance.health()
        others = sum(1 for h in health if h.in_sync_where_served and h.name != name)
        own = next(h for h in health if h.name == name)
        if not force and own.in_sync_where_served and others < self.options.min_in_sync:
            self.refused("FAILED_PRECONDITION", self.instance.drop_replica, name)
            return
        self.event(f"drop_replica {name} force={force}")
        self.call(self.instance.drop_replica, name, force=force)
        self.replica_names.remove(name)
        self.replicas[name].retired = True

    def _update_configuration(self) -> None:
        self.call(
            self.instance.update_configuration,
            ComputeParameters(max_result_rows=self.rng.randint(1, 1000)),
        )

    def _give_up_on_peeks(self) -> None:
        """The client's deadline passed for peeks pending more than 2 s."""
        for uuid, pending in list(self.instance.peeks.items()):
            if self.now - pending.issued_ms > 2_000:
                self.peeks[uuid].cancelled = True
                self.event(f"cancel_peek {uuid}")
                self.call(self.instance.cancel_peek, uuid, "deadline exceeded")

    # --- Checks -----------------------------------------------------------------------------

    def check(self, full: bool = False) -> None:
        """Invariants that hold after every call into the instance (`full`: and the more
        expensive ones, after every simulation step)."""
        if self.violations:
            self.fail("; ".join(self.violations))
        instance = self.instance
        seen_w, seen_since = self._seen_w, self._seen_since
        for id, collection in instance.collections.items():
            w, since = _key(collection.write_frontier), _key(collection.since)
            if w < seen_w.get(id, -1):
                self.fail(f"W({id}) regressed from {seen_w[id]} to {collection.write_frontier}")
            if since < seen_since.get(id, -1):
                self.fail(f"since({id}) regressed from {seen_since[id]} to {collection.since}")
            seen_w[id], seen_since[id] = w, since
            lowest = _INFINITY
            for holder, hold in collection.holds.items():
                lowest = min(lowest, _key(hold))
                if since > lowest:
                    self.fail(
                        f"since({id}) = {collection.since} passed the hold {holder} at {hold}"
                    )
            if since != lowest:  # since(c) is the min of all holds, at every step's end
                self.fail(f"since({id}) = {collection.since} lags its holds {collection.holds}")
        seen = self._seen_replica
        for replica in instance.replicas.values():
            for id, frontier in replica.frontiers.items():
                # Per session: a resumed one keeps its frontiers, a new one starts over.
                key = (replica.name, replica.session, id)
                value = _key(frontier)
                if value < seen.get(key, -1):
                    self.fail(
                        f"w_{replica.name}({id}) regressed from {seen[key]} to {frontier} "
                        f"in epoch {replica.epoch}"
                    )
                seen[key] = value
        self._check_input_holds()
        exports = sum(
            len(d.desc.index_exports) + len(d.desc.sink_exports)
            for d in instance.dataflows.values()
        )
        bound = 3 + len(instance.peeks) + len(instance.subscriptions) + len(instance.dataflows) + exports
        if instance.history.reductions != self._reductions:
            self._reductions = instance.history.reductions
            self._peak_bound = max(self._bound, bound)
        else:
            self._peak_bound = max(self._peak_bound, bound)
        self._bound = bound
        if len(instance.history) > 2 * self._peak_bound:
            self.fail(f"history length {len(instance.history)} > 2 * {self._peak_bound}")
        if full:
            state = instance.state()
            if state not in HEALTH_STATES:
                self.fail(f"health {state!r}")
            self._check_hydration()
            self._check_holds_at_fixed_point()
            pushed = (self.generation, instance.history.pushed)
            if pushed != self._reduced_checked:  # only when something was pushed
                self._reduced_checked = pushed
                reduced = reduce_commands(instance.history.commands)
                if len(reduced) > bound:
                    self.fail(f"reduced history length {len(reduced)} > {bound}: {reduced}")

    def _check_holds_at_fixed_point(self) -> None:
        """The instance updates holds from what a step touched; a recomputation from every
        collection and dataflow must find nothing left to move (else a hold is stuck)."""
        instance = self.instance

        def holds() -> tuple:
            return (
                {id: (dict(c.holds), c.since) for id, c in instance.collections.items()},
                {key: dict(d.input_holds) for key, d in instance.dataflows.items()},
            )

        before = holds()
        effects = instance._update_holds()
        if effects or holds() != before:
            self.fail(f"holds were not at their fixed point: a full update moved them ({effects})")

    def _check_input_holds(self) -> None:
        """An input's since never passes the write frontier any active replica reported
        for a dataflow reading it, nor, once that replica computed the dataflow, the last
        time it computed (its frontier less one): an incremental step reads its inputs as
        of that time too. A lagging replica must still read what it needs."""
        instance = self.instance
        active = [r for r in instance.replicas.values() if r.phase == "active"]
        for key, dataflow in instance.dataflows.items():
            desc = dataflow.desc
            lowest = _INFINITY
            for replica in active:
                for export in desc.index_exports:
                    frontier = replica.frontiers.get(export.id)
                    if frontier is not None:
                        lowest = min(lowest, _key(frontier), self._last_read(replica.name, key))
            if lowest == _INFINITY:
                continue
            for source in desc.imports:
                if source.kind == "index":
                    upstream = instance.collections.get(source.id)
                    hold = None if upstream is None else upstream.since
                else:
                    hold = self.storage_holds.get((source.id, f"{CONFIG.name}/{key}"))
                if hold is not None and _key(hold) > lowest:
                    self.fail(
                        f"input {source.id} of {key} is held at {hold}, "
                        f"past {lowest}, where a replica reads it (its write frontier, or the last time it computed)"
                    )

    def _last_read(self, replica: str, key: str) -> float:
        """The earliest time at which `replica`'s next step of dataflow `key` reads its
        inputs: its as_of until it computed, then the last time it computed (its frontier
        less one); infinite when it does not run the dataflow."""
        run = self.replicas[replica].running.get(key) if replica in self.replicas else None
        if run is None or run.frontier.is_empty:
            return _INFINITY
        if run.last_computed is None:
            return run.as_of
        return max(run.as_of, run.frontier.time - 1)

    def _check_hydration(self) -> None:
        """A replica the instance calls hydrated has computed every live dataflow."""
        for health in self.instance.health():
            conn = self.conns.get(health.name)
            if not health.hydrated or conn is None or conn.epoch != health.epoch or not conn.open:
                continue  # the instance may not know yet what happened to it
            replica = self.replicas[health.name]
            for key, dataflow in self.instance.dataflows.items():
                if all(
                    self.instance.collections[id].since.is_empty for id in dataflow.desc.export_ids
                ):
                    continue
                run = replica.running.get(key)
                if run is None or run.last_computed is None:
                    self.fail(
                        f"the instance calls {health.name} hydrated, "
                        f"but it has not computed {key} yet"
                    )

    def check_final(self) -> None:
        instance = self.instance
        lagging = self._lagging_feeds()
        if lagging:
            self.fail(f"feeds {lagging} did not catch up with their indexes")
        for uuid, issued in self.peeks.items():
            expected = 0 if issued.lost else 1
            if len(issued.answers) != expected:
                self.fail(f"peek {uuid} answered {len(issued.answers)} times, expected {expected}")
        if instance.state() != "healthy":
            self.fail(f"health is {instance.state()} after quiescing: {instance.health()}")
        live = set(instance.dataflows)
        for replica in instance.replicas.values():
            sim = self.replicas[replica.name]
            if replica.phase != "active" or sim.conn is None or sim.conn.epoch != replica.epoch:
                self.fail(f"replica {replica.name} is not connected at epoch {replica.epoch}")
            if set(sim.running) != live:
                self.fail(
                    f"replica {replica.name} runs {sorted(sim.running)}, "
                    f"the instance has {sorted(live)}"
                )
        for (id, holder), hold in self.storage_holds.items():
            key = holder.split("/", 1)[1]
            if key not in instance.dataflows and not hold.is_empty:
                self.fail(f"dataflow {key} is gone but still holds storage {id} at {hold}")

    # --- Diagnostics ------------------------------------------------------------------------

    def event(self, text: str) -> None:
        self.events.append(f"[{self.step_number} t={self.now}] {text}")

    def _describe(self) -> str:
        instance = self.instance
        return (
            f"health {instance.health()}, peeks {sorted(instance.peeks)}, "
            f"pending connects {self.pending_connects}, "
            f"conns {[(n, c.epoch) for n, c in self.conns.items()]}"
        )

    def fail(self, message: str) -> None:
        events = "\n  ".join(self.events)
        raise SimulationFailure(
            f"seed {self.options.seed}, step {self.step_number}, t={self.now}, "
            f"generation {self.generation}: "
            f"{message}\nrecent events:\n  {events}"
        )


_EFFECTS: dict[type, Callable[[Simulation, object], None]] = {
    Send: Simulation._send,
    Connect: Simulation._connect,
    Disconnect: Simulation._disconnect,
    PeekDone: Simulation._peek_done,
    StorageHold: Simulation._storage_hold,
    SinceAdvanced: Simulation._since_advanced,
    SubscribeForward: Simulation._subscribe_forward,
    SubscribeEnded: Simulation._subscribe_ended,
}


def run_seed(seed: int, **overrides) -> Simulation:
    """Run one seeded simulation to the end; raises `SimulationFailure` on a violation."""
    return Simulation(SimOptions(seed=seed, **overrides)).run()
