"""The replica: applies the controller's commands and computes every dataflow.

All state lives in one `Replica` and is touched only on the event loop. Blocking work
(Spark, Parquet, the catalog) runs on worker threads: one for dataflow steps, so steps
are computed one at a time in a fair order; one for SQL peeks, so they are not queued
behind a long step; a few for storage I/O. Peeks on an index are answered on the loop
from the arrangement, while dataflows compute.

Connection lifecycle: a session is what one controller epoch sent since an opening
`Hello`; `connect(hello)` supersedes the current connection, and either resumes its
session or starts a new one. Resumed (`hello.resume` names the current connection's
nonce, the epoch is the same, and the session has received at least `min_applied`
commands): the new connection carries on where the old one stopped, with the same
buffered replay or running state, the same count of received commands, and the same
pending peeks, which answer on it; the old one is closed without a word. Otherwise a new
session: the old connection's pending peeks end as canceled, and the commands up to
`InitializationComplete` are buffered and then reconciled against the dataflows already
running. After initialization commands apply one by one.

Every accepted connection answers first with `HelloAck` (resumed, commands received).
A resumed, initialized session then reports every live export's write frontier again
(reports in flight on the old stream were lost). Answers lost with the old stream are
the controller's to recover: it sends the peeks it has no answer for again, and a
`Peek` whose uuid is still pending here is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
from py4j.protocol import Py4JNetworkError
from pyspark.sql import SparkSession

from catalog import CatalogError
from history import (
    AllowCompaction,
    CancelPeek,
    ComputeCommand,
    ComputeParameters,
    ComputeResponse,
    CreateDataflow,
    CreateInstance,
    DataflowStatus,
    Frontier,
    FrontiersResponse,
    Hello,
    IndexTarget,
    InitializationComplete,
    InstanceConfig,
    Peek,
    PeekCanceled,
    PeekError,
    PeekResponse,
    PeekRows,
    Schedule,
    StatusResponse,
    UpdateConfiguration,
)
from protocol import HelloAck, Refusal, table_to_ipc
from replica_service import _spark
from replica_service._arrangement import Arrangement, Version, canonical_sort, digest, finish
from replica_service._dataflow import Dataflow, DataflowInputs
from replica_service._inputs import StorageTrace
from replica_service._sink import SinkWriter
from storage import NegativeCount, Storage

log = logging.getLogger(__name__)

DEFAULT_PARAMETERS = ComputeParameters(
    max_result_rows=100_000,
    heartbeat_interval_ms=500,
    input_poll_interval_ms=100,
    arrangement_max_versions=None,
)


class PeekFailed(Exception):
    """A peek that cannot be answered with rows; its message goes to the controller."""


class Refused(Exception):
    """The replica refuses the connection; carries the `Refusal` to send."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


@dataclass(eq=False)
class Connection:
    """One controller connection. Responses are queued for its stream; `None` ends it.

    `replay`, `created_instance` and `applied` are the state of the session the
    connection carries, handed on by `resumed_by`.
    """

    epoch: int
    nonce: str
    outbox: asyncio.Queue[ComputeResponse | Refusal | HelloAck | None] = field(default_factory=asyncio.Queue)
    reported: dict[str, Frontier] = field(default_factory=dict)  # frontiers sent on this stream
    replay: list[ComputeCommand] | None = field(default_factory=list)  # None once initialized
    created_instance: bool = False
    applied: int = 0  # commands of the session accepted since its opening Hello
    closed: bool = False

    def resumed_by(self, hello: Hello) -> Connection:
        """The connection of `hello` that continues this one's session."""
        return Connection(
            hello.controller_epoch,
            hello.nonce,
            replay=self.replay,
            created_instance=self.created_instance,
            applied=self.applied,
        )

    def send(self, response: ComputeResponse | Refusal | HelloAck) -> None:
        if not self.closed:
            self.outbox.put_nowait(response)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.outbox.put_nowait(None)


class Replica:
    """Everything one replica process knows and runs.

    Lifecycles: `dataflows` gains an entry on `CreateDataflow` (or keeps one through
    reconciliation) and loses it when every export is compacted to the empty frontier
    or reconciliation drops it; `collections` maps each live export id to its dataflow;
    `peeks` holds a task per unanswered peek of the current session, removed in the
    same step that sends its one response; a new session cancels them all.
    """

    def __init__(self, storage: Storage, settings: _spark.SparkSettings, work_dir: Path, session: SparkSession) -> None:
        self.storage = storage
        self.settings = settings
        self.work_dir = work_dir
        self.highest_epoch = 0
        self.instance: InstanceConfig | None = None
        self.parameters = DEFAULT_PARAMETERS
        self.connection: Connection | None = None
        self.dataflows: dict[str, Dataflow] = {}
        self.collections: dict[str, Dataflow] = {}
        self.tasks: dict[str, asyncio.Task] = {}  # dataflow id -> its run task
        self.wakeups: dict[str, asyncio.Event] = {}  # dataflow id -> "inputs may have moved"
        self.progress = asyncio.Event()  # set and replaced whenever any frontier moves
        self.peeks: dict[str, asyncio.Task] = {}
        self.storage_uppers: dict[str, Frontier] = {}  # as last polled, by collection id
        self._poller: asyncio.Task | None = None
        self.dataflows_kept = 0
        self.dataflows_built = 0
        self.heartbeats = 0
        self._step_pool = ThreadPoolExecutor(1, thread_name_prefix="step")
        self._peek_pool = ThreadPoolExecutor(1, thread_name_prefix="sql-peek")
        self._io_pool = ThreadPoolExecutor(4, thread_name_prefix="storage")
        self._session = session  # started before the gRPC server: see __main__
        self._instance_session: asyncio.Future[SparkSession] | None = None

    # --- Lifecycle -----------------------------------------------------------------------

    async def spark(self) -> SparkSession:
        """The session configured for the instance; waits for `CreateInstance`."""
        while self._instance_session is None:
            await self._wait_progress()
        return await self._instance_session

    async def shutdown(self) -> None:
        if self.connection:
            self.connection.close()
        for task in [*self.tasks.values(), *self.peeks.values(), *filter(None, [self._poller])]:
            task.cancel()
        session = await self._instance_session if self._instance_session is not None else self._session
        await asyncio.get_running_loop().run_in_executor(self._step_pool, session.stop)
        for pool in (self._step_pool, self._peek_pool, self._io_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    # --- Connections ---------------------------------------------------------------------

    def connect(self, hello: Hello) -> Connection:
        """Open a connection for `hello`, superseding the current one: resume its session
        if `hello.resume` allows, else start a new session.

        Its outbox starts with the `HelloAck`; for a resumed, initialized session, then a
        `FrontiersResponse` for every live export; heartbeats and everything else follow. Raises `Refused` for an epoch below
        the highest seen: a stale controller.
        """
        if hello.controller_epoch < self.highest_epoch:
            raise Refused(
                Refusal(
                    "stale_epoch",
                    f"controller epoch {hello.controller_epoch} is stale: this replica has "
                    f"seen epoch {self.highest_epoch}",
                )
            )
        self.highest_epoch = hello.controller_epoch
        old = self.connection
        why_not = self._why_not_resume(hello)
        if why_not is None:
            self.connection = old.resumed_by(hello)
            old.close()  # silently: its pending peeks answer on the new connection
            log.info(
                "controller connected: epoch %d, nonce %s resumes the session of connection %s after %d commands",
                hello.controller_epoch, hello.nonce, old.nonce, self.connection.applied,
            )
        else:
            if old is not None:
                # The earlier session's pending peeks end as canceled, its last words.
                for uuid, task in self.peeks.items():
                    task.cancel()
                    old.send(PeekResponse(uuid, PeekCanceled()))
                old.close()
            self.peeks.clear()
            self.connection = Connection(hello.controller_epoch, hello.nonce)
            log.info(
                "controller connected: epoch %d, nonce %s starts a new session (%s)",
                hello.controller_epoch, hello.nonce, why_not,
            )
        connection = self.connection
        connection.send(HelloAck(why_not is None, connection.applied))
        if why_not is None:
            for dataflow in self.dataflows.values():
                self._report(dataflow)  # nothing while the session is still buffering
        asyncio.get_running_loop().create_task(self._heartbeat(connection))
        return connection

    def _why_not_resume(self, hello: Hello) -> str | None:
        """Why `hello` cannot resume the current session, or None when it can."""
        resume, current = hello.resume, self.connection
        if resume is None:
            return "no resume offered"
        if current is None:
            return "no session to resume"
        if current.nonce != resume.nonce:
            return f"the current session's connection is {current.nonce}, not {resume.nonce}"
        if current.epoch != hello.controller_epoch:
            return f"the session belongs to controller epoch {current.epoch}"
        if current.applied < resume.min_applied:
            return f"the session has received {current.applied} commands, fewer than {resume.min_applied}"
        return None

    def handle(self, connection: Connection, command: ComputeCommand) -> None:
        """Apply one command from `connection` (a no-op if it has been superseded), and
        count it as received by the session.

        Raises `Refused` on a protocol violation, and then does not count it.
        """
        if connection is not self.connection:
            return
        if isinstance(command, Hello):
            raise Refused(Refusal("protocol_violation", "Hello may only open a connection"))
        if isinstance(command, CreateInstance):
            self._create_instance(connection, command)
        elif not connection.created_instance:
            raise Refused(Refusal("protocol_violation", f"{type(command).__name__} before CreateInstance"))
        elif connection.replay is not None:
            if isinstance(command, InitializationComplete):
                self._reconcile(connection)
            else:
                connection.replay.append(command)
        else:
            self._apply(command)
        connection.applied += 1

    def _create_instance(self, connection: Connection, command: CreateInstance) -> None:
        if connection.created_instance:
            raise Refused(Refusal("protocol_violation", "CreateInstance may come only once per connection"))
        if self.instance is not None and self.instance != command.config:
            raise Refused(
                Refusal(
                    "protocol_violation",
                    f"this replica serves instance {self.instance.name!r} with other settings; "
                    f"start a new replica process for {command.config.name!r}",
                )
            )
        connection.created_instance = True
        if self.instance is None:
            self.instance = command.config
            self._instance_session = asyncio.ensure_future(self._configure_spark(command.config))
            self._notify_progress()

    async def _configure_spark(self, config: InstanceConfig) -> SparkSession:
        return await asyncio.get_running_loop().run_in_executor(
            self._step_pool, _spark.apply_instance_conf, self._session, self.settings, self.work_dir, config.conf()
        )

    # --- Reconciliation ------------------------------------------------------------------

    def _reconcile(self, connection: Connection) -> None:
        """Keep running dataflows the replayed history still describes, drop the rest,
        build the new ones, then apply the remaining replayed commands in order.

        A dataflow is kept when its definition is identical, its old `as_of` is not
        beyond the new one, it has not failed, and every index it imports is kept too
        (the history lists dataflows in dependency order).
        """
        replay, connection.replay = connection.replay, None
        wanted = {c.desc.export_ids[0]: c.desc for c in replay if isinstance(c, CreateDataflow)}
        kept: dict[str, Dataflow] = {}
        for id, desc in wanted.items():
            old = self.dataflows.get(id)
            if (
                old is not None
                and old.error is None
                and old.desc.same_definition(desc)
                and old.desc.as_of <= desc.as_of
                and all(i.id in self.collections and self.collections[i.id].id in kept for i in desc.imports if i.kind == "index")
            ):
                old.desc = desc
                old.frontier = old.frontier.join(desc.as_of)
                for arrangement in old.arrangements.values():
                    arrangement.compact(desc.as_of)
                kept[id] = old
        for id in list(self.dataflows):
            if id not in kept:
                self._drop_dataflow(self.dataflows[id], report=False)
        self.dataflows_kept += len(kept)
        for dataflow in kept.values():
            self._report(dataflow)
        for command in replay:
            if not (isinstance(command, CreateDataflow) and command.desc.export_ids[0] in kept):
                self._apply(command)

    # --- Commands ------------------------------------------------------------------------

    def _apply(self, command: ComputeCommand) -> None:
        _HANDLERS[type(command)](self, command)

    def _update_configuration(self, command: UpdateConfiguration) -> None:
        self.parameters = self.parameters.update(command.params)

    def _create_dataflow(self, command: CreateDataflow) -> None:
        desc = command.desc
        for id in desc.export_ids:
            if id in self.collections:
                log.warning("CreateDataflow %s: collection %s exists; ignored", desc.name, id)
                return
        storage_inputs, index_inputs = {}, {}
        for source in desc.imports:
            if source.kind == "index":
                upstream = self.collections.get(source.id)
                if upstream is None or source.id not in upstream.arrangements:
                    log.error("CreateDataflow %s imports unknown index %s", desc.name, source.id)
                    return
                index_inputs[source.name] = upstream.arrangements[source.id]
            else:
                storage_inputs[source.name] = StorageTrace(source.id, self.storage.schema(source.id), desc.as_of.time)
        dataflow = Dataflow(
            desc=desc,
            inputs=DataflowInputs(storage_inputs, index_inputs),
            arrangements={e.id: Arrangement(e.id, e.key, desc.as_of, desc.as_of) for e in desc.index_exports},
            sinks={e.id: SinkWriter(e.id, self.storage) for e in desc.sink_exports},
        )
        self.dataflows[dataflow.id] = dataflow
        for id in desc.export_ids:
            self.collections[id] = dataflow
        self.dataflows_built += 1
        log.info("dataflow %s built: exports %s, as_of %s", desc.name, ", ".join(desc.export_ids), desc.as_of)
        self._report(dataflow)

    def _schedule(self, command: Schedule) -> None:
        dataflow = self.collections.get(command.id)
        if dataflow is None or dataflow.scheduled:
            return
        dataflow.scheduled = True
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_storage())
        self.wakeups[dataflow.id] = asyncio.Event()
        self.tasks[dataflow.id] = asyncio.get_running_loop().create_task(self._run(dataflow))

    def _allow_compaction(self, command: AllowCompaction) -> None:
        dataflow = self.collections.get(command.id)
        if dataflow is None:
            return
        if command.id in dataflow.arrangements:
            dataflow.arrangements[command.id].compact(command.frontier)
        if command.frontier.is_empty:
            dataflow.dropped.add(command.id)
            self._send_frontier(command.id, Frontier.empty())
            if dataflow.dropped >= set(dataflow.desc.export_ids):
                self._drop_dataflow(dataflow, report=False)
        since = dataflow.since
        if not since.is_empty:
            for trace in dataflow.inputs.storage.values():
                trace.compact(since.time)

    def _drop_dataflow(self, dataflow: Dataflow, *, report: bool) -> None:
        task = self.tasks.pop(dataflow.id, None)
        if task is not None:
            task.cancel()
        self.wakeups.pop(dataflow.id, None)
        self.dataflows.pop(dataflow.id, None)
        for id in dataflow.desc.export_ids:
            self.collections.pop(id, None)
            if report:
                self._send_frontier(id, Frontier.empty())
        self._notify_progress()

    def _peek(self, command: Peek) -> None:
        if command.uuid in self.peeks:
            return  # sent again after a resume, and still being answered
        self.peeks[command.uuid] = asyncio.get_running_loop().create_task(self._answer_peek(command))

    def _cancel_peek(self, command: CancelPeek) -> None:
        task = self.peeks.pop(command.uuid, None)
        if task is not None:
            task.cancel()
            self.connection.send(PeekResponse(command.uuid, PeekCanceled()))

    # --- Dataflows -----------------------------------------------------------------------

    async def _run(self, dataflow: Dataflow) -> None:
        """Compute `dataflow` until it is dropped, fails, or reaches `until`."""
        loop = asyncio.get_running_loop()
        wakeup = self.wakeups[dataflow.id]
        session = None
        while True:
            wakeup.clear()
            try:
                if session is None:
                    base = await self.spark()
                    session = await loop.run_in_executor(self._step_pool, _spark.dataflow_session, base, self.instance.conf())
                    run_sql = partial(_spark.run_sql, session)
                await self._load_inputs(dataflow)
                upper = dataflow.input_upper()  # fixed for this round: inputs move meanwhile
                times = dataflow.next_times(upper)
                for position, time in enumerate(times):
                    started = loop.time()
                    result = await loop.run_in_executor(self._step_pool, dataflow.compute, time, run_sql)
                    log.info("dataflow %s: computed %d rows at %d in %.0f ms", dataflow.desc.name, result.num_rows, time, 1000 * (loop.time() - started))
                    following = times[position + 1] if position + 1 < len(times) else None
                    await self._install(dataflow, time, result, upper if following is None else Frontier(following))
                if not times and upper > dataflow.frontier and dataflow.last_computed is not None:
                    await self._write_sinks(dataflow, None, upper)
                self._advance(dataflow, upper)
            except (OSError, CatalogError) as e:
                if isinstance(e, NegativeCount):  # the stored data is wrong, not the moment
                    self._fail(dataflow, str(e))
                    return
                # A batch file compacted away under us, a storage hiccup, a read the
                # controller's holds did not cover yet: try again at the next wake-up.
                log.warning("dataflow %s: storage read failed, retrying: %s", dataflow.desc.name, e)
                await asyncio.sleep(self.parameters.input_poll_interval_ms / 1000)
                wakeup.set()
            except (Py4JNetworkError, ConnectionError):
                log.critical("lost the Spark driver; exiting so that the replica is restarted")
                os._exit(70)
            except Exception as e:  # a Spark error in the user's SQL: this dataflow fails alone
                self._fail(dataflow, _spark_error_message(e))
                return
            if dataflow.frontier.is_empty or dataflow.frontier == dataflow.desc.until:
                return
            await wakeup.wait()  # set by the storage poller or an upstream dataflow

    def _fail(self, dataflow: Dataflow, error: str) -> None:
        dataflow.error = error
        log.warning("dataflow %s failed: %s", dataflow.desc.name, error)
        self._notify_progress()

    async def _load_inputs(self, dataflow: Dataflow) -> None:
        loop = asyncio.get_running_loop()
        for trace in dataflow.inputs.storage.values():
            upper = self.storage_uppers.get(trace.id)
            if upper is None or trace.upper < upper:
                if upper is None:
                    upper = await loop.run_in_executor(self._io_pool, self.storage.upper, trace.id)
                await loop.run_in_executor(self._io_pool, trace.load, self.storage, upper)

    async def _poll_storage(self) -> None:
        """Read every storage collection's upper with one catalog query per interval, and
        wake the dataflows whose inputs moved (instead of each dataflow polling each of
        its inputs)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.parameters.input_poll_interval_ms / 1000)
            if not any(d.scheduled and d.inputs.storage for d in self.dataflows.values()):
                continue
            try:
                collections = await loop.run_in_executor(self._io_pool, self.storage.catalog.list_collections)
            except Exception as e:  # the catalog is unreachable for a moment: poll again
                log.warning("polling storage uppers failed: %s", e)
                continue
            self.storage_uppers = {c.id: c.upper for c in collections if c.namespace == "storage"}
            for id, wakeup in self.wakeups.items():
                traces = self.dataflows[id].inputs.storage.values()
                if any(trace.upper < self.storage_uppers.get(trace.id, trace.upper) for trace in traces):
                    wakeup.set()

    async def _install(self, dataflow: Dataflow, time: int, result: pa.Table, frontier: Frontier) -> None:
        """Make the result at `time` a version of every index and a write to every sink,
        then advance the dataflow to `frontier` (the next time to compute, or its target)."""
        loop = asyncio.get_running_loop()
        for arrangement in dataflow.arrangements.values():
            version = await loop.run_in_executor(self._io_pool, Version.build, time, result, arrangement.key)
            arrangement.insert(version)
            dataflow.digest = version.digest
        if not dataflow.arrangements:
            dataflow.digest = await loop.run_in_executor(self._io_pool, digest, result)
        dataflow.last_computed = time
        dataflow.steps += 1
        await self._write_sinks(dataflow, (time, result), frontier)
        self._advance(dataflow, frontier)

    async def _write_sinks(self, dataflow: Dataflow, version: tuple[int, pa.Table] | None, upper: Frontier) -> None:
        """Write `version` (or, with None, just the upper) to every live sink export."""
        if upper.is_empty:
            return  # the inputs are closed; the last write already holds the final rows
        loop = asyncio.get_running_loop()
        for id, sink in dataflow.sinks.items():
            if id not in dataflow.dropped:
                await loop.run_in_executor(self._io_pool, sink.write, version, upper.time)

    def _advance(self, dataflow: Dataflow, frontier: Frontier) -> None:
        frontier = frontier.join(dataflow.desc.as_of)
        if frontier <= dataflow.frontier:
            return
        dataflow.frontier = frontier
        for arrangement in dataflow.arrangements.values():
            arrangement.upper = frontier
        self._report(dataflow)
        for other in self.dataflows.values():
            if any(self.collections.get(i) is dataflow for i in other.desc.import_ids):
                self.wakeups.get(other.id, asyncio.Event()).set()
        self._notify_progress()

    def _report(self, dataflow: Dataflow) -> None:
        for id in dataflow.desc.export_ids:
            if id not in dataflow.dropped:
                self._send_frontier(id, dataflow.frontier)

    def _send_frontier(self, id: str, frontier: Frontier) -> None:
        connection = self.connection
        if connection is None or connection.replay is not None:
            return
        if connection.reported.get(id) != frontier:
            connection.reported[id] = frontier
            connection.send(FrontiersResponse(id, frontier))

    # --- Peeks ---------------------------------------------------------------------------

    async def _answer_peek(self, peek: Peek) -> None:
        try:
            result = await asyncio.wait_for(self._peek_rows(peek), peek.timeout_ms / 1000)
        except TimeoutError:
            result = PeekError(
                f"peek timed out after {peek.timeout_ms} ms waiting for "
                f"{', '.join(peek.target.collection_ids)} to pass time {peek.timestamp}"
            )
        except PeekFailed as e:
            result = PeekError(str(e))
        except (Py4JNetworkError, ConnectionError):
            raise
        except Exception as e:
            result = PeekError(_spark_error_message(e))
        # No await between the removal and the send: a CancelPeek cannot slip in. The
        # peek belongs to the current session (a new one cancels them all), so its answer
        # goes to the session's current connection, which a resume may have replaced.
        if self.peeks.pop(peek.uuid, None) is not None:
            self.connection.send(PeekResponse(peek.uuid, result))

    async def _peek_rows(self, peek: Peek) -> PeekRows:
        versions = {}
        for id in peek.target.collection_ids:
            dataflow, arrangement = self._readable(id, peek.timestamp)
            while not arrangement.upper.is_complete(peek.timestamp):
                await self._wait_progress()
                dataflow, arrangement = self._readable(id, peek.timestamp)
            versions[id] = arrangement.version_at(peek.timestamp)
        loop = asyncio.get_running_loop()
        if isinstance(peek.target, IndexTarget):
            version = versions[peek.target.id]
            if peek.finishing.key is not None and not peek.finishing.filter and not peek.finishing.order_by:
                rows = finish(version.table, peek.finishing, version=version)  # a hash lookup
            else:
                rows = await loop.run_in_executor(self._io_pool, lambda: finish(version.table, peek.finishing, version=version))
        else:
            inputs = {i.name: versions[i.id].table for i in peek.target.imports}
            rows = await loop.run_in_executor(self._peek_pool, self._sql_peek, await self.spark(), peek, inputs)
        limit = self.parameters.max_result_rows
        if limit is not None and rows.num_rows > limit:
            raise PeekFailed(f"the result has {rows.num_rows} rows, more than max_result_rows = {limit}")
        return PeekRows(table_to_ipc(rows), rows.num_rows, digest(rows))

    def _sql_peek(self, session: SparkSession, peek: Peek, inputs: dict[str, pa.Table]) -> pa.Table:
        child = _spark.dataflow_session(session, self.instance.conf())
        frame = _spark.query(child, peek.target.sql, inputs)
        result = frame.toArrow()
        ordered = bool(peek.finishing.order_by) or _spark.is_ordered(frame)
        return finish(result if ordered else canonical_sort(result), peek.finishing)

    def _readable(self, id: str, time: int) -> tuple[Dataflow, Arrangement]:
        dataflow = self.collections.get(id)
        if dataflow is None or id not in dataflow.arrangements or id in dataflow.dropped:
            raise PeekFailed(f"collection {id} is not an index on this replica")
        if dataflow.error is not None:
            raise PeekFailed(f"dataflow {dataflow.desc.name} failed: {dataflow.error}")
        arrangement = dataflow.arrangements[id]
        if arrangement.since.is_empty or time < arrangement.since.time:
            raise PeekFailed(f"cannot read {id} at time {time}: it is compacted to since {arrangement.since}")
        return dataflow, arrangement

    # --- Status --------------------------------------------------------------------------

    async def _heartbeat(self, connection: Connection) -> None:
        while not connection.closed:
            self.heartbeats += 1
            connection.send(self.status())
            await asyncio.sleep(self.parameters.heartbeat_interval_ms / 1000)

    def status(self) -> StatusResponse:
        dataflows = tuple(
            DataflowStatus(
                id=dataflow.id,
                hydrated=dataflow.frontier > dataflow.desc.as_of,
                error=dataflow.error,
                digest=dataflow.digest,
            )
            for dataflow in self.dataflows.values()
        )
        return StatusResponse(
            heartbeat=self.heartbeats,
            dataflows=dataflows,
            dataflows_kept=self.dataflows_kept,
            dataflows_built=self.dataflows_built,
            pid=os.getpid(),
        )

    async def _wait_progress(self) -> None:
        await self.progress.wait()

    def _notify_progress(self) -> None:
        self.progress.set()
        self.progress = asyncio.Event()


def _spark_error_message(error: Exception) -> str:
    """The first line of a Spark error: its condition and message, not the JVM stack."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:1000]


_HANDLERS: dict[type, Callable[[Replica, Any], None]] = {
    UpdateConfiguration: Replica._update_configuration,
    CreateDataflow: Replica._create_dataflow,
    Schedule: Replica._schedule,
    AllowCompaction: Replica._allow_compaction,
    Peek: Replica._peek,
    CancelPeek: Replica._cancel_peek,
}
