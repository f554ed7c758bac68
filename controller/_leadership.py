"""Leadership of the `tandem serve` processes on one catalog: one leads, standbys wait
warm (catalog open, planner JVM up) and take the lead when the leader's lease lapses or
its process is gone. The catalog keeps the record (`catalog/_leadership.py`); this
module decides, and keeps the leader's own clock.

Rules:
- A leader renews its lease every `renew_ms`, for `lease_ms` from the renewal's start.
  Once standbys are registered (a renewal counted them), it serves only until
  `lease_ms - margin_ms` after the start of its last renewal that succeeded, by its
  own monotonic clock: past that it refuses every call and stops, before any standby
  may take over (`LeaseClock`). It is guarded so from its take on when standbys may be
  registered by then (always, for one that was a standby): its first renewal may never
  come. Without standbys nobody can take over (a plain `tandem serve` takes the epoch
  at once, fencing, as it always did), so it never stops for a slow catalog.
- A handover (`hand_over`) is the leader's planned move of the lead to a standby it
  names: new calls wait, those in flight finish (up to `DRAIN_S`), the catalog moves
  the epoch in one update (`Catalog.hand_over`), the leader stops driving and tells the
  standby, which takes the lead at once (adopting the epoch) and answers once it
  serves; then the held calls are refused naming it, and the old leader exits.
- A standby takes the lead (`takeover_cause`) when nobody holds a lease, when the
  leader's process on the same host is gone (a kill -9 is seen at the next poll, not
  after the lease), or when the lease lapsed and a renewal came after the standby
  registered (so the leader knew of it and stopped on its own). A leader on another
  host that was cut off before any standby came never learnt it must stop: no standby
  takes its lapsed lease (a plain `tandem serve` does, fencing it, on an operator's
  word). Standbys not heard from for `STALE_LEASES` leases are forgotten by the
  leader's renewal, so a dead one does not keep the leader on its guard.
- Taking the lead bumps the epoch in the same locked update (`Catalog.take_lead`), so
  every write the old leader still attempts fails, as after a restart.
- A leader that stops on purpose ends its lease (`Catalog.leave_leadership`): a standby
  takes over at its next poll.
- A standby's catalog writes wait for SQLite's write lock at most `renew_ms`. A leader
  hung (SIGSTOP) inside a write transaction holds that lock, and nobody can write: a
  standby on its host that finds the catalog locked, the lease lapsed and the leader's
  process alive kills it (`Standby.kill_hung_leader`); it has stopped serving on its own
  clock by then. (PostgreSQL ends such a session itself: `IDLE_IN_TRANSACTION_MS`.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from time import monotonic
from typing import Any

from catalog import Catalog, ControllerInfo, ControllerSpec, FailedPrecondition, Fenced, Leadership
from controller._api import ControllerError, ControllerView, HandoverView, LeadershipView
from controller._orchestrator import pid_alive, proc_stat, process_start

log = logging.getLogger(__name__)

STALE_LEASES = 3
"""A standby not heard from for this many lease durations is forgotten."""

HANDED_OVER = "this controller handed the lead over"

PROBE_S = 1.0
"""How long a handover waits for the named standby to answer before it holds any call:
one that does not (dead since it was last heard from) is refused the lead, which stays
here; a handover to a dead sole standby would otherwise leave nobody serving."""

DRAIN_S = 0.5
"""How long a handover lets the calls in flight that change something finish before it
hands the epoch over (those still running may then fail; a client sends the safe ones
again)."""

READS = frozenset({"peek", "query", "status", "list_instances", "list_sources", "list_dataflows", "events", "storage_holds", "subscribe"})
"""The calls that change nothing: a handover does not wait for them. Those still waiting
for replicas when the leader lets them go fail UNAVAILABLE naming the successor, and
the client sends them there."""


@dataclass(frozen=True, slots=True)
class LeaseOptions:
    """The leader's lease (milliseconds): its duration, how often it is renewed, and the
    margin by which the leader stops serving before it ends (clock skew between hosts
    and a renewal's own time must fit in it). Standbys poll every `renew_ms / 2`."""

    lease_ms: int = 5_000
    renew_ms: int = 1_000
    margin_ms: int = 1_500

    def __post_init__(self) -> None:
        if not (0 < self.renew_ms and 0 < self.margin_ms and self.renew_ms + self.margin_ms < self.lease_ms):
            raise ControllerError(
                "INVALID_ARGUMENT",
                f"a lease of {self.lease_ms} ms cannot be renewed every {self.renew_ms} ms with a margin of "
                f"{self.margin_ms} ms: renew_ms + margin_ms must be below lease_ms, both above 0",
            )

    @property
    def poll_s(self) -> float:
        return self.renew_ms / 2000


def this_process(address: str) -> ControllerSpec:
    """What this `tandem serve` process records of itself, serving gRPC on `address`."""
    pid = os.getpid()
    return ControllerSpec(uuid.uuid4().hex, address, socket.gethostname(), pid, process_start(pid))


def process_gone(controller: ControllerInfo) -> bool:
    """Whether `controller`'s process (on this host) runs no more: exited, replaced by
    another of the same pid, or a zombie (it serves nothing)."""
    if not pid_alive(controller.pid, controller.process_start):
        return True
    fields = proc_stat(controller.pid)
    return fields is not None and fields[0] == b"Z"


def takeover_cause(
    state: Leadership, me: ControllerSpec, now_ms: int, lease_ms: int, gone: Callable[[ControllerInfo], bool] = process_gone
) -> str | None:
    """Why standby `me` may take the lead now (see the module's rules), or None."""
    leader = state.leader
    if leader is None or state.lease_expires_ms is None:
        return "no controller leads"
    if leader.id == me.id:  # only a handover names a standby the leader
        return "the leader handed the lead over to it"
    if leader.host == me.host and gone(leader):
        return f"the leader's process (pid {leader.pid}) is gone"
    lapsed_ms = now_ms - state.lease_expires_ms
    if lapsed_ms < 0:
        return None
    mine = next((s for s in state.standbys if s.id == me.id), None)
    if mine is not None and state.lease_renewals > mine.seen_renewal:
        return f"the leader's lease lapsed {lapsed_ms} ms ago"
    return None


def leadership_view(state: Leadership, now_ms: int) -> LeadershipView:
    """What `GetLeadership` answers of the catalog's record `state` at `now_ms`."""

    def view(controller: ControllerInfo) -> ControllerView:
        return ControllerView(controller.role, controller.address, controller.host, controller.pid, now_ms - controller.heard_ms)

    remaining = None if state.lease_expires_ms is None else state.lease_expires_ms - now_ms
    leader = None if state.leader is None else view(state.leader)
    return LeadershipView(state.epoch, leader, remaining, state.lease_renewals, tuple(view(s) for s in state.standbys))


async def read_leadership(catalog: Catalog) -> LeadershipView:
    return leadership_view(await asyncio.to_thread(catalog.leadership), catalog.now_ms())


@dataclass(slots=True)
class LeaseClock:
    """The leader's own view of its lease, on its monotonic clock (seconds)."""

    options: LeaseOptions
    renewed_at: float
    guarded: bool = False  # standbys were registered at the last renewal

    def renewed(self, started_at: float, state: Leadership) -> None:
        """A renewal that started at `started_at` succeeded, and saw `state`."""
        self.renewed_at = max(self.renewed_at, started_at)
        self.guarded = bool(state.standbys)

    def serving(self, now: float) -> bool:
        return not self.guarded or now < self.serves_until

    @property
    def serves_until(self) -> float:
        return self.renewed_at + (self.options.lease_ms - self.options.margin_ms) / 1000


class Front:
    """What the gRPC server serves: the leader's controller once this process leads,
    until it stops serving (its lease clock says so, it lost the epoch, or it handed the
    lead over); before and after, every call but `GetVersion`, `GetLeadership` and
    `TakeLead` is UNAVAILABLE naming the leader, which a client follows (`NotLeader`). While this
    controller hands the lead over or takes it (`hold`), new calls wait for the outcome
    rather than fail, for at most a lease: a takeover whose recovery hangs refuses them
    then (UNAVAILABLE), and a client sends them again, here or to another controller."""

    def __init__(self, catalog: Catalog, lease: LeaseOptions) -> None:
        self.catalog = catalog
        self.lease = lease
        self.controller: Any = None
        self.clock: LeaseClock | None = None
        self.leader_address: str | None = None
        self.refusal = "this controller is a standby"
        self.standby: Standby | None = None  # while it stands by
        self.successor: str | None = None  # the address it handed the lead over to
        self.successor_serves = False  # and that one said it serves
        self._handing = False  # a handover is under way
        self.hand_over: Callable[[str | None], Awaitable[HandoverView]] | None = None  # while it leads
        self.serving_started = asyncio.Event()
        self._open = asyncio.Event()
        self._open.set()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def serve(self, controller: Any, clock: LeaseClock) -> None:
        self.controller, self.clock = controller, clock
        self.serving_started.set()

    def stop_serving(self, why: str, leader_address: str | None) -> None:
        self.controller, self.refusal, self.leader_address = None, why, leader_address

    @property
    def handed_over(self) -> bool:
        """Whether this controller handed the lead over (the catalog names its successor)."""
        return self.successor is not None

    async def leadership(self) -> LeadershipView:
        """Answered whether this controller leads or not: where a client asks who does."""
        return await read_leadership(self.catalog)

    async def handover(self, to: str | None = None) -> HandoverView:
        if not self._serving() or self.hand_over is None:
            raise NotLeader(self.refusal, self.leader_address)
        if self._handing:
            raise ControllerError("FAILED_PRECONDITION", "a handover is already under way")
        self._handing = True  # before any await: a second handover is refused, not raced
        try:
            return await self.hand_over(to)
        finally:
            self._handing = False  # after one that moved the lead, this front serves nothing

    async def take_lead(self, epoch: int) -> LeadershipView:
        """A standby's answer to the leader handing it the lead: poll now, and answer
        once serving (UNAVAILABLE if that takes longer than a lease)."""
        if self.standby is not None:
            self.standby.woken.set()
        try:
            await asyncio.wait_for(self.serving_started.wait(), self.lease.lease_ms / 1000)
        except TimeoutError:
            raise ControllerError("UNAVAILABLE", f"this controller did not take the lead of epoch {epoch} within {self.lease.lease_ms} ms") from None
        return await read_leadership(self.catalog)

    def hold(self) -> None:
        """New calls wait (for `release`) rather than start."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def drained(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for the calls in flight that change something (not
        `READS`) to finish; how many still run."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            pass
        return self._in_flight

    @property
    def epoch(self) -> int:
        return self.controller.epoch if self._serving() else 0

    def _serving(self) -> bool:
        return self.controller is not None and (self.clock is None or self.clock.serving(monotonic()))

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            if not self._open.is_set():
                try:
                    await asyncio.wait_for(self._open.wait(), self.lease.lease_ms / 1000)
                except TimeoutError:
                    raise NotLeader(f"the lead is still moving here or away after {self.lease.lease_ms} ms", self.leader_address) from None
            if not self._serving():
                raise NotLeader(self.refusal, self.leader_address)
            running = getattr(self.controller, name)(*args, **kwargs)
            if name in READS:  # a handover need not wait for it: it fails, naming the successor
                return await running
            self._in_flight += 1
            self._idle.clear()
            try:
                return await running
            finally:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle.set()

        return call


class NotLeader(ControllerError):
    """Refused: this controller does not lead; `leader` is the address of the one that
    does, when known (sent as the trailing metadata `tandem-leader`)."""

    def __init__(self, why: str, leader: str | None) -> None:
        where = f"; the leader is at {leader}" if leader else "; no leader is known yet"
        super().__init__("UNAVAILABLE", why + where)
        self.leader = leader


@dataclass(slots=True)
class Standby:
    """A standby's wait for the lead: `wait` polls the catalog until it takes it."""

    catalog: Catalog
    me: ControllerSpec
    options: LeaseOptions
    front: Front
    killed: str | None = None  # why it killed the leader's process, until it takes the lead
    woken: asyncio.Event = field(default_factory=asyncio.Event)  # poll now: a handover

    async def register(self) -> str | None:
        """Register this standby (once, before it says it stands by); the leader's
        address, if one leads."""
        state = await asyncio.to_thread(self.catalog.register_standby, self.me)
        self.front.leader_address = state.leader.address if state.leader is not None else None
        return self.front.leader_address

    async def wait(self) -> tuple[str, float]:
        """Poll (registering this standby each time) until it takes the lead; the cause,
        and the monotonic time it first found it could."""
        busy_ms = self.options.renew_ms
        while True:
            self.woken.clear()  # before the poll: a wake-up during it is not lost
            try:
                state = await asyncio.to_thread(self.catalog.register_standby, self.me, busy_ms=busy_ms)
                self.front.leader_address = state.leader.address if state.leader is not None else None
                if self._cause(state) is not None:
                    found = monotonic()
                    taken = await asyncio.to_thread(self.catalog.take_lead, self.me, self.options.lease_ms, self._cause, busy_ms=busy_ms)
                    if taken is not None:
                        return taken[1], found
            except Exception as error:  # an unreachable catalog: no one can take over
                log.warning("standby: cannot reach the catalog: %s", error)
                if self.catalog.dialect == "sqlite" and "locked" in str(error):
                    await asyncio.to_thread(self.kill_hung_leader)
            try:
                await asyncio.wait_for(self.woken.wait(), self.options.poll_s)
            except TimeoutError:
                pass

    def kill_hung_leader(self) -> None:
        """Kill the leader's process if it is on this host, alive, and its lapsed lease
        is this standby's to take (so it stopped serving on its own clock): called when
        the catalog stays locked, which on SQLite means it hangs holding the write lock."""
        state = self.catalog.leadership()  # a read: WAL lets it past the writer
        leader, cause = state.leader, self._cause(state)
        if leader is None or leader.id == self.me.id or leader.host != self.me.host or cause is None or process_gone(leader):
            return
        try:
            os.kill(leader.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.killed = f"{cause} and its process (pid {leader.pid}) held the catalog's write lock, hung: this standby killed it"
        log.warning("standby: %s", self.killed)

    def _cause(self, state: Leadership) -> str | None:
        cause = takeover_cause(state, self.me, self.catalog.now_ms(), self.options.lease_ms)
        return self.killed if cause is not None and self.killed is not None else cause


async def keep_lease(
    catalog: Catalog, me: ControllerSpec, clock: LeaseClock, on_lost: Callable[[str], None], on_fenced: Callable[[Fenced], None]
) -> None:
    """Renew the lease every `renew_ms` and watch the leader's clock; `on_lost(why)`
    once its clock says it may serve no more, `on_fenced(error)` once a renewal finds
    another controller took the epoch (as any fenced write does); returns then."""
    options = clock.options

    async def renew() -> None:
        while True:
            started = monotonic()
            try:
                state = await asyncio.to_thread(catalog.renew_lease, me.id, options.lease_ms, STALE_LEASES * options.lease_ms)
            except Fenced as error:
                on_fenced(error)
                return
            except Exception as error:  # a slow or unreachable catalog: the watch decides
                log.warning("renewing the lease failed: %s", error)
            else:
                clock.renewed(started, state)
            await asyncio.sleep(options.renew_ms / 1000)

    renewing = asyncio.ensure_future(renew())
    try:
        while not renewing.done():
            if not clock.serving(monotonic()):
                on_lost(f"its lease was not renewed within {options.lease_ms - options.margin_ms} ms, and a standby may take over")
                return
            await asyncio.sleep(0.05)
    finally:
        renewing.cancel()


def successor(state: Leadership, to: str | None, now_ms: int, lease_ms: int) -> ControllerInfo:
    """The standby a handover moves the lead to: the one at address `to`, or (None) the
    one heard from last; it must have been heard from within a lease."""
    if not state.standbys:
        raise ControllerError("FAILED_PRECONDITION", "no standby to hand the lead over to: start one with `tandem serve --standby`")
    if to is None:
        chosen = max(state.standbys, key=lambda s: s.heard_ms)
    else:
        chosen = next((s for s in state.standbys if s.address == to), None)
        if chosen is None:
            known = ", ".join(s.address for s in state.standbys)
            raise ControllerError("NOT_FOUND", f"no standby at {to}: the standbys are at {known}")
    if now_ms - chosen.heard_ms > lease_ms:
        raise ControllerError(
            "FAILED_PRECONDITION", f"the standby at {chosen.address} was last heard from {now_ms - chosen.heard_ms} ms ago: it may be gone"
        )
    return chosen


async def hand_over(
    front: Front,
    controller: Any,
    me: ControllerSpec,
    lease: LeaseOptions,
    to: str | None,
    tell: Callable[[str, int], Awaitable[None]],
    probe: Callable[[str], Awaitable[None]],
) -> HandoverView:
    """The leader's side of a handover to `successor(to)`: `probe` that it answers
    (else the lead stays here, nothing held), hold new calls, let those in flight
    finish (up to `DRAIN_S`), hand the epoch over in the catalog, stop driving the
    replicas (the successor connects to them), `tell` the successor (its address, the
    epoch) and wait for it to serve; then the held calls are refused naming it, so a
    client moves there with one retry. This controller serves nothing after."""
    state = await asyncio.to_thread(controller.catalog.leadership)
    target = successor(state, to, controller.catalog.now_ms(), lease.lease_ms)
    try:
        await probe(target.address)
    except Exception as error:
        raise ControllerError("FAILED_PRECONDITION", f"the standby at {target.address} does not answer ({error}): the lead stays here") from None
    held = monotonic()
    front.hold()
    phases = []  # (what, when it ended)
    try:
        unfinished = await front.drained(DRAIN_S)
        phases.append((f"draining ({unfinished} calls left)", monotonic()))
        epoch = await asyncio.to_thread(controller.catalog.hand_over, me.id, target.id, lease.lease_ms)
        phases.append(("the catalog's update", monotonic()))
    except FailedPrecondition as error:  # fenced too; not UNAVAILABLE: a client would send it on to the new leader
        front.release()
        raise ControllerError("FAILED_PRECONDITION", f"the lead stays where the catalog has it: {error}") from None
    except BaseException:
        front.release()
        raise
    front.successor = target.address
    front.stop_serving(HANDED_OVER, target.address)
    try:
        await controller.stop_driving(NotLeader(HANDED_OVER, target.address))
        phases.append(("letting the replicas go", monotonic()))
        await tell(target.address, epoch)
        front.successor_serves = True
        phases.append(("the successor's takeover", monotonic()))
    except Exception as error:
        # Not UNAVAILABLE: the lead did move, and a client must not send this call on.
        why = f"handed the lead to {target.address} as epoch {epoch}, which did not say it serves ({error!r})"
        log.warning("%s", why)
        raise ControllerError("DEADLINE_EXCEEDED", f"{why}; it, or a standby once its lease lapses, takes over") from None
    finally:
        front.release()
    took_ms = int(1000 * (monotonic() - held))
    starts = [held, *(at for _, at in phases)]
    spent = ", ".join(f"{what} {1000 * (at - start):.0f}" for (what, at), start in zip(phases, starts))
    log.warning("handed the lead over to %s as epoch %d: new calls held %d ms (%s)", target.address, epoch, took_ms, spent)
    return HandoverView(me.address, target.address, epoch, took_ms)
