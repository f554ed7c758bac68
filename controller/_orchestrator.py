"""Managed replica processes: spawned, found again after a controller restart, respawned
when they died.

A managed replica runs `python -m replica_service` in a session of its own, so it
outlives a controller crash; its pid, address and incarnation are recorded in the
catalog, and with the pid its process start (`process_start`), so that a later process
given the same pid (after the replica died, or a reboot) is never taken for it, nor
signalled. Every call here blocks (process start, catalog writes): the runtime runs them
on worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from catalog import Catalog, NotFound, ReplicaInfo
from controller._api import ControllerError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Size:
    """A named replica size: Spark resources only, never settings that change results."""

    master: str
    driver_memory: str


SIZES: Mapping[str, Size] = {
    "xsmall": Size("local[1]", "512m"),
    "small": Size("local[2]", "1g"),
    "medium": Size("local[4]", "2g"),
    "large": Size("local[8]", "4g"),
}

READY_TIMEOUT_S = 180  # a cold JVM start on a loaded 2-core machine
STOP_GRACE_S = 20.0  # a replica stopping its SparkSession on a loaded machine


def size_of(name: str) -> Size:
    size = SIZES.get(name)
    if size is None:
        raise ControllerError("INVALID_ARGUMENT", f"unknown replica size {name!r}; known sizes: {', '.join(SIZES)}")
    return size


def _reap_group(pid: int, child: subprocess.Popen | None, grace_s: float, start: str | None = None) -> None:
    """Wait up to `grace_s` for process `pid` (reaping it if it is our child), then kill
    what is left of its process group, unless the pid is now another process's than
    the one of `start`: a pid that leads a live group is never given to a new process,
    so that group is gone. (With no process of that pid at all, its group may still
    have members: they are killed.)"""
    deadline = time.monotonic() + grace_s
    if child is not None:
        try:
            child.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    while child is None and pid_alive(pid, start) and time.monotonic() < deadline:
        time.sleep(0.2)
    if child is None and start is not None and process_start(pid) not in (None, start):
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the whole group is gone
    if child is not None:
        child.wait()


def pid_alive(pid: int | None, start: str | None = None) -> bool:
    """Whether process `pid` runs (a zombie included) and, given the `process_start` it
    had when recorded, is still that process."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except OSError as e:
        if e.errno != errno.EPERM:
            return False
    return start is None or process_start(pid) == start


def process_start(pid: int) -> str | None:
    """What tells process `pid` from a later one given the same pid: the boot's id and
    the process's start time in clock ticks since boot (of 10 ms: processes of other
    pids may share it). None where the system does not tell (no Linux /proc), or when
    no such process runs."""
    fields = proc_stat(pid)
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()}/{int(fields[19])}" if fields else None
    except OSError:
        return None


def proc_stat(pid: int) -> list[bytes] | None:
    """The fields of `/proc/<pid>/stat` after the command name (which may hold spaces and
    parentheses), from the state (field 3) on; None if there is no such file."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


class Orchestrator:
    """Starts and stops the replica processes of every managed replica."""

    def __init__(
        self, catalog: Catalog, catalog_url: str, blob_location: str | Path, data_dir: Path, security_args: Sequence[str] = ()
    ) -> None:
        self.catalog = catalog
        self.security_args = list(security_args)  # the controller's TLS and token flags, for its replicas
        self.catalog_url = catalog_url
        self.blob_location = str(blob_location)  # a directory or a URI: replicas take both
        self.log_dir = data_dir / "logs"
        self.work_root = data_dir / "replicas"
        self._launching = threading.Lock()  # one JVM start at a time: they compete for 2 cores
        self._locks_lock = threading.Lock()
        self._replica_locks: dict[tuple[str, str], threading.Lock] = {}  # check-and-spawn, per replica
        # Processes this controller spawned, by pid: a dead child stays a zombie (and
        # looks alive to kill(pid, 0)) until it is reaped with poll().
        self._children: dict[int, subprocess.Popen] = {}
        self._stopping: set[int] = set()  # pids told to stop: dead to us, if not yet gone

    def alive(self, replica: ReplicaInfo) -> bool:
        if replica.pid in self._stopping:
            return False
        child = self._children.get(replica.pid)
        return child.poll() is None if child is not None else pid_alive(replica.pid, replica.process_start)

    def ensure_running(self, replica: ReplicaInfo, launch_conf: Mapping[str, str]) -> str:
        """The address of `replica`'s process, spawning a new incarnation if it died.

        Checked against the catalog's current record, and re-checked and spawned under a
        lock of the replica's own: a newer incarnation's connection that asks while an
        older one's spawn is under way finds that process rather than starting a second
        one (which nothing would stop), and other replicas' lookups do not wait for it."""
        if not replica.managed:
            return replica.address
        key = (replica.instance, replica.name)
        replica = self.catalog.get_replica(*key)
        if replica.address and self.alive(replica):
            return replica.address
        with self._locks_lock:
            lock = self._replica_locks.setdefault(key, threading.Lock())
        with lock:
            replica = self.catalog.get_replica(*key)
            if replica.address and self.alive(replica):
                return replica.address
            return self.spawn(replica, launch_conf).address

    def spawn(self, replica: ReplicaInfo, launch_conf: Mapping[str, str], ready_timeout_s: float = READY_TIMEOUT_S) -> ReplicaInfo:
        """Start a new process for `replica` and record it (incarnation + 1).

        `launch_conf` holds the instance's settings that Spark fixes at launch (e.g.
        `spark.default.parallelism`), so the replica need not restart its SparkContext.
        A process that is not ready within `ready_timeout_s` (DEADLINE_EXCEEDED) or that
        exits first (UNAVAILABLE, with its own reason when it gave one, e.g. an
        unreachable Spark master) is gone, its process group with it, when this raises.

        The pid is recorded before the process is ready, without an address, and the
        address once it is ready: a controller that dies in between leaves a process
        the catalog names. A recorded process without an address never became ready
        for any controller, so it is killed here before its successor starts.
        """
        with self._launching:
            if replica.address is None and self.alive(replica):
                log.warning("replica %s/%s: pid %d never became ready for its controller; killing it", replica.instance, replica.name, replica.pid)
                _reap_group(replica.pid, self._children.pop(replica.pid, None), 0.0, replica.process_start)
            incarnation = replica.incarnation + 1
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{replica.instance}-{replica.name}-{incarnation}.log"
            conf = {**launch_conf, **dict(replica.spark_conf)}
            # Scratch space under the data directory, one per incarnation: a killed
            # process cannot clean up after itself, so the next incarnation does.
            work_dir = self.work_root / f"{replica.instance}-{replica.name}"
            shutil.rmtree(work_dir, ignore_errors=True)
            with open(log_path, "ab") as log_file:
                process = subprocess.Popen(
                    self._command(replica, conf, work_dir),
                    stdout=subprocess.PIPE,
                    stderr=log_file,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            self._children[process.pid] = process
            recorded = False
            try:
                # Read while it cannot be reaped: the pid is still this child's.
                start = process_start(process.pid)
                self.catalog.update_replica(replica.instance, replica.name, address=None, pid=process.pid, process_start=start)
                recorded = True
                address = self._await_ready(replica.name, process, log_path, ready_timeout_s)
                started = self.catalog.update_replica(replica.instance, replica.name, address=address, incarnation=incarnation)
            except Exception:  # not ready, or the replica was dropped meanwhile: nothing would stop it
                self._children.pop(process.pid, None)
                _reap_group(process.pid, process, 0.0)  # with e.g. a JVM it left starting
                if recorded:
                    with contextlib.suppress(NotFound):
                        self.catalog.update_replica(replica.instance, replica.name, pid=None)
                raise
        log.info("replica %s/%s incarnation %d: pid %d at %s", replica.instance, replica.name, incarnation, process.pid, address)
        return started

    def _command(self, replica: ReplicaInfo, conf: dict[str, str], work_dir: Path) -> list[str]:
        """The replica process's command line; it prints one JSON line with its address
        when it is ready."""
        command = [
            sys.executable, "-m", "replica_service",
            "--listen", "127.0.0.1:0",
            "--catalog", self.catalog_url,
            "--blob-dir", self.blob_location,
            "--work-dir", str(work_dir),
            "--crash-file", str(self.work_root / f"{replica.instance}-{replica.name}.crashes.json"),
            "--spark-master", replica.spark_master,
            *self.security_args,
            "--driver-memory", conf.pop("spark.driver.memory", SIZES.get(replica.size, SIZES["xsmall"]).driver_memory),
        ]
        for key, flag in (("spark.driver.host", "--driver-host"), ("spark.driver.bindAddress", "--driver-bind-address")):
            if key in conf:
                command += [flag, conf.pop(key)]
        for key, value in sorted(conf.items()):
            command += ["--spark-conf", f"{key}={value}"]
        return command

    def _await_ready(self, name: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> str:
        """The address the process prints once ready; it prints `{"error": ...}` instead
        when it cannot start (then exits)."""
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            # The group: a child it started (its JVM) holds the other end of stdout too.
            os.killpg(process.pid, signal.SIGKILL)

        timer = threading.Timer(timeout_s, expire)
        timer.start()
        try:
            line = process.stdout.readline()
        finally:
            timer.cancel()
            process.stdout.close()
        ready = json.loads(line) if line else {}
        if "address" in ready:
            return ready["address"]
        code = process.wait()
        if expired.is_set():
            raise ControllerError("DEADLINE_EXCEEDED", f"replica {name} was not ready within {timeout_s:g} s; see {log_path}")
        reason = ready.get("error") or f"its process exited ({code}) before it was ready; see {log_path}"
        raise ControllerError("UNAVAILABLE", f"replica {name} could not start: {reason}")

    def stop(self, replica: ReplicaInfo) -> threading.Thread | None:
        """Ask a managed replica's process to shut down, if it still runs; the thread
        that reaps it (None when there was nothing to stop, or a stop is under way).

        SIGTERM goes to the Python process alone: it stops its SparkSession, and its JVM
        exits with it. (Signalling the whole group killed the JVM under a Spark that was
        still stopping.) Whatever of the group outlives `STOP_GRACE_S` is killed."""
        if not replica.managed or replica.pid in self._stopping:
            return None  # a stop under way finishes the job
        running = self.alive(replica)  # before the pop: it reaps a dead child
        child = self._children.pop(replica.pid, None)
        if not running:
            if child is not None:
                threading.Thread(target=child.wait, daemon=True).start()  # reap it
            return None
        try:
            os.kill(replica.pid, signal.SIGTERM)
        except ProcessLookupError:
            return None
        self._stopping.add(replica.pid)

        def reap() -> None:
            _reap_group(replica.pid, child, STOP_GRACE_S, replica.process_start)
            self._stopping.discard(replica.pid)

        reaper = threading.Thread(target=reap, daemon=True)
        reaper.start()
        return reaper

    def stop_all(self) -> list[ReplicaInfo]:
        """Stop every managed replica's process that runs (the catalog's record of each),
        all at once, and return once they are gone; the replicas that were running. For
        an operator's stop of the controller: a crash leaves them to reconcile."""
        stopping = [(replica, self.stop(replica)) for replica in self.catalog.list_replicas() if replica.managed]
        stopped = [(replica, reaper) for replica, reaper in stopping if reaper is not None]
        for _, reaper in stopped:
            reaper.join()
        return [replica for replica, _ in stopped]

    def running(self) -> list[ReplicaInfo]:
        """The managed replicas whose processes run, by the catalog's record."""
        return [replica for replica in self.catalog.list_replicas() if replica.managed and self.alive(replica)]
