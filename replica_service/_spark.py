"""The replica's SparkSession: start-up, instance settings, and running one dataflow step.

Every call here blocks (py4j); the replica runs them on worker threads, never on the
gRPC event loop.

Determinism: everything that decides *results* (partitioning, ANSI mode, time zone)
comes from the instance's `CreateInstance` and is identical on every replica; the
replica's size decides only resources (master, cores, driver memory).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import pyarrow as pa
from py4j.java_gateway import JavaGateway
from pyspark import SparkConf, SparkContext
from pyspark.java_gateway import launch_gateway
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema

log = logging.getLogger(__name__)

# PySpark's own logger writes a multi-kilobyte JSON stack trace for every failed query;
# the replica reports the error's first line itself.
logging.getLogger("SQLQueryContextLogger").disabled = True

LOG4J2_CONFIG = Path(__file__).with_name("log4j2.properties")

# Serial GC, C1 only and a small code cache: three concurrent starts went from ~14 s
# to ~7 s on a 2-core machine (SPARK_NOTES.md).
FAST_START_JVM_OPTIONS = (
    "-XX:+UseSerialGC -XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=64m "
    f"-Dlog4j2.configurationFile=file:{LOG4J2_CONFIG}"
)


@dataclass(frozen=True, slots=True)
class SparkSettings:
    """A replica's size: where Spark runs and with how much. Never changes results."""

    master: str = "local[1]"
    driver_memory: str = "512m"
    conf: Mapping[str, str] = field(default_factory=dict)


def session_conf(settings: SparkSettings, work_dir: Path) -> dict[str, str]:
    """The launch settings of the replica's session: local-only, quiet, no downloads."""
    conf = {
        "spark.master": settings.master,
        "spark.app.name": f"tandem-replica-{os.getpid()}",
        "spark.driver.memory": settings.driver_memory,
        "spark.driver.extraJavaOptions": FAST_START_JVM_OPTIONS,
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.warehouse.dir": str(work_dir / "warehouse"),
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        # Steps of different dataflows run at once, each in a pool of its own: a long
        # hydration does not queue the steps of dataflows already live behind it.
        "spark.scheduler.mode": "FAIR",
        # Materialized-view batches written by Spark are read by pyarrow too: timestamps
        # as INT64 microseconds (the default INT96 reads back as nanoseconds).
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        # A read names its batch files one by one; listing them with a Spark job (past
        # the default 32 paths) costs more than it saves.
        "spark.sql.sources.parallelPartitionDiscovery.threshold": "100000",
    }
    conf.update(settings.conf)
    return conf


def _prepare_environment(work_dir: Path) -> None:
    # Python workers run $PYSPARK_PYTHON, not sys.executable (SPARK_NOTES.md).
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Scratch space of the replica's own (spark.local.dir is overridden by this anyway).
    os.environ["SPARK_LOCAL_DIRS"] = str(work_dir / "local")
    work_dir.mkdir(parents=True, exist_ok=True)


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


def jvm_exit_cause() -> str:
    """Why this process's JVM is gone, as far as its exit code tells."""
    process = getattr(SparkContext._gateway, "proc", None)
    code = process.poll() if process is not None else None
    if code is None:
        return "the JVM stopped answering"
    return _JVM_EXIT_CODES.get(code, f"the JVM exited with code {code}")


# SparkExitCode: the codes Spark's own handlers exit the JVM with.
_JVM_EXIT_CODES = {
    52: "java.lang.OutOfMemoryError (the JVM exited with code 52)",
    50: "an uncaught exception in the JVM (exit code 50)",
}


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
