"""The replica's SparkSession: start-up, instance settings, and running one dataflow step.

Every call here blocks (py4j); the replica runs them on worker threads, never on the
gRPC event loop.

Determinism: everything that decides *results* (partitioning, ANSI mode, time zone)
comes from the instance's `CreateInstance` and is identical on every replica; the
replica's size decides only resources (master, cores, driver memory).

Clusters (`spark://` masters): a replica process starts only on a master that accepts
it (`start_replica_session` fails fast, naming the master, rather than leaving Spark to
retry for a minute), and once running it reports an application left without executors
(`cluster_problems`), the one state in which its jobs would wait forever unseen.
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Generic, Mapping, TypeVar

import pyarrow as pa
from py4j.java_gateway import JavaGateway, JavaObject
from py4j.protocol import Py4JError
from pyspark import SparkConf, SparkContext
from pyspark.java_gateway import launch_gateway
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema

from replica_service._class_archive import archive_option, archive_path as class_archive_path, build as build_class_archive

log = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")

# PySpark's own logger writes a multi-kilobyte JSON stack trace for every failed query;
# the replica reports the error's first line itself.
logging.getLogger("SQLQueryContextLogger").disabled = True

LOG4J2_CONFIG = Path(__file__).with_name("log4j2.properties")

# Serial GC and C1 only: three concurrent starts went from ~14 s to ~7 s on a 2-core
# machine (SPARK_NOTES.md, with a 64 MB code cache; 192 MB starts as fast, and keeps
# the generated classes of many dataflows compiled: ARCHITECTURE "Generated code").
# Exit on any OutOfMemoryError: Spark's handler kills the JVM only for one thrown in a
# task thread; one thrown while the driver collects or broadcasts came back to Python
# as an ordinary error and left a JVM short of heap serving on (seen in CI: the
# replica neither died nor recovered).
DRIVER_JVM_OPTIONS = (
    "-XX:+UseSerialGC -XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=192m -XX:+ExitOnOutOfMemoryError "
    f"-Dlog4j2.configurationFile=file:{LOG4J2_CONFIG}"
)


@dataclass(frozen=True, slots=True)
class SparkSettings:
    """A replica's size: where Spark runs and with how much. Never changes results.

    `driver_host` is the address the executors reach the driver at, `driver_bind_address`
    the interface it listens on: loopback unless executors run on other hosts."""

    master: str = "local[1]"
    driver_memory: str = "512m"
    conf: Mapping[str, str] = field(default_factory=dict)
    driver_host: str = "127.0.0.1"
    driver_bind_address: str = "127.0.0.1"


class SparkUnavailable(Exception):
    """The replica's Spark master cannot run it (unreachable, or it did not register the
    application). The message is one line and names the master."""


def session_conf(settings: SparkSettings, work_dir: Path) -> dict[str, str]:
    """The launch settings of the replica's session: loopback unless told otherwise,
    quiet, no downloads."""
    conf = {
        "spark.master": settings.master,
        "spark.app.name": f"tandem-replica-{os.getpid()}",
        "spark.driver.memory": settings.driver_memory,
        "spark.driver.extraJavaOptions": f"{DRIVER_JVM_OPTIONS} {archive_option(DRIVER_JVM_OPTIONS)}".rstrip(),
        "spark.driver.host": settings.driver_host,
        "spark.driver.bindAddress": settings.driver_bind_address,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.warehouse.dir": str(work_dir / "warehouse"),
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        # Steps of different dataflows run at once, each in a pool of its own: a long
        # hydration does not queue the steps of dataflows already live behind it. Light
        # steps share the pool LIGHT_POOL, whose tasks take a free core first.
        "spark.scheduler.mode": "FAIR",
        "spark.scheduler.allocation.file": str(work_dir / "pools.xml"),
        # Materialized-view batches written by Spark are read by pyarrow too: timestamps
        # as INT64 microseconds (the default INT96 reads back as nanoseconds).
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        # A read names its batch files one by one; listing them with a Spark job (past
        # the default 32 paths) costs more than it saves.
        "spark.sql.sources.parallelPartitionDiscovery.threshold": "100000",
        # Every hash aggregate, hash join and sort of a task takes its memory in pages
        # of this size, allocated (and zeroed) whole at its first row. Spark sizes them
        # to the heap (16 MB on a 1 GB driver): a step of TPC-H q21, 160 tasks over a
        # few thousand rows, then allocated gigabytes, filling the old generation
        # between full collections (ARCHITECTURE "Memory pages"). Large inputs take
        # more pages: a large sort-merge join pays about 15%, aggregations nothing.
        "spark.buffer.pageSize": "1m",
        # Generated code is compiled once per distinct source (Janino, ~5-30 ms a class).
        # By default each source names its whole-stage codegen stage, numbered by its
        # place in the plan around it, and the cache keeps 100 classes, fewer than a few
        # dataflows' steps use: steps compiled the same code again and again. The larger
        # cache keeps more compiled code alive, hence the code cache (DRIVER_JVM_OPTIONS)
        # of 192 MB, not 64 (ARCHITECTURE "Generated code").
        "spark.sql.codegen.useIdInClassName": "false",
        "spark.sql.codegen.cache.maxEntries": "4096",
        # A shuffle map task with at most this many reducers writes a file per reducer,
        # then joins them into one: 200 files created and deleted per task at Spark's
        # default 200 shuffle partitions, which an instance may set (Tandem's default
        # is 4; AQE coalesces partitions only after the map side). With 200, about 40%
        # of the CPU of a process stepping TPC-H went to creating them (ext4's inode
        # search). At 0 every task writes one sorted file (ARCHITECTURE "Shuffle files").
        "spark.shuffle.sort.bypassMergeThreshold": "0",
    }
    conf.update(settings.conf)
    return conf


def class_archive() -> Path | None:
    """The class archive the JVMs launched here map at start-up, if it was made."""
    return class_archive_path(DRIVER_JVM_OPTIONS)


def make_class_archive(on_run: Callable[[str], None] | None = None) -> Path | None:
    """Make the class archive that the JVMs launched here map at start-up, unless it
    exists (`_class_archive`: once per Java and Spark install, about 40-90 s); None if
    it cannot be made. `on_run` is told which of its two runs starts."""
    return build_class_archive(DRIVER_JVM_OPTIONS, on_run=on_run)


def _prepare_environment(work_dir: Path) -> None:
    # Python workers run $PYSPARK_PYTHON, not sys.executable (SPARK_NOTES.md).
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Scratch space of the replica's own (spark.local.dir is overridden by this anyway).
    os.environ["SPARK_LOCAL_DIRS"] = str(work_dir / "local")
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "pools.xml").write_text(_POOLS)


LIGHT_POOL = "light"
"""The FAIR scheduler pool of light steps (an incremental dataflow's, past hydration).
Its minimum share is more than any machine has cores, so it always counts as short of
its share: when a core frees, a task of a light step takes it before any hydration's or
recompute's (Spark cannot preempt a running task; light steps wait for one to end, not
for a whole stage)."""

_POOLS = f"""<?xml version="1.0"?>
<allocations>
  <pool name="{LIGHT_POOL}"><schedulingMode>FAIR</schedulingMode><weight>1</weight><minShare>1000000</minShare></pool>
</allocations>
"""


def launch_jvm(settings: SparkSettings, work_dir: Path) -> JavaGateway | None:
    """Launch the JVM a session with `settings` will run in, and return once it listens
    (a second or two): the only step of a session's start that forks, so the only one
    that must come before any gRPC thread exists. `start_session(..., gateway=)` then
    builds the session in it, from any thread. None when this process already has its
    JVM (there is one per process, and it outlives a stopped SparkContext): the session
    is then built in that one."""
    _prepare_environment(work_dir)
    if SparkContext._gateway is not None:
        return None
    return launch_gateway(SparkConf().setAll(session_conf(settings, work_dir).items()))


def start_session(
    settings: SparkSettings, work_dir: Path, instance_conf: Mapping[str, str] = {}, gateway: JavaGateway | None = None
) -> SparkSession:
    """Start (or restart) the process's SparkSession with the replica's size settings and
    the instance's settings that must be fixed at launch (e.g. `spark.default.parallelism`),
    in the JVM of `gateway` if one was launched (`launch_jvm`), else in a new one."""
    _prepare_environment(work_dir)
    conf = {**session_conf(settings, work_dir), **instance_conf}
    if gateway is not None:
        SparkContext(conf=SparkConf().setAll(conf.items()), gateway=gateway)
    builder = SparkSession.builder
    for key, value in conf.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    return session


def jvm_alive() -> bool:
    """False once this process's JVM has exited."""
    process = getattr(SparkContext._gateway, "proc", None)
    return process is None or process.poll() is None


def jvm_exit_cause(grace_s: float = 15.0) -> str:
    """Why this process's JVM is gone, as far as its exit code tells. The gateway's socket
    breaks before a dying JVM has exited (it is still writing its heap's last words on a
    loaded machine), so wait up to `grace_s` for the exit code before calling it hung."""
    process = getattr(SparkContext._gateway, "proc", None)
    if process is None:
        return "the JVM stopped answering"
    try:
        code = process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        return "the JVM stopped answering"
    return _JVM_EXIT_CODES.get(code, f"the JVM exited with code {code}")


# -XX:+ExitOnOutOfMemoryError exits with 3; the others are SparkExitCode, the codes
# Spark's own handlers exit the JVM with.
_JVM_EXIT_CODES = {
    3: "java.lang.OutOfMemoryError (-XX:+ExitOnOutOfMemoryError: the JVM exited with code 3)",
    52: "java.lang.OutOfMemoryError (the JVM exited with code 52)",
    50: "an uncaught exception in the JVM (exit code 50)",
}


def start_replica_session(settings: SparkSettings, work_dir: Path) -> SparkSession:
    """`start_session` for a replica process, failing with `SparkUnavailable` when a
    `spark://` master cannot run it: first unless some master accepts a TCP connection
    (before the JVM starts), then unless it registered the application.

    Why both: against a dead master Spark blocks the start for about a minute (three
    registration attempts of 20 s) and then fails naming no master, so the first check
    answers at once; a master that accepts connections but never registers the
    application (not a Spark master, or one that refuses it) is caught by the second,
    after Spark's own bounded wait. Spark's standalone backend waits for the master's
    answer inside the SparkContext's start, so there is nothing left to wait for after:
    a context that ran out of attempts has the placeholder application id
    (`spark-application-<ms>`, not the master's `app-...`) and is being stopped.
    """
    if not settings.master.startswith("spark://"):
        return start_session(settings, work_dir)
    check_reachable(settings.master)
    unregistered = SparkUnavailable(
        f"spark master {settings.master} did not register the application: no answer to Spark's registration attempts"
    )
    try:
        session = start_session(settings, work_dir)
    except Py4JError:
        # A context that gave up is stopped, and building the session on it fails.
        context = SparkContext._active_spark_context
        if context is not None and not _registered(context):
            raise unregistered from None
        raise
    if not _registered(session.sparkContext):
        session.stop()
        raise unregistered
    log.info("application %s registered with spark master %s", session.sparkContext.applicationId, settings.master)
    return session


def _registered(context: SparkContext) -> bool:
    """The master registered the context's application (see `start_replica_session`)."""
    return not context._jsc.sc().isStopped() and not context.applicationId.startswith("spark-application-")


def standalone_masters(master: str) -> list[tuple[str, int]]:
    """The (host, port) of each master of a standalone URL, `spark://HOST:PORT[,HOST:PORT...]`
    (several for masters under ZooKeeper recovery); ValueError if it is not one."""
    if not master.startswith("spark://"):
        raise ValueError(f"{master!r} is not a spark:// master URL")
    addresses = []
    for part in master.removeprefix("spark://").split(","):
        host, _, port = part.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")  # an IPv6 literal
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"spark master {master!r} is not spark://HOST:PORT[,HOST:PORT...]")
        addresses.append((host, int(port)))
    return addresses


def check_reachable(master: str, timeout_s: float = 5.0) -> None:
    """Return once some master of `master` (a `spark://` URL) accepts a TCP connection;
    `SparkUnavailable` naming it, with the last reason, if none does within `timeout_s`
    each."""
    try:
        addresses = standalone_masters(master)
    except ValueError as error:
        raise SparkUnavailable(str(error)) from None
    reason = ""
    for address in addresses:
        try:
            socket.create_connection(address, timeout=timeout_s).close()
            return
        except OSError as error:
            reason = error.strerror or str(error) or type(error).__name__
    raise SparkUnavailable(f"spark master {master} is not reachable ({reason})")


def _java_message(error: Exception) -> str:
    """The first line of the Java exception's message, or of the error itself."""
    java = getattr(error, "java_exception", None)
    text = (java.getMessage() if java is not None else None) or str(error) or type(error).__name__
    return text.strip().splitlines()[0]


def apply_instance_conf(session: SparkSession, settings: SparkSettings, work_dir: Path, conf: Mapping[str, str]) -> SparkSession:
    """Apply the instance's result-deciding settings, returning the session to use.

    Runtime SQL settings are set in place. A launch-time setting that differs (e.g.
    `spark.default.parallelism`) needs a new SparkContext: the session is stopped and
    started again in the same JVM, once, when the replica first learns its instance.
    """
    static_changes = {}
    for key, value in conf.items():
        if session.conf.isModifiable(key):
            session.conf.set(key, value)
        elif session.sparkContext.getConf().get(key) != value:
            static_changes[key] = value
    if not static_changes:
        return session
    log.info("restarting the SparkContext for launch-time instance settings %s", static_changes)
    session.stop()
    return start_session(settings, work_dir, dict(conf))


def set_aside_startup_objects() -> None:
    """Exempt everything allocated so far (modules, the session, the server) from
    CPython's cyclic collections, so that `release_dropped_proxies` scans only what came
    after: a full collection of a replica-sized heap took 33 ms, this leaves under 1 ms."""
    gc.collect()
    gc.freeze()


def release_dropped_proxies() -> None:
    """Free the py4j proxies this process dropped, and the JVM objects they pin.

    A proxy sits in a reference cycle (it caches its bound methods, which point back at
    it), so CPython frees it only in a cyclic collection of its generation; one that
    lived through a step has reached the oldest, rarely collected one. Until then the
    JVM keeps the Dataset it stands for, with its plans and broadcast relations: stepping
    TPC-H q21 without this, its driver's GC time grew from 1.8 to 17 s a step over six
    changes."""
    gc.collect()


def dataflow_session(session: SparkSession, conf: Mapping[str, str]) -> SparkSession:
    """A session of its own for one dataflow or peek: separate temp views, same context.

    A new session starts from the launch settings, so the instance's runtime settings
    are applied again.
    """
    child = session.newSession()
    for key, value in conf.items():
        if child.conf.isModifiable(key):
            child.conf.set(key, value)
    return child


def query(session: SparkSession, sql: str, inputs: Mapping[str, pa.Table]) -> DataFrame:
    """`sql` with each input registered as a temp view under its name.

    Inputs arrive consolidated and canonically sorted; `createDataFrame` cuts an Arrow
    table into partitions by row count only, so the partitioning, and with it every
    float sum, is the same on every replica whatever its cores.
    """
    for name, table in inputs.items():
        # An explicit schema keeps a zone-less Arrow timestamp a TIMESTAMP_NTZ, as the
        # planner typed it (createDataFrame alone would make it a zoned TIMESTAMP).
        schema = from_arrow_schema(table.schema, prefer_timestamp_ntz=True)
        session.createDataFrame(table, schema=schema).createOrReplaceTempView(name)
    return session.sql(sql)


# Plan nodes above a global sort that keep its order.
_ORDER_PRESERVING = {"Project", "GlobalLimit", "LocalLimit", "Offset", "SubqueryAlias"}


def is_ordered(frame: DataFrame) -> bool:
    """True iff the query defines its output order (an ORDER BY at the top)."""
    node = frame._jdf.queryExecution().analyzed()
    while node.nodeName() in _ORDER_PRESERVING:
        node = node.child()
    # `global` is a Python keyword, hence getattr: a per-partition sort defines no order.
    return node.nodeName() == "Sort" and getattr(node, "global")()


def cluster_problems(session: SparkSession) -> tuple[str, ...]:
    """What stops a replica on a `spark://` master from making progress, for its
    heartbeat: its application has no live executor (jobs would wait for one forever),
    naming the executors it lost; or its SparkContext stopped (the master removed the
    application). Empty in local mode, where the driver runs the tasks itself.

    Never blocks its caller (the replica's event loop): it answers from a `_Watch`. The
    first answers are empty, until the first refresh. What is watched is
    the process's SparkContext (there is one per process), so a session that
    `apply_instance_conf` replaced still answers for its replacement.
    """
    if not session.sparkContext.master.startswith("spark://"):
        return ()
    return _EXECUTOR_WATCH.get(session.sparkContext.master)


class _Watch(Generic[K, V]):
    """A value that one worker thread reads, at most once a second, with py4j calls
    (which wait for a busy JVM); `get` never blocks: it answers the last value read (of
    any argument: the caller picks what it needs from it), `initial` until the first
    read ends. A failed read gives `failed(error, argument)`."""

    REFRESH_S = 1.0

    def __init__(self, name: str, read: Callable[[K], V], initial: V, failed: Callable[[Exception, K], V]) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._read_value, self._failed = read, failed
        self._refresh: Future | None = None
        self._refreshed_at = -math.inf
        self._value = initial

    def get(self, argument: K) -> V:
        now = time.monotonic()
        if (self._refresh is None or self._refresh.done()) and now - self._refreshed_at >= self.REFRESH_S:
            self._refreshed_at = now
            self._refresh = self._pool.submit(self._read, argument)
        return self._value

    def _read(self, argument: K) -> None:
        try:
            self._value = self._read_value(argument)
        except Exception as error:  # e.g. the context stopped between two calls
            self._value = self._failed(error, argument)


def _cluster_problems_failed(error: Exception, master: str) -> tuple[str, ...]:
    log.warning("reading the Spark executors failed: %s", error)
    return (f"cannot read the Spark executors of {master}: {_java_message(error)}",)


_LOST_NAMED = 3  # lost executors named in a problem; the rest are counted


def _read_cluster_problems(master: str) -> tuple[str, ...]:
    context = SparkContext._active_spark_context
    if context is None:
        return ()  # between a stop and a restart (`apply_instance_conf`): nothing runs yet
    jcontext = context._jsc.sc()
    if jcontext.isStopped():
        return (f"the Spark application {context.applicationId} on {master} stopped",)
    # The status store keeps removed executors too (spark.ui.retainedDeadExecutors), with
    # why they went: that is what names the lost ones.
    executors = [_executor(e) for e in _scala_list(jcontext.statusStore().executorList(False))]
    executors = [e for e in executors if e[0] != "driver"]
    if any(active for _, _, active, _ in executors):
        return ()
    problem = f"no live Spark executors: application {context.applicationId} on {master} has none"
    if not executors:
        return (f"{problem} yet (no worker with enough free cores and memory?)",)
    # The latest first: executor ids are increasing numbers.
    lost = [f"{id} on {host_port} ({reason})" for id, host_port, _, reason in sorted(executors, key=lambda e: -int(e[0]))]
    more = f" and {len(lost) - _LOST_NAMED} more" if len(lost) > _LOST_NAMED else ""
    return (f"{problem}; lost executor {', '.join(lost[:_LOST_NAMED])}{more}",)


_EXECUTOR_WATCH = _Watch("executor-watch", _read_cluster_problems, (), _cluster_problems_failed)


def _executor(summary: JavaObject) -> tuple[str, str, bool, str]:
    """(id, host:port, active, why it was removed) of a `v1.ExecutorSummary`."""
    reason = summary.removeReason()
    why = reason.get().strip().splitlines()[0][:200] if reason.isDefined() else "no reason given"
    return summary.id(), summary.hostPort(), summary.isActive(), why


def _scala_list(seq: JavaObject) -> list[JavaObject]:
    return [seq.apply(i) for i in range(seq.size())]


def job_tasks(groups: frozenset[str]) -> dict[str, tuple[int, int]]:
    """(tasks done, tasks so far) of the jobs of each Spark job group in `groups` (a
    step sets its group: `step_job_group`), as last read. Never blocks (a `_Watch`):
    a group not read yet is missing."""
    return _JOB_WATCH.get(groups)


def step_job_group(dataflow_id: str, time: int) -> str:
    """The Spark job group of one step of a dataflow at `time`: new for every step, so
    that cancelling one (`cancel_jobs`) refuses no other's jobs, not even those of a
    dataflow rebuilt under the same id that steps at the same time."""
    return f"{dataflow_id}@{time}#{next(_STEP_NUMBERS)}"


def cancel_jobs(group: str) -> None:
    """Cancel the running jobs of Spark job group `group`, and refuse any it starts
    later."""
    context = SparkContext._active_spark_context
    if context is not None:
        context._jsc.sc().cancelJobGroupAndFutureJobs(group, "because its step was cancelled")


def state_bytes() -> float:
    """Bytes of the blocks Spark keeps for persisted and checkpointed data (memory and
    disk, every executor), as last read; NaN until read or when it cannot be. Never
    blocks (a `_Watch`)."""
    return _STATE_WATCH.get(None)


def _read_state_bytes(_: None) -> float:
    context = SparkContext._active_spark_context
    if context is None:
        return math.nan
    return float(sum(info.memSize() + info.diskSize() for info in context._jsc.sc().getRDDStorageInfo()))


def _read_job_tasks(groups: frozenset[str]) -> dict[str, tuple[int, int]]:
    context = SparkContext._active_spark_context
    if context is None or not groups:
        return {}
    tracker = context.statusTracker()
    tasks = {}
    for group in groups:
        done = total = 0
        for job in tracker.getJobIdsForGroup(group):
            info = tracker.getJobInfo(job)
            for stage in info.stageIds if info is not None else ():
                stage_info = tracker.getStageInfo(stage)
                if stage_info is not None:
                    done, total = done + stage_info.numCompletedTasks, total + stage_info.numTasks
        tasks[group] = (done, total)
    return tasks


_STEP_NUMBERS = itertools.count()
_JOB_WATCH = _Watch("job-watch", _read_job_tasks, {}, lambda error, groups: {})
_STATE_WATCH = _Watch("state-watch", _read_state_bytes, math.nan, lambda error, _: math.nan)
