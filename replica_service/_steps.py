"""Dataflow steps on a replica: a task per scheduled dataflow computes the next change
times and runs each step on a worker thread (Spark), then builds index versions (off
the loop), advances the frontier and reports it. Errors are classified here: a passing
Spark error rebuilds the dataflow's state and retries, a passing storage error backs off
and retries, an input compacted past the dataflow asks for a new session, an error in the
user's SQL or data (or a refusal by storage) fails the dataflow alone, a dead JVM ends
the process (`step_failure`).

`DataflowSteps` holds `Replica`'s methods for them; they run on its event loop and use
its state (dataflows, step pools, readers, metrics).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from dataclasses import dataclass
from time import monotonic
from typing import Literal

import pyarrow as pa
from py4j.protocol import Py4JNetworkError
from pyspark.sql import SparkSession
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as SQLAlchemyTimeout

from catalog import AlreadyExists, CatalogError, CompactedAway, InvalidArgument, NotFound
from history import Frontier
from replica_service import _spark
from replica_service._arrangement import Version
from replica_service._dataflow import Dataflow
from replica_service.dataplane import maintainer
from replica_service.dataplane._maintain import Changes
from storage import DIFF, NegativeCount

log = logging.getLogger("replica_service._replica")

TRANSIENT_RETRIES = 5
"""A dataflow whose Spark step fails this many times in a row for a passing reason
fails (a storage or catalog hiccup is retried for as long as it lasts)."""

STORAGE_RETRY_MAX_S = 5.0
"""The longest wait between retries of a round that storage or the catalog failed."""

LOG_EVERY_RETRIES = 10
"""A dataflow retrying logs its first retry and every this many after it."""


@dataclass(frozen=True, slots=True)
class StepFailure:
    """What a failed round of steps does next: `retry` after `delay_s`, `rebuild` its
    Spark state and retry after `delay_s`, `fail` the dataflow, or ask for a
    `new_session` (its inputs are gone where it needs them); `message` says why."""

    action: Literal["retry", "rebuild", "fail", "new_session"]
    message: str
    delay_s: float = 0.0


def step_failure(error: Exception, retries: int, rebuilds: int, poll_interval_s: float) -> StepFailure:
    """How a round of steps that raised `error` is handled, after `retries` failed
    rounds in a row (of which `rebuilds` rebuilt the Spark state).

    - Data the storage holds wrong (a negative count), a refusal of what the step asked
      (`NotFound`: a dropped sink; `InvalidArgument`: a batch storage will not commit)
      fail the dataflow: retrying asks the same again.
    - A read below an input's since (`CompactedAway`) cannot be retried in this session:
      the controller compacted the input past this replica, which it no longer waits
      for; a new session rebuilds the dataflow at the current since.
    - Any other storage or catalog error (an unreachable catalog, a file system
      hiccup, a read the controller's holds did not cover yet) is retried for as long as
      it lasts, backing off from the poll interval to `STORAGE_RETRY_MAX_S`.
    - A passing Spark error (a lost executor, a missing cached block) rebuilds the
      dataflow's Spark state and retries, at most `TRANSIENT_RETRIES` times in a row.
    - Anything else is an error in the user's SQL or data: the dataflow fails.
    """
    if isinstance(error, NegativeCount):
        return StepFailure("fail", str(error))
    if isinstance(error, CompactedAway):
        return StepFailure("new_session", str(error))
    if isinstance(error, (NotFound, InvalidArgument, AlreadyExists)):
        return StepFailure("fail", f"storage refused the step: {error}")
    if isinstance(error, (OSError, CatalogError, OperationalError, InterfaceError, SQLAlchemyTimeout)):
        return StepFailure("retry", f"storage failed: {error}", min(poll_interval_s * 2**retries, STORAGE_RETRY_MAX_S))
    if _is_passing(error) and rebuilds < TRANSIENT_RETRIES:
        message = f"step failed ({spark_error_message(error)}), rebuilding its state"
        return StepFailure("rebuild", message, min(2 ** (rebuilds + 1), 30))
    return StepFailure("fail", spark_error_message(error))


class DataflowSteps:
    """`Replica`'s dataflow steps (a mixin: the state is the replica's)."""

    async def _run(self, dataflow: Dataflow) -> None:
        """Compute `dataflow` until it is dropped, fails, or reaches `until`; then
        release its Spark state."""
        try:
            await self._steps(dataflow, self.wakeups[dataflow.id])
        finally:
            self._release_state(dataflow)

    async def _steps(self, dataflow: Dataflow, wakeup: asyncio.Event) -> None:
        """Step `dataflow` through the times its inputs reach, at each `wakeup`. A round
        that fails is handled as `step_failure` says: retried after a delay (passing
        errors, shown in the status as retrying), retried with its Spark state rebuilt,
        or the end of this dataflow here (failed, or in need of a new session)."""
        loop = asyncio.get_running_loop()
        session = None
        rebuilds = 0  # rounds in a row that rebuilt the Spark state
        while True:
            wakeup.clear()
            try:
                if session is None:
                    base = await self.spark()
                    session = await loop.run_in_executor(self._step_pool, _spark.dataflow_session, base, self.instance.conf())
                await self._refresh_readers(dataflow)
                upper = dataflow.input_upper()  # fixed for this round: inputs move meanwhile
                times = pending = dataflow.next_times(upper)
                while pending:
                    # As many times as the maintainer computes in one pass: all of them
                    # once hydrated (a ranked aggregate's, fewer: `coverable`).
                    count = dataflow.maintainer.coverable(pending) if dataflow.maintainer is not None else 1
                    covered, pending = pending[:count], pending[count:]
                    following = Frontier(pending[0]) if pending else upper
                    await self._step(dataflow, session, covered, following, last=not pending)
                if not times and upper > dataflow.frontier and dataflow.last_computed is not None:
                    await self._advance_sinks(dataflow, upper)
                self._advance(dataflow, upper)
                rebuilds, dataflow.retries, dataflow.retry_error = 0, 0, None
            except Exception as e:
                if isinstance(e, (Py4JNetworkError, ConnectionError)) or not _spark.jvm_alive():
                    self._lost_jvm({dataflow.id, *self.in_flight})  # a dying JVM raises all sorts
                failure = step_failure(e, dataflow.retries, rebuilds, self.parameters.input_poll_interval_ms / 1000)
                if failure.action == "fail":
                    self._fail(dataflow, failure.message)
                    return
                if failure.action == "new_session":
                    dataflow.needs_new_session = failure.message
                    log.warning("dataflow %s cannot go on in this session, asking for a new one: %s", dataflow.desc.name, failure.message)
                    self._notify_progress()
                    return
                dataflow.retries, dataflow.retry_error = dataflow.retries + 1, failure.message
                if failure.action == "rebuild":
                    rebuilds += 1
                    self._release_state(dataflow)
                if dataflow.retries == 1 or dataflow.retries % LOG_EVERY_RETRIES == 0:
                    log.warning("dataflow %s: %s, retry %d in %.1f s", dataflow.desc.name, failure.message, dataflow.retries, failure.delay_s)
                self._notify_progress()
                await asyncio.sleep(failure.delay_s)
                wakeup.set()
            if dataflow.frontier.is_empty or dataflow.frontier == dataflow.desc.until:
                return
            await wakeup.wait()  # set by the storage poller or an upstream dataflow

    def _release_state(self, dataflow: Dataflow) -> None:
        """Release the Spark state of `dataflow`'s maintainer (its checkpoints: a drop
        would otherwise leave them until the JVM collects their RDDs, which may take half
        an hour); a next step builds a new one. With a step still on a worker (a drop
        cancelled the task awaiting it), once that step ends."""
        step = dataflow.stepping
        if step is not None and not step.done():
            step.add_done_callback(lambda _: self._release_state(dataflow))
            return
        built, dataflow.maintainer = dataflow.maintainer, None
        if built is not None:
            try:
                built.close()
            except Exception as e:  # a stopped session or a dead JVM holds nothing more
                log.debug("dataflow %s: releasing its state failed: %s", dataflow.desc.name, e)

    def _lost_jvm(self, computing: set[str]) -> None:
        """The JVM is gone (an OutOfMemoryError in a task kills it): record what it was
        computing, so that the next incarnation does not die the same way forever, and
        exit for the controller to start one."""
        cause = _spark.jvm_exit_cause()
        log.critical("lost the Spark driver (%s) while computing %s; exiting so that the replica is restarted", cause, sorted(computing))
        self.crashes.record(computing, cause)
        os._exit(70)

    def _fail(self, dataflow: Dataflow, error: str) -> None:
        dataflow.error = error
        log.warning("dataflow %s failed: %s", dataflow.desc.name, error)
        self._notify_progress()

    async def _step(self, dataflow: Dataflow, session: SparkSession, times: list[int], following: Frontier, *, last: bool) -> None:
        """Compute `dataflow` at `times` (one Spark step: each time's changes collected
        for its indexes, written to its sinks), install a version at each, and advance
        the dataflow to `following` (the next time to compute, or the inputs' upper).
        The hydration of a dataflow created live that is the `last` time to compute for
        now ends with a rehearsal (`_rehearse`)."""
        loop = asyncio.get_running_loop()
        time = times[-1]
        previous = _latest_rows(dataflow)
        # A sink holds this version until the next one; with closed inputs, from now on.
        sink_upper = time + 1 if following.is_empty else following.time
        queued = monotonic()
        self.in_flight.add(dataflow.id)
        group = dataflow.job_group = _spark.step_job_group(dataflow.id, time)
        try:
            pool = self._light_step_pool if dataflow.light else self._step_pool
            # Ordered by cost (`StepPool`): what the step is expected to take; before the
            # first (a hydration, a pass over whole snapshots), the costliest.
            cost = dataflow.expected_step_ms if dataflow.steps else math.inf
            rehearse = last and not dataflow.steps and not dataflow.replayed
            dataflow.stepping = pool.submit_costed(cost, self._compute, dataflow, session, times, group, previous, sink_upper, rehearse)
            changes, rows, changed, started, elapsed_ms, rehearsal_ms = await asyncio.wrap_future(dataflow.stepping)
        except asyncio.CancelledError:
            # Dropped (or the replica stops): its Spark jobs stop too, and later ones of
            # the step are refused, so that they no longer hold the cluster. Called here,
            # not on the storage workers: they may all wait for Spark jobs that wait for
            # the cores this step holds (it only posts an event to Spark's scheduler).
            try:
                _spark.cancel_jobs(group)
            except Exception as e:  # a dead JVM runs nothing
                log.warning("dataflow %s: cancelling its step's Spark jobs failed: %s", dataflow.desc.name, e)
            raise
        finally:
            self.in_flight.discard(dataflow.id)
            dataflow.job_group = None
            if dataflow.stepping is not None and dataflow.stepping.done():  # else a drop's release waits for it
                dataflow.stepping = None  # its result holds a whole version's rows
        # The step's own time (`elapsed_ms`): not the wait for a free worker, which says
        # how busy the replica is, not what the step costs.
        self.metrics.observe_step(dataflow, elapsed_ms, changed, len(times))
        computed = f"time {time}" if len(times) == 1 else f"{len(times)} times {times[0]}..{time}"
        log.info(
            "dataflow %s: computed %s in %d ms (after %d ms waiting for a worker), %d rows changed",
            dataflow.desc.name, computed, elapsed_ms, int(1000 * (started - queued)), changed,
        )
        if rehearsal_ms is not None:
            log.info("dataflow %s: rehearsed a step in %d ms", dataflow.desc.name, rehearsal_ms)
        if dataflow.arrangements:
            # A version at every time computed; those before the last as their changes.
            by_time = dict(changes)
            unchanged = rows.slice(0, 0).append_column(DIFF, pa.array([], pa.int64()))
            earlier = [(t, by_time.get(t, unchanged)) for t in times[:-1]]
            last_changes = by_time.get(time, unchanged)
            if rows.num_rows and dataflow.desc.name == self._perturbed:
                rows, last_changes = pa.concat_tables([rows, rows.slice(rows.num_rows - 1)]), None
        for arrangement in dataflow.arrangements.values():
            version = await loop.run_in_executor(self._io_pool, Version.build, time, rows, arrangement.key)
            arrangement.extend(earlier, version, last_changes)
            dataflow.digest, dataflow.digest_time = version.digest, time
        dataflow.last_computed = time
        dataflow.steps += 1
        dataflow.last_step_ms, dataflow.rows_changed, dataflow.last_step_times = elapsed_ms, changed, len(times)
        dataflow.expected_step_ms = rehearsal_ms if rehearsal_ms is not None else elapsed_ms
        self._advance(dataflow, following)

    def _compute(
        self, dataflow: Dataflow, session: SparkSession, times: list[int], group: str, previous: pa.Table | None, sink_upper: int, rehearse: bool
    ) -> tuple[Changes, pa.Table | None, int, float, int, int | None]:
        """One step (blocking, on a step worker): for the indexes, each time's changes
        and the whole version at the last (nothing without any); the rows it changed,
        when the step started and its milliseconds; the sinks written. Then, if
        `rehearse`, the rehearsal's milliseconds (None: none was run, or it failed)."""
        started = monotonic()
        time = times[-1]
        session.sparkContext.setLocalProperty("spark.scheduler.pool", _spark.LIGHT_POOL if dataflow.light else dataflow.id)
        # Its jobs' tasks are the hydration progress the status reports.
        session.sparkContext.setJobGroup(group, f"dataflow {dataflow.desc.name} at {time}")
        if dataflow.maintainer is None:
            partitions = int(self.instance.conf().get("spark.sql.shuffle.partitions", "200"))
            sink_readers = {id: self.readers[id] for id in dataflow.sinks}
            built = maintainer(dataflow.desc, session, dataflow.inputs, sink_readers, partitions)
            if dataflow.last_computed is not None and not dataflow.frontier.is_empty:
                # Rebuilt after a failure: bring the state to where the versions are.
                built.restore(dataflow.frontier.time - 1)
            dataflow.maintainer = built
        if not dataflow.frontier.is_empty:
            dataflow.maintainer.unchanged_through(dataflow.frontier.time - 1)
        output = dataflow.maintainer.step(times)
        try:
            changes, rows = output.versions(previous) if dataflow.arrangements else ([], None)
            for id, sink in dataflow.sinks.items():
                if id not in dataflow.dropped:
                    output.write(sink, sink_upper)
        except BaseException:
            output.abandon()  # failed, or cancelled by a drop: what it persisted goes now
            raise
        output.finish()
        elapsed_ms = int(1000 * (monotonic() - started))
        rehearsal_ms = self._rehearse(dataflow, time) if rehearse and dataflow.maintainer.light else None
        _spark.release_dropped_proxies()
        return changes, rows, output.rows_changed, started, elapsed_ms, rehearsal_ms

    def _rehearse(self, dataflow: Dataflow, hydrated_at: int) -> int | None:
        """Right after its hydration (at `hydrated_at`), and before it is reported, an
        incremental dataflow computes a step over made-up changes and keeps nothing
        (`Maintainer.rehearse`): the code its first steps run is compiled then, not at
        the first change (TPC-H's cost the JVM 43.2 CPU-s against the third's 30.1
        without one, in one process). So a hydrated dataflow steps as fast as it will;
        reads of a new dataflow wait the rehearsal's time more. Its time is what the
        first step is expected to take (the hydration's says little of it).

        Only a dataflow created live rehearses (`_step`): one rebuilt from a replayed
        history belongs to a replica catching up, whose hydrations are not to wait for
        anything more. (In CI, rehearsals made an `xsmall` replica rebuilding seven
        dataflows after a controller restart 0.4-2.7 s later with each; it fell more
        than `max_hold_back_ms` behind the other and was evicted again and again:
        `test_drills.py`.) And none runs when a change came during the hydration: the
        step due for it compiles that code anyway, and a rehearsal first would only
        delay it. A rehearsal that fails only logs: the steps will compile their code
        themselves. Returns its milliseconds (None: none ran, or it failed)."""
        if dataflow.changes_waiting(hydrated_at):
            log.info("dataflow %s: no rehearsal: its inputs changed during its hydration", dataflow.desc.name)
            return None
        started = monotonic()
        try:
            if not dataflow.maintainer.rehearse(self.work_dir / "rehearsals"):
                return None
        except Exception as e:
            if isinstance(e, (Py4JNetworkError, ConnectionError)) or not _spark.jvm_alive():
                raise  # the step loop's to handle
            log.warning("dataflow %s: its rehearsal failed: %s", dataflow.desc.name, spark_error_message(e))
            return None
        return int(1000 * (monotonic() - started))

    async def _advance_sinks(self, dataflow: Dataflow, upper: Frontier) -> None:
        """Move every live sink's upper to `upper`: no input changed below it."""
        if upper.is_empty:
            return  # the inputs are closed; the last write holds the final rows from its time on
        loop = asyncio.get_running_loop()
        for id, sink in dataflow.sinks.items():
            if id not in dataflow.dropped:
                await loop.run_in_executor(self._io_pool, sink.write, (dataflow.last_computed,), None, upper.time)


def _latest_rows(dataflow: Dataflow) -> pa.Table | None:
    """The rows of the dataflow's latest version (all its indexes hold the same rows)."""
    for arrangement in dataflow.arrangements.values():
        return arrangement.latest.table if arrangement.latest is not None else None
    return None


# Spark errors that come from the moment, not from the query or its data.
_PASSING = (
    "ExecutorLostFailure",
    "FetchFailed",
    "Checkpoint block",
    "BlockMissingException",
    "FileNotFoundException",
    "FILE_NOT_EXIST",
    "Executor heartbeat timed out",
    "Connection refused",
)


def _is_passing(error: Exception) -> bool:
    text = str(error)
    return any(marker in text for marker in _PASSING)


def spark_error_message(error: Exception) -> str:
    """The first line of a Spark error: its condition and message, not the JVM stack
    (nor py4j's "An error occurred while calling o123.collect." before it)."""
    lines = [line.strip().removeprefix(": ") for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("An error occurred while calling"):
        lines = lines[1:]
    return (lines[0] if lines else type(error).__name__)[:1000]
