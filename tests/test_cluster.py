"""Replicas on a real Spark cluster: a standalone master and a worker on 127.0.0.1,
started with `spark-class` from the installed pyspark, a `tandem serve` process, one
replica on the cluster and one local replica.

- both replicas compute the same versions (equal digests) and answer peeks alike;
- a worker killed with its executors (kill -9 of its process group) shows in the cluster
  replica's status (errors naming the lost executor; not in sync) while the local
  replica serves, and a new worker brings it back to the local replica's digest;
- `replica add --wait` on an unreachable master fails with UNAVAILABLE naming it, and
  on a master with no free worker with DEADLINE_EXCEEDED naming why; neither leaves a
  replica record or a process.

Needs `java`: skipped locally without it, failed in CI ($CI set). One cluster, one
controller and their replicas serve the module; every process is ended however it ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
import pyspark
import pytest

from controller._process import ControllerProcess, kill_replicas, wait_until
from controller.client import Client, TandemError

pytestmark = pytest.mark.spark

SCHEMA = "id BIGINT NOT NULL, region STRING, amount BIGINT"
TOTALS = "select region, sum(amount) as total, count(*) as n from sales group by region"
REGIONS = ["north", "south", "east", "west"]
SPARK_HOME = Path(pyspark.__file__).parent
# An executor needs no more here; the default (1g) would take the whole worker.
EXECUTOR = {"spark.executor.memory": "512m"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandaloneCluster:
    """A standalone master and its workers on 127.0.0.1, each a `spark-class` process
    leading a process group of its own: a worker's executors run in its group, so
    killing the group kills them too, as losing the machine would. Logs go to `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.processes: list[subprocess.Popen] = []
        port = _free_port()
        self.url = f"spark://127.0.0.1:{port}"
        self.master = self._start(
            "master", "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(_free_port()),
        )
        self._await_log(self.master, "Starting Spark master", 60)

    def start_worker(self) -> subprocess.Popen:
        """A worker of 1 core and 1 GB, returned once the master registered it."""
        number = len(self.processes)
        worker = self._start(
            f"worker-{number}", "org.apache.spark.deploy.worker.Worker",
            "--host", "127.0.0.1", "--webui-port", str(_free_port()), "--cores", "1", "--memory", "1g",
            "--work-dir", str(self.root / f"worker-{number}"), self.url,
        )
        self._await_log(worker, "Successfully registered with master", 60)
        return worker

    def kill(self, process: subprocess.Popen) -> None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()

    def close(self) -> None:
        for process in self.processes:
            self.kill(process)

    def _start(self, name: str, main_class: str, *args: str) -> subprocess.Popen:
        env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1"}
        with open(self.root / f"{name}.log", "ab") as log:
            process = subprocess.Popen(
                [str(SPARK_HOME / "bin" / "spark-class"), main_class, *args],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        process.log_path = self.root / f"{name}.log"
        self.processes.append(process)
        return process

    def _await_log(self, process: subprocess.Popen, line: str, timeout: float) -> None:
        def ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"{process.log_path.name} exited ({process.returncode}):\n{process.log_path.read_text()[-3000:]}")
            return line in process.log_path.read_text(errors="replace")

        wait_until(ready, timeout, f"{line!r} in {process.log_path}")


def _require_java() -> None:
    if shutil.which("java") is None:
        if os.environ.get("CI"):
            pytest.fail("java is required in CI: the cluster tests may not be skipped there")
        pytest.skip("java is not installed")


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """The cluster (master, one worker), a controller and instance "grid" with a source
    of 40 rows and the dataflow "totals" over it; no replicas yet."""
    _require_java()
    root = tmp_path_factory.mktemp("cluster")
    with ExitStack() as cleanup:  # last first, each step even if another failed
        spark = StandaloneCluster(root)
        cleanup.callback(spark.close)
        spark.worker = spark.start_worker()
        data_dir = root / "tandem"
        cleanup.callback(kill_replicas, data_dir)
        controller = ControllerProcess(data_dir)
        cleanup.callback(controller.stop)
        client = Client.connect(controller.address)
        cleanup.callback(client.close)
        client.create_instance("grid", replica_timeout_ms=20_000)
        client.create_source("sales", SCHEMA)
        client.append("sales", _rows(0, 40))
        client.create_dataflow("grid", "totals", TOTALS, index_key=["region"])
        yield spark, client
    assert not _processes_naming(spark.url), "a replica process of the cluster outlived the module"


def _rows(start: int, stop: int) -> list[dict]:
    return [{"id": i, "region": REGIONS[i % 4], "amount": i} for i in range(start, stop)]


def _expected(stop: int) -> list[dict]:
    """The totals over rows 0..stop-1 (the appends are contiguous ranges of ids)."""
    return [
        {"region": region, "total": sum(i for i in range(stop) if i % 4 == k), "n": len(range(k, stop, 4))}
        for k, region in sorted(enumerate(REGIONS), key=lambda kr: kr[1])
    ]


def _replicas(client: Client) -> dict:
    return {r.name: r for r in client.status("grid")[0].replicas}


def _same_version(client: Client, before: str | None = None) -> str:
    """Wait until both replicas are in sync and report the same digest of "totals"
    (other than `before`); returns it."""

    def agreed() -> str | None:
        replicas = _replicas(client)
        digests = {name: r.dataflows["totals"].digest for name, r in replicas.items() if "totals" in r.dataflows}
        if len(digests) == 2 and all(r.in_sync for r in replicas.values()) and len(set(digests.values())) == 1:
            digest = digests["cluster"]
            return digest if digest and digest != before else None
        return None

    return wait_until(agreed, 120, "both replicas in sync on the same version of totals")


def _processes_naming(text: str) -> list[int]:
    """Pids of live processes whose command line holds `text`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry.name))
        except OSError:
            pass  # gone meanwhile
    return pids


def test_a_cluster_replica_and_a_local_one_compute_the_same_versions(grid):
    spark, client = grid
    started = time.monotonic()
    cluster = client.add_replica(
        "grid", "cluster", spark_master=spark.url, spark_conf=EXECUTOR, driver_host="127.0.0.1", wait=True, timeout_ms=150_000
    )
    assert cluster.in_sync and cluster.spark_master == spark.url and not cluster.errors
    client.add_replica("grid", "local", size="xsmall", wait=True, timeout_ms=150_000)
    print(f"both replicas in sync after {time.monotonic() - started:.1f} s")
    first = _same_version(client)
    assert client.peek("grid", "totals", consistency="strict").rows == _expected(40)

    client.append("sales", _rows(40, 80))
    _same_version(client, before=first)
    answer = client.peek("grid", "totals", key="east", consistency="strict")
    assert answer.rows == [r for r in _expected(80) if r["region"] == "east"]


def test_a_lost_worker_shows_and_a_new_one_brings_the_replica_back(grid):
    spark, client = grid
    before = _same_version(client)
    spark.kill(spark.worker)  # the worker and its executor, as losing the machine would
    lost = wait_until(lambda: (r := _replicas(client)["cluster"]).errors and r, 30, "the cluster replica to report its lost executor")
    assert "no live Spark executors" in lost.errors[0] and "lost executor 0" in lost.errors[0], lost.errors
    assert not lost.in_sync

    client.append("sales", _rows(80, 120))
    assert client.peek("grid", "totals", consistency="strict").rows == _expected(120)  # the local replica serves
    replicas = _replicas(client)
    assert replicas["local"].in_sync and not replicas["cluster"].in_sync
    assert replicas["cluster"].dataflows["totals"].digest == before  # stuck at the old version

    recovering = time.monotonic()
    spark.worker = spark.start_worker()
    after = _same_version(client, before=before)
    print(f"the cluster replica caught up {time.monotonic() - recovering:.1f} s after the new worker started")
    assert not _replicas(client)["cluster"].errors
    assert client.peek("grid", "totals", consistency="strict").rows == _expected(120)
    assert after != before


def test_wait_on_an_unreachable_master_fails_fast_and_leaves_nothing(grid):
    _, client = grid
    master = f"spark://127.0.0.1:{_free_port()}"
    started = time.monotonic()
    with pytest.raises(TandemError) as error:
        client.add_replica("grid", "nowhere", spark_master=master, wait=True)
    took = time.monotonic() - started
    assert error.value.code == grpc.StatusCode.UNAVAILABLE
    assert error.value.message.startswith(f"replica nowhere could not start: spark master {master} is not reachable")
    assert took < 20, f"{took:.1f} s: not within the instance's 20 s replica timeout"
    assert "nowhere" not in _replicas(client)
    assert not _processes_naming(master)


def test_wait_on_a_master_without_free_workers_times_out_and_leaves_nothing(grid):
    spark, client = grid  # the one worker's core runs the "cluster" replica's executor
    with pytest.raises(TandemError) as error:
        client.add_replica("grid", "starved", spark_master=spark.url, spark_conf=EXECUTOR, wait=True, timeout_ms=40_000)
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "replica starved did not get in sync within 40000 ms" in error.value.message
    assert "no live Spark executors" in error.value.message, error.value.message
    assert "starved" not in _replicas(client)
    # Its process was told to stop when it was dropped; it takes a moment to stop Spark.
    wait_until(lambda: not any("starved" in _cmdline(pid) for pid in _processes_naming(spark.url)), 30, "the starved replica's process to end")


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
