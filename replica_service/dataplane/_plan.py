"""Delta plans: how a dataflow's query is maintained incrementally, read off Spark's
analyzed plan.

A query is incremental when its analyzed plan has one of these shapes (Sorts without a
limit are ignored: a collection has no order):
- **linear**: an SPJ tree (projections, filters, inner joins, `UNION ALL`, aliases) over
  its inputs;
- **aggregate**: projections and filters (`HAVING`, expressions over aggregates) over one
  `GROUP BY` (or a global aggregate, or `DISTINCT`) over an SPJ tree, with `COUNT`,
  `SUM`, `AVG` (of integers, decimals or floats), `MIN`, `MAX` and `COUNT(DISTINCT x)`;
- **ranked aggregate**: an aggregate query under `ORDER BY ... LIMIT n` ("the top n
  groups"). Ties are broken by every column the sort sees, ascending, so which rows make
  the cut is a function of the rows alone (Spark's own pick among ties depends on the
  order rows arrive in).
An aggregate (or `DISTINCT`) below the SPJ tree's joins is a *stage*: a leaf whose
rows are that aggregate's output, maintained as a query of its own, whose changes are
the leaf's delta. `IN (subquery)` and `EXISTS (subquery)` in a `WHERE` (Spark's
optimizer rules rewrite them into semi-joins first) are maintained as inner joins with
a `DISTINCT` stage of the subquery's join keys, when every condition linking the two
is an equality; a correlated scalar subquery compared in a `WHERE` as an inner join
with its aggregate, and a scalar subquery over a global aggregate as a cross join with
it, both stages (see `_as_inner_joins`). One `<>` beside the equalities joins a stage of
the column's least and greatest value per key instead (`_semi_join`). `NOT EXISTS`, and
an `EXISTS` of the same keys beside it, join one *key stage* of the keys of the input
they come from (`_key_stage`), or, where no one input has them, `NOT EXISTS` is the
rows of its left side less those with a match (a branch of negated multiplicity).
Anything else (outer joins, `NOT IN`, other scalar subqueries, windows, limits over
non-aggregates, ...) raises `NotIncremental` naming the part that cannot be
maintained.

How the plan is kept: the SPJ tree is rewritten once, as Catalyst trees built through
py4j, so that every row carries its multiplicity (`_diff`) and its time (`_time`): each
input occurrence (a *leaf*) reads a temp view `__leaf<i>` holding the input's updates
(user columns, `_diff`, `_time`), projections and filters pass both along, and a join
multiplies its sides' diffs and takes the later of their times (as in differential
dataflow: a pair of rows exists from the time both do, so the sum of a join's updates
through t is the join of its inputs at t, and one pass computes the changes of every
time a step covers). The user's own expressions are kept as Spark analyzed them (same exprIds, same
casts), so the rewritten plan computes exactly what the query computes, row by row.

The derivative rule (DESIGN section 10): with leaves L0..Ln, the change of an SPJ query
between t' and t is the sum over i of the query with leaves before i at t, leaf i's
change in (t', t], and leaves after i at t'. `terms[i]` is that query for leaf i (the
branches of a `UNION ALL` above leaf i that do not read it are cut off; a union elsewhere
is read whole), `full` the query over every branch, used to hydrate from whole
snapshots.

Rules: this module only reads and builds trees (analysis, never a job). The controller's
planner calls `delta_plan` to classify a dataflow, the replica to build it; both analyze
the same SQL over the same schemas, so they agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from py4j.protocol import Py4JError
from pyspark.errors.exceptions.captured import CapturedException

from replica_service.dataplane._joins import _joins_ordered, _narrowings, _Tree
from replica_service.dataplane._jvm import Jvm, children, items, kind, option, static_member
from replica_service.dataplane._shapes import (
    _FLOATING,
    _INTEGRAL,
    _JOIN_TYPES,
    _SPJ_NODES,
    _STAGE_NODES,
    _SUBQUERY_EXPRESSIONS,
    ACC_VIEW,
    ACCROW,
    DIFF,
    NEGATED,
    TIME,
    AggregateCall,
    AggregateFunction,
    AggregateShape,
    DeltaPlan,
    Leaf,
    Narrowing,
    NotIncremental,
)
from replica_service.dataplane._subqueries import _as_inner_joins

__all__ = [
    "ACC_VIEW", "ACCROW", "DIFF", "NEGATED", "TIME", "AggregateCall", "AggregateFunction", "AggregateShape", "DeltaPlan", "Leaf",
    "Narrowing", "NotIncremental", "delta_plan",
]


def delta_plan(jsession: Any, analyzed: Any, imports: Mapping[str, str]) -> DeltaPlan:
    """The delta plan of `analyzed` (a query's analyzed plan in `jsession`, over temp
    views named by the keys of `imports`, lower case, mapping to import names), or
    `NotIncremental`."""
    jvm = Jvm(jsession)
    try:
        rewritten = _as_inner_joins(jvm, analyzed)
    except (CapturedException, Py4JError) as error:  # a rule refused the plan: recompute it
        raise NotIncremental(f"its subqueries could not be rewritten as joins ({str(error).splitlines()[0]})") from None
    return _Builder(jvm, imports).build(rewritten)


class _Builder:
    def __init__(self, jvm: Jvm, imports: Mapping[str, str], *, stage: bool = False) -> None:
        self.jvm = jvm
        self.imports = imports
        # A stage's output is read by position (`__c<i>`) through a view the query's
        # leaf aliases back to the aggregate's attribute ids: its own outputs take fresh
        # ids, or Spark's analysis would find those ids produced twice in one plan and
        # renew the leaf's, which the query above it references.
        self.stage = stage
        self.leaves: list[Leaf] = []  # depth first, as `_collect_leaves` numbers them
        self._stages: list[tuple[Any, DeltaPlan]] = []  # (aggregate node, its plan): one per distinct aggregate
        # A subtree is ordered and rewritten once for all the terms that see it alike:
        # (tree, the leaf that leads its joins, or None) and (tree, the term, or None
        # for a tree without a UNION ALL, which every term rewrites alike).
        self._orderings: dict[tuple[_Tree, int | None], _Tree] = {}
        self._rewrites: dict[tuple[_Tree, int | None], tuple[Any, _Carried, frozenset[int]]] = {}

    def build(self, analyzed: Any) -> DeltaPlan:
        output = [a.name() for a in items(analyzed.output())]
        chain, top = _strip_chain(analyzed)
        limited = kind(top) == "GlobalLimit"
        if limited:  # only a ranked aggregate: what is below the limit
            chain, top = [], _ranked_aggregate(analyzed)
        if kind(top) in ("Aggregate", "Distinct"):
            spj = top.child()
            self._check_spj(spj)
            shape, pre, groups = self._aggregate(top, chain)
            ranked = self._ranked(analyzed, groups) if limited else None
            ranked_timed = self._ranked_timed(analyzed, groups, shape) if limited else None
        else:
            self._check_spj(analyzed)
            spj, shape, pre, ranked, ranked_timed = analyzed, None, None, None, None
        tree = self._collect_leaves(spj)
        outputs = items(spj.output())
        full = self._wrap(outputs, self._ordered(tree, None), None, pre)
        # An input's change leads its term's joins; a stage's joins where the query put
        # it, after the inputs it filters: led by a stage's change, the chain's later
        # joins would shuffle whole inputs too large to broadcast (`_joins_ordered`).
        terms = tuple(
            self._wrap(outputs, self._ordered(tree, leaf.position if leaf.stage is None else None), leaf.position, pre)
            for leaf in self.leaves
        )
        return DeltaPlan(tuple(self.leaves), full, terms, shape, tuple(output), _narrowings(tree, self.leaves), ranked, ranked_timed)

    # --- Shape checks --------------------------------------------------------------------

    def _check_spj(self, node: Any) -> None:
        """Raise NotIncremental unless `node` is an SPJ tree over the imports."""
        name = kind(node)
        if name not in _SPJ_NODES:
            raise NotIncremental(_describe_unsupported(node))
        if name in _STAGE_NODES:  # a stage: built (and checked) when leaves are collected
            return
        if name == "View":
            self._leaf_name(node)
            return
        if name == "Join" and kind(node.joinType()) not in _JOIN_TYPES:
            raise NotIncremental(f"{node.joinType().sql().lower()} join (only inner joins are maintained incrementally)")
        if name == "Union" and (node.byName() or node.allowMissingCol()):
            raise NotIncremental("UNION BY NAME")
        for expression in items(node.expressions()):
            _check_expression(expression)
        for child in children(node):
            self._check_spj(child)

    def _leaf_name(self, view: Any) -> str:
        table = view.desc().identifier().table()
        name = self.imports.get(table.lower())
        if name is None:
            raise NotIncremental(f"view {table} is not an input of the dataflow")
        return name

    def _collect_leaves(self, node: Any) -> _Tree:
        """`node` as a `_Tree` whose leaves (an input's view, a stage) carry their
        positions, numbered depth first into `self.leaves`: the leaves keep their
        positions when `_joins_ordered` moves them."""
        name = kind(node)
        if name == "View":
            leaf = Leaf(len(self.leaves), self._leaf_name(node), tuple(a.name() for a in items(node.output())))
            self.leaves.append(leaf)
            return _Tree.leaf_of(node, name, leaf.position)
        if name in _STAGE_NODES:
            # The same aggregate twice (an anti-join reads its left side twice) is one
            # stage: leaves sharing a plan share its state and its step.
            stage = next((plan for known, plan in self._stages if node.sameResult(known)), None)
            if stage is None:
                stage = _Builder(self.jvm, self.imports, stage=True).build(node)
                self._stages.append((node, stage))
            position = len(self.leaves)
            outputs = items(node.output())
            leaf = Leaf(
                position,
                f"__stage{position}",
                tuple(f"__c{i}" for i in range(len(outputs))),
                stage,
                tuple(a.dataType().sql() for a in outputs),
            )
            self.leaves.append(leaf)
            return _Tree.leaf_of(node, name, position)
        return _Tree.of(node, name, [self._collect_leaves(child) for child in children(node)])

    # --- The SPJ rewrite ---------------------------------------------------------------

    def _wrap(self, outputs: list[Any], tree: _Tree, term: int | None, pre: Any | None) -> Any:
        """The SPJ tree `tree` (its joins ordered) rewritten for `term` (None: every
        branch), topped by the pre-aggregate projection `pre(child, carried)` or by the
        SPJ tree's `outputs`, `_diff` and `_time`."""
        node, carried, _ = self._rewritten(tree, term)
        if pre is not None:
            return pre(node, carried)
        return self.jvm.project([*outputs, *carried.named(self.jvm)], node)

    def _rewritten(self, tree: _Tree, term: int | None) -> tuple[Any, _Carried, frozenset[int]]:
        # Only a union above the term's leaf is rewritten for that term (see `_rewrite`).
        key = (tree, term if tree.has_union and term in tree.positions else None)
        if key not in self._rewrites:
            self._rewrites[key] = self._rewrite(tree, term)
        return self._rewrites[key]

    def _rewrite(self, tree: _Tree, term: int | None) -> tuple[Any, _Carried, frozenset[int]]:
        """(`tree`'s node carrying its rows' diff and time in columns, those columns, the
        leaf positions below it)."""
        jvm = self.jvm
        node, name = tree.node, tree.kind
        if tree.leaf is not None:
            carried = _Carried.fresh(jvm)
            # An input's columns keep their names; a stage's are read by position.
            columns = [
                jvm.alias(jvm.column(a.name() if name == "View" else f"__c{i}"), a.name(), a.exprId())
                for i, a in enumerate(items(node.output()))
            ]
            read = carried.aliased(jvm, jvm.column(DIFF), jvm.column(TIME))
            leaf = jvm.project([*columns, *read], jvm.relation(f"__leaf{tree.leaf}"))
            return leaf, carried, frozenset([tree.leaf])
        rewritten = [self._rewritten(child, term) for child in tree.children]
        leaves = frozenset().union(*(r[2] for r in rewritten))
        if name == "Sort":
            return rewritten[0]
        if name == "Union":
            # A union above the term's leaf changes only in the branch that reads it: the
            # others are cut. A union beside it (the other side of a join, as the rows
            # of a first NOT EXISTS are beside a second's stage) is read whole.
            branches = [
                child if term not in leaves or term in below else jvm.filter(jvm.expression("false"), child)
                for child, _, below in rewritten
            ]
            return node.withNewChildren(jvm.seq(branches)), rewritten[0][1], leaves
        if name == "Project":
            child, carried, _ = rewritten[0]
            return jvm.project([*items(node.projectList()), *carried.columns(jvm)], child), carried, leaves
        new = node.withNewChildren(jvm.seq(r[0] for r in rewritten))
        if name == "Join":
            (_, left, _), (_, right, _) = rewritten
            carried = _Carried.fresh(jvm)
            product = jvm.expression(f"`{left.diff}` * `{right.diff}`")
            later = jvm.expression(f"greatest(`{left.time}`, `{right.time}`)")
            return jvm.project([*items(node.output()), *carried.aliased(jvm, product, later)], new), carried, leaves
        if name == "SubqueryAlias" and node.alias() == NEGATED:
            carried = rewritten[0][1]
            negated = _Carried.fresh(jvm, time=carried.time)
            diff = jvm.alias(jvm.expression(f"-`{carried.diff}`"), negated.diff, negated.diff_id)
            # L's columns by name: the semi-join reads a second copy of L, whose ids
            # Spark renews without rewriting the references above this alias.
            names = [a.name() for a in items(node.output())]
            if len({n.lower() for n in names}) < len(names):
                raise NotIncremental(f"NOT EXISTS over a left side with two columns of one name ({', '.join(names)})")
            columns = [jvm.column(n) for n in names]
            return jvm.project([*columns, diff, jvm.column(carried.time)], new), negated, leaves
        return new, rewritten[0][1], leaves  # Filter, SubqueryAlias: diff and time pass through

    # --- Join order ----------------------------------------------------------------------

    def _ordered(self, tree: _Tree, first: int | None) -> _Tree:
        """`_joins_ordered(tree, first)`, built once for the terms that order it alike: a
        subtree without leaf `first` is ordered as in the full plan."""
        key = (tree, first if first in tree.positions else None)
        if key not in self._orderings:
            self._orderings[key] = _joins_ordered(self.jvm, tree, key[1], self._ordered)
        return self._orderings[key]

    # --- Aggregates ----------------------------------------------------------------------

    def _aggregate(self, top: Any, chain: list[Any]) -> tuple[AggregateShape, Any]:
        jvm = self.jvm
        if kind(top) == "Distinct":
            grouping = items(top.child().output())
            results = grouping
        else:
            grouping = items(top.groupingExpressions())
            results = items(top.aggregateExpressions())
        for expression in [*grouping, *results, *(e for above in chain for e in items(above.expressions()))]:
            _check_expression(expression)
        aggregates: list[Any] = []
        for result in results:
            _collect_aggregates(result, aggregates)
        arguments: list[Any] = []
        calls = tuple(_call(aggregate, arguments) for aggregate in aggregates)

        def pre(child: Any, carried: _Carried) -> Any:
            columns = [jvm.alias(g, f"__k{i}") for i, g in enumerate(grouping)]
            columns += [jvm.alias(a, f"__x{i}") for i, a in enumerate(arguments)]
            return jvm.project([*columns, *carried.named(jvm)], child)

        substituted = [self._substitute(result, grouping, aggregates, top=True) for result in results]
        if self.stage:
            substituted = [jvm.alias(result.child(), result.name()) if kind(result) == "Alias" else result for result in substituted]
        groups = jvm.project(substituted, jvm.relation(ACC_VIEW))
        carried = [jvm.column(DIFF), jvm.column(TIME)]
        node = jvm.project([*substituted, *carried], jvm.relation(ACC_VIEW))
        for above in reversed(chain):  # Projects and Filters over the aggregate, innermost first
            if kind(above) == "Project":
                node = jvm.project([*items(above.projectList()), *carried], node)
            else:
                node = above.withNewChildren(jvm.seq([node]))
        outputs = [*items((chain[0] if chain else top).output()), *carried]
        shape = AggregateShape(
            keys=len(grouping),
            arguments=tuple(a.dataType().sql() for a in arguments),
            key_types=tuple(g.dataType().sql() for g in grouping),
            calls=calls,
            grouped=bool(grouping) or kind(top) == "Distinct",
            post=node if self.stage else jvm.project(outputs, node),  # a stage has no chain: node is in output order
        )
        return shape, pre, groups

    def _ranked(self, node: Any, groups: Any) -> Any:
        """The ranked query `node` with its aggregate replaced by `groups` (the aggregate's
        output read off `__acc`) and every sort's ties broken by all the columns it sees."""
        name = kind(node)
        if name in ("Aggregate", "Distinct"):
            return groups
        child = self._ranked(node.child(), groups)
        if name != "Sort":
            return node.withNewChildren(self.jvm.seq([child]))
        return self.jvm.logical.Sort(self.jvm.seq(self._total_order(node)), getattr(node, "global")(), child, node.hint())

    def _ranked_timed(self, analyzed: Any, groups: Any, shape: AggregateShape) -> Any:
        """The ranked query `analyzed` ranked at each time at once: over `__acc` holding,
        per time (`_time`), every candidate group's row at that time, the first n rows
        of each time in the query's order (ties broken as `_ranked` breaks them), with
        their `_time` and the `__acc` row each came from (`__accrow`, a struct of its
        `__k*` and `__a*`). The sort and limit become a row number per time and a
        filter on it; projections and filters carry `_time`, `__accrow` (and the row
        number) along."""
        jvm = self.jvm
        names = [*(f"__k{i}" for i in range(shape.keys)), *(f"__a{i}" for i in range(len(shape.calls)))]
        fields = ", ".join(f"'{n}', `{n}`" for n in names)
        accrow = jvm.alias(jvm.expression(f"named_struct({fields})"), ACCROW)

        def rewritten(node: Any) -> tuple[Any, bool]:
            """`node` over the timed candidates, and whether it carries the row number."""
            name = kind(node)
            if name in ("Aggregate", "Distinct"):
                return jvm.project([*items(groups.projectList()), jvm.column(TIME), accrow], groups.child()), False
            child, numbered = rewritten(node.child())
            if name == "Project":
                carried = [jvm.column(TIME), jvm.column(ACCROW), *([jvm.column(_RANK)] if numbered else [])]
                return jvm.project([*items(node.projectList()), *carried], child), numbered
            if name == "Sort":
                expressions = jvm.expressions
                spec = expressions.WindowSpecDefinition(
                    jvm.seq([jvm.column(TIME)]), jvm.seq(self._total_order(node)), static_member(f"{_EXPRESSIONS}.UnspecifiedFrame$.MODULE$")
                )
                rank = jvm.alias(expressions.WindowExpression(expressions.RowNumber(), spec), _RANK)
                return jvm.project([*items(node.child().output()), jvm.column(TIME), jvm.column(ACCROW), rank], child), True
            if name == "LocalLimit":
                return jvm.filter(jvm.expressions.LessThanOrEqual(jvm.column(_RANK), node.limitExpr()), child), numbered
            if name == "GlobalLimit":
                return child, numbered
            return node.withNewChildren(jvm.seq([child])), numbered  # Filter, SubqueryAlias

        node, _ = rewritten(analyzed)
        return jvm.project([*items(analyzed.output()), jvm.column(TIME), jvm.column(ACCROW)], node)

    def _total_order(self, sort: Any) -> list[Any]:
        """`sort`'s order with its ties broken by every column it sees, ascending: which
        rows make a limit's cut is then a function of the rows alone."""
        ties = []
        for attribute in items(sort.child().output()):
            if not self.jvm.expressions.RowOrdering.isOrderable(attribute.dataType()):
                raise NotIncremental(f"ORDER BY ... LIMIT over column {attribute.name()} of type {attribute.dataType().sql()}, which cannot break ties")
            ties.append(self.jvm.ascending(attribute))
        return [*items(sort.order()), *ties]

    def _substitute(self, expression: Any, grouping: list[Any], aggregates: list[Any], *, top: bool = False) -> Any:
        """`expression` over the accumulator view: grouping expressions become `__k<i>`,
        aggregates `__a<j>`. A top-level result keeps its name and exprId."""
        jvm = self.jvm
        if top and kind(expression) == "Alias":
            return expression.withNewChildren(jvm.seq([self._substitute(expression.child(), grouping, aggregates)]))
        for i, key in enumerate(grouping):
            if expression.semanticEquals(key):
                replacement = jvm.column(f"__k{i}")
                return jvm.alias(replacement, expression.name(), expression.exprId()) if top else replacement
        if kind(expression) == "AggregateExpression":
            position = next(j for j, a in enumerate(aggregates) if a.semanticEquals(expression))
            return jvm.column(f"__a{position}")
        if top:  # an output that is neither a key nor an alias: Spark never produces one
            raise NotIncremental(f"output {expression.sql()} is not a grouping key or a named expression")
        parts = children(expression)
        if not parts:
            return expression
        return expression.withNewChildren(jvm.seq(self._substitute(p, grouping, aggregates) for p in parts))


_RANK = "__rank"  # a ranked query's row number within its time
_EXPRESSIONS = "org.apache.spark.sql.catalyst.expressions"


@dataclass(frozen=True, slots=True)
class _Carried:
    """The two columns a rewritten node carries beside its own: its rows' multiplicity
    and the time each row exists from (names and exprIds, fresh per leaf and join)."""

    diff: str
    diff_id: Any
    time: str
    time_id: Any

    @staticmethod
    def fresh(jvm: Jvm, *, time: str | None = None) -> _Carried:
        """New columns (or a new diff beside the existing `time`, which passes through)."""
        diff_id = jvm.expressions.NamedExpression.newExprId()
        time_id = jvm.expressions.NamedExpression.newExprId() if time is None else None
        return _Carried(f"__d{diff_id.id()}", diff_id, time or f"__t{time_id.id()}", time_id)

    def aliased(self, jvm: Jvm, diff: Any, time: Any) -> list[Any]:
        """`diff` and `time` as these columns (a node that computes both)."""
        return [jvm.alias(diff, self.diff, self.diff_id), jvm.alias(time, self.time, self.time_id)]

    def columns(self, jvm: Jvm) -> list[Any]:
        """References to both (a projection passing them along)."""
        return [jvm.column(self.diff), jvm.column(self.time)]

    def named(self, jvm: Jvm) -> list[Any]:
        """Both as `_diff` and `_time` (the top of a template)."""
        return [jvm.alias(jvm.column(self.diff), DIFF), jvm.alias(jvm.column(self.time), TIME)]


def _strip_chain(plan: Any) -> tuple[list[Any], Any]:
    """The Projects, Filters and aliases above the first other node (Sorts dropped), and
    that node."""
    chain = []
    node = plan
    while kind(node) in ("Project", "Filter", "SubqueryAlias", "Sort"):
        if kind(node) != "Sort":
            chain.append(node)
        node = node.child()
    return chain, node


def _ranked_aggregate(plan: Any) -> Any:
    """The aggregate of `plan` when the query ranks an aggregate's rows (projections,
    filters, an ORDER BY and one LIMIT over it), else NotIncremental."""
    node, limits, sorted_ = plan, 0, False
    while kind(node) in ("Project", "Filter", "SubqueryAlias", "Sort", "GlobalLimit", "LocalLimit"):
        limits += kind(node) == "GlobalLimit"
        # A SORT BY orders each partition alone: the rows it keeps depend on partitioning.
        sorted_ = sorted_ or (limits > 0 and kind(node) == "Sort" and getattr(node, "global")())
        for expression in items(node.expressions()):
            _check_expression(expression)
        node = node.child()
    if kind(node) == "Offset":
        raise NotIncremental("OFFSET")
    if kind(node) not in ("Aggregate", "Distinct"):
        raise NotIncremental("LIMIT over rows that are not an aggregate's")
    if limits > 1:
        raise NotIncremental("LIMIT over a LIMIT")
    if not sorted_:
        raise NotIncremental("LIMIT without ORDER BY")
    return node


def _describe_unsupported(node: Any) -> str:
    name = kind(node)
    reasons = {
        "GlobalLimit": "LIMIT",
        "LocalLimit": "LIMIT",
        "Offset": "OFFSET",
        "Window": "a window function",
        "WithCTE": "a WITH clause (common table expression)",
        "Expand": "GROUPING SETS, ROLLUP or CUBE",
        "Generate": "a generator (explode, ...)",
        "Intersect": "INTERSECT",
        "Except": "EXCEPT",
        "Deduplicate": "dropDuplicates",
    }
    return reasons.get(name, f"the plan node {name}")


def _check_expression(expression: Any) -> None:
    stack = [expression]
    while stack:
        node = stack.pop()
        name = kind(node)
        if name in _SUBQUERY_EXPRESSIONS:
            raise NotIncremental(f"a subquery ({node.sql()})")
        if name == "OuterReference":  # left by a correlation the rewrite did not join
            raise NotIncremental(f"a correlated subquery ({node.sql()})")
        if name == "WindowExpression":
            raise NotIncremental("a window function")
        stack.extend(children(node))


def _collect_aggregates(expression: Any, found: list[Any]) -> None:
    if kind(expression) == "AggregateExpression":
        if not any(expression.semanticEquals(f) for f in found):
            found.append(expression)
        return
    for child in children(expression):
        _collect_aggregates(child, found)


def _argument(expression: Any, arguments: list[Any]) -> int:
    for i, known in enumerate(arguments):
        if known.semanticEquals(expression):
            return i
    arguments.append(expression)
    return len(arguments) - 1


def _call(aggregate: Any, arguments: list[Any]) -> AggregateCall:
    """The accumulator form of one aggregate, or NotIncremental."""
    function = aggregate.aggregateFunction()
    name = kind(function)
    text = aggregate.sql()
    if option(aggregate.filter()) is not None:
        raise NotIncremental(f"an aggregate with a FILTER clause ({text})")
    result_type = aggregate.dataType().sql()
    parts = children(function)
    if name == "Count":
        if aggregate.isDistinct():
            if len(parts) != 1:
                raise NotIncremental(f"COUNT(DISTINCT ...) of several columns ({text})")
            return AggregateCall("count_distinct", _argument(parts[0], arguments), parts[0].dataType().sql(), result_type)
        if all(p.foldable() and p.nullable() is False for p in parts):
            return AggregateCall("count_rows", None, None, result_type)
        if len(parts) != 1:
            raise NotIncremental(f"COUNT of several columns ({text})")
        return AggregateCall("count", _argument(parts[0], arguments), parts[0].dataType().sql(), result_type)
    if name in ("Min", "Max"):
        return AggregateCall(name.lower(), _argument(parts[0], arguments), parts[0].dataType().sql(), result_type)
    if name in ("Sum", "Average"):
        if aggregate.isDistinct():
            raise NotIncremental(f"{name.upper()}(DISTINCT ...) ({text})")
        argument = function.child()
        input_type = argument.dataType().sql()
        if not (input_type in _INTEGRAL or input_type in _FLOATING or _decimal_precision(input_type) is not None):
            raise NotIncremental(f"{text}: sums of {input_type} are not maintained incrementally")
        function_name = "sum" if name == "Sum" else "avg"
        return AggregateCall(function_name, _argument(argument, arguments), input_type, result_type)
    raise NotIncremental(f"the aggregate {function.prettyName()} ({text})")


def _decimal_precision(spark_type: str) -> int | None:
    if not spark_type.startswith("DECIMAL("):
        return None
    return int(spark_type[len("DECIMAL(") :].split(",")[0])
