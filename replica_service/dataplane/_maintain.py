"""Computing one dataflow's versions on Spark: the two strategies behind one interface.

`maintainer(...)` builds, for a dataflow description, either
- `Incremental`: the delta plan (`_plan`), its state (`_incremental`) and its stages
  (`_Stage`: aggregates below its joins, each an `Incremental` of its own); a step reads
  the inputs' changes (and, for joins, the other inputs' current updates) and yields the
  output's changes; or
- `Recompute`: the dataflow's SQL over whole snapshots of its inputs at every step.
Both give the same versions (tests compare them).

A step's output is lazy until an export asks for it: an index collects the whole version
(`StepOutput.version`; bounded by the output), a materialized view has Spark write the
changes (`StepOutput.write`). A dataflow with only a materialized view never brings a
row to this process. `StepOutput.finish` then keeps the state the step implies and
releases what it cached; a step that failed before `finish` leaves the state unchanged.

Inputs are either `StorageReader`s (storage collections, read by executors) or
`Arrangement`s (indexes of this replica, in this process already: their versions go to
Spark as small DataFrames).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence, Union

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from history import DataflowDescription
from storage import DIFF, TIME, snapshot_of
from replica_service._arrangement import Arrangement, Version, changes_by_time, difference, timed_changes
from replica_service.dataplane._incremental import Binding, IncrementalDataflow, Step
from replica_service.dataplane._jvm import Jvm
from replica_service.dataplane._incremental import release as release_checkpoints
from replica_service.dataplane._plan import DeltaPlan, Leaf, NotIncremental, delta_plan
from replica_service.dataplane._orders import complete_orders, has_limit
from replica_service.dataplane._reader import BatchFile, Lease, StorageReader
from replica_service.dataplane._rows import arrow_frame, canonical, expand, normalized, quote, time_frame
from replica_service.dataplane._sink import SinkWriter

Input = Union[StorageReader, Arrangement]


Changes = list[tuple[int, pa.Table]]
"""Per time, ascending: the consolidated changes (user columns, `_diff`) from the version
before, in canonical order (`_arrangement.changes_by_time`)."""


@dataclass(slots=True)
class StepOutput:
    """What one step computed at each of `times` (lazy until asked).

    `versions(previous)` gives, from the version before the step, the changes at each
    time and the whole version at the last (an index's rows); `_changes(current)` the
    changes a sink must write, each with its `_time`, given the sink's current upper
    (those at times from it on: another replica, stepping other runs of times, may
    have written the first; a recomputed version is diffed against the sink's contents
    before it). A step ends with `finish` (its state becomes the dataflow's) or, when
    anything on the way failed or was cancelled, `abandon` (what it kept is released,
    the state stays).
    """

    times: tuple[int, ...]
    _versions: Callable[[pa.Table | None], tuple[Changes, pa.Table]]
    _changes: Callable[[int], DataFrame]
    _finish: Callable[[], None]
    _abandon: Callable[[], None]
    rows_changed: int = 0
    _collected: bool = False

    def versions(self, previous: pa.Table | None) -> tuple[Changes, pa.Table]:
        """The changes at each time and the whole version at the last (blocking;
        collects the output to this process). `rows_changed` then counts the rows
        inserted and deleted over every time."""
        changes, table = self._versions(previous)
        self.rows_changed, self._collected = sum(_rows_changed(c) for _, c in changes), True
        return changes, table

    def write(self, sink: SinkWriter, upper: int) -> None:
        """Have Spark write the changes of every time to `sink` and move its upper to
        `upper`. Without an index, `rows_changed` counts the rows written."""
        written = sink.write(self.times, self._changes, upper)
        if not self._collected:
            self.rows_changed = max(self.rows_changed, written)

    def finish(self) -> None:
        self._finish()

    def abandon(self) -> None:
        self._abandon()


class Maintainer:
    """How a dataflow's versions are computed; `step(times)` runs on a step thread."""

    strategy: str

    @property
    def light(self) -> bool:
        """True when the next step reads the inputs' changes, not the inputs: an
        incremental dataflow past its hydration. Such steps run on workers of their own,
        never queued behind hydrations and recomputes."""
        return False

    def step(self, times: Sequence[int]) -> StepOutput:
        """The versions at `times` (ascending, at most `coverable(times)` of them)."""
        raise NotImplementedError

    def coverable(self, times: Sequence[int]) -> int:
        """How many of the pending `times` (ascending) one step may compute: a
        recompute (and a hydration) one, each its own pass over whole inputs."""
        return 1

    def rehearse(self, directory: Path) -> bool:
        """Compute a step over made-up changes and keep nothing (`Incremental.rehearse`);
        whether one ran. A recompute's every step runs its hydration's query again:
        nothing to warm."""
        return False

    def restore(self, time: int) -> None:
        """Rebuild the state of a dataflow whose versions are computed through `time`
        (after its Spark state was lost), without output."""

    def unchanged_through(self, time: int) -> None:
        """No input changed between the last step and `time` (the dataflow's frontier
        passed it): the next step reads the changes after `time`, which the inputs'
        holds (at the frontier) keep readable, not those after the last step."""

    def close(self) -> None:
        """Release the Spark state it keeps between steps; it steps no more."""


def maintainer(
    desc: DataflowDescription,
    session: SparkSession,
    inputs: Mapping[str, Input],
    sink_readers: Mapping[str, StorageReader],
    canonical_partitions: int,
) -> Maintainer:
    """The maintainer of `desc`'s strategy, in `session` (the dataflow's own).

    A query with a delta plan means what that plan computes, whatever the strategy:
    recomputing it evaluates the same plan from scratch at every step, so both
    strategies give the same bits. Only a query without one runs as Spark SQL."""
    for name, source in inputs.items():
        _view(session, name, source)  # empty views of the right schema, for analysis
    analyzed = session.sql(desc.sql)._jdf.queryExecution().analyzed()
    try:
        plan = delta_plan(session._jsparkSession, analyzed, {name.lower(): name for name in inputs})
    except NotIncremental:
        if desc.strategy == "incremental":
            raise  # the planner found a delta plan: this replica must too
        partitions = canonical_partitions if order_sensitive(analyzed) else None
        return Recompute(desc, session, sink_readers, _native(desc, session, inputs, partitions))
    # A plan's result does not depend on partitioning (its sums are exact, its other
    # values computed row by row), so Spark may size partitions to the data: a step's
    # few changed rows then take one task, not one per shuffle partition (and a small
    # step is planned for one: `Incremental._size_plans`).
    session.conf.set("spark.sql.adaptive.enabled", "true")
    if desc.strategy == "incremental":
        return Incremental(desc, plan, session, inputs)
    return Recompute(desc, session, sink_readers, _from_scratch(desc, plan, session, inputs))


# --- Recompute -----------------------------------------------------------------------

Evaluate = Callable[[int], tuple[DataFrame, Callable[[], None]]]
"""The whole output at a time (lazy), and what releases what computing it kept."""


class Recompute(Maintainer):
    """The whole output at every step (`evaluate(time)`, lazily), collected for an
    index, and diffed against a sink's contents for a materialized view."""

    strategy = "recompute"

    def __init__(
        self,
        desc: DataflowDescription,
        session: SparkSession,
        sink_readers: Mapping[str, StorageReader],
        evaluate: Evaluate,
    ) -> None:
        self.desc, self.session = desc, session
        self.sink_readers = sink_readers
        self.evaluate = evaluate

    def step(self, times: Sequence[int]) -> StepOutput:
        (time,) = times
        full, release = self.evaluate(time)
        shared = bool(self.desc.index_exports) and bool(self.desc.sink_exports)
        if shared:
            # Read twice, by the index and by the sink diff: computed once, into blocks of
            # this step's own. (Spark's cache is keyed by plan: two dataflows of one query
            # shared an entry, the first to finish released it, and the other's job then
            # built blocks that nothing released.)
            full = full.localCheckpoint(eager=False, storageLevel=StorageLevel.MEMORY_AND_DISK)

        def versions(previous: pa.Table | None) -> tuple[Changes, pa.Table]:
            table = full.toArrow()
            return [(time, difference(previous, table))], table

        def changes(current: int) -> DataFrame:
            reader = self.sink_readers[self.desc.sink_exports[0].id]
            reader.refresh(self.session)
            before = None if reader.empty_before(current) else reader.snapshot(self.session, current - 1)
            return _difference(before, full).crossJoin(time_frame(self.session, time))

        def finish() -> None:  # nothing to commit: a recompute keeps no state
            if shared:
                release_checkpoints([full])
            release()

        return StepOutput((time,), versions, changes, finish, finish)


def _native(desc: DataflowDescription, session: SparkSession, inputs: Mapping[str, Input], partitions: int | None) -> Evaluate:
    """The query as Spark SQL over whole snapshots of its inputs.

    When it aggregates in an order-sensitive way (a floating-point sum, say), the inputs
    are laid out canonically first (`_rows.canonical`) and broadcast joins are off in
    the dataflow's session, so the plan and the order of every partial sum are the same
    on every replica whatever files compaction has merged. When it keeps the first rows
    of an order (a LIMIT), ties are broken by every column (`_orders.complete_orders`),
    so the rows kept at a tie do not depend on the order they were read in either."""
    if partitions is not None:
        session.conf.set("spark.sql.autoBroadcastJoinThreshold", "-1")
    jvm = Jvm(session._jsparkSession) if has_limit(session.sql(desc.sql)._jdf.queryExecution().analyzed()) else None

    def evaluate(time: int) -> tuple[DataFrame, Callable[[], None]]:
        lease = Lease()
        for name, source in inputs.items():
            rows = _rows_at(session, source, time, lease)
            (rows if partitions is None else canonical(rows, partitions)).createOrReplaceTempView(name)
        frame = session.sql(desc.sql)
        if jvm is not None:
            frame = DataFrame(jvm.dataframe_jdf(complete_orders(jvm, frame._jdf.queryExecution().analyzed())), session)
        return frame, lease.release

    return evaluate


def _from_scratch(desc: DataflowDescription, plan: DeltaPlan, session: SparkSession, inputs: Mapping[str, Input]) -> Evaluate:
    """The delta plan hydrated afresh at every step: its first changes are the output,
    and its state is released once they were used."""
    shuffle_partitions = session.conf.get("spark.sql.shuffle.partitions")  # before a step sizes them

    def evaluate(time: int) -> tuple[DataFrame, Callable[[], None]]:
        scratch = Incremental(desc, plan, session, inputs, shuffle_partitions=shuffle_partitions)
        try:
            changes, _ = scratch.changes([time])
        except BaseException:
            scratch.close()
            raise
        return expand(changes, [c for c in changes.columns if c not in (DIFF, TIME)]), scratch.close

    return evaluate


# --- Incremental ---------------------------------------------------------------------


# A step whose inputs changed by at most this many rows, or a hydration of at most this
# many input rows, is planned whole before it runs, with one partition per shuffle
# (`Incremental._size_plans`).
SMALL_STEP_MAX_ROWS = 100_000

# A step that reads at most this many rows (its change's and its state's, and nothing
# whole) has its projections interpreted (`Incremental._size_plans`). Each row read
# costs them about 60 us more a step of the freshness bench's (a) (a GROUP BY of a
# float sum and mean at 1M rows, in-process, 2026-11-29): with 100 groups a step took
# 0.82x the time after 100-row changes and 0.89x after 1,000-row ones, with 1,000
# groups 0.85x, 3,000 groups 1.12x, 10,000 groups 1.49x (`bench/step_settings_bench.py`).
INTERPRETED_MAX_ROWS = 1_000

RANKED_MAX_CANDIDATES = 1_000_000
"""At most this many candidate rows in one step of a ranked aggregate over several
times (`Incremental.coverable`): |times| x (touched groups + n), ranked in one pass."""
REHEARSAL_ROWS = 100
"""How many rows a rehearsal's made-up change retracts, and inserts
(`Incremental.rehearse`): a small step."""


class Incremental(Maintainer):
    """The delta plan and its state (see `_incremental`)."""

    strategy = "incremental"

    def __init__(
        self,
        desc: DataflowDescription,
        plan: DeltaPlan,
        session: SparkSession,
        inputs: Mapping[str, Input],
        *,
        shuffle_partitions: str | None = None,
    ) -> None:
        self.desc, self.plan, self.session, self.inputs = desc, plan, session, inputs
        self.state = IncrementalDataflow(plan, session, desc.name)
        self.stages = _stages(desc, plan, session, inputs)
        self.last_time: int | None = None
        # The index version each index leaf was last bound to as "new": the next step's
        # "old" (the upstream may have compacted it away since).
        self._bound: dict[int, Version] = {}
        # Inputs read whole at every step (the other sides of a join) come from a
        # persisted base. A query of one input reads it whole after hydrating only to
        # repair a dirty extreme, and under a stream of appends a base would be rebuilt
        # at each such step (more than BASE_MAX_TAIL newer batches): no gain, measured.
        self._cache = len(plan.leaves) > 1
        # What the step in progress reads of the bases (and its stages' steps): held
        # until its commit, or until the next step or `close` after one without.
        self._lease = Lease()
        # The instance's: a dataflow's query is made before any step sets them (unless
        # given: a recompute makes one at every step), and so is a stage's, which never
        # uses them (`_size_plans` is of the dataflow's query only).
        self._shuffle_partitions = shuffle_partitions or session.conf.get("spark.sql.shuffle.partitions")

    @property
    def light(self) -> bool:
        return self.last_time is not None

    def coverable(self, times: Sequence[int]) -> int:
        """Every pending time once hydrated (a hydration computes one), but for a
        ranked aggregate, which ranks |times| x (touched groups + n) candidate rows in
        one pass: as many times as keep that under RANKED_MAX_CANDIDATES, the touched
        groups bounded by the input rows changed."""
        if not self.light:
            return 1
        if self.plan.ranked is None:
            return len(times)
        for count in range(len(times), 1, -1):
            if count * (self._changed_rows(times[count - 1]) + 1) <= RANKED_MAX_CANDIDATES:
                return count
        return 1

    def changes(
        self, times: Sequence[int], *, consolidated: bool = True, rehearsal: Mapping[str, BatchFile] | None = None
    ) -> tuple[DataFrame, Callable[[], None]]:
        """The output's changes at each of `times` (lazy, each with its `_time`), and
        the commit that keeps the state they imply. Consolidated, unless `consolidated` is False and the query is linear:
        then a row retracted and inserted at once may stay as two updates, which readers
        sum anyway, and no shuffle of the changes is paid (a hydration's changes are the
        whole output). Unconsolidated float columns are `normalized` as consolidating
        leaves them (-0.0 as 0.0, one NaN), so both give the same bits, and so does
        `Recompute` (which consolidates). (Leaving an aggregate's changes unconsolidated
        too was measured: no faster, 383-394 vs 382-437 ms a step of (a) at 1M.) With
        `rehearsal`, an input's change is its made-up batch there (`rehearse`)."""
        self._lease.release()  # a step that ended without its commit held it
        self._lease = lease = Lease()
        small = self._size_plans(times[-1])
        step, commit_states = self._step(times, *self._bindings(times, lease, small, rehearsal), small=small)

        def commit() -> None:
            for state in self._states():  # the one part that may fail: before any state changes
                state.cut_lineage()  # its last job over the bases
            commit_states()
            lease.release()

        if consolidated or self.plan.aggregate is not None:
            return _consolidated(step.changes), commit
        return normalized(step.changes), commit

    def step(self, times: Sequence[int]) -> StepOutput:
        changes, commit = self.changes(times, consolidated=False)
        shared = bool(self.desc.index_exports) and bool(self.desc.sink_exports)
        if shared:
            changes = changes.persist(StorageLevel.MEMORY_AND_DISK)

        def versions(previous: pa.Table | None) -> tuple[Changes, pa.Table]:
            delta = changes.toArrow()
            by_time = changes_by_time(delta)
            parts = [c for _, c in by_time] or [delta.drop_columns([TIME])]  # none: no time changed anything
            return by_time, _apply(previous, parts, self.desc.name, times[-1])

        def written(current: int) -> DataFrame:
            """The changes at the times from `current` on (another replica may have
            written the first ones, having stepped other runs of times)."""
            return changes if current <= times[0] else changes.where(F.col(TIME) >= current)

        def abandon() -> None:  # the step's checkpoints and lease go with the next step or `close`
            if shared:
                changes.unpersist()

        def finish() -> None:
            commit()
            abandon()

        return StepOutput(tuple(times), versions, written, finish, abandon)

    def rehearse(self, directory: Path) -> bool:
        """Compute a step at the last step's time as if its largest storage input (a
        star schema's fact table, which is what changes) had changed by a made-up batch
        (`StorageReader.rehearsal_batch`, written in `directory`), collect its output
        and keep nothing: the state, the versions and what the step checkpointed stay
        as they were.

        Run once after hydration: a hydration evaluates the full plan, and the first
        steps after it generate and compile the code of the derivative terms and of
        the queries over a hydrated state: at TPC-H's first change, 376 classes in one
        process (`bench/tpch_steps.py`), 7 after a rehearsal. Generated code is cached by its
        text (`spark.sql.codegen.cache.maxEntries`), which depends on a plan's shape
        and types, not on its rows or times, and the made-up batch is read as a
        change's is: the rehearsal's plans are those of a change of that input. False
        when there was nothing to rehearse: no storage input, or none with rows."""
        assert self.light, "a rehearsal follows the hydration"
        readers = {name: source for name, source in self.inputs.items() if isinstance(source, StorageReader)}
        if not readers:
            return False
        name = max(readers, key=lambda n: readers[n].change_rows(None, self.last_time))
        made_up = readers[name].rehearsal_batch(self.session, directory, REHEARSAL_ROWS)
        if made_up is None:
            return False
        try:  # a rehearsal cancelled or failed half-way keeps nothing either
            frame, _ = self.changes([self.last_time], consolidated=False, rehearsal={name: made_up})
            frame.toArrow()
        finally:
            for state in self._states():
                state.abandon()
            self._lease.release()
        return True

    def _size_plans(self, time: int) -> bool:
        """Set how Spark plans the step at `time` in this dataflow's session (its stages
        share it; the step's plans are made from here on, on this thread), and return
        whether the step is small (its stages' steps are as well).

        A small step (at most SMALL_STEP_MAX_ROWS changed input rows after hydration, or
        input rows for a hydration) is planned whole, before it runs, with one partition
        per shuffle: its rows fit one task, and adaptive execution would run each
        shuffle and broadcast as a job of its own and plan the rest again after each. A
        larger hydration or change is executed adaptively over the instance's shuffle
        partitions: Spark sizes them to the data, and turns joins of what came out
        small into broadcasts.

        TPC-H's 17 lineitem steps after a 1,000-row change took 0.77x the JVM's CPU and
        0.82x the time planned whole (`bench/tpch_steps.py`). The result is the same
        either way: a delta plan's result does not depend on partitioning.

        A step that reads few rows (`_reads_few_rows`) also has its projections
        interpreted (`spark.sql.codegen.factoryMode`; whole-stage code is still
        generated, and compiled once): every task generated the source of its hash
        aggregate's projections anew, a third of its time in a small GROUP BY step,
        where interpreting them costs about 60 us a row read (INTERPRETED_MAX_ROWS).
        Interpreted and generated expressions give the same bits."""
        changed = self._changed_rows(time)
        small = changed <= SMALL_STEP_MAX_ROWS
        conf = self.session.conf
        conf.set("spark.sql.adaptive.enabled", "false" if small else "true")
        conf.set("spark.sql.shuffle.partitions", "1" if small else self._shuffle_partitions)
        conf.set("spark.sql.codegen.factoryMode", "NO_CODEGEN" if self._reads_few_rows(changed) else "FALLBACK")
        return small

    def _reads_few_rows(self, changed: int) -> bool:
        """Whether a step after `changed` input rows changed reads at most
        INTERPRETED_MAX_ROWS rows: one past hydration, of a query of one input and no
        stage (a join or a stage reads inputs whole, where interpreted projections cost
        at every row: TPC-H's steps took 1.1-1.3x as long with them, q21's 2x), over a
        state that small as last counted (`IncrementalDataflow.rows_bound`)."""
        if not self.light or len(self.plan.leaves) != 1 or self.stages:
            return False
        state_rows = self.state.rows_bound()
        return state_rows is not None and changed + state_rows <= INTERPRETED_MAX_ROWS

    def _changed_rows(self, time: int) -> int:
        """A bound on the input rows that changed since the last step: the updates of
        the storage batches in (last, time], and for each index read, its version's
        rows at the last step and its changes since, if it has any. Before the first
        step (a hydration): the updates through `time`, and each index's version at
        `time`."""
        rows = 0
        for source in self.inputs.values():
            if isinstance(source, StorageReader):
                rows += source.change_rows(self.last_time, time)
            elif self.last_time is None:
                rows += _version_at(source, time).table.num_rows
            else:
                changed = source.change_rows(self.last_time, time)
                if changed:
                    rows += changed + _version_at(source, self.last_time).table.num_rows
        return rows

    def unchanged_through(self, time: int) -> None:
        if self.last_time is not None:
            self.last_time = max(self.last_time, time)
        for stage in set(self.stages.values()):
            stage.query.unchanged_through(time)

    def _states(self) -> Iterator[IncrementalDataflow]:
        """This query's state and its stages', theirs included."""
        yield self.state
        for stage in set(self.stages.values()):
            yield from stage.query._states()

    def close(self) -> None:
        """Release the checkpoints of this dataflow's state and its stages', and what its
        last step read."""
        for state in self._states():
            state.close()
        self._lease.release()

    def restore(self, time: int) -> None:
        self.close()
        self.state = IncrementalDataflow(self.plan, self.session, self.desc.name)
        self.stages = _stages(self.desc, self.plan, self.session, self.inputs)
        self.last_time, self._bound = None, {}
        self.changes([time])[1]()  # the state is computed eagerly: no output needed

    def _step(
        self,
        times: Sequence[int],
        bindings: dict[int, Binding],
        bound: dict[int, Version],
        commits: list[Callable[[], None]],
        *,
        whole: bool = False,
        small: bool = False,
    ) -> tuple[Step, Callable[[], None]]:
        """The step at `times` over `bindings` (see `_bindings`), and its commit: the
        stages' states, then this query's (`changes` cuts their lineage first)."""
        step = self.state.step(times, bindings, whole=whole, small=small)

        def commit() -> None:
            for stage_commit in commits:
                stage_commit()
            step.commit()
            self._bound.update(bound)
            self.last_time = times[-1]

        return step, commit

    def _bindings(
        self, times: Sequence[int], lease: Lease, small: bool, rehearsal: Mapping[str, BatchFile] | None = None
    ) -> tuple[dict[int, Binding], dict[int, Version], list[Callable[[], None]]]:
        """Each leaf's binding for a step at `times` (reading bases under `lease`), the
        index versions bound as new, and the commits of the stages stepped for it (a
        stage's step is planned here, before this query binds its own views, and is as
        `small` as this query's). With `rehearsal`, the changes are made up (`rehearse`)."""
        bindings, bound, commits = {}, {}, []
        time = times[-1]
        stepped: dict[_Stage, Binding] = {}  # a stage read by several leaves steps once
        for leaf in self.plan.leaves:
            if leaf.stage is not None:
                stage = self.stages[leaf.position]
                if stage not in stepped:
                    stepped[stage], commit = stage.binding(times, lease, small, rehearsal)
                    commits.append(commit)
                bindings[leaf.position] = stepped[stage]
                continue
            source = self.inputs[leaf.name]
            if isinstance(source, StorageReader):
                made_up = None if rehearsal is None else rehearsal.get(leaf.name)
                bindings[leaf.position] = self._storage_binding(source, leaf.columns, time, lease, made_up)
            else:
                bindings[leaf.position], bound[leaf.position] = self._index_binding(leaf.position, source, time)
        return bindings, bound, commits

    def _storage_binding(
        self, reader: StorageReader, columns: tuple[str, ...], time: int, lease: Lease, made_up: BatchFile | None = None
    ) -> Binding:
        def updates(through: int, after: int | None = None, made_up: BatchFile | None = None) -> DataFrame:
            frame = reader.updates(self.session, through, after=after, lease=lease if self._cache else None, made_up=made_up)
            # One call into the JVM (a Column object per name costs ~1 ms each: 17 ms for
            # lineitem's columns, measured, where this takes 3).
            return frame.selectExpr(*(quote(c) for c in columns), DIFF, TIME)

        last = self.last_time
        if last is None:
            return Binding(lambda: updates(time), lambda: updates(time).limit(0), None)
        if made_up is not None:  # a rehearsal, at the last step's time
            return Binding(lambda: updates(time, made_up=made_up), lambda: updates(last), lambda: updates(time, time, made_up))
        changed = reader.has_changes(last, time)
        return Binding(lambda: updates(time), lambda: updates(last), (lambda: updates(time, last)) if changed else None)

    def _index_binding(self, position: int, arrangement: Arrangement, time: int) -> tuple[Binding, Version]:
        """An index's binding: its version at `time` for a hydration; after it, its
        version at the last step (each row at that step's time) and its changes since,
        each at its own version's time (the input through `time` is both)."""
        new = _version_at(arrangement, time)
        old = self._bound.get(position)
        if old is None:
            empty = new.table.slice(0, 0)
            return Binding(lambda: _signed_frame(self.session, new.table, time), lambda: _signed_frame(self.session, empty, time), None), new
        changes = arrangement.changes_between(old.time, time, old)
        if not changes:
            return Binding(lambda: _signed_frame(self.session, old.table, old.time), lambda: _signed_frame(self.session, old.table, old.time), None), new
        timed = pa.concat_tables([timed_changes(rows, at) for at, rows in changes])
        before = _signed_table(old.table, old.time).cast(timed.schema)
        return Binding(
            lambda: arrow_frame(self.session, pa.concat_tables([before, timed])),
            lambda: arrow_frame(self.session, before),
            lambda: arrow_frame(self.session, timed),
        ), new


def _stages(desc: DataflowDescription, plan: DeltaPlan, session: SparkSession, inputs: Mapping[str, Input]) -> dict[int, _Stage]:
    """The stage of each stage leaf, by position: one per distinct stage plan."""
    stages: dict[int, _Stage] = {}
    for leaf in plan.leaves:
        if leaf.stage is not None:
            shared = next((s for s in stages.values() if s.leaf.stage is leaf.stage), None)
            stages[leaf.position] = shared or _Stage(desc, leaf, session, inputs)
    return stages


class _Stage:
    """An aggregate below a query's joins (a `Leaf` with a `stage`), maintained as a
    query of its own over the same inputs: its changes at a step are the leaf's delta,
    its whole output after them the leaf's new rows, and the output of its last step
    the old ones. Stepped only when one of its own leaves changed."""

    def __init__(self, desc: DataflowDescription, leaf: Leaf, session: SparkSession, inputs: Mapping[str, Input]) -> None:
        self.leaf = leaf
        self.query = Incremental(desc, leaf.stage, session, inputs)
        self.rows: DataFrame | None = None  # the output at the last step

    def binding(
        self, times: Sequence[int], lease: Lease, small: bool, rehearsal: Mapping[str, BatchFile] | None = None
    ) -> tuple[Binding, Callable[[], None]]:
        """The leaf's binding for a step at `times` (reading bases under the query's
        `lease`; over made-up changes, with `rehearsal`), and the commit keeping the
        stage's state (to run once the step's output is used). Over several times, the
        leaf's new rows are its old ones and its changes, each at its own time (the
        whole output at the last time would be every row at that time)."""
        query = self.query
        bindings, bound, commits = query._bindings(times, lease, small, rehearsal)
        if query.light and not any(b.changed for b in bindings.values()):
            rows = self.rows

            def unchanged() -> None:
                for commit in commits:
                    commit()
                query.unchanged_through(times[-1])

            return Binding(lambda: rows, lambda: rows, None), unchanged
        step, commit = query._step(times, bindings, bound, commits, whole=True, small=small)
        columns = [*self.leaf.columns, DIFF, TIME]
        # Computed now: that materializes the stage's accumulators (checkpointed as they
        # are computed), which its next state and its output read, whatever the query's
        # own plan skips; and an empty change (a DISTINCT key that stays) costs the
        # query no term.
        delta = query.state.checkpoint(_consolidated(step.changes.toDF(*columns)), eager=True)
        output = step.output.toDF(*columns)
        old = self.rows if self.rows is not None else output.limit(0)
        new = output if len(times) == 1 else old.unionByName(delta)

        def commit_stage() -> None:
            commit()
            self.rows = output

        changed = self.rows is None or not delta.isEmpty()
        return Binding(lambda: new, lambda: old, (lambda: delta) if changed else None), commit_stage


# --- Helpers -------------------------------------------------------------------------


def order_sensitive(analyzed) -> bool:
    """True when the query's result could depend on the order rows reach an aggregate
    or a window: an aggregate other than the order-insensitive ones below, or a sum or
    average of floating-point values."""
    stack = [analyzed]
    while stack:
        node = stack.pop()
        for expression in _items(node.expressions()):
            inner = [expression]
            while inner:
                e = inner.pop()
                name = e.getClass().getSimpleName()
                if name == "WindowExpression":
                    return True
                if name == "AggregateExpression":
                    function = e.aggregateFunction()
                    kind = function.getClass().getSimpleName()
                    if kind not in _ORDER_INSENSITIVE:
                        return True
                    if kind in ("Sum", "Average") and function.child().dataType().sql() in ("FLOAT", "DOUBLE"):
                        return True
                inner.extend(_items(e.children()))
        stack.extend(_items(node.children()))
        stack.extend(_items(node.subqueries()))
    return False


_ORDER_INSENSITIVE = {
    "Count", "Min", "Max", "Sum", "Average", "CountIf", "BitAndAgg", "BitOrAgg", "BitXorAgg",
    "BoolAnd", "BoolOr", "HyperLogLogPlusPlus",
}


def _items(scala_seq) -> list:
    return [scala_seq.apply(i) for i in range(scala_seq.size())]


def _view(session: SparkSession, name: str, source: Input) -> None:
    if isinstance(source, StorageReader):
        source.empty(session).drop("_time", DIFF).createOrReplaceTempView(name)
    else:
        arrow_frame(session, _version_schema(source).empty_table()).createOrReplaceTempView(name)


def _version_schema(arrangement: Arrangement) -> pa.Schema:
    version = arrangement.latest
    if version is None:
        raise RuntimeError(f"index {arrangement.id} has no version yet")
    return version.table.schema


def _version_at(arrangement: Arrangement, time: int) -> Version:
    version = arrangement.version_at(time)
    if version is None:
        raise RuntimeError(f"index {arrangement.id} has no version at {time} (since {arrangement.since})")
    return version


def _rows_at(session: SparkSession, source: Input, time: int, lease: Lease) -> DataFrame:
    if isinstance(source, StorageReader):
        return source.snapshot(session, time, lease=lease)
    return arrow_frame(session, _version_at(source, time).table)


def _signed_table(table: pa.Table, time: int) -> pa.Table:
    """A version's rows as updates at `time` (user columns, `_time`, `_diff` 1)."""
    return table.append_column(TIME, pa.array([time] * table.num_rows, pa.int64())).append_column(DIFF, pa.array([1] * table.num_rows, pa.int64()))


def _signed_frame(session: SparkSession, table: pa.Table, time: int) -> DataFrame:
    return arrow_frame(session, _signed_table(table, time))


def _rows_changed(consolidated: pa.Table) -> int:
    """Rows inserted plus rows deleted by `consolidated` updates: what a step changed,
    the same whichever strategy computed it (a linear step's changes come unconsolidated:
    a row retracted and inserted at once changed nothing)."""
    return pc.sum(pc.abs(consolidated[DIFF])).as_py() or 0


def _difference(before: DataFrame | None, after: DataFrame) -> DataFrame:
    """The changes (user columns, `_diff`) that turn the rows `before` into `after`."""
    columns = [F.col(quote(c)) for c in after.columns]
    signed = after.select(*columns, F.lit(1).cast("bigint").alias(DIFF))
    if before is not None:
        signed = signed.unionByName(before.select(*columns, F.lit(-1).cast("bigint").alias(DIFF)))
    return _consolidated(signed)


def _consolidated(changes: DataFrame) -> DataFrame:
    """Changes summed per row, zero sums gone (a row retracted and inserted again)."""
    columns = [quote(c) for c in changes.columns if c != DIFF]
    return changes.groupBy(*columns).agg(F.sum(DIFF).alias(DIFF)).where(f"{DIFF} != 0")


def _apply(previous: pa.Table | None, changes: list[pa.Table], name: str, time: int) -> pa.Table:
    """`previous` (a version's rows) with `changes` (user columns, `_diff`; at least one
    table) applied (Arrow, in this process: both are bounded by the output). A row
    retracted more often than it exists is an error."""
    names = [n for n in changes[0].column_names if n != DIFF]
    schema = changes[0].select(names).schema.append(pa.field(DIFF, pa.int64()))
    parts = [part.select([*names, DIFF]).cast(schema) for part in changes]
    if previous is not None and previous.num_rows:
        rows = previous.select(names).cast(changes[0].select(names).schema)
        parts.insert(0, rows.append_column(DIFF, pa.array([1] * rows.num_rows, pa.int64())).cast(schema))
    return snapshot_of(pa.concat_tables(parts), names, f"dataflow {name} at {time}")
