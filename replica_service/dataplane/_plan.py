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
py4j, so that every row carries its multiplicity (`_diff`): each input occurrence (a
*leaf*) reads a temp view `__leaf<i>` holding the input's updates (user columns plus
`_diff`), projections and filters pass the diff along, and a join multiplies its sides'
diffs. The user's own expressions are kept as Spark analyzed them (same exprIds, same
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
from typing import Any, Callable, Literal, Mapping, Sequence

from py4j.protocol import Py4JError
from pyspark.errors.exceptions.captured import CapturedException

from replica_service.dataplane._jvm import Jvm, children, items, kind, option, static_member

DIFF = "_diff"  # the multiplicity column of storage updates and of every delta
ACC_VIEW = "__acc"  # the accumulators a step evaluates the post-aggregate template over

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

    The SPJ templates output `__k0..` (grouping keys), `__x0..` (aggregate arguments)
    and `_diff`. `post` reads the view `__acc` (columns `__k*`, `__a*` and `_diff`: one
    row per group version, +1 new, -1 old) and gives the query's output plus `_diff`.
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
    `narrowing[i]`, for a stage leaf i: the inputs its term may narrow to the rows that
    can meet its change (`_narrowings`); empty for an input's leaf."""

    leaves: tuple[Leaf, ...]
    full: Any
    terms: tuple[Any, ...]
    aggregate: AggregateShape | None
    output_columns: tuple[str, ...]
    narrowing: tuple[Narrowing, ...]
    ranked: Any | None = None


# Plan nodes the SPJ part may contain, and how each carries the diff.
_SPJ_NODES = {"Project", "Filter", "Join", "SubqueryAlias", "Union", "Sort", "View", "Aggregate", "Distinct"}
_STAGE_NODES = {"Aggregate", "Distinct"}  # below the top of a query: stages
_JOIN_TYPES = {"Inner$", "Cross$"}
_SUBQUERY_EXPRESSIONS = {"ScalarSubquery", "Exists", "ListQuery", "InSubquery", "LateralSubquery"}
_MAX_SUBQUERY_DEPTH = 8
NEGATED = "__negated"  # a SubqueryAlias of this name: its rows count negatively (an anti-join's)
_INTEGRAL = {"TINYINT", "SMALLINT", "INT", "BIGINT"}
_FLOATING = {"FLOAT", "DOUBLE"}


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
    def __init__(self, jvm: Jvm, imports: Mapping[str, str]) -> None:
        self.jvm = jvm
        self.imports = imports
        self.leaves: list[Leaf] = []  # depth first, as `_collect_leaves` numbers them
        self._stages: list[tuple[Any, DeltaPlan]] = []  # (aggregate node, its plan): one per distinct aggregate
        # A subtree is ordered and rewritten once for all the terms that see it alike:
        # (tree, the leaf that leads its joins, or None) and (tree, the term, or None
        # for a tree without a UNION ALL, which every term rewrites alike).
        self._orderings: dict[tuple[_Tree, int | None], _Tree] = {}
        self._rewrites: dict[tuple[_Tree, int | None], tuple[Any, str, frozenset[int]]] = {}

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
        else:
            self._check_spj(analyzed)
            spj, shape, pre, ranked = analyzed, None, None, None
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
        return DeltaPlan(tuple(self.leaves), full, terms, shape, tuple(output), _narrowings(tree, self.leaves), ranked)

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
                stage = _Builder(self.jvm, self.imports).build(node)
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
        branch), topped by the pre-aggregate projection `pre(child, diff)` or by the
        SPJ tree's `outputs` and `_diff`."""
        node, diff, _ = self._rewritten(tree, term)
        if pre is not None:
            return pre(node, diff)
        jvm = self.jvm
        return jvm.project([*outputs, jvm.alias(jvm.column(diff), DIFF)], node)

    def _rewritten(self, tree: _Tree, term: int | None) -> tuple[Any, str, frozenset[int]]:
        # Only a union above the term's leaf is rewritten for that term (see `_rewrite`).
        key = (tree, term if tree.has_union and term in tree.positions else None)
        if key not in self._rewrites:
            self._rewrites[key] = self._rewrite(tree, term)
        return self._rewrites[key]

    def _rewrite(self, tree: _Tree, term: int | None) -> tuple[Any, str, frozenset[int]]:
        """(`tree`'s node carrying its rows' diff in a column, that column's name, the
        leaf positions below it)."""
        jvm = self.jvm
        node, name = tree.node, tree.kind
        if tree.leaf is not None:
            diff_id = jvm.expressions.NamedExpression.newExprId()
            diff = f"__d{diff_id.id()}"
            # An input's columns keep their names; a stage's are read by position.
            columns = [
                jvm.alias(jvm.column(a.name() if name == "View" else f"__c{i}"), a.name(), a.exprId())
                for i, a in enumerate(items(node.output()))
            ]
            leaf = jvm.project([*columns, jvm.alias(jvm.column(DIFF), diff, diff_id)], jvm.relation(f"__leaf{tree.leaf}"))
            return leaf, diff, frozenset([tree.leaf])
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
            return jvm.project([*items(node.projectList()), jvm.column(rewritten[0][1])], rewritten[0][0]), rewritten[0][1], leaves
        new = node.withNewChildren(jvm.seq(r[0] for r in rewritten))
        if name == "Join":
            (_, left, _), (_, right, _) = rewritten
            diff_id = jvm.expressions.NamedExpression.newExprId()
            diff = f"__d{diff_id.id()}"
            product = jvm.alias(jvm.expression(f"`{left}` * `{right}`"), diff, diff_id)
            return jvm.project([*items(node.output()), product], new), diff, leaves
        if name == "SubqueryAlias" and node.alias() == NEGATED:
            diff_id = jvm.expressions.NamedExpression.newExprId()
            diff = f"__d{diff_id.id()}"
            negated = jvm.alias(jvm.expression(f"-`{rewritten[0][1]}`"), diff, diff_id)
            return jvm.project([*items(node.output()), negated], new), diff, leaves
        return new, rewritten[0][1], leaves  # Filter, SubqueryAlias: the diff passes through

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

        def pre(child: Any, diff: str) -> Any:
            columns = [jvm.alias(g, f"__k{i}") for i, g in enumerate(grouping)]
            columns += [jvm.alias(a, f"__x{i}") for i, a in enumerate(arguments)]
            return jvm.project([*columns, jvm.alias(jvm.column(diff), DIFF)], child)

        substituted = [self._substitute(result, grouping, aggregates, top=True) for result in results]
        groups = jvm.project(substituted, jvm.relation(ACC_VIEW))
        node = jvm.project([*substituted, jvm.column(DIFF)], jvm.relation(ACC_VIEW))
        for above in reversed(chain):  # Projects and Filters over the aggregate, innermost first
            if kind(above) == "Project":
                node = jvm.project([*items(above.projectList()), jvm.column(DIFF)], node)
            else:
                node = above.withNewChildren(jvm.seq([node]))
        outputs = [*items((chain[0] if chain else top).output()), jvm.column(DIFF)]
        shape = AggregateShape(
            keys=len(grouping),
            arguments=tuple(a.dataType().sql() for a in arguments),
            key_types=tuple(g.dataType().sql() for g in grouping),
            calls=calls,
            grouped=bool(grouping) or kind(top) == "Distinct",
            post=jvm.project(outputs, node),
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
        ties = []
        for attribute in items(node.child().output()):
            if not self.jvm.expressions.RowOrdering.isOrderable(attribute.dataType()):
                raise NotIncremental(f"ORDER BY ... LIMIT over column {attribute.name()} of type {attribute.dataType().sql()}, which cannot break ties")
            ties.append(self.jvm.ascending(attribute))
        return self.jvm.logical.Sort(self.jvm.seq([*items(node.order()), *ties]), getattr(node, "global")(), child, node.hint())

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


def _as_inner_joins(jvm: Jvm, plan: Any) -> Any:
    """`plan` with its subqueries, semi-joins and null-rejected outer joins as inner
    joins, where Spark's own optimizer rules and the rewrite below can make them so.

    The rules: correlated conditions are pulled up into their subqueries' joins;
    `IN (subquery)` and `EXISTS (subquery)` become semi-joins; a correlated scalar
    subquery becomes an outer join with its aggregate, grouped by the correlated
    columns; filters are pushed down, and an outer join under a filter that rejects
    NULLs on its inner side becomes an inner join (`x < (SELECT avg(..) ...)`; not a
    `COUNT` subquery, which gives 0 for no rows). Each semi-join of L and R on
    `l1 = r1 AND ...` (plus conditions on one side alone) then becomes L joined with
    the DISTINCT (r1, ...) of R's rows that pass R's own conditions, projected to L's
    columns. Exact, multiplicities included: a row of L passes a semi-join once however
    many rows of R match it, and the distinct keys match it at most once. (An `IN` in
    a `WHERE` drops a row whose test is NULL, as a join does.) Without a correlation,
    the distinct rows are one constant row while R has rows: a cross join. An
    anti-join (`NOT EXISTS`) joins a key stage, or becomes L plus the semi-join's rows
    counted negatively (`_existence_joins`). What stays an outer join, a null-aware
    anti-join (`NOT IN`) or a subquery is refused by the shape checks."""
    if not _has_subquery_or_outer_join(plan):
        return plan
    rules = jvm.optimizer
    plan = rules.InlineCTE(True, False, False).apply(plan)  # every CTE inlined (alwaysInline)
    # A subquery's own subqueries join the tree when it does, and their correlations are
    # pulled up only then (Spark's optimizer does it subquery by subquery): a rewrite
    # before that leaves `outer()` references, which the shape checks refuse.
    for _ in range(_MAX_SUBQUERY_DEPTH):
        before = plan
        for rule in ("PullupCorrelatedPredicates", "RewritePredicateSubquery", "PullupCorrelatedPredicates", "RewriteCorrelatedScalarSubquery"):
            plan = getattr(rules, rule).apply(plan)
        if plan.fastEquals(before):
            break
    for rule in ("PushDownPredicates", "EliminateOuterJoin"):
        plan = getattr(rules, rule).apply(plan)
    return _inner_joins(jvm, plan)


def _has_subquery_or_outer_join(plan: Any) -> bool:
    nodes = [plan]
    while nodes:
        node = nodes.pop()
        if kind(node) == "WithCTE" or (kind(node) == "Join" and kind(node.joinType()) not in _JOIN_TYPES):
            return True
        expressions = items(node.expressions())
        while expressions:
            expression = expressions.pop()
            if kind(expression) in _SUBQUERY_EXPRESSIONS:
                return True
            expressions.extend(children(expression))
        nodes.extend(children(node))
    return False


class _Tree:
    """A node of the SPJ tree with what ordering and rewriting ask of it, read over
    py4j once: every JVM call is a round trip, and the tree is rewritten for every
    derivative term (TPC-H q21's delta plan took 8 s to build when each term read the
    JVM's tree afresh). A leaf's subtree is not read: the rewrite replaces it whole.
    Trees compare by identity, so the builder's memos are keyed by them."""

    __slots__ = ("node", "kind", "children", "leaf", "positions", "has_union", "_cluster", "_output_ids")

    def __init__(self, node: Any, kind: str, children: Sequence[_Tree], leaf: int | None, positions: frozenset[int]) -> None:
        self.node, self.kind, self.children = node, kind, tuple(children)
        self.leaf, self.positions = leaf, positions
        self.has_union = kind == "Union" or any(child.has_union for child in self.children)
        self._cluster: tuple[list[_Tree], list[Any], list[set[int]]] | None = None
        self._output_ids: set[int] | None = None

    @classmethod
    def leaf_of(cls, node: Any, kind: str, position: int) -> _Tree:
        return cls(node, kind, (), position, frozenset([position]))

    @classmethod
    def of(cls, node: Any, kind: str, children: Sequence[_Tree]) -> _Tree:
        return cls(node, kind, children, None, frozenset().union(*(child.positions for child in children)))

    def output_ids(self) -> set[int]:
        if self._output_ids is None:
            self._output_ids = _attribute_ids(self.node)
        return self._output_ids

    def cluster(self) -> tuple[list[_Tree], list[Any], list[set[int]]]:
        """The inputs and conjuncts (with the ids of the columns each references) of the
        inner joins at this node, through the filters and column selections between
        them (one input, no condition, if it is no such join); read once."""
        if self._cluster is None:
            self._cluster = _join_cluster(self)
        return self._cluster


def _joins_ordered(jvm: Jvm, tree: _Tree, first: int | None, ordered: Callable[[_Tree, int | None], _Tree]) -> _Tree:
    """`tree` with each cluster of inner joins (with the filters and column selections
    between them) rebuilt left-deep: the input holding leaf `first` (a term's change)
    first, then each time the first input that a condition links to those joined
    already. That is Spark's `ReorderJoin` rule, which the diff columns' projections
    would hide from its optimizer; no cross product the query does not ask for.
    Starting from the change, a term joins a few rows with each input in turn (Spark
    broadcasts the change into the first join, and each later input into the chain,
    if it is small enough: a join's size estimate is the product of its sides'). Inner
    joins commute, so the rows (and their diffs' product) are the same. Subtrees are
    ordered by `ordered` (the builder's memo of this function)."""
    if tree.leaf is not None:
        return tree
    inputs, conditions, references = tree.cluster()
    if len(inputs) < 2:
        below = [ordered(child, first) for child in tree.children]
        if all(new is old for new, old in zip(below, tree.children)):
            return tree
        return _Tree.of(tree.node.withNewChildren(jvm.seq(child.node for child in below)), tree.kind, below)
    inputs = [ordered(i, first) for i in inputs]
    if first is not None:
        inputs.sort(key=lambda i: first not in i.positions)  # stable: the rest keep their order
    outputs = [i.output_ids() for i in inputs]
    joined, available = inputs[0], outputs[0]
    rest = list(range(1, len(inputs)))
    remaining = list(range(len(conditions)))
    while rest:
        linked = [
            i for i in rest
            if any(references[c] and not references[c] <= available and not references[c] <= outputs[i] and references[c] <= available | outputs[i] for c in remaining)
        ]
        nxt = linked[0] if linked else rest[0]
        rest.remove(nxt)
        available = available | outputs[nxt]
        usable = [c for c in remaining if references[c] <= available]
        remaining = [c for c in remaining if c not in usable]
        condition = jvm.option.apply(_conjunction(jvm, [conditions[c] for c in usable]) if usable else None)
        join = jvm.logical.Join(joined.node, inputs[nxt].node, jvm.inner_join, condition, jvm.logical.JoinHint.NONE())
        joined = _Tree.of(join, "Join", [joined, inputs[nxt]])
    if remaining:  # conditions on columns no input has (none, after analysis): kept as they were
        joined = _Tree.of(jvm.filter(_conjunction(jvm, [conditions[c] for c in remaining]), joined.node), "Filter", [joined])
    return _Tree.of(jvm.project(items(tree.node.output()), joined.node), "Project", [joined])


def _narrowings(tree: _Tree, leaves: Sequence[Leaf]) -> tuple[Narrowing, ...]:
    """Per leaf, for a stage's: each input leaf's columns that the SPJ tree's equalities
    (`a = b` of two columns, in an inner join's condition or a filter, taken
    transitively) make equal to one of the stage's columns. A term's row joins rows of
    every leaf that meet all the conditions on their way up, so an input row whose
    columns differ from those of every change row is in no row of the term: the input
    can be narrowed to the rows that match the change's (`IncrementalDataflow._pre`).
    Only a stage's term is narrowed: Spark cannot see that a stage's change is small
    (a checkpoint's size is unknown to it), so it shuffles whole the inputs it joins
    with that change."""
    parent: dict[int, int] = {}

    def find(i: int) -> int:
        while parent.setdefault(i, i) != i:
            i = parent[i] = parent[parent[i]]
        return i

    columns: dict[int, tuple[int, str]] = {}  # a leaf column's id: (its leaf, its name in the leaf's view)
    stack = [tree]
    while stack:
        node = stack.pop()
        if node.leaf is not None:
            for i, a in enumerate(items(node.node.output())):
                columns[a.exprId().id()] = (node.leaf, a.name() if node.kind == "View" else f"__c{i}")
            continue
        condition = None
        if node.kind == "Join" and kind(node.node.joinType()) in _JOIN_TYPES:
            condition = option(node.node.condition())
        elif node.kind == "Filter":
            condition = node.node.condition()
        for conjunct in _conjuncts(condition) if condition is not None else []:
            sides = _equal_columns(conjunct)
            if sides is not None:
                parent[find(sides[0])] = find(sides[1])
        stack.extend(node.children)
    narrowings = []
    for leaf in leaves:
        if leaf.stage is None:
            narrowings.append(())
            continue
        change = {find(i): name for i, (position, name) in columns.items() if position == leaf.position}
        pairs: dict[int, dict[str, str]] = {}
        for i, (position, name) in columns.items():
            if leaves[position].stage is None and find(i) in change:
                pairs.setdefault(position, {}).setdefault(name, change[find(i)])
        narrowings.append(tuple((position, tuple(named.items())) for position, named in sorted(pairs.items())))
    return tuple(narrowings)


def _equal_columns(conjunct: Any) -> tuple[int, int] | None:
    """The ids of the two columns `conjunct` says are equal (`a = b`), if it says so."""
    if kind(conjunct) != "EqualTo":
        return None
    left, right = conjunct.left(), conjunct.right()
    if kind(left) != "AttributeReference" or kind(right) != "AttributeReference":
        return None
    return left.exprId().id(), right.exprId().id()


def _join_cluster(tree: _Tree) -> tuple[list[_Tree], list[Any], list[set[int]]]:
    """`_Tree.cluster`, read over py4j."""
    node, name = tree.node, tree.kind
    if name == "Join" and kind(node.joinType()) in _JOIN_TYPES and _no_hint(node):
        left, right = (child.cluster() for child in tree.children)
        condition = option(node.condition())
        conjuncts = _conjuncts(condition) if condition is not None else []
        return left[0] + right[0], left[1] + right[1] + conjuncts, left[2] + right[2] + [_reference_ids(c) for c in conjuncts]
    if name == "Filter" or _passes_columns(node):
        inputs, conditions, references = tree.children[0].cluster()
        if len(inputs) > 1:
            conjuncts = _conjuncts(node.condition()) if name == "Filter" else []
            return inputs, conditions + conjuncts, references + [_reference_ids(c) for c in conjuncts]
    return [tree], [], []


def _attribute_ids(node: Any) -> set[int]:
    return {a.exprId().id() for a in items(node.output())}


def _reference_ids(expression: Any) -> set[int]:
    return {a.exprId().id() for a in items(expression.references().toSeq())}


def _no_hint(join: Any) -> bool:
    hint = join.hint()
    return not hint.leftHint().isDefined() and not hint.rightHint().isDefined()


def _inner_joins(jvm: Jvm, node: Any) -> Any:
    """`node` with every semi-join and one-row scalar subquery below it as an inner join
    (see `_as_inner_joins`)."""
    if kind(node) == "Join" and kind(node.joinType()) in _EXISTENCE_JOINS:
        return _existence_joins(jvm, node)
    below = children(node)
    if below:
        node = node.withNewChildren(jvm.seq(_inner_joins(jvm, child) for child in below))
    if kind(node) in ("Filter", "Project"):
        return _scalars_joined(jvm, node)
    if kind(node) == "Join" and kind(node.joinType()) == "ExistenceJoin":
        raise NotIncremental("IN or EXISTS (subquery) under OR or NOT, or outside a WHERE")
    return node


_EXISTENCE_JOINS = ("LeftSemi$", "LeftAnti$")


@dataclass(slots=True)
class _Existence:
    """One semi-join (`anti` False) or anti-join of a stack over one left side L: its
    right side R (rewritten), its conditions, and the input of L its keys come from
    unchanged (None: no keys, not one input, or an anti-join with a condition on L
    alone, which a key stage does not express)."""

    node: Any
    anti: bool
    right: Any
    links: _Links
    source: Any | None

    def merges_with(self, other: _Existence) -> bool:
        """Whether the two test the same keys of the same input (one key stage)."""
        mine, theirs = [l for l, _ in self.links.keys], [l for l, _ in other.links.keys]
        return (
            self.source is not None
            and other.source is not None
            and _attribute_ids(self.source) == _attribute_ids(other.source)
            and len(mine) == len(theirs)
            and all(a.semanticEquals(b) for a, b in zip(mine, theirs, strict=True))
        )


def _existence_joins(jvm: Jvm, top: Any) -> Any:
    """The semi-join or anti-join `top`, and those stacked below it on the same left
    side L (through projections of columns), as inner joins.

    Those whose keys come unchanged from one input V of L, the same keys of the same
    V, join L with one *key stage* (`_key_stage`) when there are two or more of them or
    one is an anti-join: TPC-H q21's `EXISTS` and `NOT EXISTS` are one stage of
    `lineitem` grouped by order. The others become what `_semi_join` makes of a
    semi-join, and, of an anti-join, L less the semi-join's rows (a Z-set difference:
    `_rewrite` negates the diff under NEGATED). Semi-joins and anti-joins only drop rows
    of L, so their order does not matter."""
    stacked = []
    node = top
    while True:
        if kind(node) == "Join" and kind(node.joinType()) in _EXISTENCE_JOINS:
            stacked.append(node)
            node = node.left()
        elif _passes_columns(node):
            node = node.child()
        else:
            break
    rows = _inner_joins(jvm, node)
    existences = []
    for join in reversed(stacked):
        anti = kind(join.joinType()) == "LeftAnti$"
        links = _links(join, anti=anti)
        traceable = bool(links.keys) and not (anti and links.on_left)
        source = _input_of(rows, {i for l, _ in links.keys for i in _reference_ids(l)}) if traceable else None
        existences.append(_Existence(join, anti, _inner_joins(jvm, join.right()), links, source))
    groups: list[list[_Existence]] = []
    for existence in existences:
        group = next((g for g in groups if g[0].merges_with(existence)), None)
        if group is None:
            groups.append([existence])
        else:
            group.append(existence)
    columns = items(rows.output())
    for group in groups:
        if (len(group) > 1 or group[0].anti) and group[0].source is not None:
            rows = jvm.project(columns, _key_stage(jvm, rows, group))
            continue
        for existence in group:
            join = existence.node.withNewChildren(jvm.seq([rows, existence.right]))
            if not existence.anti:
                rows = _semi_join(jvm, join)
            else:
                matched = getattr(getattr(jvm.logical, "SubqueryAlias$"), "MODULE$").apply(NEGATED, _semi_join(jvm, join, anti=True))
                rows = jvm.logical.Union(jvm.seq([rows, matched]), False, False)
    return jvm.project(items(top.output()), rows)


def _key_stage(jvm: Jvm, left: Any, group: list[_Existence]) -> Any:
    """`left` (L) inner-joined with one stage that answers every semi-join and anti-join
    of `group`: the same keys, from the same input V of L.

    Per key, the stage has, for each of them, how many rows of its R match it
    (equalities only: `__matches<j>`), or, with one `l <> r` more, their least and
    greatest `r` (`__least<j>`, `__greatest<j>`): rows of R that pass R's own conditions
    and have no NULL key (`=` never matches one). With an anti-join among them, every
    key of V is a group too (V read unfiltered: a superset of L's keys), so that every
    row of L meets exactly one group, through a null-safe equality (a NULL key is a
    group of V's, and matches no row of R). An R that is V's own input filtered, keyed
    by the same columns (q21's), is read off V's rows (`_folded`); any other R is a
    branch of a `UNION ALL` with V's. A row of L is kept once when each test
    holds: a semi-join's, a count above 0 (or an extreme other than `l`, which a NULL
    extreme is not); an anti-join's, a count of 0, or `l`, the least or the greatest
    NULL, or both equal to `l` (the extremes ignore NULLs, as `<>` does). Exact,
    multiplicities included.

    An anti-join was L less the semi-join's rows before (L read twice, each change to
    its inputs two derivative terms): a step of TPC-H q21 took 5.5-5.9 s that way and
    2.9-3.2 s with one key stage for its EXISTS and NOT EXISTS (`bench/RESULTS.md`)."""
    expressions, aggregate = jvm.expressions, jvm.expressions.aggregate
    source = group[0].source
    keys = [l for l, _ in group[0].links.keys]
    values = [jvm.expression("true") if e.links.other is None else e.links.other[1] for e in group]
    nulls = [jvm.alias(jvm.null(v.dataType()), f"__sr{j}") for j, v in enumerate(values)]
    # A subquery over V's own input, keyed by the same columns, is read off V's branch:
    # its value where its conditions hold, NULL elsewhere (one scan, no union).
    folded = {j: _folded(jvm, e, values[j], source, keys) for j, e in enumerate(group)}
    folded = {j: value for j, value in folded.items() if value is not None}
    branches = []
    if folded or any(e.anti for e in group):
        own = [jvm.alias(folded[j], f"__sr{j}") if j in folded else null for j, null in enumerate(nulls)]
        branches.append(jvm.project([*(jvm.alias(l, f"__sk{i}") for i, l in enumerate(keys)), *own], source))
    for j, existence in enumerate(group):
        if j in folded:
            continue
        links = existence.links
        matching = jvm.filter(_conjunction(jvm, [*links.on_right, *(expressions.IsNotNull(r) for _, r in links.keys)]), existence.right)
        own = [jvm.alias(values[j], f"__sr{j}") if i == j else null for i, null in enumerate(nulls)]
        branches.append(jvm.project([*(jvm.alias(r, f"__sk{i}") for i, (_, r) in enumerate(links.keys)), *own], matching))
    rows = branches[0] if len(branches) == 1 else jvm.logical.Union(jvm.seq(branches), False, False)
    output = items(rows.output())
    grouping, slots = output[: len(keys)], output[len(keys) :]
    tests, found = [], []
    for j, (existence, slot) in enumerate(zip(group, slots, strict=True)):
        links = existence.links
        if links.other is None:
            (matches,) = counts = [jvm.alias(_aggregate(jvm, aggregate.Count(jvm.seq([slot]))), f"__matches{j}")]
            test = expressions.EqualTo(matches.toAttribute(), jvm.expression("0L"))
            if not existence.anti:
                test = expressions.Not(test)
        else:
            counts = [jvm.alias(_aggregate(jvm, function(slot)), f"{name}{j}") for function, name in ((aggregate.Min, "__least"), (aggregate.Max, "__greatest"))]
            l, (least, greatest) = links.other[0], (c.toAttribute() for c in counts)
            if existence.anti:
                unmatched = expressions.And(expressions.EqualTo(least, l), expressions.EqualTo(greatest, l))
                test = expressions.Or(expressions.Or(expressions.IsNull(l), expressions.IsNull(least)), unmatched)
            else:
                test = expressions.Or(expressions.Not(expressions.EqualTo(least, l)), expressions.Not(expressions.EqualTo(greatest, l)))
        found.extend(counts)
        tests.extend([*links.on_left, test])  # an anti-join here has no condition on L alone
    groups = jvm.logical.Aggregate(jvm.seq(grouping), jvm.seq([*grouping, *found]), rows, jvm.option.empty())
    linked = [expressions.EqualNullSafe(l, key) for l, key in zip(keys, grouping, strict=True)]
    condition = jvm.option.apply(_conjunction(jvm, [*linked, *tests]))
    return jvm.logical.Join(left, groups, jvm.inner_join, condition, jvm.logical.JoinHint.NONE())


def _folded(jvm: Jvm, existence: _Existence, value: Any, source: Any, keys: list[Any]) -> Any | None:
    """`existence`'s value (`value`, over its R) as an expression over the input V
    (`source`), NULL where R's conditions or a key's `IS NOT NULL` fail; or None unless
    R is V's input filtered (filters, aliases and projections of columns over a view of
    the same table) and its keys are the same columns as L's (`keys`, V's columns).
    Catalyst rewrites R's columns into V's (`rewriteAttrs`)."""
    conditions = list(existence.links.on_right)
    node = existence.right
    while (name := kind(node)) != "View":
        if name == "Filter":
            conditions.append(node.condition())
        elif not (name == "SubqueryAlias" or _passes_columns(node)):
            return None
        node = node.child()
    if not node.desc().identifier().equals(source.desc().identifier()):
        return None
    theirs, ours = items(node.output()), items(source.output())
    their_positions, our_positions = ({a.exprId().id(): i for i, a in enumerate(side)} for side in (theirs, ours))
    for l, (_, r) in zip(keys, existence.links.keys, strict=True):
        if kind(l) != "AttributeReference" or kind(r) != "AttributeReference":
            return None
        if their_positions.get(r.exprId().id()) != our_positions.get(l.exprId().id()):
            return None
    expressions = jvm.expressions
    pairs = jvm.seq(static_member("scala.Tuple2")(mine, other) for mine, other in zip(theirs, ours, strict=True))
    columns = getattr(getattr(expressions, "AttributeMap$"), "MODULE$").apply(pairs)
    probe = jvm.project([jvm.alias(value, "__value"), *(jvm.alias(c, "__test") for c in conditions)], node)
    value, *conditions = (a.child() for a in items(probe.rewriteAttrs(columns).projectList()))
    tests = _conjunction(jvm, [*conditions, *(expressions.IsNotNull(l) for l in keys)])
    return expressions.If(tests, value, jvm.null(value.dataType()))


def _passes_columns(node: Any) -> bool:
    """Whether `node` is a projection of columns as they are."""
    return kind(node) == "Project" and all(kind(a) == "AttributeReference" for a in items(node.projectList()))


@dataclass(slots=True)
class _Links:
    """The conditions of a semi-join (or anti-join) of L and R: those on L alone, on R
    alone, the equalities linking them (as (L's expression, R's)), and one `l <> r`."""

    on_left: list[Any]
    on_right: list[Any]
    keys: list[tuple[Any, Any]]
    other: tuple[Any, Any] | None


def _links(node: Any, *, anti: bool) -> _Links:
    """The semi-join (or anti-join) `node`'s conditions, or NotIncremental naming one
    that is neither an equality linking the sides, one `<>`, nor a side's own."""
    left, right = node.left(), node.right()
    links = _Links([], [], [], None)
    condition = option(node.condition())
    for conjunct in _conjuncts(condition) if condition is not None else []:
        references = conjunct.references()
        if references.subsetOf(left.outputSet()):
            links.on_left.append(conjunct)
        elif references.subsetOf(right.outputSet()):
            links.on_right.append(conjunct)
        elif kind(conjunct) == "EqualTo" and _sides(conjunct, left, right) is not None:
            links.keys.append(_sides(conjunct, left, right))
        elif links.other is None and kind(conjunct) == "Not" and kind(conjunct.child()) == "EqualTo" and _sides(conjunct.child(), left, right) is not None:
            links.other = _sides(conjunct.child(), left, right)
        elif anti and kind(conjunct) == "Or" and kind(conjunct.right()) == "IsNull":  # `l = r OR isnull(l = r)`
            raise NotIncremental("NOT IN (subquery), a null-aware anti-join (NOT EXISTS is maintained incrementally)")
        else:
            raise NotIncremental(
                f"a subquery or semi-join linked by {conjunct.sql()} (only equalities, and one <>, are maintained incrementally)"
            )
    return links


def _semi_join(jvm: Jvm, node: Any, *, anti: bool = False) -> Any:
    """The rows of the semi-join (or anti-join) `node`'s left side L that have a match in
    its right side R, as an inner join (see `_as_inner_joins`).

    With equalities only, L joins the DISTINCT keys of R. One condition `l <> r` more
    (TPC-H q21: another supplier of the same order) is answered by R's least and
    greatest `r` per key instead: some row of the key has an `r` other than a non-NULL
    `l` exactly when the least or the greatest differs from it (both ignore NULLs, as
    `<>` does)."""
    left, right = node.left(), node.right()
    links = _links(node, anti=anti)
    on_left, on_right, keys, other = links.on_left, links.on_right, links.keys, links.other
    expressions = jvm.expressions
    if on_right:
        right = jvm.filter(_conjunction(jvm, on_right), right)
    grouping = [jvm.alias(r, f"__sk{i}") for i, (_, r) in enumerate(keys)] or [jvm.alias(jvm.expression("true"), "__sk0")]
    linked = [expressions.EqualTo(l, key.toAttribute()) for (l, _), key in zip(keys, grouping)]
    if other is None:
        matches = jvm.logical.Distinct(jvm.project(grouping, right))
    else:
        l, r = other
        keyed = jvm.project([*grouping, jvm.alias(r, "__sr")], right)
        value = keyed.output().last()
        extremes = [jvm.alias(_aggregate(jvm, function(value)), name) for function, name in ((expressions.aggregate.Min, "__least"), (expressions.aggregate.Max, "__greatest"))]
        attributes = [a.toAttribute() for a in grouping]
        matches = jvm.logical.Aggregate(jvm.seq(attributes), jvm.seq([*attributes, *extremes]), keyed, jvm.option.empty())
        least, greatest = (e.toAttribute() for e in extremes)
        linked.append(expressions.Or(expressions.Not(expressions.EqualTo(least, l)), expressions.Not(expressions.EqualTo(greatest, l))))
    condition = jvm.option.apply(_conjunction(jvm, [*on_left, *linked]) if on_left or linked else None)
    join = jvm.logical.Join(left, matches, jvm.inner_join, condition, node.hint())
    return jvm.project(items(node.output()), join)


def _input_of(node: Any, ids: set[int]) -> Any | None:
    """The input (a View) of `node` that the attributes `ids` all come from unchanged,
    through projections that pass them on, filters, aliases and inner joins; or None."""
    while kind(node) != "View":
        name = kind(node)
        if name == "Project":
            passed = {a.exprId().id() for a in items(node.projectList()) if kind(a) == "AttributeReference"}
            if not ids <= passed:
                return None
            node = node.child()
        elif name in ("Filter", "SubqueryAlias"):
            node = node.child()
        elif name == "Join" and kind(node.joinType()) in _JOIN_TYPES:
            side = next((s for s in (node.left(), node.right()) if ids <= _attribute_ids(s)), None)
            if side is None:
                return None
            node = side
        else:
            return None
    return node


def _aggregate(jvm: Jvm, function: Any) -> Any:
    """`function` as a (complete, not distinct) aggregate expression."""
    aggregate = jvm.expressions.aggregate
    complete = getattr(getattr(aggregate, "Complete$"), "MODULE$")
    return aggregate.AggregateExpression(function, complete, False, jvm.option.empty(), jvm.expressions.NamedExpression.newExprId())


def _scalars_joined(jvm: Jvm, node: Any) -> Any:
    """The Filter or Project `node` with each uncorrelated scalar subquery over a global
    aggregate read off a cross join with that aggregate, projected to `node`'s columns."""
    scalars: list[Any] = []
    expressions = [_scalars_replaced(jvm, e, scalars) for e in items(node.expressions())]
    if not scalars:
        return node
    joined = node.child()
    for scalar in scalars:
        joined = jvm.logical.Join(joined, scalar.plan(), jvm.inner_join, jvm.option.empty(), jvm.logical.JoinHint.NONE())
    if kind(node) == "Project":
        return jvm.project(expressions, joined)
    return jvm.project(items(node.output()), jvm.filter(expressions[0], joined))


def _scalars_replaced(jvm: Jvm, expression: Any, scalars: list[Any]) -> Any:
    """`expression` with each one-row scalar subquery replaced by its plan's column
    (the subqueries found appended to `scalars`)."""
    if kind(expression) == "ScalarSubquery" and items(expression.outerAttrs()) == [] and _one_row(expression.plan()):
        if not any(known.exprId().equals(expression.exprId()) for known in scalars):  # joined once
            scalars.append(expression)
        return expression.plan().output().apply(0)
    parts = children(expression)
    if not parts:
        return expression
    return expression.withNewChildren(jvm.seq(_scalars_replaced(jvm, part, scalars) for part in parts))


def _one_row(plan: Any) -> bool:
    """True when `plan` always has exactly one row: projections of a global aggregate."""
    while kind(plan) in ("Project", "SubqueryAlias"):
        plan = plan.child()
    return kind(plan) == "Aggregate" and plan.groupingExpressions().isEmpty()


def _conjuncts(condition: Any) -> list[Any]:
    if kind(condition) == "And":
        return _conjuncts(condition.left()) + _conjuncts(condition.right())
    return [condition]


def _conjunction(jvm: Jvm, conditions: list[Any]) -> Any:
    result = conditions[0]
    for condition in conditions[1:]:
        result = jvm.expressions.And(result, condition)
    return result


def _sides(equality: Any, left: Any, right: Any) -> tuple[Any, Any] | None:
    """(the left side's expression, the right side's) of an equality linking the two."""
    a, b = equality.left(), equality.right()
    for l, r in ((a, b), (b, a)):
        if l.references().subsetOf(left.outputSet()) and r.references().subsetOf(right.outputSet()):
            return l, r
    return None


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
