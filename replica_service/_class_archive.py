"""The class archive of the JVMs Tandem launches (HotSpot's dynamic CDS archive).

A Spark driver JVM loads, parses and verifies thousands of classes before it answers
its first query: most of a replica's start-up. An archive holds those classes already
parsed and verified; every later JVM of the same Java and Spark install maps it (read
only) instead. A replica then serves about 2.0 s after it is spawned instead of 3.5 s,
and three spawned at once after 4.3 s instead of 7.0 s (`bench/startup_bench.py`,
ARCHITECTURE "Class archive").

The archive is made once by a *training run*: a JVM launched with
`-XX:ArchiveClassesAtExit` runs Tandem's own data plane over a tiny source (hydration,
incremental steps, a recompute, Parquet written by Spark) and writes the classes it
loaded as it exits. A *check run* then launches a JVM as replicas are launched, made
to fail unless it maps the archive (`-Xshare:on`), and only then is the archive
published, under a name that holds its size: a JVM mapping a cut-short archive dies of
SIGBUS, so an archive whose size is not its name's is never used. It lives in the
user's cache (`$TANDEM_CACHE_DIR`, else `$XDG_CACHE_HOME/tandem`, else
`~/.cache/tandem`), named by what it was made from (the Java binary, the Spark install
and version, the JVM options): an upgrade of any of them makes a new one. An archive
the JVM cannot use (another JDK build, another class path) it ignores, and starts as it
would without one; without an archive, nothing changes but the start-up time.

`python -m replica_service._class_archive` makes the archive of the JVMs Tandem
launches unless it exists (the controller and the test suite do so first); `--train
OUT OPTIONS` and `--check ARCHIVE OPTIONS` are the runs `build` launches.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import pyspark
from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 300.0
# Archives kept in the cache, the newest first: each install (a virtual environment at
# another path, as a CI run's clean clone may be) makes its own, of about 180 MiB.
KEEP = 3
# The training and check runs: this module with `--train OUT OPTIONS` or `--check
# ARCHIVE OPTIONS`.
COMMAND = [sys.executable, "-m", __name__]


def cache_dir() -> Path:
    explicit = os.environ.get("TANDEM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem"


def _java() -> Path | None:
    """The java binary Spark's launcher runs (`$JAVA_HOME/bin/java`, else `java` on the
    PATH), resolved; None when there is none."""
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    return Path(found).resolve() if found and Path(found).exists() else None


def _stem(jvm_options: str) -> Path | None:
    """The cache path, less its size and suffix, of the archive for JVMs launched with
    `jvm_options`; None without a java binary."""
    java = _java()
    if java is None:
        return None
    spark_home = os.environ.get("SPARK_HOME") or str(Path(pyspark.__file__).parent)
    made_from = "\n".join((str(java), str(java.stat().st_mtime_ns), spark_home, pyspark.__version__, jvm_options))
    return cache_dir() / f"spark-{pyspark.__version__}-{hashlib.sha256(made_from.encode()).hexdigest()[:16]}"


def archive_path(jvm_options: str) -> Path | None:
    """The archive for JVMs launched with `jvm_options`, if it was made and is whole
    (as long as its name says); else None."""
    stem = _stem(jvm_options)
    if stem is None:
        return None
    for candidate in stem.parent.glob(f"{stem.name}-*.jsa"):
        try:
            if candidate.stat().st_size == int(candidate.stem.rsplit("-", 1)[1]):
                return candidate
        except (OSError, ValueError):
            continue
    return None


def archive_option(jvm_options: str) -> str:
    """The JVM option that maps the archive, if there is one; else nothing."""
    path = archive_path(jvm_options)
    return f"-XX:SharedArchiveFile={path}" if path is not None else ""


# What an archive is made from, and so what a new one is made for (see `_stem`).
KEYED_ON = (
    "the Java binary (its path and modification time), the Spark install (its path and version) and "
    "the JVM options; a JVM maps an archive only with the class path it was made with, so a virtual "
    "environment at another path, whose Spark is at another path, makes its own"
)
RUNS = {"--train": "training run (1 of 2)", "--check": "check run (2 of 2)"}


def build(jvm_options: str, timeout_s: float = BUILD_TIMEOUT_S, on_run: Callable[[str], None] | None = None) -> Path | None:
    """Make the archive for JVMs launched with `jvm_options` unless it exists; return
    it, or None when it cannot be made (no java, a cache that cannot be written, a run
    that failed: logged). Concurrent callers wait for one another (a lock file beside
    it); the archive appears whole and checked, or not at all. `on_run` is told which
    run starts (`RUNS`), for a caller that shows progress."""
    stem = _stem(jvm_options)
    if stem is None:
        return None
    try:
        stem.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{stem}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return archive_path(jvm_options) or _build(stem, jvm_options, timeout_s, on_run or (lambda run: None))
    except OSError as error:
        log.warning("no JVM class archive: %s", error)
        return None


def _build(stem: Path, jvm_options: str, timeout_s: float, on_run: Callable[[str], None]) -> Path | None:
    log.info("making the JVM class archive %s (once per Java and Spark install)", stem)
    for stale in stem.parent.glob(f"{stem.name}.*.partial"):  # of a builder killed mid-way
        stale.unlink(missing_ok=True)
    partial = stem.with_name(f"{stem.name}.{os.getpid()}.partial")
    try:
        for verb, failed in (("--train", "the training run failed"), ("--check", "no JVM could map it")):
            on_run(RUNS[verb])
            run = subprocess.run(
                [*COMMAND, verb, str(partial), jvm_options],
                check=False,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                cwd=Path(__file__).resolve().parent.parent,
            )
            if run.returncode != 0 or not partial.exists():
                log.warning("no JVM class archive: %s (exit %d): %s", failed, run.returncode, run.stderr.strip()[-2000:])
                return None
        archive = stem.with_name(f"{stem.name}-{partial.stat().st_size}.jsa")
        os.replace(partial, archive)
        _prune(stem.parent)
        return archive
    except subprocess.TimeoutExpired as expired:
        log.warning("no JVM class archive: %s took over %.0f s", expired.cmd[len(COMMAND)], timeout_s)
        return None
    finally:
        partial.unlink(missing_ok=True)


def _prune(cache: Path) -> None:
    """Remove all but the `KEEP` newest archives. A JVM that maps a removed one keeps
    its pages; one launched with it afterwards starts without (a missing archive is
    ignored), and its install makes a new one at its controller's next start."""
    def modified(archive: Path) -> int:
        try:
            return archive.stat().st_mtime_ns
        except FileNotFoundError:  # pruned meanwhile by another install's builder
            return -1

    for old in sorted(cache.glob("spark-*.jsa"), key=modified, reverse=True)[KEEP:]:
        old.unlink(missing_ok=True)


def _session(work_dir: Path, jvm_options: str) -> SparkSession:
    from replica_service import _spark

    settings = _spark.SparkSettings("local[2]", conf={"spark.driver.extraJavaOptions": jvm_options})
    return _spark.start_session(settings, work_dir, {"spark.sql.shuffle.partitions": "2"})


def _train(out: Path, jvm_options: str) -> None:
    """Load what a replica loads: start a session as a replica does, hydrate and step an
    incremental dataflow (a join and an aggregate) and a recomputed one over a small
    source in storage, and write Parquet with Spark; then stop the JVM, which writes the
    archive to `out` as it exits."""
    from catalog import Catalog
    from history import DataflowDescription, IndexExport
    from replica_service import _spark
    from replica_service.dataplane import StorageReader, maintainer
    from storage import Storage

    with tempfile.TemporaryDirectory(prefix="tandem-class-archive-") as scratch:
        root = Path(scratch)
        session = _session(root / "spark", f"{jvm_options} -XX:ArchiveClassesAtExit={out}")
        catalog = Catalog.open(f"sqlite:///{root / 'catalog.db'}")
        catalog.become_controller()
        storage = Storage(catalog, root / "blobs", fsync=False)
        orders = storage.create_source("orders", "id BIGINT, region STRING, amount DOUBLE, qty DECIMAL(10,2)").id
        regions = storage.create_source("regions", "region STRING, zone STRING").id
        readers = {"orders": StorageReader(storage, orders), "regions": StorageReader(storage, regions)}
        sql = (
            "SELECT r.zone, count(*) AS n, sum(o.amount) AS total, avg(o.qty) AS mean, max(o.id) AS top, "
            "count(DISTINCT o.region) AS regions FROM orders o JOIN regions r ON o.region = r.region GROUP BY r.zone"
        )
        flows = [
            maintainer(DataflowDescription(f"f{strategy}", sql, (), (IndexExport(f"f{strategy}", ()),), strategy=strategy), _spark.dataflow_session(session, {}), readers, {}, 2)
            for strategy in ("incremental", "recompute")
        ]
        versions: list = [None] * len(flows)
        pending: list[int] = []
        for step in range(5):
            time = catalog.write_ts()
            pending.append(time)
            storage.append(orders, [{"id": step * 10 + i, "region": ("eu", "us", "jp")[i % 3], "amount": i * 1.5, "qty": Decimal(i) / 4} for i in range(10)], ts=time)
            storage.append(regions, [{"region": r, "zone": z} for r, z in (("eu", "west"), ("us", "west"), ("jp", "east"))] if step == 0 else [], ts=time)
            if step == 3:
                continue  # the next step covers two times, as a replica behind does
            for reader in readers.values():
                reader.refresh(session)
            for index, flow in enumerate(flows):
                output = flow.step(pending[-flow.coverable(pending):])  # a recompute, the last alone
                versions[index] = output.versions(versions[index])[1]
                output.finish()
            pending = []
        session.range(100).selectExpr("id", "id % 3 AS k").write.parquet(str(root / "written"))
        session.read.parquet(str(root / "written")).groupBy("k").count().collect()
        catalog.close()
        gateway = session.sparkContext._gateway
        session.stop()
        gateway.shutdown()
        gateway.proc.stdin.close()  # the JVM exits once its stdin closes
        gateway.proc.wait(BUILD_TIMEOUT_S)


def _check(archive: Path, jvm_options: str) -> None:
    """Fail unless a JVM launched as replicas are launched maps `archive` and answers."""
    with tempfile.TemporaryDirectory(prefix="tandem-class-archive-") as scratch:
        session = _session(Path(scratch), f"{jvm_options} -Xshare:on -XX:SharedArchiveFile={archive}")
        if session.range(7).count() != 7:
            raise SystemExit("the JVM mapping the archive answered wrong")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train"]:
        _train(Path(sys.argv[2]), sys.argv[3])
    elif sys.argv[1:2] == ["--check"]:
        _check(Path(sys.argv[2]), sys.argv[3])
    else:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from replica_service._spark import make_class_archive

        sys.exit(0 if make_class_archive() else 1)
