"""The orchestrator's process handling, with a stand-in for the replica process (a small
Python program that prints the ready line), so no JVM starts.

- concurrent `ensure_running` calls for a replica whose process died start ONE process;
- `stop` sends SIGTERM to the replica's own process and, after the grace period, kills
  what is left of its process group (a child that ignores SIGTERM, as a JVM busy
  stopping would), also for a process an earlier controller started;
- a process whose replica was dropped while it started is not left running;
- a process recorded without an address (its controller died before it was ready, or
  between its ready line and the record of its address) is killed by the next
  controller's orchestrator before it starts a successor;
- a recorded pid that a later, unrelated process was given is not taken for the
  replica, nor signalled by a stop, a spawn or `kill_replicas`;
- the blob location, a directory or a URI, reaches the replica's arguments intact.
- the runtime replaces a live process that failed `RESPAWN_AFTER` attempts in a row,
  unless the controller was fenced.
- a process that cannot start (it prints `{"error": ...}`, or stays silent past the
  ready timeout) is refused with its reason, and leaves no process of its group behind;
- the driver's address in a replica's conf becomes the process's own flags.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from catalog import Catalog, NotFound
from controller import _orchestrator
from controller._api import ControllerError
from controller._orchestrator import Orchestrator, pid_alive, process_start
from controller._instance import ComputeInstance
from controller._process import _zombie, kill_replicas
from controller.runtime import RESPAWN_AFTER, Controller
from history import InstanceConfig

# Prints the ready line, then starts a child (in the stand-in's process group, as its JVM
# is) that ignores SIGTERM and writes its pid to the file named by argv[1], then waits for SIGTERM.
STAND_IN = r"""
import json, os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
print(json.dumps({"address": f"127.0.0.1:{os.getpid()}"}), flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
time.sleep(600)
"""


@pytest.fixture
def orchestrator(controller: Catalog, tmp_path: Path, monkeypatch) -> Orchestrator:
    controller.create_instance("main")
    controller.create_replica("main", "r1", size="xsmall", spark_master="local[1]")
    spawned: list[int] = []

    def command(self, replica, conf, work_dir):
        spawned.append(1)
        time.sleep(0.5)  # a slow start, so concurrent callers overlap
        return [sys.executable, "-c", STAND_IN, str(tmp_path / f"child-{len(spawned)}")]

    monkeypatch.setattr(Orchestrator, "_command", command)
    orchestrator = Orchestrator(controller, "sqlite://", tmp_path / "blobs", tmp_path)
    orchestrator.spawned = spawned
    yield orchestrator
    for replica in controller.list_replicas("main"):
        orchestrator.stop(replica)


def test_concurrent_callers_for_a_dead_replica_start_one_process(orchestrator: Orchestrator, controller: Catalog):
    stale = controller.get_replica("main", "r1")  # as both connection attempts read it
    addresses: list[str] = []
    callers = [threading.Thread(target=lambda: addresses.append(orchestrator.ensure_running(stale, {}))) for _ in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(30)
    recorded = controller.get_replica("main", "r1")
    assert len(orchestrator.spawned) == 1 and recorded.incarnation == 1
    assert addresses == [recorded.address] * 3 and pid_alive(recorded.pid)


def test_stop_terminates_the_replica_then_kills_what_is_left_of_its_group(orchestrator: Orchestrator, controller: Catalog, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(_orchestrator, "STOP_GRACE_S", 1.0)
    orchestrator.ensure_running(controller.get_replica("main", "r1"), {})
    replica = controller.get_replica("main", "r1")
    child = int((tmp_path / "child-1").read_text())
    assert running(child)

    orchestrator.stop(replica)

    deadline = time.monotonic() + 10
    while (running(replica.pid) or running(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not orchestrator.alive(replica)  # it exited on SIGTERM (and was reaped)
    assert not running(child)  # the straggler that ignored SIGTERM was killed with the group


def test_a_process_an_earlier_controller_started_is_stopped_too(orchestrator: Orchestrator, controller: Catalog, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(_orchestrator, "STOP_GRACE_S", 1.0)
    orchestrator.ensure_running(controller.get_replica("main", "r1"), {})
    replica = controller.get_replica("main", "r1")
    child = int((tmp_path / "child-1").read_text())
    successor = Orchestrator(controller, "sqlite://", tmp_path / "blobs", tmp_path)  # not its parent
    assert successor.alive(replica)

    successor.stop(replica)
    successor.stop(replica)  # a second stop while the first is under way does nothing

    assert not successor.alive(replica)  # stopping counts as dead: a restart may respawn now
    deadline = time.monotonic() + 10
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(child)
    orchestrator.alive(replica)  # reap the stand-in, the first orchestrator's child


def test_a_replica_dropped_while_its_process_starts_leaves_no_process(orchestrator: Orchestrator, controller: Catalog, tmp_path: Path, monkeypatch):
    replica = controller.get_replica("main", "r1")

    record = controller.update_replica

    def dropped(*args, **kwargs):
        if kwargs.get("address"):  # found when its address is recorded
            raise NotFound("replica r1 does not exist")
        return record(*args, **kwargs)

    monkeypatch.setattr(controller, "update_replica", dropped)
    with pytest.raises(NotFound):
        orchestrator.spawn(replica, {})
    child = int((tmp_path / "child-1").read_text())
    deadline = time.monotonic() + 10
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(child) and not orchestrator._children


class ControllerKilled(BaseException):
    """What a SIGKILL of the controller at this point leaves: no cleanup of any kind."""


def test_a_process_whose_controller_died_before_recording_its_address_is_killed_by_the_next(
    orchestrator: Orchestrator, controller: Catalog, tmp_path: Path, monkeypatch
):
    record = controller.update_replica

    def killed_once_ready(*args, **kwargs):
        if kwargs.get("address"):
            raise ControllerKilled
        return record(*args, **kwargs)

    monkeypatch.setattr(controller, "update_replica", killed_once_ready)
    with pytest.raises(ControllerKilled):
        orchestrator.ensure_running(controller.get_replica("main", "r1"), {})
    monkeypatch.setattr(controller, "update_replica", record)
    orphan = controller.get_replica("main", "r1")
    orphans_child = int((tmp_path / "child-1").read_text())
    assert orphan.address is None and running(orphan.pid) and running(orphans_child)

    successor = Orchestrator(controller, "sqlite://", tmp_path / "blobs", tmp_path)
    address = successor.ensure_running(orphan, {})

    replica = controller.get_replica("main", "r1")
    assert address == replica.address and replica.pid != orphan.pid and running(replica.pid)
    assert replica.incarnation == 1  # the orphan's was never recorded
    deadline = time.monotonic() + 10
    while (running(orphan.pid) or running(orphans_child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(orphan.pid) and not running(orphans_child)  # the whole group
    orchestrator.alive(orphan)  # reap the orphan, the first orchestrator's child
    successor.stop(replica)


def test_a_process_is_told_from_a_later_one_given_the_same_pid(tmp_path: Path):
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    # Starts are clock ticks (10 ms): two processes of one tick have the same start.
    # Never so for one pid: it is given again only after the whole pid space went round.
    time.sleep(0.05)
    second = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        start = process_start(first.pid)
        assert start is not None and start == process_start(first.pid)
        assert process_start(second.pid) not in (None, start)
        assert pid_alive(first.pid, start) and pid_alive(first.pid)
        # The first's pid, as if given to the second: alive, but not that process.
        assert pid_alive(second.pid) and not pid_alive(second.pid, start)
    finally:
        for process in (first, second):
            process.kill()
            process.wait()
    assert process_start(first.pid) is None and not pid_alive(first.pid, start)


def test_the_group_of_a_recorded_process_that_is_gone_is_still_killed(tmp_path: Path):
    """A replica gone but for its JVM (a member of its group): the group is killed,
    though no process has the pid now to match the recorded start."""
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']).pid, flush=True)"],
        stdout=subprocess.PIPE, start_new_session=True,
    )
    start = process_start(leader.pid)
    member = int(leader.stdout.readline())
    leader.wait()  # reaped: the pid leads no process, only the group
    assert running(member) and process_start(leader.pid) is None
    _orchestrator._reap_group(leader.pid, None, 0.0, start)
    deadline = time.monotonic() + 10
    while running(member) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(member)


def test_a_recorded_pid_that_another_process_was_given_is_neither_the_replica_nor_signalled(
    orchestrator: Orchestrator, controller: Catalog, catalog_url: str, tmp_path: Path, monkeypatch
):
    monkeypatch.setattr(_orchestrator, "STOP_GRACE_S", 0.5)
    orchestrator.ensure_running(controller.get_replica("main", "r1"), {})
    dead = controller.get_replica("main", "r1")
    orchestrator.stop(dead)
    deadline = time.monotonic() + 10
    while running(dead.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    # An unrelated process, leading a group of its own as a replica does, now has the
    # pid the catalog records (a pid is reused once its process is gone, after a reboot
    # above all); its start is not the one recorded.
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        controller.update_replica("main", "r1", address=None, pid=unrelated.pid, process_start=dead.process_start)
        recorded = controller.get_replica("main", "r1")
        successor = Orchestrator(controller, "sqlite://", tmp_path / "blobs", tmp_path)
        assert not successor.alive(recorded)
        successor.stop(recorded)
        assert kill_replicas(tmp_path, catalog_url) == []
        address = successor.ensure_running(recorded, {})  # a process recorded without an address
        replica = controller.get_replica("main", "r1")
        assert address == replica.address and replica.pid != unrelated.pid and replica.incarnation == 2
        time.sleep(1.0)  # past the stop's grace
        assert unrelated.poll() is None
        successor.stop(replica)
    finally:
        unrelated.kill()
        unrelated.wait()


def test_a_live_process_that_keeps_failing_is_replaced_unless_the_controller_is_fenced(
    orchestrator: Orchestrator, controller: Catalog, catalog_url: str
):
    runtime = Controller(controller, catalog_url, None, Future(), orchestrator)
    runtime.drivers["main"] = type("Driver", (), {"instance": ComputeInstance(InstanceConfig.of("main", {}))})

    def address(attempt: int) -> str:
        return asyncio.run(runtime._replica_address("main", "r1", attempt))

    first = address(1)  # none running: spawned
    assert address(RESPAWN_AFTER) == first  # alive, failed fewer times in a row: kept
    second = address(RESPAWN_AFTER + 1)
    assert second != first and len(orchestrator.spawned) == 2
    newer = Catalog.open(catalog_url)
    newer.become_controller()
    newer.close()
    assert address(RESPAWN_AFTER + 5) == second  # fenced: the newer controller's process
    assert len(orchestrator.spawned) == 2


# Starts a child in its process group (as a JVM it launched), writes the child's pid to
# argv[1], then says why it cannot start and exits, as `python -m replica_service` does.
CANNOT_START = r"""
import json, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
print(json.dumps({"error": "spark master spark://127.0.0.1:9 is not reachable (Connection refused)"}), flush=True)
sys.exit(2)
"""


@pytest.mark.parametrize(
    ("program", "timeout_s", "code", "message"),
    [
        (CANNOT_START, 30.0, "UNAVAILABLE", "replica r1 could not start: spark master spark://127.0.0.1:9 is not reachable"),
        (STAND_IN.replace("print(", "0 and print("), 1.0, "DEADLINE_EXCEEDED", "replica r1 was not ready within 1 s"),
    ],
)
def test_a_process_that_cannot_start_is_refused_and_leaves_nothing(
    orchestrator: Orchestrator, controller: Catalog, tmp_path: Path, monkeypatch, program, timeout_s, code, message
):
    monkeypatch.setattr(Orchestrator, "_command", lambda self, replica, conf, work_dir: [sys.executable, "-c", program, str(tmp_path / "child")])
    with pytest.raises(ControllerError) as error:
        orchestrator.spawn(controller.get_replica("main", "r1"), {}, ready_timeout_s=timeout_s)
    assert error.value.code == code and error.value.message.startswith(message)
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 10  # SIGKILL lands a moment later
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(child) and not orchestrator._children
    assert controller.get_replica("main", "r1").pid is None


def test_the_driver_address_is_passed_as_the_process_flags(controller: Catalog, tmp_path: Path):
    from replica_service.__main__ import parse_args

    controller.create_instance("main")
    conf = {"spark.driver.host": "10.0.0.2", "spark.driver.bindAddress": "0.0.0.0", "spark.executor.cores": "2"}
    replica = controller.create_replica("main", "r2", size="custom", spark_master="spark://h:7077", spark_conf=conf)
    command = Orchestrator(controller, "sqlite://", tmp_path / "blobs", tmp_path)._command(replica, dict(conf), tmp_path)
    args = parse_args(command[3:])
    assert (args.driver_host, args.driver_bind_address, args.spark_master) == ("10.0.0.2", "0.0.0.0", "spark://h:7077")
    assert args.spark_conf == {"spark.executor.cores": "2"}


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    return pid_alive(pid) and not _zombie(pid)


def test_the_blob_location_reaches_the_replica_intact(controller: Catalog, tmp_path: Path):
    from replica_service.__main__ import parse_args

    controller.create_instance("main")
    replica = controller.create_replica("main", "r1", size="xsmall", spark_master="local[1]")
    location = "s3://bucket/tandem/blobs?region=eu-west-1"
    orchestrator = Orchestrator(controller, "sqlite://", location, tmp_path)
    command = orchestrator._command(replica, {}, tmp_path / "work")
    assert command[1:3] == ["-m", "replica_service"]
    assert parse_args(command[3:]).blob_dir == location  # a Path would have eaten a slash
    assert parse_args(["--catalog", "sqlite://", "--blob-uri", location]).blob_dir == location
