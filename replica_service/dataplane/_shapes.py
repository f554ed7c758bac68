"""What a delta plan is made of: the types `_plan` builds (from Spark's analyzed plan)
and `_incremental` steps, and the plan nodes a maintained query may hold. Shared by the
builder (`_plan`), the join order (`_joins`) and the subquery rewrites (`_subqueries`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

DIFF = "_diff"  # the multiplicity column of storage updates and of every delta
TIME = "_time"  # the time of each update, of storage and of every delta
ACC_VIEW = "__acc"  # the accumulators a step evaluates the post-aggregate template over
ACCROW = "__accrow"  # a timed ranked query's output: the `__acc` row each row came from

AggregateFunction = Literal["count_rows", "count", "sum", "avg", "min", "max", "count_distinct"]


class NotIncremental(Exception):
    """The query cannot be maintained incrementally; the message says which part."""


@dataclass(frozen=True, slots=True)
class Leaf:
    """One occurrence of an input in the query (a self-join has two), or a *stage*: an
    aggregate below the query's joins (or under an `IN`/`EXISTS`), maintained as a
    query of its own (`stage`, whose output columns are `columns`, positionally named
    `__c<i>`, of Spark types `types`)."""

    position: int
    name: str  # the import's name, as the SQL reads it (a stage's: `__stage<position>`)
    columns: tuple[str, ...]
    stage: DeltaPlan | None = None
    types: tuple[str, ...] = ()

    @property
    def view(self) -> str:
        return f"__leaf{self.position}"


@dataclass(frozen=True, slots=True)
class AggregateCall:
    """One aggregate of the query, over pre-aggregate argument column `__x<argument>`
    (None for `COUNT(*)`). Its value is column `__a<position>` of the accumulator view,
    of Spark type `result_type`."""

    function: AggregateFunction
    argument: int | None
    input_type: str | None
    result_type: str


@dataclass(frozen=True, slots=True)
class AggregateShape:
    """The aggregate at the top of an aggregate query.

    The SPJ templates output `__k0..` (grouping keys), `__x0..` (aggregate arguments),
    `_diff` and `_time`. `post` reads the view `__acc` (columns `__k*`, `__a*`, `_diff`
    and `_time`: one row per group version, +1 new, -1 old, at the time it changed) and
    gives the query's output plus `_diff` and `_time`.
    A global aggregate (`grouped` False) has exactly one output row at every time.
    """

    keys: int
    arguments: tuple[str, ...]  # Spark type of each __x<i>
    key_types: tuple[str, ...]
    calls: tuple[AggregateCall, ...]
    grouped: bool
    post: Any


# For one term: each input leaf to narrow (by position) and its columns the query's
# equalities make equal to a column of the term's change, as (input's, change's) names.
Narrowing = tuple[tuple[int, tuple[tuple[str, str], ...]], ...]


@dataclass(frozen=True, slots=True)
class DeltaPlan:
    """`ranked`, for a ranked aggregate: the whole query (sort and limit included) over
    `__acc` holding every group's current row (`__k*`, `__a*`); None otherwise.
    `ranked_timed`, the same query ranked at several times at once: over `__acc` rows
    with a `_time` too, the top rows of each time, with their `_time` and `__accrow`.
    `narrowing[i]`, for a stage leaf i: the inputs its term may narrow to the rows that
    can meet its change (`_narrowings`); empty for an input's leaf."""

    leaves: tuple[Leaf, ...]
    full: Any
    terms: tuple[Any, ...]
    aggregate: AggregateShape | None
    output_columns: tuple[str, ...]
    narrowing: tuple[Narrowing, ...]
    ranked: Any | None = None
    ranked_timed: Any | None = None


# Plan nodes the SPJ part may contain, and how each carries the diff.
_SPJ_NODES = {"Project", "Filter", "Join", "SubqueryAlias", "Union", "Sort", "View", "Aggregate", "Distinct"}
_STAGE_NODES = {"Aggregate", "Distinct"}  # below the top of a query: stages
_JOIN_TYPES = {"Inner$", "Cross$"}
_SUBQUERY_EXPRESSIONS = {"ScalarSubquery", "Exists", "ListQuery", "InSubquery", "LateralSubquery"}
_MAX_SUBQUERY_DEPTH = 8
NEGATED = "__negated"  # a SubqueryAlias of this name: its rows count negatively (an anti-join's)
_INTEGRAL = {"TINYINT", "SMALLINT", "INT", "BIGINT"}
_FLOATING = {"FLOAT", "DOUBLE"}
