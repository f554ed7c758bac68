"""The replica: applies the controller's commands and computes every dataflow.

All state lives in one `Replica` and is touched only on the event loop. Blocking work
(Spark, the catalog) runs on worker threads: two pools of step workers, so steps of
different dataflows run at once where Spark has room, taken in the order of cost the
controller asks for (`_step_pool`). Light steps (an incremental dataflow's, past
hydration: they read the changes) have workers of their own and share a FAIR scheduler
pool whose tasks take a free core first, so a long hydration or recompute does not hold
them back, not even in a queue; hydrations and recomputes run each in a FAIR scheduler
pool of the dataflow's own. One worker runs SQL peeks, so they are not queued behind a
long step; a few do storage I/O. Peeks on an index are answered on the loop from the
arrangement, while dataflows compute. How a step computes (reading storage,
incremental state, writing materialized views) is the data plane's
(`replica_service.dataplane`).

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
`Peek` whose uuid is still pending here is a no-op; it sends each open subscription
again from what it forwarded, and a `Subscribe` for an open uuid restarts its reports
there.

Subscriptions are reported by `_feeds`, dataflows stepped by `_steps` (mixins of `Replica`:
the state is all here).
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from time import monotonic
from typing import Any, Callable, Mapping

import pyarrow as pa
from py4j.protocol import Py4JNetworkError
from pyspark.sql import SparkSession

from history import (
    AllowCompaction,
    CancelPeek,
    CancelSubscribe,
    ComputeCommand,
    ComputeParameters,
    ComputeResponse,
    CreateDataflow,
    DataflowDescription,
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
    Subscribe,
    UpdateConfiguration,
)
from protocol import HelloAck, Refusal, table_to_ipc
from replica_service import _spark
from replica_service._arrangement import Arrangement, Version, canonical_sort, digest, finish
from replica_service._crashes import CrashRecord
from replica_service._dataflow import Dataflow
from replica_service._feeds import PeekFailed, Subscriptions
from replica_service._metrics import ReplicaMetrics
from replica_service._step_pool import StepPool
from replica_service._steps import DataflowSteps, spark_error_message
from replica_service.dataplane import SinkWriter, StorageReader
from storage import Storage

log = logging.getLogger(__name__)

STEP_WORKERS = 2
"""Dataflow steps computed at once in each of the two step pools, light and heavy
(Spark shares the cores between their jobs). Two, not four: steps side by side stretch
one another on the replica's cores, which undoes the order of waiting steps (with four,
the last of 22 TPC-H answers came after 13.4-22.4 s, with two after 10.0-19.4 s; RESULTS
"Two step workers a pool")."""

MANIFEST_MAX_AGE_S = 60.0
"""A reader reads its manifest again at least this often, even when its upper has not
moved. Compaction replaces batches without moving the upper, and the files it retires
are deleted after the garbage grace (15 minutes by default): a reader that waited for
its upper to move (a source loaded once and then idle, a sealed one) would go on
planning reads of deleted files."""

PERTURB_ENV = "TANDEM_TEST_PERTURB_DATAFLOW"
"""A test hook, read at start: the index versions of the dataflow this names get their
last row twice on this replica, a wrong answer for the controller's divergence check
to catch. Never set outside tests."""

DEFAULT_PARAMETERS = ComputeParameters(
    max_result_rows=100_000,
    heartbeat_interval_ms=500,
    input_poll_interval_ms=100,
)


def manifests_due(readers: Mapping[str, StorageReader], uppers: Mapping[str, Frontier], now: float) -> tuple[set[str], set[str]]:
    """The readers whose manifests the poller reads again (those read once already): the
    ones whose upper moved (their dataflows are woken), and the others whose manifest is
    older than `MANIFEST_MAX_AGE_S` (compaction may have replaced their batches)."""
    read = {id: reader for id, reader in readers.items() if reader.refreshed_at is not None}
    moved = {id for id, reader in read.items() if uppers.get(id, reader.upper) != reader.upper}
    old = {id for id, reader in read.items() if id not in moved and now - reader.refreshed_at >= MANIFEST_MAX_AGE_S}
    return moved, old


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


class Replica(DataflowSteps, Subscriptions):
    """Everything one replica process knows and runs.

    Lifecycles: `dataflows` gains an entry on `CreateDataflow` (or keeps one through
    reconciliation) and loses it when every export is compacted to the empty frontier
    or reconciliation drops it; `collections` maps each live export id to its dataflow;
    `peeks` holds a task per unanswered peek of the current session, removed in the
    same step that sends its one response; `feeds` a task per open subscription of the
    current session, until its `CancelSubscribe`, an error, or a `Subscribe` for its
    uuid replaces it; a new session cancels them all.
    """

    def __init__(
        self, storage: Storage, settings: _spark.SparkSettings, work_dir: Path, session: SparkSession, crashes: CrashRecord | None = None
    ) -> None:
        self.storage = storage
        self.settings = settings
        self.work_dir = work_dir
        self._perturbed = os.environ.get(PERTURB_ENV)
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
        self.feeds: dict[str, asyncio.Task] = {}  # subscription uuid -> its reporting task
        # One reader per storage collection that a live dataflow imports or writes,
        # shared by those dataflows; dropped with the last of them.
        self.readers: dict[str, StorageReader] = {}
        self._refreshing: dict[str, asyncio.Task] = {}  # reader id -> its manifest read
        self.crashes = crashes or CrashRecord(None)
        self.in_flight: set[str] = set()  # dataflows whose step is running on Spark
        self._poller: asyncio.Task | None = None
        self._poll_now = asyncio.Event()  # a read waits for inputs: do not wait out the interval
        self.dataflows_kept = 0
        self.dataflows_built = 0
        self.heartbeats = 0
        self.metrics = ReplicaMetrics(self)
        self._step_pool = StepPool(STEP_WORKERS, thread_name_prefix="step")
        self._light_step_pool = StepPool(STEP_WORKERS, thread_name_prefix="light-step")
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
        for task in [*self.tasks.values(), *self.peeks.values(), *self.feeds.values(), *filter(None, [self._poller])]:
            task.cancel()
        session = await self._instance_session if self._instance_session is not None else self._session
        await asyncio.get_running_loop().run_in_executor(self._step_pool, session.stop)
        for pool in (self._step_pool, self._light_step_pool, self._peek_pool, self._io_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    # --- Connections ---------------------------------------------------------------------

    def connect(self, hello: Hello) -> Connection:
        """Open a connection for `hello`, superseding the current one: resume its session
        if `hello.resume` allows, else start a new session.

        Its outbox starts with the `HelloAck`; for a resumed, initialized session, then a
        `FrontiersResponse` for every live export; heartbeats and everything else follow. Raises `Refused` for an epoch below
        the highest seen: a stale controller. The step pools take waiting steps in the
        order `hello` asks from now on.
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
        for pool in (self._step_pool, self._light_step_pool):
            pool.cheapest_first = not hello.costliest_first
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
            for task in self.feeds.values():
                task.cancel()  # the new session's history subscribes again
            self.feeds.clear()
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

        A dataflow is kept when its definition is identical, it can serve every read the
        replay allows (its old `as_of` is not beyond the new one, nor any arrangement's
        since beyond the new as_of or that export's replayed `AllowCompaction`), it has
        computed every time before the new `as_of` or can still compute them
        (`_catches_up`: it reads storage only, still readable where it stands; jumping its
        frontier instead would skip their changes for good), it has not failed (nor asked
        for a new session), and every index it imports is kept too (the history lists
        dataflows in dependency order).
        """
        replay, connection.replay = connection.replay, None
        wanted = {c.desc.export_ids[0]: c.desc for c in replay if isinstance(c, CreateDataflow)}
        allowed = {c.id: c.frontier for c in replay if isinstance(c, AllowCompaction)}
        kept: dict[str, Dataflow] = {}
        for id, desc in wanted.items():
            old = self.dataflows.get(id)
            if old is None:
                continue
            why_not = _why_not_kept(old, desc, allowed, kept, self.collections, lambda id: self.storage.catalog.get_collection(id).since)
            if why_not is None:
                # A lagging one keeps its own as_of: its frontier must say what it has
                # computed (`_advance` joins it with the as_of), not jump to the replay's.
                old.desc = desc if desc.as_of <= old.frontier else desc.with_as_of(old.desc.as_of)
                for arrangement in old.arrangements.values():
                    arrangement.compact(desc.as_of)
                kept[id] = old
            else:
                log.info("reconciliation builds dataflow %s again: %s", desc.name, why_not)
        for id in list(self.dataflows):
            if id not in kept:
                self._drop_dataflow(self.dataflows[id], report=False)
        self.dataflows_kept += len(kept)
        for dataflow in kept.values():
            self._report(dataflow)
        for command in replay:
            if not (isinstance(command, CreateDataflow) and command.desc.export_ids[0] in kept):
                self._apply(command)
        for id in wanted.keys() - kept.keys():
            if id in self.dataflows:
                self.dataflows[id].replayed = True  # catching up: its hydration rehearses nothing

    # --- Commands ------------------------------------------------------------------------

    def _apply(self, command: ComputeCommand) -> None:
        _HANDLERS[type(command)](self, command)

    def _update_configuration(self, command: UpdateConfiguration) -> None:
        self.parameters = self.parameters.update(command.params)
        self._poll_now.set()  # the poller waits out the old interval otherwise

    def _create_dataflow(self, command: CreateDataflow) -> None:
        desc = command.desc
        for id in desc.export_ids:
            if id in self.collections:
                log.warning("CreateDataflow %s: collection %s exists; ignored", desc.name, id)
                return
        inputs: dict[str, StorageReader | Arrangement] = {}
        for source in desc.imports:
            if source.kind == "index":
                upstream = self.collections.get(source.id)
                if upstream is None or source.id not in upstream.arrangements:
                    log.error("CreateDataflow %s imports unknown index %s", desc.name, source.id)
                    return
                inputs[source.name] = upstream.arrangements[source.id]
            else:
                inputs[source.name] = self._reader(source.id)
        for sink in desc.sink_exports:
            self._reader(sink.id)  # a recomputed version is diffed against the sink's contents
        dataflow = Dataflow(
            desc=desc,
            inputs=inputs,
            arrangements={e.id: Arrangement(e.id, e.key, desc.as_of, desc.as_of) for e in desc.index_exports},
            sinks={e.id: SinkWriter(e.id, self.storage) for e in desc.sink_exports},
        )
        dataflow.error = self.crashes.refusal(dataflow.id)
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
        if dataflow.error is not None:
            return  # refused at creation: reported, never computed
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
        self._release_readers()
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

    def _subscribe(self, command: Subscribe) -> None:
        old = self.feeds.pop(command.uuid, None)
        if old is not None:
            old.cancel()  # sent again after a resume: report from the new as_of
        self.feeds[command.uuid] = asyncio.get_running_loop().create_task(self._feed(command))

    def _cancel_subscribe(self, command: CancelSubscribe) -> None:
        task = self.feeds.pop(command.uuid, None)
        if task is not None:
            task.cancel()

    # --- Storage readers -------------------------------------------------------------------

    def _reader(self, id: str) -> StorageReader:
        reader = self.readers.get(id)
        if reader is None:
            reader = self.readers[id] = StorageReader(self.storage, id)
        return reader

    def _release_readers(self) -> None:
        """Close the readers no live dataflow reads or writes any more."""
        used = {s.id for d in self.dataflows.values() for s in (*d.desc.imports, *d.desc.sink_exports)}
        for id in [id for id in self.readers if id not in used]:
            self.readers.pop(id).close()

    async def _refresh_readers(self, dataflow: Dataflow) -> None:
        """Read the manifests of the dataflow's storage collections not read yet (the
        poller keeps them current afterwards)."""
        ids = [s.id for s in dataflow.desc.imports if s.kind == "storage"] + [s.id for s in dataflow.desc.sink_exports]
        await asyncio.gather(*(self._refresh(id) for id in ids if self.readers[id].refreshed_at is None))

    async def _refresh(self, id: str) -> None:
        """Read collection `id`'s manifest again; concurrent callers share one read."""
        task = self._refreshing.get(id)
        if task is None:
            reader, session = self.readers[id], await self.spark()
            task = asyncio.get_running_loop().run_in_executor(self._io_pool, reader.refresh, session)
            task = self._refreshing[id] = asyncio.ensure_future(task)
            task.add_done_callback(lambda _: self._refreshing.pop(id, None))
        await asyncio.shield(task)

    async def _poll_storage(self) -> None:
        """Read the uppers of the storage collections this replica reads with one catalog
        query per interval (at once when a peek starts waiting for them), read the
        manifests of the collections that moved, and wake the dataflows reading them
        (instead of each dataflow polling each of its inputs)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                await asyncio.wait_for(self._poll_now.wait(), self.parameters.input_poll_interval_ms / 1000)
            except TimeoutError:
                pass
            self._poll_now.clear()
            if not self.readers:
                continue
            try:
                uppers = await loop.run_in_executor(self._io_pool, self.storage.catalog.uppers, list(self.readers))
            except Exception as e:  # the catalog is unreachable for a moment: poll again
                log.warning("polling storage failed: %s", e)
                continue
            moved, old = manifests_due(self.readers, uppers, monotonic())
            due = sorted(moved | old)
            # One reader's failed manifest read loses only its own wake-ups (its upper has
            # not moved, so the next round reads it again), not the others'.
            for id, outcome in zip(due, await asyncio.gather(*(self._refresh(id) for id in due), return_exceptions=True)):
                if isinstance(outcome, Exception):
                    log.warning("reading the manifest of %s failed: %s", id, outcome)
                    moved.discard(id)
            for id, wakeup in self.wakeups.items():
                if any(source.id in moved for source in self.dataflows[id].desc.imports):
                    wakeup.set()

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
            result = PeekError(spark_error_message(e))
        # No await between the removal and the send: a CancelPeek cannot slip in. The
        # peek belongs to the current session (a new one cancels them all), so its answer
        # goes to the session's current connection, which a resume may have replaced.
        if self.peeks.pop(peek.uuid, None) is not None:
            self.metrics.observe_peek("rows" if isinstance(result, PeekRows) else "error")
            self.connection.send(PeekResponse(peek.uuid, result))

    async def _peek_rows(self, peek: Peek) -> PeekRows:
        versions = {}
        for id in peek.target.collection_ids:
            dataflow, arrangement = self._readable(id, peek.timestamp)
            if not arrangement.upper.is_complete(peek.timestamp):
                # The controller reads at a time its inputs have reached (a strict read:
                # the last write's), so the data is in storage already: look now.
                self._poll_now.set()
            while not arrangement.upper.is_complete(peek.timestamp):
                await self._wait_progress()
                _, arrangement = self._readable(id, peek.timestamp)
            versions[id] = await self._version(arrangement, peek.timestamp)
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

    async def _version(self, arrangement: Arrangement, time: int) -> Version | None:
        """The version a read at `time` finds, made whole on a storage worker if the
        arrangement holds only its changes (and kept whole for the reads after it)."""
        if arrangement.whole_at(time):
            return arrangement.version_at(time)
        version = await asyncio.get_running_loop().run_in_executor(self._io_pool, arrangement.version_at, time)
        if version is not None:
            arrangement.keep(version)
        return version

    def _sql_peek(self, session: SparkSession, peek: Peek, inputs: dict[str, pa.Table]) -> pa.Table:
        child = _spark.dataflow_session(session, self.instance.conf())
        frame = _spark.query(child, peek.target.sql, inputs)
        result = frame.toArrow()
        ordered = bool(peek.finishing.order_by) or _spark.is_ordered(frame)
        return finish(result if ordered else canonical_sort(result), peek.finishing)

    def _readable(self, id: str, time: int, *, compacted_ok: bool = False) -> tuple[Dataflow, Arrangement]:
        """The dataflow and arrangement of index `id`, readable at `time` (or, with
        `compacted_ok`, at its since); PeekFailed saying why not."""
        dataflow = self.collections.get(id)
        if dataflow is None or id not in dataflow.arrangements or id in dataflow.dropped:
            raise PeekFailed(f"collection {id} is not an index on this replica")
        if dataflow.error is not None:
            raise PeekFailed(f"dataflow {dataflow.desc.name} failed: {dataflow.error}")
        arrangement = dataflow.arrangements[id]
        if arrangement.since.is_empty or (time < arrangement.since.time and not compacted_ok):
            raise PeekFailed(f"cannot read {id} at time {time}: it is compacted to since {arrangement.since}")
        return dataflow, arrangement

    # --- Status --------------------------------------------------------------------------

    async def _heartbeat(self, connection: Connection) -> None:
        while not connection.closed:
            self.heartbeats += 1
            connection.send(self.status())
            await asyncio.sleep(self.parameters.heartbeat_interval_ms / 1000)

    def status(self) -> StatusResponse:
        hydrating = {
            d.id: d.job_group for d in self.dataflows.values() if d.job_group is not None and not d.hydrated
        }
        tasks = _spark.job_tasks(frozenset(hydrating.values())) if hydrating else {}
        dataflows = []
        for dataflow in self.dataflows.values():
            done, total = tasks.get(hydrating.get(dataflow.id, ""), (0, 0))
            pending_times, pending_rows = (0, 0) if dataflow.error is not None or not dataflow.scheduled else dataflow.backlog()
            dataflows.append(
                DataflowStatus(
                    id=dataflow.id,
                    hydrated=dataflow.hydrated,
                    error=dataflow.error,
                    digest=dataflow.digest,
                    digest_time=dataflow.digest_time,
                    last_step_ms=dataflow.last_step_ms,
                    rows_changed=dataflow.rows_changed,
                    steps=dataflow.steps,
                    hydration_tasks_done=done,
                    hydration_tasks_total=total,
                    pending_times=pending_times,
                    pending_rows=pending_rows,
                    last_step_times=dataflow.last_step_times,
                    retries=dataflow.retries,
                    retry_error=dataflow.retry_error,
                    needs_new_session=dataflow.needs_new_session,
                )
            )
        return StatusResponse(
            heartbeat=self.heartbeats,
            dataflows=tuple(dataflows),
            dataflows_kept=self.dataflows_kept,
            dataflows_built=self.dataflows_built,
            pid=os.getpid(),
            errors=_spark.cluster_problems(self._session),  # cached: never waits for the JVM
            metrics_address=self.metrics.address,
        )

    async def _wait_progress(self) -> None:
        await self.progress.wait()

    def _notify_progress(self) -> None:
        self.progress.set()
        self.progress = asyncio.Event()


_HANDLERS: dict[type, Callable[[Replica, Any], None]] = {
    UpdateConfiguration: Replica._update_configuration,
    CreateDataflow: Replica._create_dataflow,
    Schedule: Replica._schedule,
    AllowCompaction: Replica._allow_compaction,
    Peek: Replica._peek,
    CancelPeek: Replica._cancel_peek,
    Subscribe: Replica._subscribe,
    CancelSubscribe: Replica._cancel_subscribe,
}


def _why_not_kept(
    old: Dataflow,
    desc: DataflowDescription,
    allowed: Mapping[str, Frontier],
    kept: Mapping[str, Dataflow],
    collections: Mapping[str, Any],
    storage_since: Callable[[str], Frontier],
) -> str | None:
    """Why reconciliation cannot keep running dataflow `old` for the replayed `desc`
    (see `_reconcile`), or None when it can."""
    if old.error is not None:
        return f"it failed: {old.error}"
    if old.needs_new_session is not None:
        return f"it asked for a new session: {old.needs_new_session}"
    if not old.desc.same_definition(desc):
        return "its definition changed"
    if not old.desc.as_of <= desc.as_of:
        return f"its as_of {old.desc.as_of} is beyond the replayed {desc.as_of}"
    if not desc.as_of <= old.frontier and not _catches_up(old, storage_since):
        return (
            f"it has computed the times before {old.frontier} only, not all before the replayed as_of {desc.as_of}, "
            "and its inputs are compacted past them"
        )
    for a in old.arrangements.values():
        if not a.since <= desc.as_of.join(allowed.get(a.id, desc.as_of)):
            return f"export {a.id} is compacted to {a.since}, past what the replay allows"
    for i in desc.imports:
        if i.kind == "index" and not (i.id in collections and collections[i.id].id in kept):
            return f"the index {i.name} it imports is not kept"
    return None


def _catches_up(old: Dataflow, storage_since: Callable[[str], Frontier]) -> bool:
    """Whether dataflow `old`, lagging behind a replayed as_of, can go on from its own
    frontier: it reads storage only, and every input is still readable at the last time
    it computed (the controller holds a dataflow's inputs at each replica's last
    computed time, and a recovered history comes back no later: `catalog/_recovery.py`).
    It then computes every time it missed, as a lagging replica always does; only moving
    its frontier up to the as_of would skip the changes in between."""
    last = old.frontier.step_back(1)
    if not old.desc.reads_storage_only:
        return False
    try:
        return all(storage_since(i.id) <= last for i in old.desc.imports)
    except Exception as error:  # the catalog is out of reach for a moment: build it again
        log.warning("reconciliation could not read the sinces of %s's inputs: %s", old.desc.name, error)
        return False
