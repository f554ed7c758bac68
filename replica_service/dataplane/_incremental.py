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
from typing import Callable, Mapping

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from replica_service.dataplane._jvm import Jvm
from replica_service.dataplane._plan import ACC_VIEW, DIFF, AggregateCall, AggregateShape, DeltaPlan
from replica_service.dataplane._rows import quote

_FLOAT_TYPES = ("FLOAT", "DOUBLE")
_EXTREME_FUNCTIONS = ("min", "max")
_STATE_FUNCTIONS = (*_EXTREME_FUNCTIONS, "count_distinct")  # not additive accumulators
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
        self._stages, self._accumulators = _accumulators(shape) if shape else ([], {})
        self._value_arguments = sorted({c.argument for c in shape.calls if c.function == "count_distinct"}) if shape else []
        # Each extreme kept per group, by state column name: (function, argument).
        self._extremes = {_extreme_name(c): (c.function, c.argument) for c in shape.calls if c.function in _EXTREME_FUNCTIONS} if shape else {}
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

    def step(self, time: int, bindings: Mapping[int, Binding], *, whole: bool = False, small: bool = False) -> Step:
        """The changes at `time`. The first step hydrates: every leaf is read whole at
        `time` (its `new`), and the changes are the whole output. `whole` (an aggregate
        query's only) asks for the whole output too: every group's row, read off the
        step's accumulators. `small`: the step's changes are few (see `_pre`)."""
        self.abandon()  # a step that failed before its commit left them
        pre = self._pre(bindings, small)
        shape = self.plan.aggregate
        if shape is None:
            assert not whole, "a linear query's whole output is its inputs'"
            return Step(pre, self._mark_hydrated)
        return self._aggregate_step(time, shape, pre, bindings, whole)

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

    def _aggregate_step(self, time: int, shape: AggregateShape, pre: DataFrame, bindings: Mapping[int, Binding], whole: bool) -> Step:
        """One query: the groups' accumulators before and after the change (the state's
        rows and the change's, summed per group), of which the touched groups' old (-1)
        and new (+1) values go through the post-aggregate template. The summed table
        is checkpointed as it is computed. With extremes, a first job computes it and
        counts the dirty groups, whose extremes are then recomputed from the input
        (`_repair_sql`).

        The state is a base and an overlay (`_overlay_applies`). A *full* step sums the whole
        state with the change, and its new half is the next base (the overlay merged
        in). An *overlaid* step sums only the touched groups' current rows with the
        change, and their new rows replace theirs in the overlay; the base stays."""
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
        if self._extremes:
            self._bind("__grouped", summed)
            dirty = summed.where("__dirty").select(*self._keys)
            dirty_groups = _count(dirty)  # computes (and checkpoints) the grouped table
            repaired = dirty_groups > 0
            if repaired:
                self._bind("__dirty", dirty)
                for leaf in self.plan.leaves:
                    self._bind(leaf.view, bindings[leaf.position].new)
                self._bind("__full", self._frame(self.plan.full))
                repair = self._repair_sql(broadcast=dirty_groups <= _BROADCAST_DIRTY)
                base_parts.append(self.checkpoint(self._sql(repair)))
                self._bind("__repaired", base_parts[-1])
            summed = self._sql(self._extremes_sql(repaired))
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
        summed_values = {}
        for a in self._value_arguments:
            if self._values[a] is not None:
                self._bind(f"__vstate{a}", self._values[a])
            summed_values[a] = self.checkpoint(self._sql(self._summed_values_sql(a)))
            self._bind(f"__vsummed{a}", summed_values[a])
        if self.plan.ranked is None:
            self._bind(ACC_VIEW, self._sql(self._versions_sql(time, shape, every_group=False)))
            changes = self._frame(shape.post)
        else:
            self._bind("__summed", every_group)
            self._bind(ACC_VIEW, self._sql(self._versions_sql(time, shape, every_group=True)))
            top = self.checkpoint(self._frame(self.plan.ranked))
            changes = self._ranked_changes(top)
        output = None
        if whole:
            self._bind("__summed", every_group)
            self._bind(ACC_VIEW, self._sql(self._versions_sql(time, shape, every_group=True)))
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

    def _ranked_changes(self, top: DataFrame) -> DataFrame:
        """The new top rows (+1) and, once hydrated, the old ones (-1)."""
        changes = top.withColumn(DIFF, F.lit(1).cast("bigint"))
        if self._top is not None:
            changes = changes.unionAll(self._top.withColumn(DIFF, F.lit(-1).cast("bigint")))
        return changes

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
        staged = "__pre"
        for stage in self._stages:
            columns = ", ".join(f"{expression} AS {name}" for name, expression in stage.items())
            staged = f"(SELECT *, {columns} FROM {staged})"
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

    def _versions_sql(self, time: int, shape: AggregateShape, *, every_group: bool) -> str:
        """The old (-1) and new (+1) rows of every touched group, with each aggregate's
        value as `__a<i>`: the view the post-aggregate template reads. With
        `every_group`, the new row of every group instead: the view a ranked query
        reads."""
        keys = self._keys
        source = "__summed g"
        for a in self._value_arguments:
            distinct_counts = ", ".join(f"count(IF({side}_c > 0, __v, NULL)) AS {side}_cd{a}" for side in ("new", "old"))
            grouping = f" GROUP BY {', '.join(keys)}" if keys else ""
            source += (
                f" LEFT JOIN (SELECT {_prefix(', '.join(keys))}{distinct_counts} FROM __vsummed{a}{grouping}) x{a}"
                f" ON {_matching('g', f'x{a}', keys)}"
            )
        selects = [self._rows_sql(source, "new", time, shape, sign=1, every_group=every_group)]
        if self.hydrated and not every_group:
            selects.append(self._rows_sql(source, "old", time, shape, sign=-1, every_group=False))
        return " UNION ALL ".join(selects)

    def _rows_sql(self, source: str, side: str, time: int, shape: AggregateShape, *, sign: int, every_group: bool) -> str:
        """The `side` ("new" or "old") row of every touched group (of every group, with
        `every_group`) that exists on that side: a positive multiplicity, or always for a
        global aggregate (whose sums over nothing are then 0)."""
        keys = self._keys
        if keys:
            values = {n: f"g.{side}_{n}" for n in self._accumulators}
            multiplicity = values["__n"]
            message = f"'negative count in dataflow {_sql_text(self.what)} at {time}: a group has multiplicity ' || {multiplicity}"
            exists = f"CASE WHEN {multiplicity} < 0 THEN raise_error({message}) ELSE {multiplicity} > 0 END"
            where = f" WHERE {exists}" if every_group else f" WHERE g.__touched = 1 AND {exists}"
        else:
            values = {n: f"coalesce(g.{side}_{n}, 0)" for n in self._accumulators}
            where = ""
        values.update({n: f"g.{side}_{n}" for n in self._extremes})
        finals = [
            f"CAST({_final(call, values, side)} AS {call.result_type}) AS __a{i}" for i, call in enumerate(shape.calls)
        ]
        columns = [*(f"g.{k}" for k in keys), *finals, f"CAST({sign} AS BIGINT) AS {DIFF}"]
        return f"SELECT {', '.join(columns)} FROM {source}{where}"

    def _mark_hydrated(self) -> None:
        self.hydrated = True
        self._keep_pending()

    # --- Checkpoints ---------------------------------------------------------------------

    def checkpoint(self, frame: DataFrame, *, eager: bool = False) -> DataFrame:
        """`frame`, kept on the executors' local disks as the first job that reads it
        computes it (or now, `eager`). It belongs to the step in progress, which must
        `cut_lineage` before its commit keeps it as the state's (`_keep_pending`)."""
        checkpointed = frame.localCheckpoint(eager=eager, storageLevel=StorageLevel.DISK_ONLY)
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


def _extreme_name(call: AggregateCall) -> str:
    return f"__{'mn' if call.function == 'min' else 'mx'}{call.argument}"


def _extreme_value(x: str, spark_type: str) -> str:
    """The value an extreme compares: a float's -0.0 as 0.0, since the two compare
    equal and which one a MIN or MAX returns would depend on the order of the rows."""
    return f"IF({x} = 0, abs({x}), {x})" if spark_type in _FLOAT_TYPES else x


def _sql_text(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")


# Floating-point values are summed as integers: each finite x is cut into chunks of 24
# bits, three of its integral part and four of its fraction, each an integer held in a
# double. Doubles add integers below 2^53 exactly, so the chunk sums are exact (and
# cheap: plain double sums) for groups of fewer than 2^29 rows; the value is rebuilt
# from them once, in a fixed order.
_CHUNK = 2**24
_FLOAT_CHUNKS = ("i0", "i1", "i2", "f1", "f2", "f3", "f4")


def _double(value: float) -> str:
    """A DOUBLE literal (`16777216.0` alone would be a DECIMAL in Spark SQL)."""
    return f"{value!r}D"


def _floor(y: str) -> str:
    """floor(y) as a double (Spark's floor of a double is a BIGINT, which overflows);
    through `rint`, which is exact and cheap (`%` on doubles costs ten times more)."""
    return f"(rint({y}) - IF(rint({y}) > {y}, 1D, 0D))"


def _float_chunks(x: str, a: int) -> tuple[list[dict[str, str]], dict[str, str]]:
    """The seven chunks of the double `x` (argument `a`), when finite: x = i2*2^48 +
    i1*2^24 + i0 + f1*2^-24 + f2*2^-48 + f3*2^-72 + f4*2^-96, with i0, i1, f2, f3, f4 in
    [0, 2^24) and f1 in [-2^24, 2^24) (bits below 2^-96, about 1e-29, are dropped:
    rounded down). `x` is cut into its truncated integral part and its fraction (both
    exact), then each chunk is the difference of two floors of a part scaled by powers
    of two, all exact in doubles. Returned as staged projections (each stage's columns,
    SQL over the columns before it) and the chunks over them: inlined, the SQL repeats
    `x` hundreds of times (measured: a 10M-row hydration took 59 s inlined, 0.9 s
    staged; Spark keeps a projection whose columns are read more than once)."""
    c = _double(float(_CHUNK))
    d, whole, fraction = f"__d{a}", f"__w{a}", f"__fr{a}"
    floors = {  # floor(whole * 2^p) for p = -48, -24; floor(fraction * 2^p) for p = 24 .. 96
        f"__g{a}_{i}": _floor(f"{whole if power < 0 else fraction} * {_double(2.0**power)}")
        for i, power in enumerate((-48, -24, 24, 48, 72, 96))
    }
    stages = [
        {d: f"CAST({x} AS DOUBLE)"},
        {
            whole: f"IF(abs(rint({d})) > abs({d}), rint({d}) - signum({d}), rint({d}))",
            f"__fin{a}": f"(NOT isnan({d}) AND abs({d}) != CAST('Infinity' AS DOUBLE))",
        },
        {fraction: f"{d} - {whole}"},  # in (-1, 1), the sign of x
        floors,
    ]
    high, low, f1, f2, f3, f4 = floors
    chunks = {
        "i2": high,
        "i1": f"{low} - {high} * {c}",
        "i0": f"{whole} - {low} * {c}",
        "f1": f1,
        "f2": f"{f2} - {f1} * {c}",
        "f3": f"{f3} - {f2} * {c}",
        "f4": f"{f4} - {f3} * {c}",
    }
    return stages, {name: f"IF(__fin{a}, {chunk}, 0D)" for name, chunk in chunks.items()}


def _from_chunks(sums: Mapping[str, str]) -> str:
    """The double of summed chunks: the integral chunks added first (exactly, below
    2^53), then the fraction, smallest chunk first; deterministic, and within an ulp or
    two of the exact sum."""
    whole = f"(({sums['i2']}) * {_double(float(_CHUNK**2))} + ({sums['i1']}) * {_double(float(_CHUNK))}) + ({sums['i0']})"
    fraction = " + ".join(
        f"({sums[name]}) / {_double(float(_CHUNK**power))}" for power, name in ((4, "f4"), (3, "f3"), (2, "f2"), (1, "f1"))
    )
    return f"(({whole}) + ({fraction}))"


def _decimal_type(spark_type: str) -> tuple[int, int]:
    precision, scale = (int(p) for p in spark_type[len("DECIMAL(") : -1].split(","))
    return precision, scale


_DECIMAL_CHUNK = 10**9


def _decimal_chunks(x: str, a: int, precision: int, scale: int) -> tuple[list[dict[str, str]], list[str]]:
    """The unscaled value u of the DECIMAL `x` (argument `a`) cut into base-10^9 digits:
    u = sum(c_k * 10^(9k)), every c_k in [0, 10^9) but the last (u's sign is there), each
    a BIGINT whose sum over 9e9 rows cannot overflow. Exact: `x * 10^scale` is an
    integer, which Spark keeps whole in 38 - min(scale, 6) digits when precision +
    min(scale, 6) > 38 (a larger value fails the step loudly, an ANSI overflow; Spark's
    own sum of such a column overflows beyond 38 - scale digits). Returned as staged
    projections (each digit's quotient is the next stage's input) and the chunks over
    them."""
    count = -(-precision // 9)
    quotients = [f"__u{a}_{k}" for k in range(count)]
    stages = [{quotients[0]: f"CAST({x} * CAST({10**scale} AS DECIMAL({scale + 1},0)) AS DECIMAL(38,0))"}]
    for k in range(1, count):
        q = quotients[k - 1]
        stages.append({quotients[k]: f"CAST(({q} - pmod({q}, {_DECIMAL_CHUNK})) / {_DECIMAL_CHUNK} AS DECIMAL(38,0))"})
    chunks = [f"CAST(pmod({q}, {_DECIMAL_CHUNK}) AS BIGINT)" for q in quotients[:-1]] + [f"CAST({quotients[-1]} AS BIGINT)"]
    return stages, chunks


def _accumulators(shape: AggregateShape) -> tuple[list[dict[str, str]], dict[str, str]]:
    """The additive accumulators kept per group, by name, each as one row's contribution
    (a group's accumulator is their sum): `__n` and, per argument, what its aggregates
    need. Machine words wherever that stays exact (Spark sums BIGINTs and doubles ten
    times faster than wide DECIMALs). Returned with the staged projections the
    contributions read (each stage's columns, SQL over the pre-aggregate columns and
    the stages before it)."""
    stages: list[dict[str, str]] = []
    contributions: dict[str, str] = {"__n": DIFF}
    for call in shape.calls:
        if call.argument is None or call.function in _STATE_FUNCTIONS:
            continue
        a = call.argument
        x = f"__x{a}"
        contributions[f"__c{a}"] = f"IF({x} IS NOT NULL, {DIFF}, 0)"
        if call.function == "count":
            continue
        if call.input_type in _FLOAT_TYPES:
            chunk_stages, chunks = _float_chunks(x, a)
            _merge_stages(stages, chunk_stages)
            for name, chunk in chunks.items():
                contributions[f"__{name}_{a}"] = f"{chunk} * {DIFF}"
            value = f"__d{a}"
            contributions[f"__nan{a}"] = f"IF(isnan({value}), {DIFF}, 0)"
            contributions[f"__pinf{a}"] = f"IF({value} = CAST('Infinity' AS DOUBLE), {DIFF}, 0)"
            contributions[f"__ninf{a}"] = f"IF({value} = CAST('-Infinity' AS DOUBLE), {DIFF}, 0)"
        elif call.input_type.startswith("DECIMAL") and _decimal_type(call.input_type)[0] <= 18:
            # The unscaled value fits a BIGINT; cut in two (31 low bits, the rest) so
            # that their BIGINT sums cannot overflow.
            _, scale = _decimal_type(call.input_type)
            unscaled = f"CAST({x} * {10**scale} AS BIGINT)"
            contributions[f"__sl{a}"] = f"pmod({unscaled}, 2147483648) * {DIFF}"
            contributions[f"__sh{a}"] = f"(({unscaled} - pmod({unscaled}, 2147483648)) div 2147483648) * {DIFF}"
        elif call.input_type.startswith("DECIMAL"):
            chunk_stages, digits = _decimal_chunks(x, a, *_decimal_type(call.input_type))
            _merge_stages(stages, chunk_stages)
            for k, digit in enumerate(digits):
                contributions[f"__dc{a}_{k}"] = f"{digit} * {DIFF}"
        else:  # integers: a BIGINT sum, overflowing (in ANSI mode, loudly) where Spark's does
            contributions[f"__s{a}"] = f"CAST({x} AS BIGINT) * {DIFF}"
    return stages, contributions


def _merge_stages(stages: list[dict[str, str]], more: list[dict[str, str]]) -> None:
    """Add `more`'s columns to `stages`, level by level (arguments' stages run side by side)."""
    for level, columns in enumerate(more):
        if level == len(stages):
            stages.append({})
        stages[level].update(columns)


def _final(call: AggregateCall, values: Mapping[str, str], side: str) -> str:
    """The aggregate's value on `side` ("new" or "old") as SQL over the accumulators
    and extremes (`values`: name -> SQL) and the distinct counts, NULL over no values,
    as Spark's aggregates."""
    a = call.argument
    if call.function == "count_rows":
        return values["__n"]
    if call.function in _EXTREME_FUNCTIONS:
        return values[_extreme_name(call)]
    if call.function == "count_distinct":
        return f"coalesce(x{a}.{side}_cd{a}, 0)"
    count = values[f"__c{a}"]
    if call.function == "count":
        return count
    floating = call.input_type in _FLOAT_TYPES
    if floating:
        total = (
            f"CASE WHEN {values[f'__nan{a}']} > 0 OR ({values[f'__pinf{a}']} > 0 AND {values[f'__ninf{a}']} > 0) THEN CAST('NaN' AS DOUBLE) "
            f"WHEN {values[f'__pinf{a}']} > 0 THEN CAST('Infinity' AS DOUBLE) "
            f"WHEN {values[f'__ninf{a}']} > 0 THEN CAST('-Infinity' AS DOUBLE) "
            f"ELSE {_from_chunks({name: values[f'__{name}_{a}'] for name in _FLOAT_CHUNKS})} END"
        )
    elif call.input_type.startswith("DECIMAL"):  # its unscaled sum, in BIGINT parts
        precision, scale = _decimal_type(call.input_type)
        if f"__sh{a}" in values:
            unscaled = f"CAST({values[f'__sh{a}']} AS DECIMAL(38,0)) * 2147483648 + {values[f'__sl{a}']}"
        else:
            unscaled = " + ".join(
                f"CAST({values[f'__dc{a}_{k}']} AS DECIMAL(38,0)) * CAST({_DECIMAL_CHUNK**k} AS DECIMAL(38,0))"
                for k in range(-(-precision // 9))
            )
        total = f"CAST(CAST({unscaled} AS STRING) || 'E-{scale}' AS DECIMAL(38,{scale}))"
    else:
        total = values[f"__s{a}"]
    if call.function == "avg":
        if floating:
            total = f"({total}) / {count}"
        elif call.input_type.startswith("DECIMAL"):
            precision, scale = _decimal_type(call.input_type)
            total = f"CAST({total} AS DECIMAL({min(38, precision + 10)},{scale})) / CAST({count} AS DECIMAL(20,0))"
        else:
            total = f"CAST({total} AS DOUBLE) / {count}"
    return f"IF({count} = 0, NULL, {total})"
