"""The running controller: the catalog, storage, planner, orchestrator and one driver per
instance, behind the operations of `ControllerApi`.

Durability order (DESIGN section 6): a request that changes durable state is validated,
committed to the catalog (fenced by the controller epoch), and only then pushed into the
instance's history and sent. A refused request changes nothing.

Start-up order matters: the catalog is opened and the blob location checked first, so a
bad location stops the start before anything runs; the planner's JVM is launched before
any gRPC thread exists (a fork while gRPC threads run broke JVM launches), then the
catalog epoch is bumped (fencing any older controller), every instance's history is
rebuilt from the catalog and its replicas are re-added; live replicas reconcile instead
of recomputing. The planner's session is built in the background meanwhile: only
planning waits for it.

Background tasks, once started: the advancer (idle sources' uppers move to now; an
append moves them to its own time at once) and storage upkeep (retention holds,
compaction, garbage; `_upkeep.py`). A `Fenced` error ends either, as a fenced controller
must stop; any other error is logged and the next tick tries again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar

import pyarrow as pa

from catalog import (
    APPEND_KEY_LENGTH,
    Catalog,
    DataflowInfo,
    Fenced,
    HoldInfo,
    InvalidArgument,
    NewEvent,
    NotFound,
    ReplicaInfo,
    default_url,
)
from controller._api import (
    CollectionView,
    Consistency,
    ControllerError,
    DataflowStatusView,
    DataflowView,
    EventView,
    HandoverView,
    InstanceView,
    LeadershipView,
    ReadResult,
    ReplicaView,
    SourceView,
    StorageView,
)
from controller._blocking import blocking as _blocking
from controller._blocking import inline as _inline
from controller._blocking import refused as _refused
from controller._driver import InstanceDriver
from controller import _reconfigure
from controller._http import HttpListener
from controller._ingest import GroupCommit
from controller._leadership import read_leadership
from controller._metrics import ControllerMetrics
from controller._instance import ComputeInstance, InstanceError, InstanceOptions, SinceAdvanced, StorageHold
from controller._orchestrator import Orchestrator, size_of
from controller._planner import Planner
from controller._storage_view import orphan_events, storage_views
from controller._subscribe import FeedRequest, IndexFeed, OpenFeeds, StorageFeed
from controller._upkeep import RETENTION_HOLDER, StorageUpkeep, UpkeepOptions
from history import DataflowDescription, DataflowStatus, Frontier, Import, IndexTarget, Peek, PeekCanceled, PeekRows, RowSetFinishing, SqlTarget, Subscribe
from protocol.security import ServerSecurity
from replica_service._spark import class_archive, make_class_archive, standalone_masters
from storage import DIFF, TIME, Storage, parse_schema

log = logging.getLogger(__name__)

T = TypeVar("T")

ADVANCE_INTERVAL_S = 1.0
IN_SYNC_POLL_S = 0.5
RESPAWN_AFTER = 3  # failed attempts in a row before a live managed process is replaced
INLINE_CHECK_ROWS = 4096  # an append of at most this many rows is checked on the event loop (about 0.1 ms for 50)

async def _every(interval_s: float, tick: Callable[[], Awaitable[None]], what: str, on_fenced: Callable[[Fenced], None]) -> None:
    """Run `tick` every `interval_s` seconds until cancelled. `Fenced` ends the loop and
    is reported to `on_fenced` (a fenced controller must stop); any other error is
    logged and the next tick retries."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await tick()
        except Fenced as fenced:
            log.critical("fenced by a newer controller: stopping %s", what)
            on_fenced(fenced)
            return
        except Exception:
            log.exception("%s failed", what)


class Controller:
    """Implements `ControllerApi` over the catalog, storage and instance drivers."""

    def __init__(
        self,
        catalog: Catalog,
        catalog_url: str,
        storage: Storage,
        planner: Future[Planner],
        orchestrator: Orchestrator,
        upkeep: UpkeepOptions = UpkeepOptions(),
        security: ServerSecurity = ServerSecurity(),
    ) -> None:
        self.catalog = catalog
        self.catalog_url = catalog_url
        self.storage = storage
        self._planner = planner  # still starting while recovery runs and peeks are served
        self.orchestrator = orchestrator
        self.open_feeds = OpenFeeds()  # holders of the storage feeds this controller has open
        self.upkeep = StorageUpkeep(storage, upkeep, open_feeds=self.open_feeds)
        self.drivers: dict[str, InstanceDriver] = {}
        self.security = security  # how replicas are reached (and managed ones secured)
        self._epoch = 0
        self._lead_cause = ""  # why this controller took the lead, for its take-over events
        self._lead_found: float | None = None  # when it found it could (monotonic)
        self.ingest = GroupCommit(lambda appends, keys: self.storage.append_group(appends, keys))  # appends, and the advancer's ticks
        self._source_ids: dict[str, str] = {}  # appends' sources by name: only this leader drops one
        self._tasks: list[asyncio.Task] = []  # the background tasks, cancelled by stop()
        self.metrics = ControllerMetrics(self)
        self.http = HttpListener(self)
        # Set once this controller learns a newer one took the catalog: it must stop.
        self.fenced: Fenced | None = None
        self.fenced_event = asyncio.Event()

    # --- Life cycle -----------------------------------------------------------------------

    @classmethod
    async def start(cls, data_dir: Path, catalog_url: str | None = None, **options: Any) -> Controller:
        """`prepare` (the same arguments), take the epoch at once (fencing any older
        controller) and `lead`."""
        controller = await cls.prepare(data_dir, catalog_url, **options)
        try:
            await _blocking(controller.catalog.become_controller)
        except BaseException:
            await controller.stop()
            raise
        await controller.lead()
        return controller

    @classmethod
    async def prepare(
        cls,
        data_dir: Path,
        catalog_url: str | None = None,
        *,
        blob_uri: str | None = None,
        upkeep: UpkeepOptions = UpkeepOptions(),
        security: ServerSecurity = ServerSecurity(),
        on_making_class_archive: Callable[[], None] = lambda: None,
    ) -> Controller:
        """A controller on `data_dir`, ready to `lead` once its catalog holds the epoch:
        the catalog at `catalog_url` (default: SQLite in `data_dir`), batch files at
        `blob_uri` (default: `data_dir/blobs`), the planner's JVM starting. What a
        standby keeps warm. An unusable blob location is INVALID_ARGUMENT, naming it,
        before anything runs. `security` is the controller's own (TLS, token): it
        reaches replicas with it, and the replicas it spawns serve with it.
        `on_making_class_archive` is called before the class archive is made, when this
        start must make it."""
        data_dir = Path(data_dir).resolve()
        data_dir.mkdir(parents=True, exist_ok=True)
        url = catalog_url or default_url(data_dir)
        catalog = await asyncio.to_thread(Catalog.open, url)
        try:
            storage = await _blocking(Storage, catalog, blob_uri or data_dir / "blobs")
        except ControllerError:
            catalog.close()
            raise
        # Once per machine (about 40 s): the JVMs launched from now on, the planner's and
        # the local replicas', start in about half the time.
        if class_archive() is None:
            on_making_class_archive()
        await asyncio.to_thread(make_class_archive)
        planner = await asyncio.to_thread(Planner.launch, data_dir / "planner")  # before any gRPC thread
        orchestrator = Orchestrator(catalog, url, storage.blob_uri, data_dir, security.argv())
        return cls(catalog, url, storage, planner, orchestrator, upkeep, security)

    async def lead(self, cause: str = "", found: float | None = None) -> None:
        """Drive every instance from the catalog, whose epoch this controller now holds
        (`Catalog.become_controller` or `take_lead`, for `cause`, found possible at
        monotonic time `found`): recover the histories, reconcile the live replicas,
        resume upkeep and any resize left halfway."""
        self._epoch = self.catalog.epoch
        self._lead_cause, self._lead_found = cause, found
        log.info("controller epoch %d on %s; batch files at %s", self._epoch, self.catalog_url, self.storage.blob_uri)
        started = time.monotonic()
        await self._recover()
        recovered = time.monotonic()
        # What a dropped instance or a dead controller left holds its collections back
        # until removed: compaction resumes from this controller's first pass.
        await self._note_orphans(await _blocking(self.upkeep.remove_orphans))
        orphans = time.monotonic()
        self._start_tasks()
        # A resize a dead predecessor left halfway is finished or rolled back now.
        self._tasks.extend(await _reconfigure.resume(self))
        log.info(
            "leading: recovery %.0f ms, orphaned holds %.0f ms, resizes %.0f ms",
            *(1000 * (b - a) for a, b in ((started, recovered), (recovered, orphans), (orphans, time.monotonic()))),
        )

    def _start_tasks(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(_every(ADVANCE_INTERVAL_S, self._advance_sources, "advancing sources", self.learn_fenced)))
        interval_s = self.upkeep.options.interval_ms / 1000
        self._tasks.append(loop.create_task(_every(interval_s, self._upkeep_storage, "storage upkeep", self.learn_fenced)))

    def learn_fenced(self, error: Fenced) -> None:
        """Another controller took the epoch (a fenced write, or a lease renewal, found
        it): this one must stop (`fenced_event`)."""
        if self.fenced is None:
            self.fenced = error
            self.fenced_event.set()

    async def stop(self, *, stop_replicas: bool = False) -> list[ReplicaInfo]:
        """Stop driving. The managed replicas' processes keep running (a restart
        reconciles with them) unless `stop_replicas` (an operator's stop of `tandem
        serve`), when they are stopped too, and gone when this returns. Either way,
        the managed replicas that were running."""
        await self.stop_driving()
        await asyncio.to_thread(self.http.close)  # a request in flight may need this loop
        try:
            replicas = await asyncio.to_thread(self.orchestrator.stop_all if stop_replicas else self.orchestrator.running)
        except Exception as error:  # the catalog is gone: nothing says which processes are ours
            log.warning("could not tell which replica processes run: %s", error)
            replicas = []
        await self._stop_planner()
        return replicas

    async def stop_driving(self, why: ControllerError | None = None) -> None:
        """Stop committing, upkeep and every instance's replica connections, at once:
        what a controller that handed the lead over must not go on doing while the
        next one connects; feeds and waiting peeks fail with `why` (`InstanceDriver.stop`).
        `stop` does it too; doing it twice is harmless."""
        for task in self._tasks:
            task.cancel()
        self.ingest.stop()
        for driver in self.drivers.values():
            await driver.stop(why)

    async def _stop_planner(self) -> None:
        try:
            planner = await asyncio.wrap_future(self._planner)
        except Exception:
            return  # it never started; the error was reported to whoever asked for it
        await asyncio.to_thread(planner.stop)

    async def _plan(self, call: Callable[[Planner], T]) -> T:
        """Run `call` on the planner, on a worker thread, once the planner has started."""
        try:
            planner = await asyncio.wrap_future(self._planner)
        except Exception as e:
            raise ControllerError("UNAVAILABLE", f"the SQL planner did not start: {e}") from None
        return await asyncio.to_thread(call, planner)

    async def _recover(self) -> None:
        for info in await _blocking(self.catalog.list_instances):
            commands = await _blocking(self.catalog.recover_history, info.name)
            driver = self._new_driver(info.name)
            for command in commands:
                desc = getattr(command, "desc", None)
                if desc is not None:
                    exports = [await _blocking(self.catalog.get_collection, id) for id in desc.export_ids]
                    window = (await _blocking(self.catalog.get_dataflow, exports[0].dataflow_id)).compaction_window_ms or 0
                    sinces = {export.id: export.since for export in exports}
                    await driver.call(
                        lambda instance, desc=desc, window=window, sinces=sinces: instance.create_dataflow(desc, window, sinces)
                    )
            replicas = await _blocking(self.catalog.list_replicas, info.name)
            for replica in replicas:
                await driver.call(lambda instance, name=replica.name, n=max(1, replica.incarnation): instance.add_replica(name, n))
            took_over = f"controller epoch {self._epoch} recovered the instance: {len(commands)} commands, {len(replicas)} replicas"
            if self._lead_cause:
                took_over += f" (it took the lead: {self._lead_cause}"
                took_over += f"; {1000 * (time.monotonic() - self._lead_found):.0f} ms after it found it could)" if self._lead_found else ")"
            await driver.call(lambda instance: instance.note("took_over", took_over))
            log.info("recovered instance %s: %d commands", info.name, len(commands))

    def _new_driver(self, name: str) -> InstanceDriver:
        info = self.catalog.get_instance(name)
        instance = ComputeInstance(
            info.config,
            InstanceOptions(
                info.min_in_sync,
                info.max_lag_ms,
                info.replica_timeout_ms,
                max_hold_back_ms=info.max_hold_back_ms,
                replace_slow=info.replace_slow,
            ),
            info.parameters,
            now_ms=int(time.time() * 1000),
        )
        driver = InstanceDriver(
            instance,
            self._epoch,
            resolve_address=lambda replica, attempt: self._replica_address(name, replica, attempt),
            durable=self._record,
            on_fenced=self.learn_fenced,
            security=self.security,
            recompute=lambda desc, time: self._recompute_digest(name, desc, time),
            on_status=lambda replica, response: self.metrics.observe_status(name, replica, response),
            record_events=lambda events: self.catalog.record_events(
                [NewEvent(e.at_ms, name, e.kind, e.message, e.replica) for e in events]
            ),
        )
        self.drivers[name] = driver
        driver.start()
        return driver

    async def _replica_address(self, instance: str, name: str, attempt: int) -> str:
        """Where replica `name` listens now; a managed replica whose process died is
        spawned again, and so is one whose process lives but failed `RESPAWN_AFTER`
        attempts in a row (attempts count on across the replica's failed incarnations:
        unreachable, refusing, or dying after it connected). A fenced controller leaves
        the processes alone: they are the newer controller's now."""
        replica = await _blocking(self.catalog.get_replica, instance, name)
        if replica.managed and attempt > RESPAWN_AFTER and self.orchestrator.alive(replica) and not await self._fenced():
            log.warning("replica %s/%s at %s failed %d times in a row; starting a new process", instance, name, replica.address, attempt - 1)
            self.orchestrator.stop(replica)
        launch_conf = self._launch_conf(instance)
        return await _blocking(self.orchestrator.ensure_running, replica, launch_conf)

    async def _fenced(self) -> bool:
        try:
            await asyncio.to_thread(self.catalog.check_epoch)
        except Fenced:
            return True
        return False

    async def _recompute_digest(self, instance: str, desc: DataflowDescription, time: int) -> str:
        """The digest of `desc`'s index version at `time`, recomputed from storage on the
        planner's Spark (see `Planner.recompute_digest`)."""
        if any(source.kind != "storage" for source in desc.imports):
            raise ControllerError("FAILED_PRECONDITION", f"dataflow {desc.name} imports an index, which only replicas hold")
        if not desc.index_exports:
            raise ControllerError("FAILED_PRECONDITION", f"dataflow {desc.name} has no index")
        conf = self.drivers[instance].instance.config.conf()
        return await self._plan(lambda planner: planner.recompute_digest(desc, time, self.storage, conf))

    def _launch_conf(self, instance: str) -> dict[str, str]:
        conf = self.drivers[instance].instance.config.conf()
        return {k: v for k, v in conf.items() if k == "spark.default.parallelism"}

    def _record(self, effects: Sequence[StorageHold | SinceAdvanced]) -> None:
        """Make holds and sinces durable, all in one transaction (blocking; on the
        driver's serial worker): see `Catalog.record_compute_frontiers`."""
        sinces = {e.id: e.since for e in effects if isinstance(e, SinceAdvanced)}
        holds = [(e.id, e.holder, e.frontier) for e in effects if isinstance(e, StorageHold)]
        self.catalog.record_compute_frontiers(sinces, holds)

    @property
    def epoch(self) -> int:
        return self._epoch

    def _driver(self, instance: str) -> InstanceDriver:
        driver = self.drivers.get(instance)
        if driver is None:
            raise ControllerError("NOT_FOUND", f"instance {instance!r} does not exist")
        return driver

    # --- Instances ------------------------------------------------------------------------

    async def create_instance(
        self, name, *, min_in_sync=1, max_lag_ms=None, replica_timeout_ms=None, spark_conf=None, max_hold_back_ms=None, replace_slow=None
    ) -> InstanceView:
        given = (
            ("max_lag_ms", max_lag_ms),
            ("replica_timeout_ms", replica_timeout_ms),
            ("max_hold_back_ms", max_hold_back_ms),
            ("replace_slow", replace_slow),
        )
        options = {k: v for k, v in given if v is not None}
        await _blocking(self.catalog.create_instance, name, spark_conf=spark_conf, min_in_sync=min_in_sync, **options)
        self._new_driver(name)
        return (await self.status(name))[0]

    async def drop_instance(self, name: str) -> None:
        driver = self._driver(name)
        replicas = await _blocking(self.catalog.list_replicas, name)
        await _blocking(self.catalog.drop_instance, name)
        del self.drivers[name]
        await driver.stop()
        for replica in replicas:
            self.orchestrator.stop(replica)

    async def list_instances(self) -> list[InstanceView]:
        return await self.status()

    # --- Replicas -------------------------------------------------------------------------

    async def add_replica(
        self,
        instance,
        name,
        *,
        size=None,
        spark_master=None,
        spark_conf=None,
        address=None,
        driver_host=None,
        driver_bind_address=None,
        wait=False,
        timeout_ms=None,
    ) -> ReplicaView:
        driver = self._driver(instance)
        if timeout_ms is not None and (not wait or timeout_ms < 1):
            raise ControllerError("INVALID_ARGUMENT", f"timeout_ms ({timeout_ms}) is how long to wait: a positive number, with wait")
        timeout_ms = driver.instance.options.replica_timeout_ms if timeout_ms is None else timeout_ms
        deadline = time.monotonic() + timeout_ms / 1000
        spark_conf = _placed(name, spark_conf or {}, address, driver_host, driver_bind_address)
        if spark_master is None:
            size = size or "xsmall"
            spark_master = size_of(size).master
            spark_conf = {"spark.driver.memory": size_of(size).driver_memory, **spark_conf}
        elif spark_master.startswith("spark://"):
            try:
                standalone_masters(spark_master)
            except ValueError as e:
                raise ControllerError("INVALID_ARGUMENT", str(e)) from None
        size = size or "custom"
        info = await _blocking(
            self.catalog.create_replica, instance, name, size=size, spark_master=spark_master, spark_conf=spark_conf, address=address
        )
        if info.managed:
            ready_timeout = {"ready_timeout_s": deadline - time.monotonic()} if wait else {}
            try:
                await _blocking(self.orchestrator.spawn, info, self._launch_conf(instance), **ready_timeout)
            except ControllerError:
                await _blocking(self.catalog.drop_replica, instance, name)
                raise
        added = f"replica {name} added: size {size}, master {spark_master}" + (f", at {address}" if address else "")
        await driver.call(lambda inst: inst.add_replica(name) + inst.note("replica_added", added, name))
        if wait:
            try:
                # Strictly: where no replica is hydrated yet, no dataflow is served, and a
                # new replica would be in sync "where served" at once.
                in_sync = await self._await_in_sync(driver, [name], deadline)
            except BaseException:  # the call was canceled: it leaves nothing behind either
                await asyncio.shield(self.drop_replica(instance, name, force=True))
                raise
            if not in_sync:
                why = _why_not_in_sync(driver, name)
                await self.drop_replica(instance, name, force=True)
                raise ControllerError("DEADLINE_EXCEEDED", f"replica {name} did not get in sync within {timeout_ms} ms ({why}); it was dropped")
        return next(r for r in (await self.status(instance))[0].replicas if r.name == name)

    async def drop_replica(self, instance: str, name: str, *, force: bool = False) -> None:
        driver = self._driver(instance)
        # The check holds only if no other drop runs between it and the drop itself.
        async with driver.ddl:
            await driver.call(lambda inst: ([], inst.check_drop_replica(name, force=force)))
            info = await _blocking(self.catalog.get_replica, instance, name)
            await _blocking(self.catalog.drop_replica, instance, name)
            dropped = f"replica {name} dropped" + (" (forced)" if force else "")
            await driver.call(lambda inst: inst.drop_replica(name, force=True) + inst.note("replica_dropped", dropped, name))
        self.orchestrator.stop(info)

    async def resize(self, instance: str, size: str, *, timeout_ms: int = 600_000, on_timeout: str = "rollback") -> list[ReplicaView]:
        """A durable reconfiguration: see `_reconfigure`."""
        return await _reconfigure.resize(self, instance, size, timeout_ms=timeout_ms, on_timeout=on_timeout)

    @staticmethod
    async def _await_in_sync(driver: InstanceDriver, names: Sequence[str], deadline: float, *, where_served: bool = False) -> bool:
        """Whether replicas `names` all got in sync before `deadline` (monotonic seconds):
        strictly, or `where_served` (`ReplicaHealth.in_sync_where_served`)."""
        while not all(h.in_sync_where_served if where_served else h.in_sync for h in driver.instance.health() if h.name in names):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(IN_SYNC_POLL_S)
        return True

    # --- Sources --------------------------------------------------------------------------

    async def create_source(self, name: str, schema: str) -> SourceView:
        # Held by the retention window from its creation, in the same transaction: until
        # upkeep's next pass, a dataflow's hold alone would set its since.
        info = await _blocking(self.storage.create_source, name, schema, holders=(RETENTION_HOLDER,))
        return _source_view(info)

    async def append(self, source: str, rows, *, idempotency_key: str | None = None) -> int:
        if idempotency_key is not None and len(idempotency_key) > APPEND_KEY_LENGTH:
            raise ControllerError("INVALID_ARGUMENT", f"an idempotency key has at most {APPEND_KEY_LENGTH} characters, not {len(idempotency_key)}")
        # Refused whole, nothing written. A small batch to a source appended to before is
        # checked on the loop: at hundreds of appends a second, a worker thread's round
        # trip per append cost more of the controller's one core than the check.
        id = self._source_ids.get(source)
        if id is not None and isinstance(rows, pa.Table) and rows.num_rows <= INLINE_CHECK_ROWS:
            batch = _inline(self.storage.append_batch_of, id, rows)
        else:
            id, batch = await _blocking(self._append_batch, source, rows)
        # Committed with the appends that arrive meanwhile, at one timestamp, which moves
        # every other source's upper past it in the same transaction: no write can take
        # a time at or before it any more, so a dataflow joining this source with idle
        # ones computes it at once instead of at the advancer's next tick.
        return await _refused(self.ingest.append(id, batch, idempotency_key))

    def _append_batch(self, source: str, rows) -> tuple[str, pa.Table]:
        """Source `source`'s id and `rows` as its batch, in one trip to a worker thread.
        The id is remembered: a source's id never changes, and only this controller,
        while it leads, drops a source (`drop_source` forgets it; a group commit refuses
        an append to one dropped meanwhile)."""
        id = self._source_ids.get(source)
        if id is None:
            info = self.catalog.collection_by_name(source)
            if info.kind != "source":
                raise ControllerError("INVALID_ARGUMENT", f"{source} is a materialized view; only sources take appends")
            id = self._source_ids[source] = info.id
        return id, self.storage.append_batch_of(id, rows)

    async def drop_source(self, name: str) -> None:
        info = await _blocking(self.catalog.collection_by_name, name)
        await _blocking(self.catalog.drop_source, info.id)
        self._source_ids.pop(name, None)

    async def list_sources(self) -> list[SourceView]:
        collections = await _blocking(self.catalog.list_collections)
        return [_source_view(c) for c in collections if c.kind == "source"]

    # --- Subscriptions ----------------------------------------------------------------------

    async def subscribe(
        self,
        instance: str | None,
        name: str,
        *,
        as_of: int | None = None,
        up_to: int | None = None,
        snapshot: bool = True,
        progress: bool = False,
    ) -> StorageFeed | IndexFeed:
        """The open feed of `name`: a dataflow of `instance` (its materialized view if it
        has one, else its index, through the replicas), or a source or materialized
        view. Checked before anything opens: an unknown name is NOT_FOUND, `as_of`
        below the since FAILED_PRECONDITION naming it, `up_to` not after `as_of`
        INVALID_ARGUMENT. The caller closes the feed."""
        if as_of is not None and as_of < 0:
            raise ControllerError("INVALID_ARGUMENT", f"as_of must be a time (a non-negative int), not {as_of}")
        collection = None
        if instance is not None:
            driver = self._driver(instance)  # NOT_FOUND for an unknown instance
            try:
                dataflow = await asyncio.to_thread(self.catalog.dataflow_by_name, instance, name)
            except NotFound:
                dataflow = None
            if dataflow is not None and dataflow.sink_id is None:
                return await self._subscribe_index(driver, name, as_of, up_to, snapshot, progress)
            if dataflow is not None:
                collection = await _blocking(self.catalog.get_collection, dataflow.sink_id)
        if collection is None:
            collection = await _blocking(self.catalog.collection_by_name, name)
        since = collection.since.time
        if as_of is None:
            upper = collection.upper
            as_of = since if upper.is_empty else max(since, upper.time - 1)
        elif as_of < since:
            raise ControllerError(
                "FAILED_PRECONDITION", f"cannot subscribe to {name} as of {as_of}: its since is {since} (times before it were compacted away)"
            )
        if up_to is not None and up_to <= as_of:
            raise ControllerError("INVALID_ARGUMENT", f"up_to ({up_to}) must be after as_of ({as_of})")
        feed = StorageFeed(self.storage, FeedRequest(collection.id, name, as_of, up_to, snapshot, progress), self.open_feeds)
        await _blocking(feed.hold)
        return feed.start()

    async def _subscribe_index(
        self, driver: InstanceDriver, name: str, as_of: int | None, up_to: int | None, snapshot: bool, progress: bool
    ) -> IndexFeed:
        """The feed of dataflow `name`'s index, as of `as_of` (None: the latest
        time it can serve), opened on its instance."""

        def index_of(instance: ComputeInstance) -> tuple[list, tuple[str, int, str]]:
            desc = instance.dataflow_named(name).desc
            id = desc.index_exports[0].id
            return [], (id, instance.readable_time(id) if as_of is None else as_of, desc.schema)

        id, chosen, ddl = await driver.call(index_of)
        if up_to is not None and up_to <= chosen:
            raise ControllerError("INVALID_ARGUMENT", f"up_to ({up_to}) must be after as_of ({chosen})")
        request = FeedRequest(id, name, chosen, up_to, snapshot, progress)
        command = Subscribe(uuid.uuid4().hex, id, chosen, snapshot)
        empty = parse_schema(ddl).empty_table()
        empty = empty.append_column(TIME, pa.array([], pa.int64())).append_column(DIFF, pa.array([], pa.int64()))
        return driver.open_feed(lambda cancel: IndexFeed(request, command.uuid, empty, cancel), lambda instance: instance.subscribe(command))

    async def _advance_sources(self) -> None:
        """One tick of the advancer: move every idle source's upper to now, so dataflows
        over idle inputs keep making progress (an empty append of the group commit,
        fenced: also how an idle controller learns, within a tick, that it was)."""
        await self.ingest.advance()

    async def _upkeep_storage(self) -> None:
        """One tick of storage upkeep, on a worker thread. It moves no upper, so it takes
        no part in the group commit: appends never wait behind a compaction."""
        done = await asyncio.to_thread(self.upkeep.run_once)
        await self._note_orphans(done.orphans)
        if done.compacted or (done.garbage and (done.garbage.retired or done.garbage.orphans)):
            log.debug("storage upkeep: compacted %s, garbage %s", done.compacted, done.garbage)

    async def _note_orphans(self, orphans: Sequence[HoldInfo]) -> None:
        """Each removed orphaned hold: a warning, an event (of no instance) and a count."""
        for hold in orphans:
            log.warning("removed the hold %s on %s at %s: its owner (%s) is gone", hold.holder, hold.collection_id, hold.frontier.time, hold.owner)
            self.metrics.orphaned_holds.labels(hold.owner.kind).inc()
        if orphans:
            await asyncio.to_thread(self.catalog.record_events, orphan_events(orphans, self.catalog.now_ms()))

    async def storage_holds(self) -> list[StorageView]:
        return await _blocking(storage_views, self.catalog)

    # --- Dataflows ------------------------------------------------------------------------

    async def create_dataflow(self, instance, name, sql, *, index_key=None, materialize=False, compaction_window_ms=0, strategy="auto") -> DataflowView:
        if strategy not in STRATEGIES:
            raise ControllerError("INVALID_ARGUMENT", f"strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
        driver = self._driver(instance)
        conf = driver.instance.config.conf()
        tables = await self._plan(lambda planner: planner.referenced_tables(sql, conf))
        schemas = {table: (await self._resolve(driver, table))[1] for table in tables}
        planned = await self._plan(lambda planner: planner.analyze(sql, schemas, conf))
        if index_key is None and not materialize:
            index_key = ()
        if index_key is not None:
            key = index_key
            index_key = await self._plan(lambda planner: planner.check_index_key(planned, key))
        recorded = _strategy(name, strategy, planned.not_incremental)
        async with driver.ddl:
            # The inputs' frontiers are read after planning, which takes a while: by then
            # a since read before could have moved past the as_of chosen from it.
            imports, as_of, latest = [], Frontier.minimum(), Frontier.empty()
            for table in tables:
                source, _, since, upper = await self._resolve(driver, table)
                imports.append(source)
                as_of, latest = as_of.join(since), latest.meet(upper)
            # Start at the latest time every input can serve, not at an old since: each
            # input change between the two would otherwise be one more Spark step.
            as_of = as_of.join(latest.step_back()) if not latest.is_empty else as_of
            # Nothing may be recorded that the instance then refuses: the imported
            # indexes are held at as_of until the instance holds them itself, and the
            # catalog holds the storage imports in the same transaction as the record.
            token = uuid.uuid4().hex
            indexes = [source.id for source in imports if source.kind == "index"]
            as_of = await driver.call(lambda inst: ([], inst.reserve(token, indexes, as_of)))
            try:
                info = await _blocking(
                    self.catalog.create_dataflow,
                    instance,
                    name,
                    sql=sql,
                    imports=imports,
                    schema=planned.schema,
                    as_of=as_of,
                    index_key=index_key,
                    materialized=materialize,
                    compaction_window_ms=compaction_window_ms,
                    strategy=recorded,
                    sink_holders=(RETENTION_HOLDER,),  # as a new source is
                )
                desc = info.description()
                await driver.call(lambda inst: inst.create_dataflow(desc, compaction_window_ms))
            finally:
                driver.post(lambda inst: inst.release_reservation(token))
        return _dataflow_view(info, driver)

    async def _resolve(self, driver: InstanceDriver, table: str) -> tuple[Import, str, Frontier, Frontier]:
        """A name in SQL: an index of this instance, else a storage collection."""
        for dataflow in await _blocking(self.catalog.list_dataflows, driver.name):
            if dataflow.name.lower() == table.lower() and dataflow.index_id is not None:
                collection = driver.instance.collections.get(dataflow.index_id)
                if collection is not None:
                    return Import(table, dataflow.index_id, "index"), dataflow.schema, collection.since, collection.write_frontier
        try:
            info = await _blocking(self.catalog.collection_by_name, table)
        except ControllerError:
            raise ControllerError("NOT_FOUND", f"no source, materialized view or index of instance {driver.name!r} is named {table!r}") from None
        return Import(table, info.id, "storage"), info.schema, info.since, info.upper

    async def drop_dataflow(self, instance: str, name: str) -> None:
        driver = self._driver(instance)
        async with driver.ddl:
            info = await _blocking(self.catalog.dataflow_by_name, instance, name)
            await driver.call(lambda inst: ([], inst.check_drop_dataflow(info.export_ids[0])))
            await _blocking(self.catalog.drop_dataflow, info.id)
            await driver.call(lambda inst: inst.drop_dataflow(info.export_ids[0]))

    async def list_dataflows(self, instance: str | None = None) -> list[DataflowView]:
        if instance is not None:
            self._driver(instance)
        return [_dataflow_view(d, self.drivers.get(d.instance)) for d in await _blocking(self.catalog.list_dataflows, instance)]

    # --- Reads ----------------------------------------------------------------------------

    async def peek(self, instance, name, *, key=None, where=(), order_by=(), limit=None, offset=0, columns=None, timestamp=None, consistency="serializable", timeout_ms=30_000) -> ReadResult:
        driver = self._driver(instance)

        def index_target(inst: ComputeInstance) -> IndexTarget:
            # Resolved by the instance, in the step that issues the peek: no catalog read.
            dataflow = inst.dataflow_named(name)
            if not dataflow.desc.index_exports:
                raise InstanceError("FAILED_PRECONDITION", f"dataflow {name!r} has no index to peek; it only writes a materialized view")
            return IndexTarget(dataflow.desc.index_exports[0].id)

        finishing = RowSetFinishing(
            key=None if key is None else tuple(key),
            filter=tuple(where),
            order_by=tuple(order_by),
            offset=offset,
            limit=limit,
            projection=None if columns is None else tuple(columns),
        )
        return await self._read(driver, index_target, finishing, timestamp, consistency, timeout_ms)

    async def query(self, instance, sql, *, timestamp=None, consistency="serializable", timeout_ms=30_000) -> ReadResult:
        driver = self._driver(instance)
        imports = []
        schemas = {}
        conf = driver.instance.config.conf()
        for table in await self._plan(lambda planner: planner.referenced_tables(sql, conf)):
            source, schema, _, _ = await self._resolve(driver, table)
            if source.kind != "index":
                raise ControllerError("FAILED_PRECONDITION", f"query reads indexes of instance {instance!r}; {table!r} is not one (create a dataflow over it)")
            imports.append(source)
            schemas[table] = schema
        await self._plan(lambda planner: planner.analyze(sql, schemas, conf))
        target = SqlTarget(sql, tuple(imports))
        return await self._read(driver, lambda inst: target, RowSetFinishing(), timestamp, consistency, timeout_ms)

    async def _read(
        self,
        driver: InstanceDriver,
        resolve_target: Callable[[ComputeInstance], IndexTarget | SqlTarget],
        finishing: RowSetFinishing,
        timestamp: int | None,
        consistency: Consistency,
        timeout_ms: int,
    ) -> ReadResult:
        if consistency not in ("serializable", "strict"):
            raise ControllerError("INVALID_ARGUMENT", f"consistency must be 'serializable' or 'strict', not {consistency!r}")
        if timestamp is None and consistency == "strict":
            timestamp = await _blocking(self.catalog.read_ts)
        peek_id = uuid.uuid4().hex
        waiter = asyncio.get_running_loop().create_future()

        def issue(instance: ComputeInstance):
            target = resolve_target(instance)
            chosen = timestamp
            if chosen is None:
                chosen = max(instance.readable_time(id) for id in target.collection_ids)
            driver.peek_waiters[peek_id] = waiter
            try:
                return instance.peek(Peek(peek_id, target, chosen, finishing, timeout_ms)), chosen
            except Exception:
                del driver.peek_waiters[peek_id]
                raise

        chosen = await driver.call(issue)
        started = time.monotonic()
        try:
            result, replica = await asyncio.wait_for(asyncio.shield(waiter), timeout_ms / 1000)
        except asyncio.TimeoutError:
            driver.post(lambda inst: inst.cancel_peek(peek_id, f"no replica answered within {timeout_ms} ms"))
            self.metrics.observe_peek(driver.name, None, "timeout", time.monotonic() - started)
            raise ControllerError(
                "DEADLINE_EXCEEDED",
                f"no replica answered the read at {chosen} within {timeout_ms} ms (instance {driver.name!r} is {driver.instance.state()})",
            ) from None
        outcome = {PeekRows: "rows", PeekCanceled: "canceled"}.get(type(result), "error")
        self.metrics.observe_peek(driver.name, replica, outcome, time.monotonic() - started)
        if isinstance(result, PeekRows):
            return ReadResult(result.arrow_ipc, chosen, replica)
        if isinstance(result, PeekCanceled):
            raise ControllerError("UNAVAILABLE", "the read was canceled")
        raise ControllerError("FAILED_PRECONDITION", result.message)

    # --- Status ---------------------------------------------------------------------------

    async def status(self, instance: str | None = None) -> list[InstanceView]:
        names = [instance] if instance is not None else sorted(self.drivers)
        views = []
        for name in names:
            driver = self._driver(name)
            replicas = {r.name: r for r in await _blocking(self.catalog.list_replicas, name)}
            dataflows = await _blocking(self.catalog.list_dataflows, name)
            views.append(_instance_view(driver, replicas, dataflows))
        return views

    async def leadership(self) -> LeadershipView:
        return await read_leadership(self.catalog)

    async def handover(self, to: str | None = None) -> HandoverView:
        raise ControllerError("FAILED_PRECONDITION", _NO_LEADERSHIP)

    async def take_lead(self, epoch: int) -> LeadershipView:
        raise ControllerError("FAILED_PRECONDITION", _NO_LEADERSHIP)

    async def events(self, instance: str | None = None, *, after: int | None = None, limit: int = 100) -> list[EventView]:
        try:
            found = await _blocking(self.catalog.list_events, instance, after=after, limit=limit)
        except InvalidArgument as e:
            raise ControllerError("INVALID_ARGUMENT", str(e)) from None
        if instance is not None and instance not in self.drivers and not found and after is None:
            raise ControllerError("NOT_FOUND", f"no instance {instance!r}, and none left events")
        return [EventView(e.id, e.at_ms, e.instance, e.kind, e.replica, e.message) for e in found]


_NO_LEADERSHIP = "this controller runs in-process, without standbys: only `tandem serve` hands the lead over"

STRATEGIES = ("auto", "incremental", "recompute")


def _strategy(name: str, asked: str, not_incremental: str | None) -> str:
    """The strategy to record: "incremental" or "recompute: <why>". `auto` picks
    incremental where the planner found the query maintainable; `incremental` refuses a
    query that is not, naming the part that cannot be maintained."""
    if asked == "recompute":
        return "recompute: asked for"
    if not_incremental is None:
        return "incremental"
    if asked == "incremental":
        raise ControllerError("INVALID_ARGUMENT", f"dataflow {name!r} cannot be maintained incrementally: {not_incremental}")
    return f"recompute: {not_incremental}"


def _placed(name: str, spark_conf: Mapping[str, str], address: str | None, driver_host: str | None, driver_bind_address: str | None) -> dict[str, str]:
    """`spark_conf` with the driver's address of a managed replica: where executors on
    other hosts reach its driver (`spark.driver.host`) and the interface it listens on
    (`spark.driver.bindAddress`, default the host). Loopback when neither is given."""
    placement = {
        key: value
        for key, value in (("spark.driver.host", driver_host), ("spark.driver.bindAddress", driver_bind_address))
        if value is not None
    }
    if placement and address is not None:
        raise ControllerError(
            "INVALID_ARGUMENT",
            f"replica {name!r} is external (at {address}): its own process sets its driver's address "
            "(python -m replica_service --driver-host)",
        )
    for key, value in placement.items():
        if not value or any(c.isspace() for c in value):
            raise ControllerError("INVALID_ARGUMENT", f"{value!r} is not a host name or address (for {key} of replica {name!r})")
        if spark_conf.get(key, value) != value:
            raise ControllerError("INVALID_ARGUMENT", f"replica {name!r} gets two values for {key}: {spark_conf[key]!r} in its spark_conf and {value!r}")
    return {**spark_conf, **placement}


def _why_not_in_sync(driver: InstanceDriver, name: str) -> str:
    """Why replica `name` is not in sync, from what the instance knows of it now."""
    health = next(h for h in driver.instance.health() if h.name == name)
    status = driver.instance.replicas[name].status
    if status is not None and status.errors:
        return "it reports: " + "; ".join(status.errors)
    failed = [f"{d.id} failed: {d.error}" for d in (status.dataflows if status is not None else ()) if d.error]
    if failed:
        return "its dataflow " + "; ".join(failed)
    if health.phase != "active":
        return f"it is {health.phase}"
    if not health.hydrated:
        return "it has not hydrated every dataflow yet"
    return f"it lags {health.lag_ms} ms behind, more than the instance's max lag of {driver.instance.options.max_lag_ms} ms"


def _time(frontier: Frontier) -> int | None:
    return frontier.time


def _source_view(info) -> SourceView:
    return SourceView(info.id, info.name, info.schema, _time(info.since), _time(info.upper))


def _status_view(status: DataflowStatus) -> DataflowStatusView:
    return DataflowStatusView(
        status.hydrated,
        status.error,
        status.digest,
        status.last_step_ms,
        status.rows_changed,
        status.steps,
        status.hydration_tasks_done,
        status.hydration_tasks_total,
        status.pending_times,
        status.pending_rows,
        status.last_step_times,
        status.retries,
        status.retry_error,
    )


def _dataflow_view(info: DataflowInfo, driver: InstanceDriver | None) -> DataflowView:
    """The catalog's record of a dataflow, with what each replica last reported of it."""
    replicas = [] if driver is None else sorted(driver.instance.replicas.values(), key=lambda r: r.name)
    key = info.export_ids[0]  # the replicas' (and the instance's) id of the dataflow
    return DataflowView(
        id=info.id,
        instance=info.instance,
        name=info.name,
        sql=info.sql,
        schema=info.schema,
        index_id=info.index_id,
        index_key=info.index_exports[0].key if info.index_exports else None,
        sink_id=info.sink_id,
        compaction_window_ms=info.compaction_window_ms or 0,
        strategy=info.strategy,
        replicas={r.name: _status_view(r.dataflow_status[key]) for r in replicas if key in r.dataflow_status},
    )


def _instance_view(driver: InstanceDriver, replicas: Mapping[str, ReplicaInfo], dataflows: Sequence[DataflowInfo]) -> InstanceView:
    instance = driver.instance
    names = {export: d.name for d in dataflows for export in d.export_ids}
    replica_views = []
    for health in instance.health():
        state = instance.replicas[health.name]
        info = replicas.get(health.name)
        status = state.status
        replica_views.append(
            ReplicaView(
                name=health.name,
                size=info.size if info else "",
                spark_master=info.spark_master if info else "",
                address=info.address if info else None,
                managed=info.managed if info else False,
                state=health.phase,
                epoch=health.epoch,
                pid=(status.pid or None) if status else (info.pid if info else None),
                in_sync=health.in_sync,
                hydrated=health.hydrated,
                lag_ms=health.lag_ms,
                peeks_won=health.peeks_won,
                dataflows_kept=status.dataflows_kept if status else 0,
                dataflows_built=status.dataflows_built if status else 0,
                resumes=state.resumes,
                replays=state.replays,
                errors=status.errors if status else (),
                # By name (unique in the instance); dataflows the catalog no longer has are left out.
                dataflows=dict(sorted((names[id], _status_view(s)) for id, s in state.dataflow_status.items() if id in names)),
                consecutive_failures=state.consecutive_failures,
                last_failure=state.last_failure or None,
                next_retry_ms=state.retry_at_ms if state.phase == "failed" else None,
                wallclock_lag_ms=health.wallclock_lag_ms,
                diverged=state.diverged,
                slow=health.slow,
                metrics_address=(status.metrics_address or None) if status else None,
            )
        )
    return InstanceView(
        name=driver.name,
        health=instance.state(),
        min_in_sync=instance.options.min_in_sync,
        max_lag_ms=instance.options.max_lag_ms,
        replica_timeout_ms=instance.options.replica_timeout_ms,
        max_hold_back_ms=instance.options.max_hold_back_ms,
        replace_slow=instance.options.replace_slow,
        history_length=len(instance.history),
        history_reductions=instance.history.reductions,
        commands_pushed=instance.history.pushed,
        replicas=tuple(replica_views),
        collections=tuple(
            CollectionView(id, names.get(id, id), _time(c.since), _time(c.write_frontier), instance.wallclock_lag_ms(c.write_frontier))
            for id, c in instance.collections.items()
        ),
        unavailable_dataflows=dict(sorted(instance.unavailable_dataflows().items())),
        divergences=instance.divergences,
        events=tuple(f"{e.at_ms} {e.kind}: {e.message}" for e in instance.events),
    )
