"""Orders that decide which rows a query keeps: `LIMIT` and `OFFSET` (DESIGN section 7,
"Determinism").

A limit keeps the first rows of an order, so its result is a function of the inputs
alone only when that order is total. Rules:
- A limit or offset with no `ORDER BY` under it (through projections, filters and
  aliases) keeps whichever rows Spark reads first, which depends on how files and
  partitions fall on each replica: the planner refuses it (`unordered_limit`). A
  `SORT BY` orders each partition alone, so it counts as no order.
- An `ORDER BY` under a limit that ties is completed by every column its input has,
  ascending (`complete_orders`), so a tie at the cut keeps the same rows on every
  replica, whatever the batches compaction merged. Rows that tie on every column are
  the same row. The incremental path breaks ties of ranked aggregates the same way
  (`_plan._Builder._ranked`).
- Only the query's own plan is completed, not a subquery expression's (an `IN`, an
  `EXISTS`, a scalar subquery), whose plan py4j cannot replace: the planner refuses a
  limit there (`unordered_limit`).
"""

from __future__ import annotations

from typing import Any

from replica_service.dataplane._jvm import Jvm, items, kind, static_member

_LIMITS = ("GlobalLimit", "LocalLimit", "Offset", "Tail")
_PASSING = ("Project", "Filter", "SubqueryAlias")  # keep the order of the rows below them


def unordered_limit(plan: Any) -> str | None:
    """Why the analyzed `plan` keeps rows replicas could pick differently, or None: a
    limit or offset without an `ORDER BY` under it, one inside a subquery expression,
    or an order whose input has a column that cannot break ties (a map)."""
    stack = [(plan, False)]
    while stack:
        node, in_expression = stack.pop()
        name = kind(node)
        if name in _LIMITS:
            if in_expression:
                return (
                    f"{_clause(name)} inside a subquery expression (IN, EXISTS or a scalar "
                    "subquery): its ties cannot be broken alike on every replica; move the "
                    "subquery into the FROM clause"
                )
            order = _order_below(node)
            if order is None:
                return (
                    f"{_clause(name)} without ORDER BY is nondeterministic: it keeps whichever rows "
                    "Spark reads first, which differ between replicas; add an ORDER BY (ties are "
                    "broken by every column)" + ("" if name == "Offset" else "; TABLESAMPLE (n ROWS) is such a LIMIT")
                )
            unorderable = _unorderable_column(order)
            if unorderable is not None:
                return unorderable
        for top in items(node.expressions()):
            stack.extend((p, True) for p in _subquery_plans(top))
        stack.extend((child, in_expression) for child in items(node.children()))
    return None


def has_limit(plan: Any) -> bool:
    """True when the query's own plan keeps only some rows of an order."""
    stack = [plan]
    while stack:
        node = stack.pop()
        if kind(node) in _LIMITS:
            return True
        stack.extend(items(node.children()))
    return False


def complete_orders(jvm: Jvm, plan: Any) -> Any:
    """`plan` with every global `ORDER BY` completed by each column of its input,
    ascending with NULLs first, after the query's own keys."""
    children = [complete_orders(jvm, child) for child in items(plan.children())]
    if children:
        plan = plan.withNewChildren(jvm.seq(children))
    if kind(plan) != "Sort" or not getattr(plan, "global")():
        return plan
    ties = [jvm.ascending(attribute) for attribute in items(plan.child().output())]
    return jvm.logical.Sort(jvm.seq([*items(plan.order()), *ties]), True, plan.child(), plan.hint())


def _order_below(node: Any) -> Any | None:
    """The global Sort that orders the rows `node` (a limit) keeps, if there is one."""
    node = node.child()
    while kind(node) in (*_PASSING, *_LIMITS):
        node = node.child()
    return node if kind(node) == "Sort" and getattr(node, "global")() else None


def _unorderable_column(sort: Any) -> str | None:
    orderable = static_member("org.apache.spark.sql.catalyst.expressions.RowOrdering.isOrderable")
    for attribute in items(sort.child().output()):
        if not orderable(attribute.dataType()):
            return (
                f"ORDER BY ... LIMIT over column {attribute.name()} of type "
                f"{attribute.dataType().sql()}, which cannot break ties: leave it out below the ORDER BY"
            )
    return None


def _subquery_plans(expression: Any) -> list[Any]:
    found, stack = [], [expression]
    while stack:
        e = stack.pop()
        if kind(e) in ("ScalarSubquery", "Exists", "ListQuery", "LateralSubquery"):
            found.append(e.plan())
        stack.extend(items(e.children()))
    return found


def _clause(name: str) -> str:
    return "OFFSET" if name == "Offset" else "LIMIT"
