"""What the data-plane benchmarks share: generated sources, timed appends, process
memory and a JVM's CPU, percentiles, and a controller on a data directory of its own.

Sources are generated with pyarrow alone (deterministic: `pc.random` with a seed) and
appended through the public client in batches, as a user would load them.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from catalog import Catalog  # noqa: E402
from controller._process import ControllerProcess, kill_replicas, wait_until  # noqa: E402
from controller.client import Client  # noqa: E402
from storage import Storage  # noqa: E402

SALES = "id BIGINT NOT NULL, region STRING, amount DOUBLE"
GROUPS = 100
LOAD_BATCH = 500_000


def scratch_storage(root: Path) -> Storage:
    """Storage under `root` with a SQLite catalog of its own, this process its controller
    (for benches that step dataflows in-process)."""
    catalog = Catalog.open(f"sqlite:///{root / 'catalog.db'}")
    catalog.become_controller()
    return Storage(catalog, root / "blobs", fsync=False)


def catalog_for(kind: str):
    """A context giving the catalog URL of a bench's `--catalog`: None for "sqlite" (the
    embedded default), a schema of its own on 127.0.0.1:5432/test for "postgres"
    (dropped on exit), else `kind` itself as a URL."""
    from contextlib import nullcontext

    if kind == "sqlite":
        return nullcontext(None)
    if kind != "postgres":
        return nullcontext(kind)

    @contextmanager
    def schema() -> Iterator[str]:
        import uuid

        from sqlalchemy import create_engine, text
        from sqlalchemy.pool import NullPool

        base = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        name = f"bench_{uuid.uuid4().hex[:12]}"
        admin = create_engine(base, poolclass=NullPool, isolation_level="AUTOCOMMIT")
        with admin.connect() as connection:
            connection.execute(text(f'CREATE SCHEMA "{name}"'))
        try:
            yield f"{base}?options=-csearch_path%3D{name}"
        finally:
            with admin.connect() as connection:
                connection.execute(text(f'DROP SCHEMA "{name}" CASCADE'))
            admin.dispose()

    return schema()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def p50_p99(samples: list[float]) -> str:
    if not samples:
        return "-"
    return f"{1000 * pct(samples, 50):.0f} / {1000 * pct(samples, 99):.0f} ms"


def sales_rows(start: int, count: int, *, seed: int, groups: int = GROUPS) -> pa.Table:
    """Rows `start .. start + count` of a deterministic 3-column source: ids, one of
    `groups` regions, and an amount in [0, 100)."""
    ids = pa.array(range(start, start + count), pa.int64())
    group = pc.subtract(ids, pc.multiply(pc.divide(ids, groups), groups))
    region = pc.binary_join_element_wise("r", pc.cast(group, pa.string()), "")
    amount = pc.multiply(pc.random(count, initializer=seed), 100.0)
    return pa.table({"id": ids, "region": region, "amount": amount})


def load(client: Client, source: str, rows: int, *, seed: int = 1) -> int:
    """Append `rows` generated rows in batches; the last append's timestamp."""
    last = 0
    for start in range(0, rows, LOAD_BATCH):
        last = client.append(source, sales_rows(start, min(LOAD_BATCH, rows - start), seed=seed + start))
    return last


def change(rows: int, step: int, count: int = 100, *, retract: int = 30, groups: int = GROUPS) -> pa.Table:
    """A `count`-row change at `step`: `retract` rows of the loaded source (of `groups`
    regions) retracted (their exact values, regenerated) and the rest new rows
    inserted, with `_diff`."""
    inserted = sales_rows(10**12 + step * count, count - retract, seed=10**6 + step, groups=groups)
    parts = [inserted.append_column("_diff", pa.array([1] * inserted.num_rows, pa.int64()))]
    if retract:
        # Retract rows of the first load batch (regenerated bit for bit), a different
        # stretch at every step.
        first = min(rows, LOAD_BATCH)
        offset = (step * retract) % max(1, first - retract)
        old = sales_rows(0, first, seed=1, groups=groups).slice(offset, retract)
        parts.append(old.append_column("_diff", pa.array([-1] * retract, pa.int64())))
    return pa.concat_tables(parts)


def rss_mb(pid: int | None) -> float:
    """Resident memory of a process, in MB (0 if it is gone)."""
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def jvm_of(pid: int) -> int | None:
    """The JVM child of a replica's Python process."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and "java" in open(f"/proc/{entry}/cmdline").read():
                return int(entry)
        except OSError:
            continue
    return None


class Peak:
    """The peak resident memory of some processes, sampled on a thread."""

    def __init__(self, pids: Callable[[], dict[str, int | None]]) -> None:
        self.pids = pids
        self.peak: dict[str, float] = {}
        self._stop = False
        import threading

        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            for name, pid in self.pids().items():
                self.peak[name] = max(self.peak.get(name, 0.0), rss_mb(pid))
            time.sleep(0.25)

    def stop(self) -> dict[str, float]:
        self._stop = True
        self._thread.join()
        return self.peak


def replica_pid(client: Client, instance: str) -> int:
    return wait_until(lambda: next((r.pid for r in client.status(instance)[0].replicas if r.pid), None), 180, "the replica's pid")


def hydrated(client: Client, instance: str, *names: str) -> bool:
    """Every replica reports each dataflow of `names` hydrated (its frontier past its
    as_of), in one status read."""
    replicas = client.status(instance)[0].replicas
    return bool(replicas) and all(
        r.dataflows.get(name) is not None and r.dataflows[name].hydrated for r in replicas for name in names
    )


def write_frontier(client: Client, instance: str, name: str) -> int | None:
    """The write frontier the controller knows for the dataflow `name`'s export."""
    for collection in client.status(instance)[0].collections:
        if collection.name == name:
            return collection.write_frontier
    return None


@contextmanager
def controller(root: Path, *serve_args: str) -> Iterator[Client]:
    """A controller on `root` (a fresh data directory), its client, and every process
    it started ended afterwards."""
    process = ControllerProcess(root, serve_args=list(serve_args))
    try:
        with Client.connect(process.address) as client:
            yield client
    finally:
        process.stop()
        kill_replicas(root)


class JvmCpu:
    """CPU seconds of the session's JVM, in all and by thread (read from /proc), and of
    this process."""

    def __init__(self, session) -> None:
        self._proc = Path(f"/proc/{session._jvm.java.lang.ProcessHandle.current().pid()}")
        self._marked = (0.0, 0.0)
        self._threads_at_start = self._threads()

    @staticmethod
    def _seconds(stat: str) -> tuple[str, float]:
        """The name (digits dropped, as Linux keeps it: 15 characters) and CPU seconds of
        a /proc stat line."""
        name = re.sub(r"\d+", "N", stat[stat.index("(") + 1 : stat.rindex(")")])
        fields = stat[stat.rindex(")") + 2 :].split()
        return name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime

    def _threads(self) -> dict[str, tuple[str, float]]:
        threads = {}
        for task in (self._proc / "task").iterdir():
            try:
                threads[task.name] = self._seconds((task / "stat").read_text())
            except OSError:  # the thread ended
                continue
        return threads

    def _now(self) -> tuple[float, float]:
        own = os.times()
        return self._seconds((self._proc / "stat").read_text())[1], own.user + own.system

    def mark(self) -> None:
        self._marked = self._now()

    def since_mark(self) -> tuple[float, float]:
        """The JVM's and this process's CPU seconds since `mark`."""
        jvm, own = self._now()
        return jvm - self._marked[0], own - self._marked[1]

    def by_kind(self) -> list[tuple[str, float]]:
        """The JVM's CPU seconds since this was made, by kind of thread, most first.
        Threads that ended before now are missed (Spark's pools keep theirs)."""
        kinds: Counter[str] = Counter()
        for tid, (name, seconds) in self._threads().items():
            kind = next((kind for prefix, kind in THREAD_KINDS if name.startswith(prefix)), "other")
            kinds[kind] += seconds - self._threads_at_start.get(tid, (name, 0.0))[1]
        return kinds.most_common()


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# What the JVM's threads do, by name. py4j runs each call from Python on a thread of its
# own: for a step, Catalyst's analysis and planning and the waits on its jobs.
THREAD_KINDS = (
    ("Thread-", "py4j calls: analysis, planning, job submission"),
    ("Executor task", "tasks (the executors' work)"),
    ("VM Thread", "garbage collection (serial)"),
    ("broadcast-exch", "broadcasts: collecting and hashing a join's side"),
    ("shuffle-exchan", "adaptive query stages: submitting, re-planning"),
    ("dag-scheduler", "DAG scheduler"),
    ("CN CompilerThr", "JIT compiler"),
    ("spark-listener", "listeners (status store)"),
)
