"""Leadership of controllers on one catalog, without Spark: the decisions
(`controller/_leadership.py`), their records in a real catalog (`catalog/_leadership.py`),
and a seeded simulation of a leader and standbys under kills, pauses, catalog cuts,
stops and handovers, checking that at most one controller serves at any moment, and that one does
once the faults end."""

from __future__ import annotations

import asyncio
import random
import socket
import sqlite3
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from catalog import Catalog, ControllerInfo, ControllerSpec, FailedPrecondition, Fenced, Leadership, make_engine
from controller._api import ControllerError
from controller._leadership import STALE_LEASES, Front, LeaseClock, LeaseOptions, Standby, successor, takeover_cause
from controller._orchestrator import process_start

LEASE = LeaseOptions(lease_ms=5_000, renew_ms=1_000, margin_ms=1_500)
ME = ControllerSpec("b", "127.0.0.1:7002", "h1", 20, None)


def _info(spec: ControllerSpec, role: str, seen: int = 0) -> ControllerInfo:
    return ControllerInfo(spec.id, role, spec.address, spec.host, spec.pid, spec.process_start, 0, 0, seen)


def _state(*, leader_host: str = "h2", expires: int | None = 10_000, renewals: int = 4, seen: int | None = 3) -> Leadership:
    leader = _info(ControllerSpec("a", "127.0.0.1:7001", leader_host, 10, None), "leader")
    standbys = () if seen is None else (_info(ME, "standby", seen),)
    return Leadership(2, leader if expires is not None else None, expires, renewals, standbys)


def test_a_standby_takes_a_lapsed_lease_only_once_the_leader_saw_it():
    assert takeover_cause(_state(), ME, 9_999, LEASE.lease_ms) is None  # not lapsed
    assert takeover_cause(_state(), ME, 10_250, LEASE.lease_ms) == "the leader's lease lapsed 250 ms ago"
    # Registered after the last renewal: the leader does not know it must stop on its own.
    assert takeover_cause(_state(seen=4), ME, 10_250, LEASE.lease_ms) is None
    assert takeover_cause(_state(seen=4), ME, 10_000 + 10 * LEASE.lease_ms, LEASE.lease_ms) is None
    assert takeover_cause(_state(seen=None), ME, 10_250, LEASE.lease_ms) is None  # not registered yet
    assert takeover_cause(_state(expires=None), ME, 0, LEASE.lease_ms) == "no controller leads"


def test_a_standby_on_the_leaders_host_takes_over_at_once_when_its_process_is_gone():
    gone = lambda info: True  # noqa: E731
    assert takeover_cause(_state(leader_host="h1"), ME, 0, LEASE.lease_ms, gone) == "the leader's process (pid 10) is gone"
    assert takeover_cause(_state(leader_host="h2"), ME, 0, LEASE.lease_ms, gone) is None  # another host: the lease decides
    assert takeover_cause(_state(leader_host="h1"), ME, 0, LEASE.lease_ms, lambda info: False) is None


def test_a_leader_serves_on_its_own_clock_only_while_its_lease_is_surely_its_own():
    clock = LeaseClock(LEASE, renewed_at=100.0)
    assert clock.serving(10_000.0)  # no standby seen: nobody can take over
    clock.renewed(101.0, _state())
    assert clock.serves_until == 101.0 + 3.5
    assert clock.serving(104.49) and not clock.serving(104.5)
    clock.renewed(100.5, _state())  # a slower renewal that started earlier moves nothing back
    assert clock.serves_until == 104.5


@pytest.mark.parametrize(("lease", "renew", "margin"), [(5_000, 4_000, 1_000), (5_000, 0, 1_000), (5_000, 1_000, 0)])
def test_lease_options_that_cannot_hold_are_refused(lease, renew, margin):
    with pytest.raises(ControllerError, match="renew_ms \\+ margin_ms must be below lease_ms") as refused:
        LeaseOptions(lease, renew, margin)
    assert refused.value.code == "INVALID_ARGUMENT"


class _Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000


def _catalogs(tmp_path, clock: _Clock, *skews: int) -> list[Catalog]:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    Catalog.open(url).close()  # migrated once
    return [Catalog(make_engine(url), now_ms=lambda skew=skew: clock.ms + skew) for skew in skews]


def test_taking_the_lead_bumps_the_epoch_and_fences_the_old_leader(tmp_path):
    clock = _Clock()
    a, b = _catalogs(tmp_path, clock, 0, 0)
    leader = ControllerSpec("a", "x:1", "h1", 10, None)
    assert a.take_lead(leader, 5_000, lambda state: "started") == (1, "started")
    assert b.register_standby(ME).standbys[0].seen_renewal == 1
    state = a.renew_lease("a", 5_000, 15_000)
    assert (state.lease_renewals, state.lease_expires_ms, [s.id for s in state.standbys]) == (2, clock.ms + 5_000, ["b"])
    assert b.take_lead(ME, 5_000, lambda state: None) is None  # declined: nothing changed
    assert b.leadership().epoch == 1
    clock.ms += 5_000
    assert b.take_lead(ME, 5_000, lambda state: takeover_cause(state, ME, clock.ms, 5_000)) == (2, "the leader's lease lapsed 0 ms ago")
    with pytest.raises(Fenced):
        a.renew_lease("a", 5_000, 15_000)
    state = b.leadership()
    assert (state.epoch, state.leader.id, state.standbys) == (2, "b", ())


def test_a_leader_that_leaves_ends_its_lease_and_forgets_silent_standbys(tmp_path):
    clock = _Clock()
    a, b = _catalogs(tmp_path, clock, 0, 0)
    a.take_lead(ControllerSpec("a", "x:1", "h1", 10, None), 5_000, lambda state: "started")
    b.register_standby(ME)
    clock.ms += 15_001
    assert a.renew_lease("a", 5_000, 15_000).standbys == ()  # b was silent for 3 leases
    b.register_standby(ME)  # heard from again
    assert [s.id for s in a.leave_leadership("a").standbys] == ["b"]  # what the leaver's stop reads
    state = b.leadership()
    assert state.leader is None and takeover_cause(state, ME, clock.ms, 5_000) == "no controller leads"


def test_a_standby_kills_a_leader_on_its_host_that_hangs_holding_the_catalogs_write_lock(tmp_path):
    """SQLite: a leader stopped inside a write transaction locks every writer out, so no
    standby could take its lapsed lease; the standby on its host kills it once the lease
    is its to take, and takes the lead when the lock is free."""
    clock = _Clock()
    (catalog,) = _catalogs(tmp_path, clock, 0)
    hung = subprocess.Popen(["sleep", "120"])  # the hung leader's process
    try:
        leader = ControllerSpec("a", "x:1", socket.gethostname(), hung.pid, process_start(hung.pid))
        me = ControllerSpec("b", "x:2", socket.gethostname(), 1, None)
        catalog.take_lead(leader, 5_000, lambda state: "started")
        catalog.register_standby(me)
        catalog.renew_lease("a", 5_000, 15_000)  # the leader counted the standby
        lock = sqlite3.connect(tmp_path / "catalog.db", isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")  # what the leader holds, stopped mid-transaction
        standby = Standby(catalog, me, LeaseOptions(lease_ms=5_000, renew_ms=200, margin_ms=1_500), Front(catalog, LeaseOptions()))

        async def take_over() -> tuple[str, float]:
            waiting = asyncio.ensure_future(standby.wait())
            await asyncio.sleep(1)
            assert hung.poll() is None and not waiting.done()  # the lease holds: it waits
            clock.ms += 5_001
            while hung.poll() is None:
                await asyncio.sleep(0.05)
            lock.execute("COMMIT")  # the kill ended the holder's transaction
            return await asyncio.wait_for(waiting, 30)

        cause, _ = asyncio.run(take_over())
        assert hung.returncode == -9
        assert cause.startswith("the leader's lease lapsed") and f"(pid {hung.pid}) held the catalog's write lock" in cause
        assert catalog.leadership().leader.id == "b"
    finally:
        hung.kill()
        hung.wait()


# --- The simulation ----------------------------------------------------------------------

TICK_MS = 100


@dataclass
class _Process:
    """A simulated `tandem serve`: a standby or the leader, on `host`, with its clock
    `skew_ms` off the true time; paused (SIGSTOP) or cut off from the catalog until
    some time, or dead."""

    spec: ControllerSpec
    catalog: Catalog
    skew_ms: int
    role: str = "standby"  # standby | leader | stopped | dead
    clock: LeaseClock | None = None
    paused_until: int = 0
    cut_until: int = 0
    next_ms: int = 0  # its next poll or renewal

    def monotonic(self, now_ms: int) -> float:
        return (now_ms + self.skew_ms) / 1000

    def serving(self, now_ms: int) -> bool:
        return self.role == "leader" and now_ms >= self.paused_until and self.clock.serving(self.monotonic(now_ms))


class _World:
    def __init__(self, directory: Path, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 1_000_000
        self.url = f"sqlite:///{directory / 'catalog.db'}"
        Catalog.open(self.url).close()
        self.engine = make_engine(self.url)
        self.processes: list[_Process] = []
        self.started = 0
        self.takeovers: list[str] = []
        self.handovers = 0
        self.start("h2")  # alone at first: standbys join later, one may find a leader unaware of it

    def start(self, host: str) -> _Process:
        """A new process (a supervisor's restart), a standby."""
        self.started += 1
        skew = self.rng.randint(-600, 600)  # |difference| below the margin
        process = _Process(
            ControllerSpec(f"p{self.started}", f"addr{self.started}", host, self.started, None),
            Catalog(self.engine, now_ms=lambda: self.now + skew),
            skew,
            next_ms=self.now,
        )
        self.processes.append(process)
        return process

    def gone(self, info: ControllerInfo) -> bool:
        return all(p.spec.id != info.id or p.role in ("dead", "stopped") for p in self.processes)

    def act(self, process: _Process) -> None:
        """What the process does at its next poll or renewal, if it runs and reaches the catalog."""
        if process.role in ("dead", "stopped") or self.now < process.paused_until or self.now < process.next_ms:
            return
        reachable = self.now >= process.cut_until
        if process.role == "leader":
            process.next_ms = self.now + LEASE.renew_ms
            if reachable:
                started = process.monotonic(self.now)
                try:
                    process.clock.renewed(started, process.catalog.renew_lease(process.spec.id, LEASE.lease_ms, STALE_LEASES * LEASE.lease_ms))
                except Fenced:
                    self.stopped(process)
            return
        process.next_ms = self.now + int(LEASE.poll_s * 1000)
        if not reachable:
            return
        process.catalog.register_standby(process.spec)
        now = process.catalog.now_ms()
        found = process.monotonic(self.now)
        taken = process.catalog.take_lead(
            process.spec, LEASE.lease_ms, lambda state: takeover_cause(state, process.spec, now, LEASE.lease_ms, self.gone)
        )
        if taken is not None:
            process.role, process.clock = "leader", LeaseClock(LEASE, renewed_at=found, guarded=True)  # as `serve`
            process.next_ms = self.now  # renews at once, as `keep_lease` does
            self.takeovers.append(taken[1])

    def watch(self, process: _Process) -> None:
        """A leader past its own deadline stops serving and exits (`keep_lease`)."""
        if process.role == "leader" and self.now >= process.paused_until and not process.clock.serving(process.monotonic(self.now)):
            self.stopped(process)

    def stopped(self, process: _Process) -> None:
        """`process` exits (no longer leading); its supervisor starts a standby in its place."""
        process.role = "stopped"
        self.start(process.spec.host)

    def fault(self) -> None:
        live = [p for p in self.processes if p.role in ("standby", "leader")]
        kind = self.rng.choice(["kill", "pause", "cut", "stop", "join", "handover"])
        victim = self.rng.choice(live)
        if kind == "handover":  # only the leader hands over
            victim = next((p for p in live if p.role == "leader"), victim)
        if kind == "join":
            if len(live) < 4:
                self.start(self.rng.choice(["h1", "h2"]))
        elif kind == "kill":
            victim.role = "dead"
            self.start(victim.spec.host)
        elif kind == "pause":
            victim.paused_until = self.now + self.rng.randint(500, 12_000)
        elif kind == "cut":
            victim.cut_until = self.now + self.rng.randint(500, 12_000)
        elif kind == "handover":  # to a standby it names; it stops serving once the catalog says so
            standbys = victim.catalog.leadership().standbys if victim.serving(self.now) and self.now >= victim.cut_until else ()
            if standbys:
                try:
                    victim.catalog.hand_over(victim.spec.id, self.rng.choice(standbys).id, LEASE.lease_ms)
                except Fenced:
                    pass
                self.stopped(victim)
                self.handovers += 1
        elif victim.role == "leader":  # an operator's stop: it ends its lease as it goes
            victim.catalog.leave_leadership(victim.spec.id)
            self.stopped(victim)

    def run(self, fault_ms: int, quiet_ms: int) -> list[str]:
        """Faults for `fault_ms`, then none for `quiet_ms`; who served at each tick."""
        served = []
        for _ in range((fault_ms + quiet_ms) // TICK_MS):
            if self.now < 1_000_000 + fault_ms and self.rng.random() < 0.02:
                self.fault()
            for process in self.rng.sample(self.processes, len(self.processes)):
                self.act(process)
                self.watch(process)
            serving = [p.spec.id for p in self.processes if p.serving(self.now)]
            assert len(serving) <= 1, f"at {self.now}: {serving} serve at once"
            served.append(serving[0] if serving else "")
            self.now += TICK_MS
        return served


@pytest.mark.parametrize("seed", range(6))
def test_at_most_one_controller_serves_under_kills_pauses_cuts_and_handovers_and_one_does_after(tmp_path, seed):
    # In memory where the machine has it: a catalog commit per poll and renewal.
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else tmp_path) as directory:
        world = _World(Path(directory), seed)
        served = world.run(fault_ms=120_000, quiet_ms=20_000)
        world.engine.dispose()
    assert served[-1] != "", f"nobody serves once the faults ended (takeovers: {world.takeovers})"
    assert len(world.takeovers) >= 2  # the faults moved the lead at least once
    print(f"seed {seed}: {len(world.takeovers)} takeovers, {world.handovers} handovers")


def test_a_standby_the_leader_never_saw_does_not_take_its_lease(tmp_path):
    """A leader alone renews without a guard (nobody can take over); a standby that
    registers just before the leader is cut off must not take the lapsed lease: the
    leader does not know it should stop, and serves on when it is back."""
    world = _World(tmp_path, seed=0)
    world.run(fault_ms=0, quiet_ms=3_000)
    (leader,) = [p for p in world.processes if p.role == "leader"]
    standby = world.start("h1")
    world.act(standby)  # registered after the leader's latest renewal
    leader.cut_until = world.now + 20_000
    served = world.run(fault_ms=0, quiet_ms=30_000)
    assert set(served) == {leader.spec.id}  # it served throughout; then it saw the standby
    assert standby.role == "standby" and leader.clock.guarded


def test_a_standby_that_takes_the_lead_and_is_cut_off_at_once_stops_before_another_takes_it(tmp_path):
    """The new leader's first renewal may never come: it must not serve past its own
    clock's deadline meanwhile, since the other standbys saw the lease's renewals."""
    world = _World(tmp_path, seed=1)
    world.run(fault_ms=0, quiet_ms=2_000)
    b, c = world.start("h1"), world.start("h1")
    world.run(fault_ms=0, quiet_ms=2_000)  # both counted by a renewal
    (a,) = [p for p in world.processes if p.role == "leader"]
    a.role = "dead"  # on another host: the lease must lapse
    world.gone = lambda info: False
    while b.role != "leader" and c.role != "leader":
        world.now += TICK_MS
        for process in (b, c):
            world.act(process)
    taker = b if b.role == "leader" else c
    taker.cut_until = world.now + 30_000  # before its first renewal
    served = world.run(fault_ms=0, quiet_ms=20_000)  # asserts that at most one serves
    assert served[-1] not in ("", taker.spec.id)


def test_a_handover_moves_the_lead_to_the_named_standby_and_fences_the_old_leader(tmp_path):
    clock = _Clock()
    a, b = _catalogs(tmp_path, clock, 0, 0)
    a.take_lead(ControllerSpec("a", "x:1", "h1", 10, None), 5_000, lambda state: "started")
    b.register_standby(ME)
    with pytest.raises(FailedPrecondition, match="is not a standby"):
        a.hand_over("a", "nobody", 5_000)
    assert a.hand_over("a", ME.id, 5_000) == 2
    with pytest.raises(Fenced):
        a.renew_lease("a", 5_000, 15_000)
    state = b.leadership()
    assert (state.epoch, state.leader.id, state.standbys) == (2, ME.id, ())
    cause = takeover_cause(state, ME, clock.ms, 5_000)
    assert b.take_lead(ME, 5_000, lambda state: takeover_cause(state, ME, clock.ms, 5_000)) == (2, cause)  # adopted, not bumped
    assert cause == "the leader handed the lead over to it" and b.renew_lease(ME.id, 5_000, 15_000).epoch == 2


def test_a_handover_goes_to_a_standby_heard_from_within_a_lease():
    fresh = ControllerInfo("b", "standby", "b:1", "h", 2, None, 0, 9_000, 0)
    stale = ControllerInfo("c", "standby", "c:1", "h", 3, None, 0, 1_000, 0)
    state = Leadership(3, None, None, 5, (stale, fresh))
    assert successor(state, None, 10_000, 5_000) == fresh
    with pytest.raises(ControllerError, match="last heard from 9000 ms ago") as failed:
        successor(state, "c:1", 10_000, 5_000)
    assert failed.value.code == "FAILED_PRECONDITION"
    with pytest.raises(ControllerError, match="no standby at d:1: the standbys are at c:1, b:1") as failed:
        successor(state, "d:1", 10_000, 5_000)
    assert failed.value.code == "NOT_FOUND"
    with pytest.raises(ControllerError, match="no standby to hand the lead over to") as failed:
        successor(Leadership(3, None, None, 5, ()), None, 10_000, 5_000)
    assert failed.value.code == "FAILED_PRECONDITION"


def test_a_front_holds_new_calls_through_a_handover_refuses_a_second_and_then_names_the_successor(tmp_path):
    """Calls that come while the lead is handed over wait, and are then refused naming
    the successor; a second handover meanwhile is refused at once, not raced."""
    from controller._leadership import NotLeader

    async def run() -> None:
        catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
        front = Front(catalog, LEASE)
        moved = asyncio.Event()

        class Controller:
            epoch = 3

            async def list_sources(self):
                return ["s"]

        async def hand_over(to):
            front.hold()
            await moved.wait()
            front.successor = "b:1"
            front.stop_serving("handed over", "b:1")
            front.release()
            return "view"

        front.serve(Controller(), LeaseClock(LEASE, renewed_at=0.0))
        front.hand_over = hand_over
        assert await front.list_sources() == ["s"]
        first = asyncio.ensure_future(front.handover("b:1"))
        await asyncio.sleep(0)
        held = asyncio.ensure_future(front.list_sources())
        with pytest.raises(ControllerError, match="already under way") as second:
            await front.handover("b:1")
        assert second.value.code == "FAILED_PRECONDITION"
        await asyncio.sleep(0.05)
        assert not held.done()  # it waits, it is not refused
        moved.set()
        assert await first == "view" and front.handed_over
        with pytest.raises(NotLeader) as refused:
            await held
        assert refused.value.leader == "b:1" and refused.value.code == "UNAVAILABLE"
        catalog.close()

    asyncio.run(run())


def test_a_handover_to_a_standby_that_does_not_answer_is_refused_and_the_lead_stays(tmp_path):
    """A standby heard from within a lease may have died since: the leader asks it
    (`PROBE_S`) before it holds a call or moves the epoch, and keeps the lead when it
    does not answer, rather than hand it to nobody."""
    from functools import partial

    from controller._leadership import PROBE_S, hand_over
    from controller._service import ask_leadership
    from protocol.security import ServerSecurity

    with socket.socket() as unbound:
        unbound.bind(("127.0.0.1", 0))
        dead = ControllerSpec("b", f"127.0.0.1:{unbound.getsockname()[1]}", "h1", 20, None)  # nothing listens once closed
    leader = ControllerSpec("a", "127.0.0.1:7001", "h1", 10, None)
    catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    catalog.take_lead(leader, LEASE.lease_ms, lambda state: "started")
    catalog.register_standby(dead)

    class Controller:
        epoch = 1

        def __init__(self) -> None:
            self.catalog = catalog

        async def list_sources(self):
            return ["s"]

    async def tell(address: str, epoch: int) -> None:
        raise AssertionError("a standby that does not answer is never told it leads")

    async def run() -> None:
        front = Front(catalog, LEASE)
        front.serve(Controller(), LeaseClock(LEASE, renewed_at=0.0))
        probe = partial(ask_leadership, security=ServerSecurity(), timeout_s=PROBE_S)
        with pytest.raises(ControllerError, match=f"the standby at {dead.address} does not answer") as refused:
            await hand_over(front, Controller(), leader, LEASE, dead.address, tell, probe)
        assert refused.value.code == "FAILED_PRECONDITION"
        assert await asyncio.wait_for(front.list_sources(), 1) == ["s"]  # calls are not held

    asyncio.run(run())
    state = catalog.leadership()
    assert (state.epoch, state.leader.id, [s.id for s in state.standbys]) == (1, "a", ["b"])
    catalog.close()


def test_a_call_held_through_a_change_of_leader_waits_at_most_a_lease(tmp_path):
    """A takeover whose recovery hangs (or a handover whose successor does not answer)
    holds new calls for at most a lease, then refuses them UNAVAILABLE, which a client
    sends again; calls made once the front is released go through."""
    from controller._leadership import NotLeader

    lease = LeaseOptions(lease_ms=300, renew_ms=100, margin_ms=100)

    class Controller:
        epoch = 1

        async def list_sources(self):
            return ["s"]

    async def run() -> None:
        catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
        front = Front(catalog, lease)
        front.hold()
        front.serve(Controller(), LeaseClock(lease, renewed_at=0.0))
        started = asyncio.get_running_loop().time()
        with pytest.raises(NotLeader, match="still moving here or away after 300 ms") as refused:
            await front.list_sources()
        assert refused.value.code == "UNAVAILABLE"
        assert 0.25 <= asyncio.get_running_loop().time() - started < 2
        held = asyncio.ensure_future(front.list_sources())
        await asyncio.sleep(0.1)
        front.release()
        assert await held == ["s"]
        catalog.close()

    asyncio.run(run())
