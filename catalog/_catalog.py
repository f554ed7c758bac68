"""`Catalog`: the durable record of instances, replicas, collections, dataflows, the
storage manifest, the id allocator, the timestamp oracle and the controller epoch.

Rules of this module:
- `Catalog.open(url)` migrates the schema through Alembic and bumps nothing, so
  replicas use it too. A controller then calls `become_controller()`, which bumps the
  epoch in its own transaction.
- Every mutation runs in one transaction that first checks the epoch is still this
  catalog's (`SELECT ... FOR SHARE` on PostgreSQL, so a concurrent bump waits for it, and
  it for the bump; `BEGIN IMMEDIATE` serializes writers on SQLite). Otherwise it raises
  `Fenced`, having written nothing. A catalog that never became controller may only
  compare-and-append, guarded by the upper check alone.
- A refused call writes nothing: checks come first, and the transaction rolls back on
  any error. Reads return frozen records, never ORM rows.
- The oracle's clock (`now_ms`) is injected, so tests can move it backwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Self

from sqlalchemy import Engine, bindparam, case, select, update
from sqlalchemy.engine import URL
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from catalog import _collections, _events, _instances, _leadership, _manifest, _reconfigurations, _recovery
from catalog._leadership import ControllerSpec, Leadership
from catalog._engine import BUSY_MS, default_url, make_engine, read_only, upgrade
from catalog._errors import AlreadyExists, Fenced, InvalidArgument
from catalog._instances import (
    DEFAULT_MAX_HOLD_BACK_MS,
    DEFAULT_MAX_LAG_MS,
    DEFAULT_MIN_IN_SYNC,
    DEFAULT_REPLICA_TIMEOUT_MS,
    UNSET,
)
from catalog._models import ControllerEpoch, TimestampOracle
from catalog._records import (
    BatchInfo,
    CollectionInfo,
    DataflowInfo,
    EventInfo,
    HoldInfo,
    HoldOwner,
    InstanceInfo,
    ManifestState,
    ManifestTail,
    NewBatch,
    NewEvent,
    ReconfigurationInfo,
    ReplicaInfo,
)
from history import ComputeCommand, ComputeParameters, Frontier, Import


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


PRUNE_APPEND_KEYS_EVERY_MS = 1_000


class Catalog:
    """A connection to the catalog database. Thread-safe: every call runs its own
    transaction on a pooled connection.

    `epoch` is None until `become_controller()`; from then on every mutation is fenced
    against it.
    """

    def __init__(self, engine: Engine, *, now_ms: Callable[[], int] = wall_clock_ms) -> None:
        """Use `Catalog.open`; this assumes the schema is at head already."""
        self._engine = engine
        self._reader = read_only(engine)
        self._now_ms = now_ms
        self._epoch: int | None = None
        self._prune_keys_at_ms = 0  # when a group commit next forgets expired idempotency keys

    @classmethod
    def open(cls, url: str | URL, *, now_ms: Callable[[], int] = wall_clock_ms) -> Catalog:
        """Open the catalog at `url`, creating or upgrading its schema to the head
        revision. Bumps nothing: the result may serve a replica as it is."""
        engine = make_engine(url)
        try:
            upgrade(engine)
        except BaseException:
            engine.dispose()
            raise
        return cls(engine, now_ms=now_ms)

    default_url = staticmethod(default_url)

    @property
    def url(self) -> URL:
        return self._engine.url

    @property
    def dialect(self) -> str:
        """'sqlite' or 'postgresql'."""
        return self._engine.dialect.name

    @property
    def epoch(self) -> int | None:
        return self._epoch

    @property
    def is_controller(self) -> bool:
        return self._epoch is not None

    def now_ms(self) -> int:
        """The catalog's clock (wall clock unless injected)."""
        return self._now_ms()

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- Transactions -------------------------------------------------------------------

    @contextmanager
    def _write(self, *, fenced: bool = True, conflict: str | None = None, busy_ms: int | None = None) -> Iterator[Session]:
        """One write transaction, fenced by the epoch unless `fenced` is False.
        `conflict` is the AlreadyExists message for a unique-constraint violation (two
        concurrent creations of one name); `busy_ms` bounds its wait for SQLite's write
        lock (`BUSY_MS`)."""
        if fenced and self._epoch is None:
            raise Fenced(
                "this catalog is not the controller's: call become_controller() before "
                "writing (replicas may only compare_and_append)",
                epoch=None,
                current=None,
            )
        engine = self._engine if busy_ms is None else self._engine.execution_options(**{BUSY_MS: busy_ms})
        session = Session(engine, expire_on_commit=False)
        try:
            with session.begin():
                if fenced:
                    self._check_epoch(session)
                yield session
        except IntegrityError as error:
            if conflict is None or "unique" not in str(error.orig).lower():
                raise
            raise AlreadyExists(conflict) from error
        finally:
            session.close()

    def _check_epoch(self, session: Session) -> None:
        current = session.connection().execute(_READ_EPOCH).scalar_one()  # Core: every write pays it
        if current != self._epoch:
            raise Fenced(
                f"controller epoch {self._epoch} was superseded by epoch {current}: another "
                f"controller opened the catalog, so this one must stop",
                epoch=self._epoch,
                current=current,
            )

    @contextmanager
    def _read(self) -> Iterator[Session]:
        """One read transaction over a single consistent snapshot."""
        with Session(self._reader) as session, session.begin():
            yield session

    # --- Epoch and timestamps -----------------------------------------------------------

    def become_controller(self) -> int:
        """Bump the controller epoch and hold the new one: every later mutation through
        this object is fenced against it, and every older controller is fenced."""
        with self._write(fenced=False) as session:
            row = session.scalars(
                select(ControllerEpoch).where(ControllerEpoch.id == 1).with_for_update()
            ).one()
            row.epoch += 1
            epoch = row.epoch
        self._epoch = epoch
        return epoch

    # --- Leadership (`_leadership.py`) -------------------------------------------------

    def take_lead(
        self, me: ControllerSpec, lease_ms: int, decide: Callable[[Leadership], str | None], *, busy_ms: int | None = None
    ) -> tuple[int, str] | None:
        """Become the controller with a lease of `lease_ms` if `decide` (given the
        state under the lock) names a cause: bump the epoch (fencing every older
        controller) and hold it, as `become_controller`; (epoch, cause), or None."""
        with self._write(fenced=False, busy_ms=busy_ms) as session:
            taken = _leadership.take_lead(session, me, lease_ms, self._now_ms(), decide)
        if taken is not None:
            self._epoch = taken[0]
        return taken

    def hand_over(self, me: str, to: str, lease_ms: int) -> int:
        """Leader `me` hands the lead to standby `to` with a lease of `lease_ms`; the new
        epoch, which fences this catalog from then on. `Fenced` if another controller
        took the epoch first; `FailedPrecondition` if `to` is no standby."""
        with self._write() as session:
            return _leadership.hand_over(session, me, to, lease_ms, self._now_ms())

    def renew_lease(self, me: str, lease_ms: int, forget_after_ms: int) -> Leadership:
        """Extend leader `me`'s lease by `lease_ms` from now, forgetting standbys not
        heard from for `forget_after_ms`; `Fenced` once another controller took the
        epoch."""
        with self._write() as session:
            return _leadership.renew_lease(session, me, lease_ms, self._now_ms(), forget_after_ms)

    def register_standby(self, me: ControllerSpec, *, busy_ms: int | None = None) -> Leadership:
        """Record (or refresh) standby `me`; the leadership as it is."""
        with self._write(fenced=False, busy_ms=busy_ms) as session:
            return _leadership.register_standby(session, me, self._now_ms())

    def leave_leadership(self, me: str) -> Leadership:
        """`me` stops taking part (a leader's lease ends at once); the leadership after."""
        with self._write(fenced=False) as session:
            return _leadership.leave(session, me)

    def leadership(self) -> Leadership:
        with self._read() as session:
            return _leadership.leadership(session)

    def check_epoch(self) -> None:
        """Raise `Fenced` unless this catalog is the current controller's."""
        with self._write():
            pass

    def controller_epoch(self) -> int:
        """The epoch recorded in the catalog (0 before any controller)."""
        with self._read() as session:
            return session.scalars(select(ControllerEpoch.epoch)).one()

    def write_ts(self) -> int:
        """A new write timestamp: `max(now_ms(), last + 1)`, durably recorded (fenced)
        before it is returned. Strictly increasing across calls, processes and
        restarts, and never behind this catalog's clock."""
        with self._write() as session:
            return self._next_ts(session, self._now_ms())

    @staticmethod
    def _next_ts(session: Session, now_ms: int) -> int:
        """Take the oracle's next write timestamp, `max(now_ms, last + 1)`, in
        `session`'s transaction (its row locked until the transaction ends)."""
        return session.connection().execute(_NEXT_TS, {"now": now_ms}).scalar_one()

    def read_ts(self) -> int:
        """The latest write timestamp handed out (0 before the first)."""
        with self._read() as session:
            return session.scalars(select(TimestampOracle.last_ts)).one()

    # --- Instances and replicas ---------------------------------------------------------

    def create_instance(
        self,
        name: str,
        *,
        spark_conf: Mapping[str, str] | None = None,
        min_in_sync: int = DEFAULT_MIN_IN_SYNC,
        max_lag_ms: int = DEFAULT_MAX_LAG_MS,
        replica_timeout_ms: int = DEFAULT_REPLICA_TIMEOUT_MS,
        max_hold_back_ms: int = DEFAULT_MAX_HOLD_BACK_MS,
        replace_slow: bool = False,
        parameters: ComputeParameters | None = None,
    ) -> InstanceInfo:
        """Record an instance. Its Spark configuration is `DETERMINISTIC_SPARK_CONF` with
        `spark_conf` on top, fixed from now on; resource settings are refused."""
        with self._write(conflict=f"instance {name!r} already exists") as session:
            return _instances.create_instance(
                session,
                name,
                spark_conf=spark_conf or {},
                min_in_sync=min_in_sync,
                max_lag_ms=max_lag_ms,
                replica_timeout_ms=replica_timeout_ms,
                max_hold_back_ms=max_hold_back_ms,
                replace_slow=replace_slow,
                parameters=parameters or ComputeParameters(),
            )

    def update_instance(
        self,
        name: str,
        *,
        min_in_sync: int | None = None,
        max_lag_ms: int | None = None,
        replica_timeout_ms: int | None = None,
        max_hold_back_ms: int | None = None,
        replace_slow: bool | None = None,
        parameters: ComputeParameters | None = None,
    ) -> InstanceInfo:
        """Replace the options given; merge `parameters` into the recorded ones."""
        with self._write() as session:
            return _instances.update_instance(
                session,
                name,
                min_in_sync=min_in_sync,
                max_lag_ms=max_lag_ms,
                replica_timeout_ms=replica_timeout_ms,
                max_hold_back_ms=max_hold_back_ms,
                replace_slow=replace_slow,
                parameters=parameters,
            )

    def drop_instance(self, name: str) -> None:
        """Drop an instance, its replicas and its dataflows (their collections are
        marked dropped, the holds they own on their inputs released in the same
        transaction). Refused while another instance imports one of its views."""
        with self._write() as session:
            _manifest.release_owned_holds(session, _collections.drop_instance(session, name, self._now_ms()))

    def get_instance(self, name: str) -> InstanceInfo:
        with self._read() as session:
            return _instances.get_instance(session, name)

    def list_instances(self) -> list[InstanceInfo]:
        with self._read() as session:
            return _instances.list_instances(session)

    def create_replica(
        self,
        instance: str,
        name: str,
        *,
        size: str,
        spark_master: str = "local[1]",
        spark_conf: Mapping[str, str] | None = None,
        address: str | None = None,
    ) -> ReplicaInfo:
        """Record a replica: managed (spawned by the orchestrator) without `address`,
        external with one. `spark_conf` may hold resource settings only."""
        conflict = f"instance {instance!r} already has a replica {name!r}"
        with self._write(conflict=conflict) as session:
            return _instances.create_replica(
                session,
                instance,
                name,
                size=size,
                spark_master=spark_master,
                spark_conf=spark_conf or {},
                address=address,
            )

    def update_replica(
        self,
        instance: str,
        name: str,
        *,
        address: str | None = UNSET,
        pid: int | None = UNSET,
        process_start: str | None = UNSET,
        incarnation: int = UNSET,
    ) -> ReplicaInfo:
        """Record a managed replica's address and pid (with what tells its process from
        a later one given the same pid, `process_start`, where known), or a new
        incarnation (which never regresses). Arguments left out keep their recorded
        values, except that a new pid clears the process start unless given with it."""
        with self._write() as session:
            return _instances.update_replica(
                session, instance, name, address=address, pid=pid, process_start=process_start, incarnation=incarnation
            )

    def drop_replica(self, instance: str, name: str) -> None:
        with self._write() as session:
            _instances.drop_replica(session, instance, name)

    def get_replica(self, instance: str, name: str) -> ReplicaInfo:
        with self._read() as session:
            return _instances.get_replica(session, instance, name)

    def list_replicas(self, instance: str | None = None) -> list[ReplicaInfo]:
        with self._read() as session:
            return _instances.list_replicas(session, instance)

    # --- Reconfigurations -------------------------------------------------------------

    def begin_reconfiguration(
        self, instance: str, *, size: str, old: Sequence[str], new: Sequence[str], deadline_ms: int, on_timeout: str
    ) -> ReconfigurationInfo:
        """Record a resize of `instance` (replicas `new` of `size` to replace `old`,
        in sync by `deadline_ms` or else `on_timeout`) before any of it is done;
        AlreadyExists while another reconfiguration of it runs."""
        with self._write() as session:
            return _reconfigurations.begin_reconfiguration(
                session, instance, size=size, old=old, new=new, started_at_ms=self._now_ms(), deadline_ms=deadline_ms, on_timeout=on_timeout
            )

    def end_reconfiguration(self, instance: str) -> None:
        """Forget `instance`'s reconfiguration: it ended (idempotent)."""
        with self._write() as session:
            _reconfigurations.end_reconfiguration(session, instance)

    def list_reconfigurations(self) -> list[ReconfigurationInfo]:
        """The reconfigurations in progress, by instance."""
        with self._read() as session:
            return _reconfigurations.list_reconfigurations(session)

    # --- Collections and dataflows ------------------------------------------------------

    def create_source(
        self, name: str, schema: str, *, since: Frontier = Frontier.minimum(), holders: Sequence[str] = ()
    ) -> CollectionInfo:
        """Record a source with `since = upper = since`, held there by each of `holders`
        in the same transaction, on behalf of the retention window (owner `retention`). `schema` is stored as given; `Storage.create_source`
        checks and normalizes it first."""
        conflict = f"a source or materialized view named {name!r} already exists"
        with self._write(conflict=conflict) as session:
            info = _collections.create_source(session, name, schema=schema, since=since)
            for holder in holders:
                _manifest.acquire_read_hold(session, info.id, holder, since, HoldOwner.retention())
            return info

    def drop_source(self, id: str) -> None:
        """Drop a source; its batch files are retired. Refused while a dataflow imports it."""
        with self._write() as session:
            _collections.drop_source(session, id, self._now_ms())

    def get_collection(self, id: str) -> CollectionInfo:
        """Collection `id`, dropped or not."""
        with self._read() as session:
            return _collections.get_collection(session, id)

    def collection_by_name(self, name: str) -> CollectionInfo:
        """The live source or materialized view named `name` (an index is found through
        its dataflow: `dataflow_by_name(instance, name).index_id`)."""
        with self._read() as session:
            return _collections.collection_by_name(session, name)

    def list_collections(self, *, include_dropped: bool = False) -> list[CollectionInfo]:
        with self._read() as session:
            return _collections.list_collections(session, include_dropped=include_dropped)

    def uppers(self, ids: Sequence[str]) -> dict[str, Frontier]:
        """The upper of each of the collections `ids` that exist: one lean query, cheap
        enough for a replica to ask many times a second."""
        with self._read() as session:
            return _collections.uppers(session, ids)

    def record_frontiers(
        self, id: str, *, since: Frontier | None = None, upper: Frontier | None = None
    ) -> CollectionInfo:
        """Record an index's since and/or upper; values below the recorded ones are
        ignored. (Storage collections move by compare_and_append and read holds.)"""
        with self._write() as session:
            return _collections.record_frontiers(session, id, since=since, upper=upper)

    def create_dataflow(
        self,
        instance: str,
        name: str,
        *,
        sql: str,
        imports: Sequence[Import],
        schema: str,
        as_of: Frontier,
        index_key: Sequence[str] | None = None,
        materialized: bool = False,
        until: Frontier = Frontier.empty(),
        compaction_window_ms: int | None = None,
        strategy: str = "recompute: not planned",
        sink_holders: Sequence[str] = (),
    ) -> DataflowInfo:
        """Record a dataflow exporting an index named `name` (keyed by `index_key`)
        and/or a materialized view named `name`. `name` must be free among the dataflows
        of `instance` and, for a materialized view, among all sources and views. Imports
        must be live and readable at `as_of`; indexes only from the same instance.
        `strategy`: "incremental", or "recompute: <reason>".

        In the same transaction, the dataflow takes its read hold on each storage import
        at `as_of` (`dataflow_holder`), so no compaction can pass `as_of` between the
        record and the controller acting on it (DESIGN section 6: record, then act);
        and each of `sink_holders` holds the materialized view's collection at `as_of`
        on behalf of the retention window."""
        conflict = (
            f"instance {instance!r} already has a dataflow named {name!r}, or a source or "
            f"materialized view named {name!r} already exists"
        )
        with self._write(conflict=conflict) as session:
            info = _collections.create_dataflow(
                session,
                instance,
                name,
                sql=sql,
                imports=imports,
                schema=schema,
                index_key=index_key,
                materialized=materialized,
                as_of=as_of,
                until=until,
                compaction_window_ms=compaction_window_ms,
                strategy=strategy,
            )
            key = info.export_ids[0]
            holder = _recovery.dataflow_holder(instance, key)
            for source in info.imports:
                if source.kind == "storage":
                    _manifest.acquire_read_hold(session, source.id, holder, as_of, HoldOwner.dataflow(key))
            if info.sink_id is not None:
                for sink_holder in sink_holders:
                    _manifest.acquire_read_hold(session, info.sink_id, sink_holder, as_of, HoldOwner.retention())
            return info

    def record_compute_frontiers(
        self, sinces: Mapping[str, Frontier], holds: Sequence[tuple[str, str, Frontier]]
    ) -> None:
        """Record, in one transaction, compute sinces (`id -> since`; a materialized
        view's is its dataflow's `sink_holder` hold) and storage read holds (`(id,
        holder, frontier)`: moved forward, released when empty; never taken again once
        missing, see `_manifest.move_read_hold`).

        All or nothing: the controller writes the latest value of every since and hold
        that moved as one cut of its state, in which an upstream index's since never
        exceeds a dependent's, nor a dataflow's input hold its own since; so recovery
        after a crash at any moment finds a consistent record. Values behind the
        recorded ones are ignored, and so are dropped collections."""
        with self._write() as session:
            for id, since in sinces.items():
                row = _collections.collection_row(session, id, live=False)
                if row.dropped or since.is_empty:
                    continue
                if row.namespace == _collections.COMPUTE:
                    _collections.record_frontiers(session, id, since=since, upper=None)
                else:
                    holder = _recovery.sink_holder(row.dataflow_id)
                    _manifest.move_read_hold(session, id, holder, since, HoldOwner.dataflow(id))
            for id, holder, frontier in holds:
                _manifest.move_read_hold(session, id, holder, frontier)

    def drop_dataflow(self, id: str) -> None:
        """Drop a dataflow; its exports are marked dropped, a view's files retired, and
        its holds on its inputs released, all in one transaction (a controller dying
        after it leaves none behind). Refused while another dataflow imports one of its
        exports."""
        with self._write() as session:
            _manifest.release_owned_holds(session, _collections.drop_dataflow(session, id, self._now_ms()))

    def get_dataflow(self, id: str) -> DataflowInfo:
        with self._read() as session:
            return _collections.get_dataflow(session, id)

    def dataflow_by_name(self, instance: str, name: str) -> DataflowInfo:
        with self._read() as session:
            return _collections.dataflow_by_name(session, instance, name)

    def list_dataflows(self, instance: str | None = None) -> list[DataflowInfo]:
        with self._read() as session:
            return _collections.list_dataflows(session, instance)

    def recover_history(self, instance: str) -> list[ComputeCommand]:
        """The command history that rebuilds `instance` after a controller crash:
        CreateInstance, merged configuration, each live dataflow (dependency order,
        `as_of` = its recorded since), their Schedules, InitializationComplete."""
        with self._read() as session:
            return _recovery.recover_history(session, instance)

    # --- Storage manifest (used by `storage.Storage`) -----------------------------------

    def manifest(self, id: str) -> ManifestState:
        """Frontiers, batches and holds of storage collection `id`, in one snapshot."""
        with self._read() as session:
            return _manifest.manifest_state(session, id)

    def manifest_tail(self, id: str, known_upper: int | None, known_batches: int) -> ManifestTail:
        """What changed in storage collection `id`'s manifest since a read that saw
        upper `known_upper` (None: no read yet, or a closed collection) and
        `known_batches` batches: the batches appended since, or all of them if an
        earlier one changed (`ManifestTail`), and its frontiers, in one snapshot."""
        with self._read() as session:
            return _manifest.manifest_tail(session, id, known_upper, known_batches)

    def append_batch(
        self, id: str, expected_upper: Frontier, new_upper: Frontier, batch: NewBatch | None
    ) -> CollectionInfo:
        """The commit of compare-and-append: if the upper of `id` is `expected_upper`,
        record `batch` (covering `[expected_upper, new_upper)`) and the new upper in one
        transaction; else raise `UpperMismatch`. Fenced if this catalog is a
        controller's; a replica's is guarded by the upper check alone."""
        with self._write(fenced=self.is_controller) as session:
            return _manifest.append_batch(session, id, expected_upper, new_upper, batch)

    def append_group(
        self, write: Callable[[int, Collection[str]], Mapping[str, NewBatch | None]], keys: Mapping[str, str] | None = None
    ) -> tuple[int, dict[str, tuple[str, int]]]:
        """A group commit of appends to sources, at one new write timestamp `ts`, in one
        fenced transaction: take `ts` from the oracle, have `write(ts, earlier)` write
        each source's batch file (None: no rows) but those of the appends whose keys are
        in `earlier`, record every batch (covering `[its upper, ts + 1)`), and move
        every live source's upper to `ts + 1`. All of it commits or none does (a crash
        included). The files are written while the transaction holds the oracle, so one
        commit (one fsync of the catalog) serves the whole group, and no later timestamp
        is issued until it ends.

        `keys` maps the idempotency key of each keyed append to its source: a key
        committed before (`AppendKey`) is `earlier`, and comes back with the source and
        timestamp it was committed at; the others are recorded at `ts`. Returns `ts`
        and the earlier keys."""
        keys = keys or {}
        with self._write() as session:
            now_ms = self._now_ms()
            ts = self._next_ts(session, now_ms)
            prune = now_ms >= self._prune_keys_at_ms
            earlier = _manifest.earlier_appends(session, keys, now_ms, prune=prune)
            _manifest.append_group(session, write(ts, earlier.keys()), ts)
            _manifest.record_append_keys(session, {k: s for k, s in keys.items() if k not in earlier}, ts, now_ms)
        if prune:
            self._prune_keys_at_ms = now_ms + PRUNE_APPEND_KEYS_EVERY_MS
        return ts, earlier

    def advance_sources(self, upper: Frontier) -> list[str]:
        """Move every live source whose upper is below `upper` to it, in one fenced
        transaction; the ids moved (`_manifest.advance_sources`)."""
        with self._write() as session:
            return _manifest.advance_sources(session, upper)

    def replace_batches(self, id: str, old: Sequence[BatchInfo], new: NewBatch | None) -> bool:
        """The commit of compaction (see `_manifest.replace_batches`)."""
        with self._write() as session:
            return _manifest.replace_batches(session, id, old, new, self._now_ms())

    def acquire_read_hold(
        self, id: str, holder: str, frontier: Frontier, owner: HoldOwner = HoldOwner.caller()
    ) -> CollectionInfo:
        """A new hold by `holder` at `frontier` (not below since), on behalf of `owner`
        (by default the caller, who releases it)."""
        with self._write() as session:
            return _manifest.acquire_read_hold(session, id, holder, frontier, owner)

    def downgrade_read_hold(self, id: str, holder: str, frontier: Frontier) -> CollectionInfo:
        """Move `holder`'s hold forward to `frontier`; empty releases it."""
        with self._write() as session:
            return _manifest.downgrade_read_hold(session, id, holder, frontier)

    def release_read_hold(self, id: str, holder: str) -> CollectionInfo:
        with self._write() as session:
            return _manifest.release_read_hold(session, id, holder)

    def list_holds(self) -> list[HoldInfo]:
        """Every read hold with its owner, by collection and holder."""
        with self._read() as session:
            return _manifest.list_holds(session)

    def remove_orphaned_holds(self, open_feeds: Callable[[], Collection[str]]) -> list[HoldInfo]:
        """Delete, in one fenced transaction, every hold whose owner is gone (see
        `_manifest.remove_orphaned_holds`; `open_feeds` names the holders of this
        controller's open feeds) and return them."""
        with self._write() as session:
            return _manifest.remove_orphaned_holds(session, self._epoch or 0, open_feeds)

    def referenced_paths(self) -> set[str]:
        """Every blob path named by a batch or a retired-file row."""
        with self._read() as session:
            return _manifest.referenced_paths(session)

    def is_referenced(self, path: str) -> bool:
        """True iff a batch or a retired-file row names blob path `path`."""
        with self._read() as session:
            return _manifest.is_referenced(session, path)

    # --- Events -------------------------------------------------------------------------

    def record_events(self, events: Sequence[NewEvent]) -> None:
        """Append `events` in order (fenced), dropping the oldest beyond the bound."""
        if events:
            with self._write() as session:
                _events.record_events(session, events)

    def list_events(self, instance: str | None = None, *, after: int | None = None, limit: int = 100) -> list[EventInfo]:
        """Events oldest first, of `instance` or all: those recorded after id `after`,
        or (`after` None) the latest `limit`."""
        if limit <= 0:
            raise InvalidArgument(f"limit must be positive, not {limit}")
        with self._read() as session:
            return _events.list_events(session, instance, after, limit)

    def retired_paths(self, retired_before_ms: int) -> list[str]:
        with self._read() as session:
            return _manifest.retired_paths(session, retired_before_ms)

    def forget_retired(self, paths: Sequence[str]) -> None:
        """Remove retired-file rows once their files are deleted."""
        with self._write() as session:
            _manifest.forget_retired(session, paths)


_ORACLE = TimestampOracle.__table__
_NEXT_TS = (  # one statement, which locks the row (SQLite 3.35 and PostgreSQL return from an UPDATE)
    update(_ORACLE)
    .where(_ORACLE.c.id == 1)
    .values(last_ts=case((_ORACLE.c.last_ts >= bindparam("now"), _ORACLE.c.last_ts + 1), else_=bindparam("now")))
    .returning(_ORACLE.c.last_ts)
)
_EPOCH = ControllerEpoch.__table__
_READ_EPOCH = select(_EPOCH.c.epoch).where(_EPOCH.c.id == 1).with_for_update(read=True)
