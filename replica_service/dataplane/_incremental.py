"""Incremental maintenance of one dataflow (DESIGN section 10): each step costs what
changed, and its state lives on Spark.

A step at time t, after the previous step at t', binds each leaf of the delta plan
(`_plan.DeltaPlan`) to DataFrames of that input: its updates through t (*new*), through
t' (*old*) and in (t', t] (*delta*), and evaluates one derivative term per leaf whose
delta is not empty. A linear query's changes are those terms. An aggregate query keeps
state:
- **accumulators**, one row per group and piece: the group's multiplicity `__n` and, per
  aggregate argument, exact sums: integers and decimals as DECIMAL (`__s`), floats as an
  integer part and a fraction in units of 1e-18 (`__h`, `__l`) with counts of NaNs and
  infinities, and the non-null count `__c`. Accumulators are additive, so a step appends
  the change's accumulators as a new piece, and a group's value is the sum over pieces;
- **value counts** for `MIN`, `MAX` and `COUNT(DISTINCT)`: (group, value, count) rows,
  from which the touched groups' extremes and distinct counts are recomputed.
Both are DataFrames checkpointed in the executors' block managers (`localCheckpoint`);
pieces are merged once there are `MAX_PIECES`. A step looks up only the touched groups
(a semi-join with the change's keys), so it reads the state, never the inputs whole.

Path independence: every accumulator is an exact sum over the group's rows whatever
their order, partitioning or the times they arrived at, and the output is a function of
the accumulators alone. So a version at t has the same bits whether it was maintained
from an early `as_of`, hydrated at a later one, or recomputed from scratch (`recompute`
evaluates the same plan over whole snapshots). The price, for floating-point sums: each
value is rounded to 1e-18 before summing, and |x| must stay below 1e38 (beyond, the
ANSI cast fails loudly). Spark's own float sum depends on the order of its partitions;
this one does not, and may differ from it in the last bits.

Rules: nothing here awaits; every method blocks on Spark (run it on a step thread).
`step` is lazy; the caller runs the changes, then `commit`s the state it implies, so a
failed output leaves the state as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from typing import Callable, Mapping

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from replica_service.dataplane._jvm import Jvm
from replica_service.dataplane._plan import ACC_VIEW, DIFF, AggregateCall, AggregateShape, DeltaPlan

MAX_PIECES = 8
"""State pieces kept before they are merged into one."""

_FLOAT_UNIT = "1e18"  # a float's fraction is summed in units of 10^-18
_FLOAT_TYPES = ("FLOAT", "DOUBLE")
_VALUE_FUNCTIONS = ("min", "max", "count_distinct")


@dataclass(frozen=True, slots=True)
class Binding:
    """What a step binds to one leaf: the input through t, through t', and in (t', t]
    (None: the input did not change)."""

    new: DataFrame
    old: DataFrame
    delta: DataFrame | None


@dataclass(slots=True)
class Step:
    """The output's changes at one time (lazy: user columns and `_diff`), and the state
    change to keep once the caller has used them."""

    changes: DataFrame
    commit: Callable[[], None]


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
        self._accumulators = _accumulators(shape) if shape else {}
        self._value_arguments = sorted({c.argument for c in shape.calls if c.function in _VALUE_FUNCTIONS}) if shape else []
        self._acc: list[DataFrame] = []  # pieces: __k*, __n, accumulators
        self._values: dict[int, list[DataFrame]] = {a: [] for a in self._value_arguments}  # __k*, __v, __c

    # --- Steps ---------------------------------------------------------------------------

    def step(self, time: int, bindings: Mapping[int, Binding]) -> Step:
        """The changes at `time`. The first step hydrates: every leaf is read whole at
        `time` (its `new`), and the changes are the whole output."""
        pre = self._pre(bindings)
        shape = self.plan.aggregate
        if shape is None:
            return Step(pre, self._mark_hydrated)
        return self._aggregate_step(time, shape, pre)

    def _pre(self, bindings: Mapping[int, Binding]) -> DataFrame:
        """The SPJ part's changes: the full plan while hydrating, else the derivative
        terms of the leaves that changed."""
        plan = self.plan
        if not self.hydrated:
            for leaf in plan.leaves:
                self._bind(leaf.view, bindings[leaf.position].new)
            return self._frame(plan.full)
        terms = []
        for leaf in plan.leaves:
            if bindings[leaf.position].delta is None:
                continue
            for other in plan.leaves:
                binding = bindings[other.position]
                chosen = binding.new if other.position < leaf.position else binding.old
                self._bind(other.view, binding.delta if other is leaf else chosen)
            terms.append(self._frame(plan.terms[leaf.position]))
        if not terms:
            for leaf in plan.leaves:  # no change: an empty result of the right shape
                self._bind(leaf.view, bindings[leaf.position].new.limit(0))
            return self._frame(plan.full)
        return reduce(lambda a, b: a.unionAll(b), terms)

    def _aggregate_step(self, time: int, shape: AggregateShape, pre: DataFrame) -> Step:
        keys = self._keys
        if self._value_arguments:
            pre = pre.localCheckpoint(eager=True)  # read once per value argument and once more
        delta_acc = pre.groupBy(*keys).agg(*(expression.alias(name) for name, expression in self._accumulators.items()))
        delta_acc = delta_acc.localCheckpoint(eager=True)
        delta_values = {
            a: pre.where(F.col(f"__x{a}").isNotNull())
            .groupBy(*keys, F.col(f"__x{a}").alias("__v"))
            .agg(F.sum(DIFF).alias("__c"))
            .where(F.col("__c") != 0)
            .localCheckpoint(eager=True)
            for a in self._value_arguments
        }
        touched = delta_acc.select(*keys) if keys else None
        sums = list(self._accumulators)
        old_acc = _lookup(self._acc, touched, keys, sums) if self.hydrated else None
        new_acc = _merge([old_acc, delta_acc], keys, sums)
        old_values = {a: _lookup(self._values[a], touched, [*keys, "__v"], ["__c"]) for a in self._value_arguments}
        new_values = {a: _merge([old_values[a], delta_values[a]], [*keys, "__v"], ["__c"]) for a in self._value_arguments}
        rows = [self._finals(time, shape, new_acc, new_values, sign=1)]
        if old_acc is not None:
            rows.append(self._finals(time, shape, old_acc, old_values, sign=-1))
        self._bind(ACC_VIEW, reduce(lambda a, b: a.unionByName(b), rows))
        changes = self._frame(shape.post)

        def commit() -> None:
            self._acc = _append(self._acc, delta_acc, keys, sums, "__n")
            for a in self._value_arguments:
                self._values[a] = _append(self._values[a], delta_values[a], [*keys, "__v"], ["__c"], "__c")
            self.hydrated = True

        return Step(changes, commit)

    def _finals(
        self, time: int, shape: AggregateShape, acc: DataFrame, values: Mapping[int, DataFrame], *, sign: int
    ) -> DataFrame:
        """One row per group of `acc` that exists (positive multiplicity; a global
        aggregate always has its one row): the keys, each aggregate's value as `__a<i>`
        and `_diff` = `sign`."""
        keys = self._keys
        if not shape.grouped:
            # The one group exists even without rows: its sums over nothing are zeros.
            one = self.session.range(1).join(acc, F.lit(True), "left")
            acc = one.select(*(F.coalesce(F.col(n), F.lit(0)).alias(n) for n in self._accumulators))
        else:
            message = F.concat(
                F.lit(f"negative count in dataflow {self.what} at {time}: a group has multiplicity "),
                F.col("__n").cast("string"),
            )
            acc = acc.where(F.when(F.col("__n") < 0, F.raise_error(message)).otherwise(F.col("__n") > 0))
        for a, frame in values.items():
            extremes = frame.where(F.col("__c") > 0).groupBy(*keys).agg(
                F.min("__v").alias(f"__min{a}"), F.max("__v").alias(f"__max{a}"), F.count("__v").alias(f"__cd{a}")
            )
            acc = _join_on_keys(acc, extremes, keys)
        columns = [F.col(k) for k in keys]
        columns += [F.expr(_final(call)).cast(call.result_type).alias(f"__a{i}") for i, call in enumerate(shape.calls)]
        return acc.select(*columns, F.lit(sign).cast("bigint").alias(DIFF))

    def _mark_hydrated(self) -> None:
        self.hydrated = True

    # --- Plumbing ------------------------------------------------------------------------

    def _bind(self, view: str, frame: DataFrame) -> None:
        frame.createOrReplaceTempView(view)

    def _frame(self, template) -> DataFrame:
        return DataFrame(self.jvm.dataframe_jdf(template), self.session)


def _accumulators(shape: AggregateShape) -> dict[str, Column]:
    """The additive sums kept per group, by column name: `__n` and, per argument, what
    its aggregates need."""
    sums: dict[str, Column] = {"__n": F.sum(DIFF)}
    for call in shape.calls:
        if call.argument is None or call.function in _VALUE_FUNCTIONS:
            continue
        a = call.argument
        x = f"__x{a}"
        sums[f"__c{a}"] = F.sum(F.expr(f"IF({x} IS NOT NULL, {DIFF}, 0)"))
        if call.function == "count":
            continue
        if call.input_type in _FLOAT_TYPES:
            value = f"CAST({x} AS DOUBLE)"
            finite = f"(NOT isnan({value}) AND abs({value}) != CAST('Infinity' AS DOUBLE))"
            sums[f"__h{a}"] = F.sum(F.expr(f"IF({finite}, CAST({value} - {value} % 1 AS DECIMAL(38,0)), 0) * {DIFF}"))
            sums[f"__l{a}"] = F.sum(F.expr(f"IF({finite}, CAST(({value} % 1) * {_FLOAT_UNIT} AS DECIMAL(38,0)), 0) * {DIFF}"))
            sums[f"__nan{a}"] = F.sum(F.expr(f"IF(isnan({value}), {DIFF}, 0)"))
            sums[f"__pinf{a}"] = F.sum(F.expr(f"IF({value} = CAST('Infinity' AS DOUBLE), {DIFF}, 0)"))
            sums[f"__ninf{a}"] = F.sum(F.expr(f"IF({value} = CAST('-Infinity' AS DOUBLE), {DIFF}, 0)"))
        elif call.input_type.startswith("DECIMAL"):
            sums[f"__s{a}"] = F.sum(F.expr(f"{x} * CAST({DIFF} AS DECIMAL(10,0))"))
        else:
            sums[f"__s{a}"] = F.sum(F.expr(f"CAST({x} AS DECIMAL(38,0)) * {DIFF}"))
    return sums


def _float_sum(a: int) -> str:
    return (
        f"CASE WHEN __nan{a} > 0 OR (__pinf{a} > 0 AND __ninf{a} > 0) THEN CAST('NaN' AS DOUBLE) "
        f"WHEN __pinf{a} > 0 THEN CAST('Infinity' AS DOUBLE) "
        f"WHEN __ninf{a} > 0 THEN CAST('-Infinity' AS DOUBLE) "
        f"ELSE CAST(__h{a} AS DOUBLE) + CAST(__l{a} AS DOUBLE) / {_FLOAT_UNIT} END"
    )


def _final(call: AggregateCall) -> str:
    """The aggregate's value as SQL over the accumulator columns (NULL over no values, as
    Spark's aggregates)."""
    a = call.argument
    if call.function == "count_rows":
        return "__n"
    if call.function == "count":
        return f"__c{a}"
    if call.function in ("min", "max"):
        return f"__{call.function}{a}"
    if call.function == "count_distinct":
        return f"coalesce(__cd{a}, 0)"
    floating = call.input_type in _FLOAT_TYPES
    if call.function == "sum":
        total = _float_sum(a) if floating else f"__s{a}"
    elif floating:
        total = f"({_float_sum(a)}) / __c{a}"
    elif call.input_type.startswith("DECIMAL"):
        precision, scale = (int(p) for p in call.input_type[len("DECIMAL(") : -1].split(","))
        total = f"CAST(__s{a} AS DECIMAL({min(38, precision + 10)},{scale})) / CAST(__c{a} AS DECIMAL(20,0))"
    else:
        total = f"CAST(__s{a} AS DOUBLE) / __c{a}"
    return f"IF(__c{a} = 0, NULL, {total})"


def _merge(pieces: list[DataFrame], keys: list[str], sums: list[str]) -> DataFrame:
    """The pieces summed per key."""
    union = reduce(lambda a, b: a.unionByName(b), [p for p in pieces if p is not None])
    return union.groupBy(*keys).agg(*(F.sum(s).alias(s) for s in sums))


def _lookup(pieces: list[DataFrame], touched: DataFrame | None, keys: list[str], sums: list[str]) -> DataFrame | None:
    """The state of the touched groups (all of it for a global aggregate): pieces
    semi-joined with the change's keys (broadcast: the change is small), then summed."""
    if not pieces:
        return None
    union = reduce(lambda a, b: a.unionByName(b), pieces)
    if touched is not None:
        group_keys = keys[: len(touched.columns)]
        renamed = touched.select(*(F.col(k).alias(f"__t{i}") for i, k in enumerate(group_keys)))
        condition = reduce(lambda a, b: a & b, (F.col(k).eqNullSafe(F.col(f"__t{i}")) for i, k in enumerate(group_keys)))
        union = union.join(F.broadcast(renamed), condition, "left_semi")
    return union.groupBy(*keys).agg(*(F.sum(s).alias(s) for s in sums))


def _append(pieces: list[DataFrame], piece: DataFrame, keys: list[str], sums: list[str], count: str) -> list[DataFrame]:
    pieces = [*pieces, piece]
    if len(pieces) <= MAX_PIECES:
        return pieces
    merged = _merge(pieces, keys, sums).where(F.col(count) != 0)
    return [merged.localCheckpoint(eager=True)]


def _join_on_keys(left: DataFrame, right: DataFrame, keys: list[str]) -> DataFrame:
    """`left` with `right`'s other columns, matched on `keys` (NULL keys match NULL)."""
    if not keys:
        return left.crossJoin(right) if right.columns else left
    renamed = right.select(*(F.col(k).alias(f"__r{i}") for i, k in enumerate(keys)), *(c for c in right.columns if c not in keys))
    condition = reduce(lambda a, b: a & b, (F.col(k).eqNullSafe(F.col(f"__r{i}")) for i, k in enumerate(keys)))
    return left.join(renamed, condition, "left").drop(*(f"__r{i}" for i in range(len(keys))))
