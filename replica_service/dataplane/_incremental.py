"""Incremental maintenance of one dataflow (DESIGN section 10): each step costs what
changed, and its state lives on Spark.

A step at time t, after the previous step at t', binds each leaf of the delta plan
(`_plan.DeltaPlan`) to DataFrames of that input: its updates through t (*new*), through
t' (*old*) and in (t', t] (*delta*), and evaluates one derivative term per leaf whose
delta is not empty. A linear query's changes are those terms. An aggregate query keeps
state:
- **accumulators**, one row per group: the group's multiplicity `__n` and, per aggregate
  argument, exact sums: integers as BIGINT, decimals as their unscaled value in two
  BIGINTs (in base-10^9 BIGINT digits beyond 18 digits), floats as seven 24-bit integer chunks held in
  doubles (exact below 2^53), with counts of NaNs and infinities, and the non-null
  count `__c`;
- **extremes** for `MIN` and `MAX`: the group's current value. A change's inserts move
  it (`least`/`greatest`); a retraction of a value at or beyond it may remove it, so
  such a group is *dirty* and its extreme is recomputed from the input at t, for the
  dirty groups only (one scan of the input, on the steps that need it);
- **value counts** for `COUNT(DISTINCT)`: (group, value, count) rows, from which the
  touched groups' distinct counts are recomputed;
- for a ranked aggregate (`ORDER BY ... LIMIT n`), the **top rows** of the last step.
  A step ranks every group's new row (one pass over the state, a sort that keeps n rows
  per partition) and its changes are the new top rows less the old ones.
Accumulators are additive, so a step is one Spark query (its SQL generated here over
temp views): the state's rows and the change's rows summed per group give every group's
old and new accumulators at once; the touched groups' old and new values are the
output's changes, and the new sums the next state. The state is checkpointed on the
executors' local disks as that query computes it (`localCheckpoint`; the step's commit
cuts its lineage and releases the state before): it is never read from storage again,
and a step reads an input whole only to repair dirty extremes. A step's cost is the
change plus one pass over the state (one row per group; one per group and value for
COUNT(DISTINCT)), not the inputs: for a few thousand groups, that pass is a few
milliseconds. A state of many groups is kept as a base and an overlay of the groups
changed since: a step then reads the base, but writes only the overlay.

Path independence: every accumulator is an exact sum over the group's rows whatever
their order, partitioning or the times they arrived at, and the output is a function of
the accumulators alone. So a version at t has the same bits whether it was maintained
from an early `as_of`, hydrated at a later one, or recomputed from scratch (`recompute`
evaluates the same plan over whole snapshots). The price, for floating-point sums: bits
of a value below 2^-96 (about 1e-29) are dropped, the chunk sums stay exact for groups
below 2^29 rows of values below 2^72, and the value is rebuilt from the exact chunk
sums with a few roundings, in a fixed order. Spark's own float sum depends on the order
of its partitions; this one does not, and may differ from it in the last bits.

Rules: nothing here awaits; every method blocks on Spark (run it on a step thread).
`step` is lazy; the caller runs the changes, then `cut_lineage`, then `commit`s the
state they imply, so a failed output leaves the state as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Mapping, Sequence

import pyarrow as pa
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from replica_service.dataplane._accumulators import EXTREME_FUNCTIONS, FLOAT_TYPES, accumulators, extreme_name, final
from replica_service.dataplane._jvm import Jvm, bounded_statistics
from replica_service.dataplane._plan import ACC_VIEW, ACCROW, DIFF, TIME, AggregateShape, DeltaPlan
from replica_service.dataplane._rows import arrow_frame, at_least, is_time, quote, time_frame

# At most this many dirty groups' keys are broadcast to the scan that repairs them (a few
# MB through the driver); more are joined with the input by a shuffle.
_BROADCAST_DIRTY = 100_000
# An aggregate's state of at least this many groups is kept as a base and an overlay:
# a step then reads the base (the touched groups' rows, and the untouched ones where
# the whole output is asked for) but does not write it again. Once the overlay may
# hold more than OVERLAY_MAX_GROUPS groups, a full step merges it into a new base.
# The overlay's extra jobs cost about what writing 30,000 groups does, now that a small
# step's full merge runs in one task: a step over a state of 20,000 groups took 1.19x
# as long overlaid, one of 40,000 groups 0.89x, of 100,000 groups 0.52x
# (`bench/groups_bench.py`, 2026-11-28).
OVERLAY_MIN_GROUPS = 40_000
OVERLAY_MAX_GROUPS = 50_000
RECOUNT_STEPS = 16


class Binding:
    """What a step binds to one leaf: the input through t, through t', and in (t', t]
    (`delta` None: the input did not change). Each is built only when a term reads it
    (building a DataFrame over files costs a file listing and an analysis)."""

    def __init__(self, new: Callable[[], DataFrame], old: Callable[[], DataFrame], delta: Callable[[], DataFrame] | None) -> None:
        self._new, self._old, self._delta = new, old, delta

    @property
    def changed(self) -> bool:
        return self._delta is not None

    @cached_property
    def new(self) -> DataFrame:
        return self._new()

    @cached_property
    def old(self) -> DataFrame:
        return self._old()

    @cached_property
    def delta(self) -> DataFrame:
        assert self._delta is not None, "the input did not change"
        return self._delta()


@dataclass(slots=True)
class Step:
    """The output's changes at one time (lazy: user columns and `_diff`), and the state
    change to keep once the caller has used them; with `whole`, also the whole output
    at that time (`_diff` 1 on every row)."""

    changes: DataFrame
    commit: Callable[[], None]
    output: DataFrame | None = None


class IncrementalDataflow:
    """The Spark-side state of one incremental dataflow in its own session."""

    def __init__(self, plan: DeltaPlan, session: SparkSession, what: str) -> None:
        self.plan = plan
        self.session = session
        self.what = what  # the dataflow's name, for errors
        self.jvm = Jvm(session._jsparkSession)
        self.hydrated = False
        shape = plan.aggregate
        self._keys = [f"__k{i}" for i in range(shape.keys)] if shape else []
        self._stages, self._accumulators = accumulators(shape) if shape else ([], {})
        self._value_arguments = sorted({c.argument for c in shape.calls if c.function == "count_distinct"}) if shape else []
        # Each extreme kept per group, by state column name: (function, argument).
        self._extremes = {extreme_name(c): (c.function, c.argument) for c in shape.calls if c.function in EXTREME_FUNCTIONS} if shape else {}
        # The state, once hydrated: accumulators and extremes per group (__k*, then the
        # accumulators' and extremes' names) as a base and an overlay, and, per
        # COUNT(DISTINCT) argument, counts per group and value (__k*, __v, __c).
        self._base: DataFrame | None = None  # every group, as of the last full step
        self._base_groups: int | None = None  # its groups, as last counted
        self._full_steps_uncounted = 0  # full steps since
        # The groups changed since, with their current rows (a group with none left
        # keeps a row with `__n` 0, hiding the base's); None when there are none.
        self._overlay: DataFrame | None = None
        self._overlay_groups = 0  # the touched groups summed over its steps: a bound on its size
        self._values: dict[int, DataFrame | None] = {a: None for a in self._value_arguments}
        self._top: DataFrame | None = None  # a ranked aggregate's output (its top rows)
        # Checkpoints the base reads, the rest of the committed state's, and the step's
        # in progress.
        self._base_kept: list[DataFrame] = []
        self._kept: list[DataFrame] = []
        self._pending: list[DataFrame] = []

    # --- Steps ---------------------------------------------------------------------------

    def step(self, times: Sequence[int], bindings: Mapping[int, Binding], *, whole: bool = False, small: bool = False) -> Step:
        """The changes at each of `times` (ascending; the updates before the first belong
        to it), each with its `_time`. The first step hydrates, at one time: every leaf
        is read whole then (its `new`), and the changes are the whole output. `whole`
        (an aggregate query's only) asks for the whole output at the last time too:
        every group's row, read off the step's accumulators. `small`: the step's
        changes are few (see `_pre`)."""
        assert self.hydrated or len(times) == 1, "a hydration computes one time"
        self.abandon()  # a step that failed before its commit left them
        # A change before the first time (a time skipped below every read) is the
        # first time's: the SPJ part's rows exist from the later of their leaves' times.
        pre = self._pre(bindings, small)
        pre = pre.withColumn(TIME, at_least(TIME, times[0]))
        shape = self.plan.aggregate
        if shape is None:
            assert not whole, "a linear query's whole output is its inputs'"
            return Step(pre, self._mark_hydrated)
        return self._aggregate_step(times, shape, pre, bindings, whole)

    def _pre(self, bindings: Mapping[int, Binding], small: bool) -> DataFrame:
        """The SPJ part's changes: the full plan while hydrating, else the derivative
        terms of the leaves that changed. In a `small` step, a stage's term reads the
        inputs it narrows (`DeltaPlan.narrowing`) only where they match its change: a
        broadcast semi-join with the change's columns, instead of the whole inputs
        shuffled to meet a change Spark cannot tell is small (its broadcast holds the
        change's rows, which a small step bounds)."""
        plan = self.plan
        if not self.hydrated:
            for leaf in plan.leaves:
                self._bind(leaf.view, bindings[leaf.position].new)
            return self._frame(plan.full)
        terms = []
        for leaf in plan.leaves:
            if not bindings[leaf.position].changed:
                continue
            change = bindings[leaf.position].delta
            narrowed = dict(plan.narrowing[leaf.position]) if small else {}
            for other in plan.leaves:
                binding = bindings[other.position]
                if other is leaf:
                    self._bind(other.view, change)
                    continue
                rows = binding.new if other.position < leaf.position else binding.old
                if other.position in narrowed:
                    rows = _meeting(rows, change, narrowed[other.position])
                self._bind(other.view, rows)
            terms.append(self._frame(plan.terms[leaf.position]))
        if not terms:
            for leaf in plan.leaves:  # no change: an empty result of the right shape
                self._bind(leaf.view, bindings[leaf.position].new.limit(0))
            return self._frame(plan.full)
        changes = terms[0]
        for term in terms[1:]:
            changes = changes.unionAll(term)
        return changes

    def _aggregate_step(self, times: Sequence[int], shape: AggregateShape, pre: DataFrame, bindings: Mapping[int, Binding], whole: bool) -> Step:
        """One query: the groups' accumulators before and after the change (the state's
        rows and the change's, summed per group), of which the touched groups' old (-1)
        and new (+1) values go through the post-aggregate template. The summed table
        is checkpointed as it is computed. With extremes, a first job computes it and
        counts the dirty groups, whose extremes are then recomputed from the input
        (`_repair_sql`).

        A step covering several times computes the same query, and beside it each
        touched group's accumulators at each time it changed (`_timed`): running sums
        over the group's times in time order, from its value in the state. Those, not
        the summed table, give the versions; the summed table still gives the next
        state (the accumulators at the last time).

        The state is a base and an overlay (`_overlay_applies`). A *full* step sums the whole
        state with the change, and its new half is the next base (the overlay merged
        in). An *overlaid* step sums only the touched groups' current rows with the
        change, and their new rows replace theirs in the overlay; the base stays."""
        time, timed = times[-1], len(times) > 1
        if timed:
            # Read by every query of the step: its batches (one per time, each a file to
            # open) are scanned once, not once per query.
            pre = self.checkpoint(pre)
        self._bind("__pre", pre)
        overlaid, touched_groups = self._overlay_applies(), 0
        if overlaid:
            touched = self.checkpoint(self._sql(f"SELECT DISTINCT {', '.join(self._keys)} FROM __pre"))
            touched_groups = _count(touched)
            overlaid = self._overlay_groups + touched_groups <= OVERLAY_MAX_GROUPS  # else merged into a new base
        if self._base is not None:
            self._bind("__base", self._base)
            if self._overlay is not None:
                self._bind("__overlay", self._overlay)
            if overlaid:
                self._bind("__keys", touched)
                self._bind("__state", self._sql(self._touched_sql()))
            else:
                self._bind("__state", self._sql(self._current_sql(overlay=self._overlay is not None)))
        summed = self.checkpoint(self._sql(self._summed_sql()))
        base_parts = [summed]
        self._bind("__grouped", summed)
        if self._extremes and not timed:
            dirty = summed.where("__dirty").select(*self._keys)
            dirty_groups = _count(dirty)  # computes (and checkpoints) the grouped table
            repaired = dirty_groups > 0
            if repaired:
                base_parts.append(self._repaired(dirty, bindings, lambda: self._repair_sql(broadcast=dirty_groups <= _BROADCAST_DIRTY)))
            summed = self._sql(self._extremes_sql(repaired))
        self._bind("__summed", summed)
        summed_values = {}
        for a in self._value_arguments:
            if self._values[a] is not None:
                self._bind(f"__vstate{a}", self._values[a])
            summed_values[a] = self.checkpoint(self._sql(self._summed_values_sql(a)))
            self._bind(f"__vsummed{a}", summed_values[a])
        if timed:
            summed = self._timed(times, bindings, base_parts)
            self._bind("__summed", summed)
        keys = _prefix(", ".join(self._keys))
        accumulators = ", ".join(f"new_{n} AS {n}" for n in (*self._accumulators, *self._extremes))
        every_group = summed
        if overlaid:
            # The touched groups' new rows (those left with no rows too: they hide the
            # base's) replace theirs in the overlay; checkpointed, so that overlays do
            # not chain. The untouched groups are read from it and the base.
            overlay = f"SELECT {keys}{accumulators} FROM __summed"
            if self._overlay is not None:
                overlay += f" UNION ALL SELECT /*+ BROADCAST(c) */ o.* FROM __overlay o LEFT ANTI JOIN __keys c ON {_matching('o', 'c', self._keys)}"
            next_overlay = self.checkpoint(self._sql(overlay))
            if whole or self.plan.ranked is not None:
                self._bind("__overlay", next_overlay)
                every_group = summed.unionByName(self._sql(self._untouched_sql()))
        if self.plan.ranked is None:
            self._bind(ACC_VIEW, self._versions(time, shape, every_group=False, timed=timed))
            changes = self._frame(shape.post)
        elif timed:
            changes, top = self._ranked_timed_changes(times, shape, every_group)
        else:
            self._bind("__summed", every_group)
            self._bind(ACC_VIEW, self._versions(time, shape, every_group=True))
            top = self.checkpoint(self._frame(self.plan.ranked))
            changes = self._ranked_changes(top, time)
        output = None
        if whole:
            self._bind("__summed", every_group)
            self._bind(ACC_VIEW, self._versions(time, shape, every_group=True))
            output = self._frame(shape.post)

        # The next state, planned now: the views it reads are this step's only until
        # another query (a stage's, a later step's) binds its own.
        self._bind("__summed", summed)
        if not overlaid:
            kept = " WHERE new___n != 0" if self._keys else ""
            next_base = self._sql(f"SELECT {keys}{accumulators} FROM __summed{kept}")
        next_values = {a: self._sql(f"SELECT {keys}__v, new_c AS __c FROM __vsummed{a} WHERE new_c != 0") for a in self._value_arguments}

        def commit() -> None:
            if overlaid:
                self._overlay = next_overlay
                self._overlay_groups += touched_groups
                self._keep_pending()
            else:
                self._base, self._overlay, self._overlay_groups = next_base, None, 0
                self._keep_pending(base=base_parts)
                self._full_steps_uncounted += 1
            self._values.update(next_values)
            if self.plan.ranked is not None:
                self._top = top
            self.hydrated = True

        return Step(changes, commit, output)

    # --- Steps of several times ----------------------------------------------------------

    def _timed(self, times: Sequence[int], bindings: Mapping[int, Binding], base_parts: list[DataFrame]) -> DataFrame:
        """Bind `__steps` for a step covering several times: per touched group and time
        it changed, its accumulators after (`new_*`) and before (`old_*`) that time's
        change, its extremes and distinct counts likewise. Returns the step's grouped
        table (`__grouped`) with each extreme's new value, which a group's last time
        gives, or the table as it is without extremes.

        An extreme at a time is the state's moved by the inserts so far, unless a
        retraction so far reached it: then that (group, time) is dirty and its extreme
        is recomputed from the input at that time (`_repair_timed_sql`). The checkpoints
        the next state reads go to `base_parts`."""
        self._bind("__timed", self._sql(self._timed_sql()))
        for a in self._value_arguments:
            self._bind(f"__vdelta{a}", self._sql(self._value_deltas_sql(a)))
            self._bind(f"__vcount{a}", self._sql(self._distinct_counts_sql(a)))
        steps = self._sql(self._steps_sql())
        if not self._extremes:
            self._bind("__steps", steps)
            return self._sql("SELECT * FROM __grouped")
        raw = self.checkpoint(steps)
        base_parts.append(raw)
        self._bind("__raw", raw)
        dirty = raw.where("__dirty").select(*self._keys, TIME)
        dirty_pairs = _count(dirty)  # computes (and checkpoints) the timed table
        repaired = dirty_pairs > 0
        if repaired:
            self._bind("__ranks", arrow_frame(self.session, pa.table({TIME: pa.array(times, pa.int64()), "__i": pa.array(range(len(times)), pa.int64())})))
            base_parts.append(self._repaired(dirty, bindings, lambda: self._repair_timed_sql(times, broadcast=dirty_pairs <= _BROADCAST_DIRTY)))
        self._bind("__steps", self._sql(self._timed_extremes_sql(repaired)))
        return self._sql(self._last_extremes_sql())

    def _timed_sql(self) -> str:
        """Per group and time of the change: each accumulator's contribution summed
        (`d_*`), and per extreme the extreme of the values inserted (`ins_*`) and
        retracted (`ret_*`) then."""
        key_list = _prefix(", ".join(self._keys))
        sums = ", ".join(f"sum({expression}) AS d_{name}" for name, expression in self._accumulators.items())
        extremes = []
        for name, (function, a) in self._extremes.items():
            value = _extreme_value(f"__x{a}", self.plan.aggregate.arguments[a])
            extremes.append(f"{function}(IF({DIFF} > 0, {value}, NULL)) AS ins_{name}, {function}(IF({DIFF} < 0, {value}, NULL)) AS ret_{name}")
        return f"SELECT {key_list}{TIME}, {sums}{_prefix_comma(extremes)} FROM {self._staged()} GROUP BY {key_list}{TIME}"

    def _steps_sql(self) -> str:
        """`__steps` before extremes are settled: per touched group and time (`__timed`
        t, joined with the step's grouped table g for the state's values), the running
        sums of the group's contributions in time order from its value in the state;
        per extreme the state's (`st_*`), the inserts' and retractions' so far (`cins_*`,
        `cret_*`), the state's moved by the inserts (`mov_*`) and whether the group is
        `__dirty` then; per distinct count, its values made present less those made
        absent so far, from the state's count (`__vcount`, `__vdelta`). Exact: every
        running sum is of integers (float chunks are integers held in doubles)."""
        keys = self._keys
        partition = f"PARTITION BY {', '.join(f't.{k}' for k in keys)} " if keys else ""
        running = f"({partition}ORDER BY t.{TIME} ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)"
        columns = [*(f"t.{k}" for k in keys), f"t.{TIME}"]
        for n in self._accumulators:
            # A time's contribution is NULL where its values are (a SUM of NULLs): 0, so
            # that neither the group's running value nor its value before that time
            # (`old_*`, new less it) is NULL.
            contribution = f"coalesce(t.d_{n}, 0)"
            columns += [f"coalesce(g.old_{n}, 0) + sum({contribution}) OVER {running} AS new_{n}", f"{contribution} AS d_{n}"]
        for name, (function, _) in self._extremes.items():
            columns += [
                f"g.old_{name} AS st_{name}",
                f"{function}(t.ins_{name}) OVER {running} AS cins_{name}",
                f"{function}(t.ret_{name}) OVER {running} AS cret_{name}",
            ]
        if self._extremes:
            columns.append(f"row_number() OVER ({partition}ORDER BY t.{TIME}) AS __nth")
            columns.append(f"row_number() OVER ({partition}ORDER BY t.{TIME} DESC) AS __last")
        source = f"__timed t JOIN __grouped g ON {_matching('t', 'g', keys)}"
        for a in self._value_arguments:
            columns += [
                f"coalesce(x{a}.old_cd{a}, 0) + sum(coalesce(v{a}.__dd, 0)) OVER {running} AS new_cd{a}",
                f"coalesce(v{a}.__dd, 0) AS __dd{a}",
            ]
            source += (
                f" LEFT JOIN __vcount{a} x{a} ON {_matching('t', f'x{a}', keys)}"
                f" LEFT JOIN __vdelta{a} v{a} ON {_matching('t', f'v{a}', keys)} AND t.{TIME} = v{a}.{TIME}"
            )
        outer = ["*", *(f"new_{n} - d_{n} AS old_{n}" for n in self._accumulators)]
        outer += [f"new_cd{a} - __dd{a} AS old_cd{a}" for a in self._value_arguments]
        dirty = []
        for name, (function, _) in self._extremes.items():
            moved = f"{'least' if function == 'min' else 'greatest'}(st_{name}, cins_{name})"
            beyond = "<=" if function == "min" else ">="
            outer.append(f"{moved} AS mov_{name}")
            dirty.append(f"(cret_{name} IS NOT NULL AND ({moved} IS NULL OR cret_{name} {beyond} {moved}))")
        if dirty:
            outer.append(f"({' OR '.join(dirty)}) AS __dirty")
        return f"SELECT {', '.join(outer)} FROM (SELECT /*+ BROADCAST(t) */ {', '.join(columns)} FROM {source})"

    def _value_deltas_sql(self, a: int) -> str:
        """Per group and time of the change: how many values of argument `a` that time
        made present, less those it made absent (`__dd`), from each value's count in
        the state (`__vsummed`'s `old_c`) and the change's counts so far."""
        keys = self._keys
        key_list = _prefix(", ".join(keys))
        partition = ", ".join([*(f"v.{k}" for k in keys), "v.__v"])
        changed = (
            f"SELECT {key_list}__x{a} AS __v, {TIME}, sum({DIFF}) AS __d FROM __pre WHERE __x{a} IS NOT NULL "
            f"GROUP BY {key_list}__x{a}, {TIME}"
        )
        counted = (
            f"SELECT /*+ BROADCAST(v) */ {_prefix(', '.join(f'v.{k}' for k in keys))}v.{TIME}, v.__d, "
            f"s.old_c + sum(v.__d) OVER (PARTITION BY {partition} ORDER BY v.{TIME} ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS __c "
            f"FROM ({changed}) v JOIN __vsummed{a} s ON {_matching('v', 's', keys)} AND v.__v <=> s.__v"
        )
        return f"SELECT {key_list}{TIME}, sum(IF(__c > 0, 1, 0) - IF(__c - __d > 0, 1, 0)) AS __dd FROM ({counted}) GROUP BY {key_list}{TIME}"

    def _distinct_counts_sql(self, a: int) -> str:
        """Per group: its distinct values of argument `a` in the state (`old_cd<a>`)."""
        key_list = _prefix(", ".join(self._keys))
        grouping = f" GROUP BY {', '.join(self._keys)}" if self._keys else ""
        return f"SELECT {key_list}count(IF(old_c > 0, __v, NULL)) AS old_cd{a} FROM __vsummed{a}{grouping}"

    def _repaired(self, dirty: DataFrame, bindings: Mapping[int, Binding], repair_sql: Callable[[], str]) -> DataFrame:
        """The extremes of the `dirty` groups (or group and time pairs) recomputed from
        the input (`repair_sql`, over `__dirty` and `__full`: every leaf as it is new),
        checkpointed and bound as `__repaired`."""
        self._bind("__dirty", dirty)
        for leaf in self.plan.leaves:
            self._bind(leaf.view, bindings[leaf.position].new)
        self._bind("__full", self._frame(self.plan.full))
        repaired = self.checkpoint(self._sql(repair_sql()))
        self._bind("__repaired", repaired)
        return repaired

    def _repair_timed_sql(self, times: Sequence[int], *, broadcast: bool) -> str:
        """The extremes of the dirty (group, time) pairs (`__dirty`), at each pair's time,
        from one scan of the dirty groups' input (`__full`: every update through the
        last time) and a pass over the step's changes, not a scan per pair.

        Per argument, each of a group's values has a count from the updates before the
        first time and changes at some of the step's times (`__ranks`: a time's index
        i). A value no time changed is there at every time: the extreme of those is the
        group's *static* extreme. A changed value is there over runs of indexes
        [start, end); only runs beyond the static extreme matter. Each run is cut into
        the aligned segments [j 2^k, (j + 1) 2^k) that tile it, at most two per level
        k (as a segment tree updates a range), and each segment keeps the extreme of
        its runs' values; the extreme at index i is then the static one with those of
        the segments holding i, one per level. So a repair costs the dirty groups'
        input, plus the changes and the dirty pairs times the levels (log2 |times|)."""
        keys = self._keys
        key_list = _prefix(", ".join(keys))
        count = len(times)
        levels = f"LATERAL VIEW explode(sequence(0, {max(1, (count - 1).bit_length())})) AS __lv"
        groups = f"SELECT DISTINCT {', '.join(keys)} FROM __dirty" if keys else None
        scanned = "__full f"
        if groups:
            hint = "/*+ BROADCAST(g) */ " if broadcast else ""
            scanned += f" LEFT SEMI JOIN ({groups}) g ON {_matching('f', 'g', keys)}"
        else:
            hint = ""
        index = (
            f"CASE WHEN f.{TIME} < {times[0]} THEN -1 WHEN r.__i IS NOT NULL THEN r.__i "
            f"ELSE raise_error('a change at ' || f.{TIME} || ', not a time of the step of dataflow {_sql_text(self.what)}') END"
        )
        pairs = f"SELECT /*+ BROADCAST(r) */ d.*, r.__i FROM __dirty d JOIN __ranks r ON d.{TIME} = r.{TIME}"
        source = f"({pairs}) d"
        columns = [*(f"d.{k}" for k in keys), f"d.{TIME}"]
        value_key = f"{key_list}__v"
        for a in sorted({a for _, a in self._extremes.values()}):
            value = _extreme_value(f"f.__x{a}", self.plan.aggregate.arguments[a])
            events = (
                f"SELECT {hint}{_prefix(', '.join(f'f.{k}' for k in keys))}{value} AS __v, {index} AS __i, sum(f.{DIFF}) AS __d "
                f"FROM {scanned} LEFT JOIN __ranks r ON f.{TIME} = r.{TIME} WHERE f.__x{a} IS NOT NULL "
                f"GROUP BY {_prefix(', '.join(f'f.{k}' for k in keys))}{value}, {index}"
            )
            window = f"(PARTITION BY {value_key} ORDER BY __i)"
            runs = (
                f"SELECT {value_key}, greatest(__i, 0) AS __s, coalesce(lead(__i) OVER {window}, {count}) AS __e, "
                f"sum(__d) OVER ({window[1:-1]} ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS __c FROM ({events})"
            )
            for name, (function, b) in self._extremes.items():
                if b != a:
                    continue
                static = f"SELECT {key_list}{function}(__v) AS __st FROM ({runs}) WHERE __c > 0 AND __s = 0 AND __e = {count}"
                if keys:
                    static += f" GROUP BY {', '.join(keys)}"
                beyond = ">" if function == "max" else "<"
                relevant = (
                    f"SELECT u.* FROM ({runs}) u LEFT JOIN ({static}) s ON {_matching('u', 's', keys)} "
                    f"WHERE u.__c > 0 AND u.__s < u.__e AND NOT (u.__s = 0 AND u.__e = {count}) AND (s.__st IS NULL OR u.__v {beyond} s.__st)"
                )
                low, high = "shiftright(__s + shiftleft(1, __lv) - 1, __lv)", "shiftright(__e, __lv)"
                cut = (
                    f"SELECT {key_list}__lv, explode(array(IF({low} < {high} AND {low} % 2 = 1, {low}, NULL), "
                    f"IF({low} < {high} AND {high} % 2 = 1, {high} - 1, NULL))) AS __j, __v FROM ({relevant}) {levels}"
                )
                segments = f"SELECT {key_list}__lv, __j, {function}(__v) AS __m FROM ({cut}) WHERE __j IS NOT NULL GROUP BY {key_list}__lv, __j"
                held = (
                    f"SELECT {_prefix(', '.join(f'p.{k}' for k in keys))}p.{TIME}, {function}(m.__m) AS __m "
                    f"FROM (SELECT *, shiftright(__i, __lv) AS __j FROM ({pairs}) {levels}) p "
                    f"JOIN ({segments}) m ON {_matching('p', 'm', keys)} AND p.__lv = m.__lv AND p.__j = m.__j "
                    f"GROUP BY {_prefix(', '.join(f'p.{k}' for k in keys))}p.{TIME}"
                )
                combine = "greatest" if function == "max" else "least"
                columns.append(f"{combine}(s{name}.__st, h{name}.__m) AS rep_{name}")
                source += (
                    f" LEFT JOIN ({static}) s{name} ON {_matching('d', f's{name}', keys)}"
                    f" LEFT JOIN ({held}) h{name} ON {_matching('d', f'h{name}', keys)} AND d.{TIME} = h{name}.{TIME}"
                )
        return f"SELECT {', '.join(columns)} FROM {source}"

    def _timed_extremes_sql(self, repaired: bool) -> str:
        """`__steps`: the timed table (`__raw`) with each extreme's value after each
        time (`new_*`: repaired where dirty, else moved) and before it (`old_*`: the
        state's at the group's first time, else the value after its time before)."""
        keys = self._keys
        news = []
        for name in self._extremes:
            news.append(f"IF(s.__dirty, r.rep_{name}, s.mov_{name}) AS new_{name}" if repaired else f"s.mov_{name} AS new_{name}")
        source = "__raw s"
        if repaired:
            source += f" LEFT JOIN __repaired r ON {_matching('s', 'r', keys)} AND s.{TIME} = r.{TIME}"
        partition = f"PARTITION BY {', '.join(keys)} " if keys else ""
        olds = [f"IF(__nth = 1, st_{name}, lag(new_{name}) OVER ({partition}ORDER BY {TIME})) AS old_{name}" for name in self._extremes]
        return f"SELECT *, {', '.join(olds)} FROM (SELECT s.*, {', '.join(news)} FROM {source})"

    def _last_extremes_sql(self) -> str:
        """The step's grouped table with each extreme's new value: a touched group's at
        its last time in `__steps`, an untouched group's the state's."""
        keys = self._keys
        last = f"SELECT {_prefix(', '.join(keys))}{', '.join(f'new_{n}' for n in self._extremes)} FROM __steps WHERE __last = 1"
        news = ", ".join(f"IF(g.__touched = 1, l.new_{n}, g.old_{n}) AS new_{n}" for n in self._extremes)
        return f"SELECT /*+ BROADCAST(l) */ g.*, {news} FROM __grouped g LEFT JOIN ({last}) l ON {_matching('g', 'l', keys)}"

    def _ranked_timed_changes(self, times: Sequence[int], shape: AggregateShape, every_group: DataFrame) -> tuple[DataFrame, DataFrame]:
        """A ranked aggregate's changes at each of several `times` (`__steps` bound), and
        its top rows at the last (checkpointed).

        The top n rows at a time are the top n of two kinds of candidates: each group
        the step touched, as of that time (`_as_of_sql`), and the top n of the groups
        it did not touch, whose rows stay as they were (an untouched group beyond those
        n has n untouched ones before it at every time). Ranked at every time at once
        (`DeltaPlan.ranked_timed`): |times| x (touched groups + n) rows. The changes
        are each time's top rows (+1) less the time's before (-1; before the first,
        the last step's top)."""
        self._bind("__vrows", self._versions(times[-1], shape, every_group=False, timed=True))
        following = [*times[1:], None]
        self._bind("__times", arrow_frame(self.session, _times_table(times, following)))
        # Checkpointed, as the untouched groups' top rows below: the ranked template reads
        # each through a plan of its own (a template over the step's own plan, which
        # holds the query's attribute ids too, has Spark renew the ids it references).
        self._bind("__asof", self.checkpoint(self._sql(self._as_of_sql(shape))))
        self._bind("__summed", every_group.where("__touched = 0"))
        self._bind(ACC_VIEW, self._versions(times[0], shape, every_group=True))
        self._bind("__static", self.checkpoint(self._frame(self.plan.ranked_timed).select(f"{ACCROW}.*")))
        accumulated = [*(f"__k{i}" for i in range(shape.keys)), *(f"__a{i}" for i in range(len(shape.calls)))]
        self._bind(
            ACC_VIEW,
            self._sql(f"SELECT s.*, t.{TIME} FROM __static s CROSS JOIN __times t UNION ALL SELECT {', '.join(accumulated)}, {TIME} FROM __asof"),
        )
        top = self.checkpoint(self._frame(self.plan.ranked_timed).drop(ACCROW))
        self._bind("__top", top)
        output = [quote(c) for c in top.columns if c != TIME]
        listed = ", ".join(f"o.{c}" for c in output)
        changes = self._sql(
            f"SELECT {listed}, CAST(1 AS BIGINT) AS {DIFF}, o.{TIME} FROM __top o UNION ALL "
            f"SELECT {listed}, CAST(-1 AS BIGINT) AS {DIFF}, t.__next AS {TIME} FROM __top o JOIN __times t ON o.{TIME} = t.{TIME} WHERE t.__next IS NOT NULL"
        )
        if self._top is not None:
            changes = changes.unionAll(self._top.select("*", F.lit(-1).cast("bigint").alias(DIFF)).crossJoin(time_frame(self.session, times[0])))
        return changes, top.where(is_time(TIME, times[-1])).drop(TIME)

    def _as_of_sql(self, shape: AggregateShape) -> str:
        """Every touched group's row (`__k*`, `__a*`) at every time of the step
        (`__times`) where it exists then: its row after its latest change at or before
        that time, or, before its first, its row before it. From `__vrows` (its old
        (-1) and new (+1) rows at each time it changed), each change wrapped in a struct
        so that "absent after this change" is not taken for "no change yet"."""
        keys = self._keys
        values = [*keys, *(f"__a{i}" for i in range(len(shape.calls)))]
        fields = ", ".join(f"'{v}', {v}" for v in values)
        row = f"named_struct({fields})"
        key_list = _prefix(", ".join(keys))
        changes = (
            f"SELECT {key_list}{TIME}, 0 AS __probe, named_struct('row', first(IF({DIFF} > 0, {row}, NULL), true)) AS __after, "
            f"named_struct('row', first(IF({DIFF} < 0, {row}, NULL), true)) AS __before FROM __vrows GROUP BY {key_list}{TIME}"
        )
        groups = f"(SELECT DISTINCT {', '.join(keys)} FROM __vrows) k CROSS JOIN " if keys else ""
        no_change = f"CAST(NULL AS STRUCT<row: STRUCT<{', '.join(f'{v}: {_type}' for v, _type in self._accumulated_types(shape))}>>)"
        probes = f"SELECT {_prefix(', '.join(f'k.{k}' for k in keys))}t.{TIME}, 1 AS __probe, {no_change} AS __after, {no_change} AS __before FROM {groups}__times t"
        partition = f"PARTITION BY {', '.join(keys)} " if keys else ""
        order = f"ORDER BY {TIME}, __probe"
        chosen = (
            f"SELECT {key_list}{TIME}, __probe, coalesce("
            f"last(__after, true) OVER ({partition}{order} ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW), "
            f"first(__before, true) OVER ({partition}{order} ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING)).row AS __row "
            f"FROM ({changes} UNION ALL {probes})"
        )
        return f"SELECT __row.*, {TIME} FROM ({chosen}) WHERE __probe = 1 AND __row IS NOT NULL"

    def _accumulated_types(self, shape: AggregateShape) -> list[tuple[str, str]]:
        """The `__acc` view's user columns and their Spark types."""
        return [*((f"__k{i}", t) for i, t in enumerate(shape.key_types)), *((f"__a{i}", c.result_type) for i, c in enumerate(shape.calls))]

    def rows_bound(self) -> int | None:
        """The rows of state a step reads, as last counted: none for a linear query, one
        for a global aggregate, else the base's groups and the overlay's; None before
        the base is counted (at the first step after hydration), and when the state
        keeps COUNT(DISTINCT) value counts (never counted). Not a bound on a state that
        grows: it gains at most a change's groups a step and is recounted every
        RECOUNT_STEPS full steps (`_overlay_applies`), so an estimate of what a step
        costs, never of what it computes."""
        if self.plan.aggregate is None:
            return 0
        if self._value_arguments:
            return None
        if not self._keys:
            return 1
        return None if self._base_groups is None else self._base_groups + self._overlay_groups

    def _overlay_applies(self) -> bool:
        """Whether this step may be overlaid: a state grouped by keys whose base has at
        least OVERLAY_MIN_GROUPS groups. The base's rows are counted (a job reading it)
        at its first step, when a full step replaced a base of that many, and otherwise
        every RECOUNT_STEPS full steps (a state grows by at most a change's groups a
        step, and its size only decides what a step costs, never what it computes)."""
        if not (self._keys and self._base is not None):
            return False
        replaced = self._full_steps_uncounted > 0
        if self._base_groups is None or (replaced and self._base_groups >= OVERLAY_MIN_GROUPS) or self._full_steps_uncounted >= RECOUNT_STEPS:
            self._base_groups = _rdd(self._base_kept[0]).count()  # the summed table's groups: a bound
            self._full_steps_uncounted = 0
        return self._base_groups >= OVERLAY_MIN_GROUPS

    def _current_sql(self, *, overlay: bool) -> str:
        """Every group's current row: the base's, or, with `overlay`, the overlay's (the
        view `__overlay`) where it holds the group, none where that row has no
        multiplicity left. The overlay's keys are broadcast: it holds at most
        OVERLAY_MAX_GROUPS groups."""
        if not overlay:
            return "SELECT * FROM __base"
        return (
            "SELECT * FROM __overlay WHERE __n != 0 UNION ALL SELECT /*+ BROADCAST(o) */ b.* FROM __base b "
            f"LEFT ANTI JOIN (SELECT {', '.join(self._keys)} FROM __overlay) o ON {_matching('b', 'o', self._keys)}"
        )

    def _touched_sql(self) -> str:
        """The current rows of the groups the change touches (`__keys`, broadcast: an
        overlaid step touches at most OVERLAY_MAX_GROUPS groups)."""
        current = self._current_sql(overlay=self._overlay is not None)
        return f"SELECT /*+ BROADCAST(c) */ s.* FROM ({current}) s LEFT SEMI JOIN __keys c ON {_matching('s', 'c', self._keys)}"

    def _untouched_sql(self) -> str:
        """The groups the change did not touch, in `__summed`'s columns (old and new
        the same), read from the step's next overlay (bound as `__overlay`) and the
        base."""
        columns = [*self._keys, "0 AS __touched"]
        columns += [f"{n} AS new_{n}, {n} AS old_{n}" for n in self._accumulators]
        for name, (_, a) in self._extremes.items():
            typed_null = f"CAST(NULL AS {self.plan.aggregate.arguments[a]})"
            columns.append(f"{name} AS old_{name}, {typed_null} AS ins_{name}, {typed_null} AS ret_{name}, {name} AS new_{name}")
        if self._extremes:
            columns.append("false AS __dirty")
        return (
            f"SELECT /*+ BROADCAST(c) */ {', '.join(columns)} FROM ({self._current_sql(overlay=True)}) s "
            f"LEFT ANTI JOIN __keys c ON {_matching('s', 'c', self._keys)}"
        )

    def _ranked_changes(self, top: DataFrame, time: int) -> DataFrame:
        """The new top rows (+1) and, once hydrated, the old ones (-1), at `time`."""
        at = time_frame(self.session, time)
        changes = top.select("*", F.lit(1).cast("bigint").alias(DIFF)).crossJoin(at)
        if self._top is not None:
            changes = changes.unionAll(self._top.select("*", F.lit(-1).cast("bigint").alias(DIFF)).crossJoin(at))
        return changes

    def _staged(self) -> str:
        """The change's rows (`__pre`) with the staged projections its accumulators'
        contributions read (see `_accumulators`)."""
        staged = "__pre"
        for stage in self._stages:
            columns = ", ".join(f"{expression} AS {name}" for name, expression in stage.items())
            staged = f"(SELECT *, {columns} FROM {staged})"
        return staged

    def _summed_sql(self) -> str:
        """Per group: each accumulator summed over state and change (`new_*`), over the
        state alone (`old_*`, NULL for a group the state lacks; none while hydrating), and
        whether the change touched it. Per extreme: the state's value (`old_*`), the
        extreme of the change's inserted values (`ins_*`) and whether a retraction may
        have removed it (the group is then `__dirty`)."""
        keys = self._keys
        contributions = ", ".join(f"{expression} AS {name}" for name, expression in self._accumulators.items())
        stored = ", ".join(self._accumulators)
        key_list = _prefix(", ".join(keys))
        staged = self._staged()
        extremes_of_state, extremes_of_change, extreme_sums, dirty = [], [], [], []
        for name, (function, a) in self._extremes.items():
            typed_null = f"CAST(NULL AS {self.plan.aggregate.arguments[a]})"
            value = _extreme_value(f"__x{a}", self.plan.aggregate.arguments[a])
            extremes_of_state.append(f"{name}, {typed_null} AS __ins{name}, {typed_null} AS __ret{name}")
            extremes_of_change.append(
                f"{typed_null} AS {name}, IF({DIFF} > 0, {value}, NULL) AS __ins{name}, IF({DIFF} < 0, {value}, NULL) AS __ret{name}"
            )
            extreme_sums.append(f"max({name}) AS old_{name}, {function}(__ins{name}) AS ins_{name}, {function}(__ret{name}) AS ret_{name}")
            beyond = "<=" if function == "min" else ">="
            dirty.append(f"(ret_{name} IS NOT NULL AND (old_{name} IS NULL OR ret_{name} {beyond} old_{name}))")
        both = f"SELECT {key_list}{contributions}{_prefix_comma(extremes_of_change)}, 1 AS __src FROM {staged}"
        if self._base is not None:
            both = f"SELECT {key_list}{stored}{_prefix_comma(extremes_of_state)}, 0 AS __src FROM __state UNION ALL {both}"
        # A hydration's groups have no old sums, but its table has the columns a step's
        # has: the next step reads its state with the same generated code as every
        # later step (which a rehearsal compiles: `Incremental.rehearse`).
        old = "sum(IF(__src = 0, {n}, NULL))" if self._base is not None else "IF(false, sum({n}), NULL)"
        sums = ", ".join(f"sum({n}) AS new_{n}, {old.format(n=n)} AS old_{n}" for n in self._accumulators)
        grouping = f" GROUP BY {', '.join(keys)}" if keys else ""
        grouped = f"SELECT {key_list}{sums}{_prefix_comma(extreme_sums)}, max(__src) AS __touched FROM ({both}){grouping}"
        if not self._extremes:
            return grouped
        return f"SELECT *, {' OR '.join(dirty)} AS __dirty FROM ({grouped})"

    def _repair_sql(self, *, broadcast: bool) -> str:
        """The extremes of the dirty groups, recomputed from the input at the step's time
        (`__full`: the SPJ part over every input's updates through it, unconsolidated):
        per argument, each value's count summed per group, and the extremes of the
        values still there. With `broadcast`, the dirty groups' keys are broadcast to
        the input's scan, which then keeps only their rows; Spark would otherwise
        shuffle the whole input to join it with them (their size is unknown when it
        plans), as TPC-H q21's stages did with `lineitem` at every step."""
        keys = self._keys
        key_list = _prefix(", ".join(keys))
        grouping = f" GROUP BY {', '.join(keys)}" if keys else ""
        source = "__dirty d"
        columns = [f"d.{k}" for k in keys]
        hint = "/*+ BROADCAST(d) */ " if broadcast else ""
        for a in sorted({a for _, a in self._extremes.values()}):
            value = _extreme_value(f"__x{a}", self.plan.aggregate.arguments[a])
            extremes = ", ".join(f"{function}(__v) AS rep_{name}" for name, (function, b) in self._extremes.items() if b == a)
            columns += [f"r{a}.rep_{name}" for name, (_, b) in self._extremes.items() if b == a]
            counted = (
                f"SELECT {hint}{key_list}{value} AS __v, sum({DIFF}) AS __c FROM __full f "
                f"LEFT SEMI JOIN __dirty d ON {_matching('f', 'd', keys)} "
                f"WHERE __x{a} IS NOT NULL GROUP BY {key_list}{value}"
            )
            source += f" LEFT JOIN (SELECT {key_list}{extremes} FROM ({counted}) WHERE __c > 0{grouping}) r{a} ON {_matching('d', f'r{a}', keys)}"
        return f"SELECT {', '.join(columns)} FROM {source}"

    def _extremes_sql(self, repaired: bool) -> str:
        """The grouped table with each extreme's new value: recomputed for a dirty group,
        else the state's moved by the change's inserts."""
        news = []
        for name, (function, _) in self._extremes.items():
            moved = f"{'least' if function == 'min' else 'greatest'}(g.old_{name}, g.ins_{name})"
            news.append(f"IF(g.__dirty, r.rep_{name}, {moved}) AS new_{name}" if repaired else f"{moved} AS new_{name}")
        source = "__grouped g"
        if repaired:
            source += f" LEFT JOIN __repaired r ON {_matching('g', 'r', self._keys)}"
        return f"SELECT g.*, {', '.join(news)} FROM {source}"

    def _summed_values_sql(self, a: int) -> str:
        """Per group and value of argument `a`: its count after and before the change,
        and whether the change touched it."""
        key_list = _prefix(", ".join(self._keys))
        both = f"SELECT {key_list}__x{a} AS __v, {DIFF} AS __c, 1 AS __src FROM __pre WHERE __x{a} IS NOT NULL"
        if self._values[a] is not None:
            both = f"SELECT {key_list}__v, __c, 0 AS __src FROM __vstate{a} UNION ALL {both}"
        return (
            f"SELECT {key_list}__v, sum(__c) AS new_c, sum(IF(__src = 0, __c, 0)) AS old_c "
            f"FROM ({both}) GROUP BY {key_list}__v"
        )

    def _versions(self, time: int, shape: AggregateShape, *, every_group: bool, timed: bool = False) -> DataFrame:
        """`_versions_sql`'s rows, each with its `_time`: at one time, a one-row relation
        cross joined once (`_rows`: a BIGINT literal's value is inlined in the code
        Spark generates, so each step would compile anew)."""
        versions = self._sql(self._versions_sql(time, shape, every_group=every_group, timed=timed))
        return versions if timed else versions.crossJoin(time_frame(self.session, time))

    def _versions_sql(self, time: int, shape: AggregateShape, *, every_group: bool, timed: bool = False) -> str:
        """The old (-1) and new (+1) rows of every touched group at `time`, with each
        aggregate's value as `__a<i>`: the view the post-aggregate template reads. With
        `every_group`, the new row of every group instead: the view a ranked query
        reads. `timed`: the rows of every touched group at each time it changed in a
        step covering several (from `__steps`, `_timed`)."""
        both = (("new", 1), ("old", -1))
        if timed:
            return self._rows_sql("__steps g", both, shape, timed=True)
        keys = self._keys
        source = "__summed g"
        for a in self._value_arguments:
            distinct_counts = ", ".join(f"count(IF({side}_c > 0, __v, NULL)) AS {side}_cd{a}" for side in ("new", "old"))
            grouping = f" GROUP BY {', '.join(keys)}" if keys else ""
            source += (
                f" LEFT JOIN (SELECT {_prefix(', '.join(keys))}{distinct_counts} FROM __vsummed{a}{grouping}) x{a}"
                f" ON {_matching('g', f'x{a}', keys)}"
            )
        sides = both if self.hydrated and not every_group else both[:1]
        return self._rows_sql(source, sides, shape, time=time, every_group=every_group)

    def _rows_sql(
        self, source: str, sides: tuple[tuple[str, int], ...], shape: AggregateShape, *, time: int | None = None, every_group: bool = False, timed: bool = False
    ) -> str:
        """The rows of each of `sides` (("new", 1), ("old", -1): the side and its
        `_diff`) of every touched group (of every group, with `every_group`) that exists
        on that side: a positive multiplicity, or always for a global aggregate (whose
        sums over nothing are then 0); at `time` (its `_time` joined by `_versions`), or,
        `timed`, at each time of `__steps` (where every row is a touched group's), with
        its `_time`. One scan of `source` gives both sides (a generator of two rows a
        row): a UNION ALL of a select per side would compute a window or join under it
        twice."""
        keys = self._keys
        at = f"g.{TIME}" if timed else f"'{time}'"  # a string literal: see `_versions`
        fields = []  # per side: (name, expression)
        for side, sign in sides:
            if keys:
                values = {n: f"g.{side}_{n}" for n in self._accumulators}
            else:
                values = {n: f"coalesce(g.{side}_{n}, 0)" for n in self._accumulators}
            values.update({n: f"g.{side}_{n}" for n in self._extremes})
            for a in self._value_arguments:
                values[f"__cd{a}"] = f"g.{side}_cd{a}" if timed else f"coalesce(x{a}.{side}_cd{a}, 0)"
            row = [(f"__a{i}", f"CAST({final(call, values)} AS {call.result_type})") for i, call in enumerate(shape.calls)]
            row.append((DIFF, f"CAST({sign} AS BIGINT)"))
            if keys:
                multiplicity = values["__n"]
                message = f"'negative count in dataflow {_sql_text(self.what)} at ' || {at} || ': a group has multiplicity ' || {multiplicity}"
                row.append(("__exists", f"CASE WHEN {multiplicity} < 0 THEN raise_error({message}) ELSE {multiplicity} > 0 END"))
            fields.append(row)
        if len(fields) == 1:
            row = dict(fields[0])
            exists = row.pop("__exists", None)
            outputs = [f"{e} AS {n}" for n, e in row.items()]
        else:
            names = [name for name, _ in fields[0]]
            structs = ", ".join("named_struct(" + ", ".join(f"'{n}', {e}" for n, e in row) + ")" for row in fields)
            source += f" LATERAL VIEW inline(array({structs})) s AS {', '.join(names)}"
            exists = "s.__exists" if keys else None
            outputs = [f"s.{name}" for name in names if name != "__exists"]
        columns = [*(f"g.{k}" for k in keys), *outputs, *([f"{at} AS {TIME}"] if timed else [])]
        conditions = [*([] if every_group or timed or not keys else ["g.__touched = 1"]), *([exists] if exists else [])]
        where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        return f"SELECT {', '.join(columns)} FROM {source}{where}"

    def _mark_hydrated(self) -> None:
        self.hydrated = True
        self._keep_pending()

    # --- Checkpoints ---------------------------------------------------------------------

    def checkpoint(self, frame: DataFrame, *, eager: bool = False) -> DataFrame:
        """`frame`, kept on the executors' local disks as the first job that reads it
        computes it (or now, `eager`), with a bounded size estimate (a state's grew
        at every step: `bounded_statistics`). It belongs to the step in progress, which
        must `cut_lineage` before its commit keeps it as the state's (`_keep_pending`)."""
        checkpointed = bounded_statistics(frame.localCheckpoint(eager=eager, storageLevel=StorageLevel.DISK_ONLY))
        self._pending.append(checkpointed)
        return checkpointed

    def cut_lineage(self) -> None:
        """Cut the lineage of the step's checkpoints, computing any partition no job of
        the step did (it may fail: run before any commit changes state).

        A lazy checkpoint cuts its lineage only when a job started by `runJob` computes
        it, and here an adaptive query's shuffle stage usually does: left so, each state
        kept the plans, RDDs and broadcast relations of every step before it, and TPC-H
        q21's steps spent more and more of their time in the driver's GC until its heap
        was full. `doCheckpoint` (internal to Spark, public in its bytecode) cuts it.
        Checkpointing eagerly instead cost about 40 ms a step of a one-source GROUP BY
        (a second job, and a read of the state)."""
        for frame in self._pending:
            _rdd(frame).doCheckpoint()

    def _keep_pending(self, base: list[DataFrame] | None = None) -> None:
        """The end of a commit: the step's checkpoints become the state's, and the
        state's before them are released (nothing reads them once the step's output was
        used). With `base` (a full step's: its summed table first, then any repaired
        extremes), those are kept until the next full step, and the base's before are
        released too."""
        retired = self._kept
        if base is not None:
            retired = retired + self._base_kept
            self._base_kept = list(base)
        self._kept = [frame for frame in self._pending if not any(frame is part for part in self._base_kept)]
        self._pending = []
        release(retired)

    def abandon(self) -> None:
        """Release what the step in progress checkpointed: it will not be committed."""
        release(self._pending)
        self._pending = []

    def close(self) -> None:
        """Release every checkpoint this dataflow holds (it is dropped or rebuilt)."""
        release(self._base_kept + self._kept + self._pending)
        self._base_kept, self._kept, self._pending = [], [], []

    # --- Plumbing ------------------------------------------------------------------------

    def _bind(self, view: str, frame: DataFrame) -> None:
        frame.createOrReplaceTempView(view)

    def _sql(self, text: str) -> DataFrame:
        return self.session.sql(text)

    def _frame(self, template) -> DataFrame:
        return DataFrame(self.jvm.dataframe_jdf(template), self.session)


def _meeting(rows: DataFrame, change: DataFrame, columns: tuple[tuple[str, str], ...]) -> DataFrame:
    """The `rows` whose columns equal a `change` row's, pairwise ((rows', change's)
    names): a left semi-join with the change's columns broadcast, renamed clear of
    `rows`' columns so that the condition names each side's."""
    tag = _fresh_prefix("__meet", rows.columns)
    keys = change.selectExpr(*(f"{quote(theirs)} AS {tag}{i}" for i, (_, theirs) in enumerate(columns)))
    condition = " AND ".join(f"{quote(ours)} = {tag}{i}" for i, (ours, _) in enumerate(columns))
    return rows.join(F.broadcast(keys), F.expr(condition), "left_semi")


def _fresh_prefix(prefix: str, names: list[str]) -> str:
    """`prefix`, lengthened with underscores until no name in `names` starts with it
    (Spark matches names ignoring case)."""
    taken = [name.lower() for name in names]
    while any(name.startswith(prefix.lower()) for name in taken):
        prefix += "_"
    return prefix


def release(frames: list[DataFrame]) -> None:
    """Drop checkpointed frames' blocks from the executors now. Spark's own cleaner drops
    them once the JVM has collected their RDD, which may take until its periodic full
    collection (every 30 minutes): a step a second would leave thousands of state
    copies on disk by then."""
    for frame in frames:
        _rdd(frame).unpersist(False)


def _rdd(checkpointed: DataFrame):
    """The RDD a checkpointed frame reads (its plan is one `LogicalRDD`)."""
    return checkpointed._jdf.logicalPlan().rdd()


def _count(frame: DataFrame) -> int:
    """The rows of `frame`, counted by the RDD: a count planned as a query (an
    aggregate over a limit) compiled new code for every dataflow
    (`test_steps_of_a_query_seen_before_compile_no_code`)."""
    return frame._jdf.queryExecution().toRdd().count()


def _prefix(columns: str) -> str:
    """`columns, ` or nothing."""
    return f"{columns}, " if columns else ""


def _matching(left: str, right: str, keys: list[str]) -> str:
    """Equal keys, a NULL matching a NULL (as GROUP BY groups them); `true` without
    keys (a global aggregate's one group)."""
    return " AND ".join(f"{left}.{k} <=> {right}.{k}" for k in keys) or "true"


def _prefix_comma(columns: list[str]) -> str:
    """`, columns` or nothing."""
    return "".join(f", {c}" for c in columns)


def _extreme_value(x: str, spark_type: str) -> str:
    """The value an extreme compares: a float's -0.0 as 0.0, since the two compare
    equal and which one a MIN or MAX returns would depend on the order of the rows."""
    return f"IF({x} = 0, abs({x}), {x})" if spark_type in FLOAT_TYPES else x


def _times_table(times: Sequence[int], following: Sequence[int | None]) -> pa.Table:
    """A step's times, each with the next (None for the last), as an Arrow table."""
    return pa.table({TIME: pa.array(times, pa.int64()), "__next": pa.array(following, pa.int64())})


def _sql_text(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")
