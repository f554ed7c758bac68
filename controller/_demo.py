"""`tandem demo`: what a newcomer runs first. One run on the embedded defaults (SQLite
catalog, local blobs, `xsmall` replicas on local Spark) that shows what Tandem is for:

0. on the first run of a Java and Spark install, the class archive that halves every
   Spark JVM's start-up (`replica_service/_class_archive.py`), made once, its progress
   shown (about a minute of silence otherwise, the first thing a newcomer sees);
1. a controller and an instance with two replicas, a source with data, a dataflow kept
   as an index and written as a materialized view, and a read-your-writes peek;
2. a replica killed with SIGKILL while a loop keeps peeking: no peek fails, and the
   replica comes back (incarnation + 1, a new process) and gets in sync again;
3. a resize to `small` under the same kind of load: no peek fails;
4. the controller killed with SIGKILL and restarted: the dataflows come back and the
   running replicas reconcile (they keep their dataflows) instead of recomputing.

Rules:
- One line per step, with the time since the start and the step's own time; then the
  instance's status, as `tandem status` prints it, once it is healthy (or saying why
  it is not).
- Every process it starts is ended on the way out, on success, error, Ctrl-C or SIGTERM
  (`embedded_controller`: the controller, then every replica the catalog records).
- A step that does not happen in time raises `DemoFailed`, saying what it waited for.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from controller import _progress
from controller._api import ReplicaView
from controller._process import ControllerProcess, PeekLoop, embedded_controller, wait_until
from controller.cli._render import _status
from controller.client import Client, QueryResult
from replica_service._class_archive import KEYED_ON
from replica_service._spark import class_archive, make_class_archive

T = TypeVar("T")

INSTANCE = "demo"
SCHEMA = "id BIGINT NOT NULL, region STRING, amount DOUBLE"
REGIONS = ("north", "south", "east", "west")
TOTALS = (
    "SELECT region, sum(amount) AS total, count(*) AS orders FROM orders GROUP BY region"
)
WAIT_S = 300.0  # for any one step: JVM starts on a loaded 2-core machine are slow
SETTLE_S = 60.0  # for the instance to be healthy at the end


class DemoFailed(Exception):
    """A step of the demo did not happen (in time)."""


def run(data_dir: Path | None = None, *, keep: bool = False) -> None:
    """The whole demo; `data_dir` (kept) or a temporary directory (removed unless
    `keep`)."""
    story = _Story()
    print(f"tandem demo: data in {data_dir or 'a temporary directory'}\n")
    if class_archive() is None:  # else the controller would make it, unannounced
        story.say(
            "making the JVM class archive, once for this Java and Spark install (about a minute): "
            "every Spark JVM started after it starts in about half the time"
        )
        with _progress.spinner("making the JVM class archive") as say:
            made = make_class_archive(on_run=lambda run: say(f"making the JVM class archive: {run}"))
        story.say(
            f"made the JVM class archive {made}, for {KEYED_ON}"
            if made
            else "could not make the JVM class archive (a warning above says why): Spark JVMs start without it"
        )
    with embedded_controller(data_dir, keep=keep) as controller:
        if data_dir is None and keep:
            print(f"data directory (kept): {controller.data_dir}\n")
        story.say(f"controller started (epoch {controller.epoch}) on {controller.address}")
        tour = _Tour(controller, story)
        try:
            tour.build()
            tour.kill_a_replica()
            tour.resize()
            tour.kill_the_controller()
            tour.settle()
        finally:
            tour.client.close()
    story.say("stopped the controller and every replica it started")


class _Tour:
    """The steps, in order, on one controller; `client` follows it across a restart."""

    def __init__(self, controller: ControllerProcess, story: _Story) -> None:
        self.controller = controller
        self.story = story
        self.client = Client.connect(controller.address)
        self.rows: list[dict[str, Any]] = []

    @property
    def expected(self) -> list[dict[str, Any]]:
        """What a peek of key north must answer, from the rows appended so far."""
        amounts = [r["amount"] for r in self.rows if r["region"] == "north"]
        return [{"region": "north", "total": sum(amounts), "orders": len(amounts)}]

    def build(self) -> None:
        """An instance, two replicas, data, a dataflow, a read of our own write."""
        client, say = self.client, self.story.say
        client.create_instance(INSTANCE)
        for name in ("r1", "r2"):
            client.add_replica(INSTANCE, name, size="xsmall")
        pids = ", ".join(f"{r.name} pid {r.pid}" for r in self._replicas().values())
        say(f"instance {INSTANCE}: two xsmall replicas (local[1] Spark) started: {pids}")

        client.create_source("orders", SCHEMA)
        self.rows = [
            {"id": i, "region": REGIONS[i % len(REGIONS)], "amount": i % 50 + 0.25}
            for i in range(1000)
        ]
        timestamp = client.append("orders", self.rows)
        say(f"source orders: appended {len(self.rows)} rows at timestamp {timestamp}")

        dataflow = client.create_dataflow(
            INSTANCE, "totals", TOTALS, index_key=["region"], materialize=True
        )
        say(
            f"dataflow totals: index {dataflow.index_id} on (region), "
            f"materialized view {dataflow.sink_id}"
        )
        result = self._strict_peek("the first strict peek", timeout_ms=240_000)
        say(
            f"strict peek of totals, key north: {_show(result.rows)} (answered by "
            f"{result.replica}; the replicas had to hydrate first)"
        )
        _wait(lambda: all(r.in_sync for r in self._replicas().values()), "both in sync")
        say("both replicas in sync")

    def kill_a_replica(self) -> None:
        """SIGKILL r1 under a peek loop; it comes back as incarnation + 1 in a new process."""
        victim = self._replicas()["r1"]
        with self._peeks() as loop:
            time.sleep(1)
            killed = time.monotonic()
            os.killpg(victim.pid, signal.SIGKILL)  # the replica and its JVM, as a crash would
            self.story.say(f"killed replica r1 (pid {victim.pid}) with SIGKILL; peeks go on")
            back = _wait(
                lambda: _rejoined(self._replicas().get("r1"), victim),
                "r1 to be rehydrated and in sync again",
            )
            self.story.say(
                f"r1 rehydrated: incarnation {victim.epoch} -> {back.epoch}, pid {victim.pid} -> "
                f"{back.pid}, in sync again {time.monotonic() - killed:.1f} s after the kill"
            )
            time.sleep(1)
        self.story.say(f"peeks while r1 was down and back: {loop.summary()}")
        _no_failures(loop)

    def resize(self) -> None:
        """xsmall -> small under a peek loop, then a write read back."""
        before = self._replicas()
        with self._peeks() as loop:
            started = time.monotonic()
            after = self.client.resize(INSTANCE, "small")
            took = time.monotonic() - started
            time.sleep(1)
        kept = set(before) & {r.name for r in after}
        if kept:
            raise DemoFailed(f"the resize kept the old replicas {sorted(kept)}")
        new = ", ".join(f"{r.name} pid {r.pid}" for r in after)
        self.story.say(
            f"resized to small in {took:.1f} s: {new} in sync; {', '.join(before)} dropped"
        )
        self.story.say(f"peeks during the resize: {loop.summary()}")
        _no_failures(loop)

        more = [{"id": len(self.rows), "region": "north", "amount": 100.0}]
        self.client.append("orders", more)
        self.rows += more
        result = self._strict_peek("the strict peek after the resize")
        self.story.say(
            f"appended 1 row; strict peek sees it: {_show(result.rows)} from {result.replica}"
        )

    def kill_the_controller(self) -> None:
        """SIGKILL the controller and start it again: the live replicas reconcile."""
        before = self._replicas()
        old_epoch = self.controller.epoch
        self.client.close()
        self.controller.kill()
        self.story.say(
            f"killed the controller with SIGKILL; replicas {', '.join(before)} keep running"
        )
        self.controller.start()
        self.client = Client.connect(self.controller.address)
        self.story.say(f"controller restarted: epoch {old_epoch} -> {self.controller.epoch}")
        dataflows = [d.name for d in self.client.list_dataflows(INSTANCE)]
        after = _wait(
            lambda: (r := self._replicas())
            and all(x.in_sync and x.dataflows_kept > 0 for x in r.values())
            and r,
            "the replicas to reconcile and get in sync",
        )
        self.story.say(f"dataflows back: {', '.join(dataflows)}; replicas reconciled, in sync")
        for name, replica in after.items():
            old = before.get(name)
            same = old is not None and old.pid == replica.pid
            if not same or old.dataflows_built != replica.dataflows_built:
                raise DemoFailed(f"{name} was not reconciled: before {old}, after {replica}")
            kept = replica.dataflows_kept - old.dataflows_kept
            self.story.say(
                f"  {name}: same process (pid {replica.pid}, incarnation {replica.epoch}): reconciliation kept "
                f"{kept} dataflow{'' if kept == 1 else 's'} as it ran, rebuilt none: nothing recomputed"
            )
        result = self._strict_peek("the strict peek after the restart")
        self.story.say(
            f"strict peek after the restart: {_show(result.rows)} from {result.replica}"
        )

    def settle(self) -> None:
        """Print the instance's status once it is healthy: right after the restart, a
        collection may still be more than max_lag_ms behind the clock (seen once: 5153
        ms), while the replicas catch up on the seconds the controller was down. If it
        is not healthy within `SETTLE_S`, the status says why."""
        try:
            with _progress.spinner("waiting for the instance to be healthy"):
                wait_until(lambda: self.client.status(INSTANCE)[0].health == "healthy", SETTLE_S, "a healthy instance")
        except TimeoutError:
            self.story.say(f"the instance is not healthy {SETTLE_S:g} s after the restart; the status below says why")
        print(f"\n{_status(self.client.status(INSTANCE))}\n")

    def _replicas(self) -> dict[str, ReplicaView]:
        return {r.name: r for r in self.client.status(INSTANCE)[0].replicas}

    def _strict_peek(self, what: str, timeout_ms: int = 120_000) -> QueryResult:
        result = self.client.peek(
            INSTANCE, "totals", key="north", consistency="strict", timeout_ms=timeout_ms
        )
        if result.rows != self.expected:
            raise DemoFailed(f"{what} answered {result.rows}, expected {self.expected}")
        return result

    def _peeks(self) -> PeekLoop:
        return PeekLoop(
            self.controller.address, INSTANCE, "totals", key="north", expect=self.expected
        )


# --- Helpers ---------------------------------------------------------------------------


class _Story:
    """Prints one line per step: seconds since the start, then the step's own."""

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()

    def say(self, text: str) -> None:
        now = time.monotonic()
        print(f"{now - self.start:6.1f}s {now - self.last:+6.1f}s  {text}", flush=True)
        self.last = now


def _no_failures(loop: PeekLoop) -> None:
    if loop.failures:
        raise DemoFailed(f"{len(loop.failures)} peeks failed, the first: {loop.failures[0]}")


def _rejoined(now: ReplicaView | None, before: ReplicaView) -> ReplicaView | None:
    if now and now.epoch > before.epoch and now.pid != before.pid and now.in_sync:
        return now
    return None


def _wait(predicate: Callable[[], T], what: str) -> T:
    try:
        with _progress.spinner(f"waiting for {what}"):
            return wait_until(predicate, WAIT_S, what)
    except TimeoutError as error:
        raise DemoFailed(str(error)) from None


def _show(rows: list[dict[str, Any]]) -> str:
    return "; ".join(", ".join(f"{k}={v}" for k, v in row.items()) for row in rows)
