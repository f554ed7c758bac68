"""Subqueries, semi-joins and null-rejected outer joins rewritten as inner joins with
stages (`_as_inner_joins`), so that the delta-plan builder sees an SPJ tree: Spark's own
optimizer rules first, then ours (semi-joins as joins with a `DISTINCT` of the keys, one
`<>` as the least and greatest value per key, anti-joins as key stages or negated
branches, scalar subqueries over a global aggregate as cross joins). Reads and builds
trees only: never a job."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replica_service.dataplane._joins import (
    _attribute_ids,
    _conjunction,
    _conjuncts,
    _passes_columns,
    _reference_ids,
)
from replica_service.dataplane._jvm import Jvm, children, items, kind, option, static_member
from replica_service.dataplane._shapes import (
    _JOIN_TYPES,
    _MAX_SUBQUERY_DEPTH,
    _SUBQUERY_EXPRESSIONS,
    NEGATED,
    NotIncremental,
)


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



def _sides(equality: Any, left: Any, right: Any) -> tuple[Any, Any] | None:
    """(the left side's expression, the right side's) of an equality linking the two."""
    a, b = equality.left(), equality.right()
    for l, r in ((a, b), (b, a)):
        if l.references().subsetOf(left.outputSet()) and r.references().subsetOf(right.outputSet()):
            return l, r
    return None
