"""Seeded chaos with real processes: every answer checked, a failing seed replays.

    .venv/bin/python bench/chaos.py --seconds 300 --seed 7

A controller (`tandem serve`), a managed replica and an external replica behind a
fault-injecting TCP proxy serve instance `chaos`. One seeded generator drives, for
`--seconds`: appends of new rows and retractions of live ones, dataflow creates and
drops, peeks, kill -9 of either replica and of the controller (each restarted), and
proxy cuts, delays and partitions. Errors while things are down are counted, not
failures. Then every fault heals, the replicas get back in sync, and every live
dataflow is read at every key once more.

Every answer (rows at a timestamp) is then checked against an independent computation
of the same query (plain Python) on the source's storage snapshot at that timestamp,
read from the batch files. A mismatch fails the run, naming the seed; the same seed
replays the same schedule (the processes' timing still varies).
`tests/test_chaos.py` runs a short schedule in CI.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from catalog import Catalog, default_url  # noqa: E402
from controller._process import ControllerProcess, kill_replicas, wait_until  # noqa: E402
from controller.client import Client, TandemError  # noqa: E402
from fault_proxy import FaultProxy  # noqa: E402
from replica_harness import ReplicaProcess  # noqa: E402
from storage import Storage  # noqa: E402

INSTANCE = "chaos"
SCHEMA = "id BIGINT NOT NULL, k STRING NOT NULL, v BIGINT NOT NULL"
KEYS = ("a", "b", "c", "d")
# Storage keeps an hour behind its upper: the snapshots the check reads stay readable.
SERVE_ARGS = ["--retention-ms", str(3_600_000)]
PEEK_TIMEOUT_MS = 10_000


def _totals(rows: list[dict]) -> list[dict]:
    groups: dict[str, list[int]] = {}
    for row in rows:
        groups.setdefault(row["k"], []).append(row["v"])
    return [{"k": k, "s": sum(vs), "n": len(vs)} for k, vs in groups.items()]


def _peaks(rows: list[dict]) -> list[dict]:
    groups: dict[str, int] = {}
    for row in rows:
        groups[row["k"]] = max(groups.get(row["k"], row["v"]), row["v"])
    return [{"k": k, "m": m} for k, m in groups.items()]


@dataclass(frozen=True)
class Query:
    sql: str
    key: str  # the index key, a single column
    compute: Callable[[list[dict]], list[dict]]  # the same query, in Python


QUERIES = {
    "totals": Query("select k, sum(v) as s, count(*) as n from events group by k", "k", _totals),
    "big": Query("select id, k, v from events where v >= 50", "id", lambda rows: [r for r in rows if r["v"] >= 50]),
    "peaks": Query("select k, max(v) as m from events group by k", "k", _peaks),
}


@dataclass
class Answer:
    dataflow: str
    key: Any
    timestamp: int
    rows: list[dict]
    replica: str | None


@dataclass
class Report:
    seed: int
    seconds: float
    actions: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)  # status name -> count (refused or down)
    answers: int = 0
    mismatches: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        actions = ", ".join(f"{name} {n}" for name, n in sorted(self.actions.items()))
        errors = ", ".join(f"{name} {n}" for name, n in sorted(self.errors.items())) or "none"
        verdict = "every answer correct" if not self.mismatches else f"{len(self.mismatches)} WRONG ANSWERS"
        return (
            f"chaos seed {self.seed}, {self.seconds:.0f} s: {self.answers} answers checked, {verdict}\n"
            f"  actions: {actions}\n  errors while faults were on: {errors}"
        )


class Chaos:
    """The cluster under chaos and what it answered."""

    def __init__(self, root: Path, seed: int) -> None:
        self.root = root
        self.seed = seed
        self.rng = random.Random(seed)
        self.url = default_url(root)
        self.controller = ControllerProcess(root, serve_args=SERVE_ARGS)
        self.client = Client.connect(self.controller.address)
        self.external = ReplicaProcess(self.url, root / "blobs", log_path=root / "external.log")
        self.external_port = self.external.address.rsplit(":", 1)[1]
        self.proxy = FaultProxy(self.external.address)
        self.live_rows: list[dict] = []  # rows this run believes are in the source
        self.next_id = 0
        self.dataflows: set[str] = set()
        self.answers: list[Answer] = []
        self.report = Report(seed, 0.0)
        self.restarts = 0

    # --- Set-up and tear-down ---------------------------------------------------------------

    def setup(self) -> None:
        self.client.create_instance(INSTANCE, min_in_sync=1, replica_timeout_ms=3000, max_lag_ms=2000)
        self.client.add_replica(INSTANCE, "managed", size="xsmall")
        self.client.add_replica(INSTANCE, "external", address=self.proxy.address)
        self.client.create_source("events", SCHEMA)
        self._append(self._new_rows(20))
        self.client.create_dataflow(INSTANCE, "totals", QUERIES["totals"].sql, index_key=["k"])
        self.dataflows.add("totals")
        wait_until(lambda: all(r.in_sync for r in self.client.status(INSTANCE)[0].replicas), 240, "both replicas in sync")

    def close(self) -> None:
        self.client.close()
        self.controller.stop()
        self.proxy.close()
        self.external.stop()
        kill_replicas(self.root)

    # --- The schedule -------------------------------------------------------------------------

    def run(self, seconds: float) -> Report:
        started = time.monotonic()
        actions = [
            (30, self.append),
            (12, self.retract),
            (30, self.peek),
            (4, self.create_dataflow),
            (3, self.drop_dataflow),
            (3, self.kill_managed),
            (2, self.kill_external),
            (2, self.kill_controller),
            (4, self.cut),
            (3, self.delay),
            (2, self.partition),
            (5, self.heal),
        ]
        weights = [w for w, _ in actions]
        while time.monotonic() - started < seconds:
            (action,) = self.rng.choices([a for _, a in actions], weights)
            self.report.actions[action.__name__] += 1
            try:
                action()
            except TandemError as error:  # down or refused while faults are on: not wrong
                self.report.errors[error.code.name] += 1
            time.sleep(self.rng.uniform(0.0, 0.2))
        self.settle()
        self.report.seconds = time.monotonic() - started
        self.check()
        return self.report

    def settle(self) -> None:
        """Heal every fault, wait until both replicas are in sync, then read every live
        dataflow at every key once more."""
        self.proxy.heal()
        if self.external.process.poll() is not None:
            self._start_external()
        wait_until(self._in_sync, 240, "both replicas in sync after the chaos")
        for name in sorted(self.dataflows):
            for key in self._keys(name):
                self._peek(name, key)

    def _in_sync(self) -> bool:
        try:
            return all(r.in_sync for r in self.client.status(INSTANCE)[0].replicas)
        except TandemError:
            return False

    # --- Actions ------------------------------------------------------------------------------

    def _new_rows(self, n: int) -> list[dict]:
        rows = []
        for _ in range(n):
            rows.append({"id": self.next_id, "k": self.rng.choice(KEYS), "v": self.rng.randrange(100)})
            self.next_id += 1
        return rows

    def _append(self, rows: list[dict]) -> None:
        self.client.append("events", rows)
        self.live_rows += rows  # only once the append returned: a failed one may not have landed

    def append(self) -> None:
        self._append(self._new_rows(self.rng.randint(1, 5)))

    def retract(self) -> None:
        if not self.live_rows:
            return
        row = self.live_rows.pop(self.rng.randrange(len(self.live_rows)))  # gone, whatever happens
        self.client.append("events", [{**row, "_diff": -1}])

    def _keys(self, name: str) -> list[Any]:
        if QUERIES[name].key == "k":
            return list(KEYS)
        return sorted({r["id"] for r in self.rng.sample(self.live_rows, min(3, len(self.live_rows)))}) or [0]

    def _peek(self, name: str, key: Any) -> None:
        result = self.client.peek(INSTANCE, name, key=key, timeout_ms=PEEK_TIMEOUT_MS)
        self.answers.append(Answer(name, key, result.timestamp, result.rows, result.replica))

    def peek(self) -> None:
        name = self.rng.choice(sorted(self.dataflows))
        self._peek(name, self.rng.choice(self._keys(name)))

    def create_dataflow(self) -> None:
        missing = sorted(set(QUERIES) - self.dataflows)
        if missing:
            name = self.rng.choice(missing)
            self.client.create_dataflow(INSTANCE, name, QUERIES[name].sql, index_key=[QUERIES[name].key])
            self.dataflows.add(name)

    def drop_dataflow(self) -> None:
        droppable = sorted(self.dataflows - {"totals"})
        if droppable:
            name = self.rng.choice(droppable)
            self.client.drop_dataflow(INSTANCE, name)
            self.dataflows.discard(name)

    def kill_managed(self) -> None:
        with Catalog.open(self.url) as catalog:
            replica = next(r for r in catalog.list_replicas(INSTANCE) if r.name == "managed")
        if replica.pid:
            try:
                os.killpg(replica.pid, signal.SIGKILL)  # its JVM with it
            except ProcessLookupError:
                pass

    def _start_external(self) -> None:
        self.restarts += 1
        self.external = ReplicaProcess(
            self.url,
            self.root / "blobs",
            log_path=self.root / f"external-{self.restarts}.log",
            args=("--listen", f"127.0.0.1:{self.external_port}"),
        )

    def kill_external(self) -> None:
        self.external.kill()
        self._start_external()

    def kill_controller(self) -> None:
        self.controller.kill()
        self.restarts += 1
        self.controller = ControllerProcess(self.root, log_name=f"controller-{self.restarts}.log", serve_args=SERVE_ARGS)
        self.client.close()
        self.client = Client.connect(self.controller.address)

    def cut(self) -> None:
        self.proxy.cut()

    def delay(self) -> None:
        self.proxy.delay(self.rng.uniform(0.05, 1.0))

    def partition(self) -> None:
        self.proxy.partition()

    def heal(self) -> None:
        self.proxy.heal()

    # --- The check ----------------------------------------------------------------------------

    def check(self) -> None:
        """Every answer against the same query in Python on the storage snapshot."""
        with Catalog.open(self.url) as catalog:
            storage = Storage(catalog, self.root / "blobs")
            source = catalog.collection_by_name("events").id
            snapshots: dict[int, list[dict]] = {}
            for answer in self.answers:
                if answer.timestamp not in snapshots:
                    snapshots[answer.timestamp] = storage.read_snapshot(source, answer.timestamp).to_pylist()
                query = QUERIES[answer.dataflow]
                expected = [r for r in query.compute(snapshots[answer.timestamp]) if r[query.key] == answer.key]
                if _canonical(answer.rows) != _canonical(expected):
                    self.report.mismatches.append(
                        f"{answer.dataflow} key {answer.key!r} at {answer.timestamp} from {answer.replica}: "
                        f"{answer.rows} != expected {expected}"
                    )
        self.report.answers = len(self.answers)


def _canonical(rows: list[dict]) -> list[tuple]:
    return sorted(tuple(sorted(row.items())) for row in rows)


def run(root: Path, seconds: float, seed: int) -> Report:
    """One chaos run in `root`; the report (its `mismatches` empty when all is well)."""
    chaos = Chaos(root, seed)
    try:
        chaos.setup()
        return chaos.run(seconds)
    finally:
        chaos.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--seed", type=int, default=random.randrange(1_000_000))
    parser.add_argument("--dir", type=Path, help="where the run's processes keep their files (default: a new temporary one)")
    args = parser.parse_args()
    import tempfile

    root = args.dir or Path(tempfile.mkdtemp(prefix="tandem-chaos-"))
    report = run(root, args.seconds, args.seed)
    print(report)
    for mismatch in report.mismatches:
        print("  WRONG:", mismatch)
    if report.mismatches:
        print(f"replay: .venv/bin/python bench/chaos.py --seconds {args.seconds:g} --seed {args.seed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
