"""The SPJ tree as the delta-plan builder reads it once over py4j (`_Tree`), its inner
joins ordered left-deep from the input that leads a term (`_joins_ordered`), and the
inputs a stage's term may narrow to the rows that meet its change (`_narrowings`).
Reads and builds trees only: never a job."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from replica_service.dataplane._jvm import Jvm, items, kind, option
from replica_service.dataplane._shapes import _JOIN_TYPES, Narrowing

if TYPE_CHECKING:
    from replica_service.dataplane._shapes import Leaf


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


def _passes_columns(node: Any) -> bool:
    """Whether `node` is a projection of columns as they are."""
    return kind(node) == "Project" and all(kind(a) == "AttributeReference" for a in items(node.projectList()))


def _conjuncts(condition: Any) -> list[Any]:
    if kind(condition) == "And":
        return _conjuncts(condition.left()) + _conjuncts(condition.right())
    return [condition]


def _conjunction(jvm: Jvm, conditions: list[Any]) -> Any:
    result = conditions[0]
    for condition in conditions[1:]:
        result = jvm.expressions.And(result, condition)
    return result
