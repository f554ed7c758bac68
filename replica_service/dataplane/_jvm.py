"""Small py4j helpers for building and reading Catalyst trees from Python.

Catalyst's case classes are built through their JVM constructors (Scala companions'
`apply` methods are not visible to py4j), Scala collections are converted in one call,
and new expressions are parsed from SQL text by the session's own parser, so the
analyzer resolves them by name like any query's.
"""

from __future__ import annotations

from functools import reduce
from typing import Any, Iterable

from pyspark import SparkContext
from pyspark.sql import DataFrame, SparkSession


class Jvm:
    """The Catalyst constructors and conversions one JVM session needs."""

    def __init__(self, jsession: Any) -> None:
        self.jsession = jsession
        self.expressions = _Classes("org.apache.spark.sql.catalyst.expressions")
        self.logical = _Classes("org.apache.spark.sql.catalyst.plans.logical")
        self.analysis = _Classes("org.apache.spark.sql.catalyst.analysis")
        self.optimizer = _Classes("org.apache.spark.sql.catalyst.optimizer")
        self.option = static_member("scala.Option")
        self._array_list = static_member("java.util.ArrayList")
        self._converters = static_member("scala.jdk.javaapi.CollectionConverters")
        self._parser = jsession.sessionState().sqlParser()
        self._nil, self._none = self.seq(()), self.option.empty()
        self._quoted = self.analysis.UnresolvedAttribute.quoted
        self.inner_join = static_member("org.apache.spark.sql.catalyst.plans.Inner$.MODULE$")

    def seq(self, items: Iterable[Any]) -> Any:
        """A Scala immutable Seq of `items`."""
        array = self._array_list()
        for item in items:
            array.add(item)
        return self._converters.asScala(array).toList()

    def alias(self, child: Any, name: str, expr_id: Any | None = None) -> Any:
        """`child AS name`, with the given ExprId (so that references to it resolve), or
        a fresh one."""
        expressions = self.expressions
        expr_id = expr_id if expr_id is not None else expressions.NamedExpression.newExprId()
        return expressions.Alias(child, name, expr_id, self._nil, self._none, self._nil)

    def null(self, data_type: Any) -> Any:
        """A NULL literal of the Catalyst type `data_type`."""
        return getattr(getattr(self.expressions, "Literal$"), "MODULE$").create(None, data_type)

    def column(self, name: str) -> Any:
        """An unresolved reference to the column `name` (resolved by the analyzer)."""
        return self._quoted(name)

    def expression(self, sql: str) -> Any:
        """A new (unresolved) expression from SQL text."""
        return self._parser.parseExpression(sql)

    def relation(self, view: str) -> Any:
        """An unresolved reference to the temp view `view`."""
        options = static_member("org.apache.spark.sql.util.CaseInsensitiveStringMap.empty")()
        return self.analysis.UnresolvedRelation(self.seq([view]), options, False)

    def ascending(self, child: Any) -> Any:
        """`child ASC NULLS FIRST`, Spark's default order."""
        expressions = self.expressions
        direction = getattr(getattr(expressions, "Ascending$"), "MODULE$")
        nulls = getattr(getattr(expressions, "NullsFirst$"), "MODULE$")
        return expressions.SortOrder(child, direction, nulls, self.seq(()))

    def project(self, items: Iterable[Any], child: Any) -> Any:
        return self.logical.Project(self.seq(items), child)

    def filter(self, condition: Any, child: Any) -> Any:
        return self.logical.Filter(condition, child)

    def dataframe_jdf(self, plan: Any) -> Any:
        """The Dataset of `plan`, analyzed now (errors surface here, before any job)."""
        return static_member(_OF_ROWS)(self.jsession, plan)


class _Classes:
    """A JVM package's classes as attributes (`expressions.Alias`), each looked up once
    per gateway (`static_member`)."""

    def __init__(self, package: str) -> None:
        self._package = package

    def __getattr__(self, name: str) -> Any:
        return static_member(f"{self._package}.{name}")


def in_session(frame: DataFrame, session: SparkSession) -> DataFrame:
    """`frame`'s plan as a DataFrame of `session`, so that temp views registered from it
    land in that session. Persisted data is shared by the whole context: the plan finds
    its cached data in any session."""
    if frame.sparkSession is session:
        return frame
    logical = frame._jdf.queryExecution().logical()
    return DataFrame(static_member(_OF_ROWS)(session._jsparkSession, logical), session)


LONG_MAX = (1 << 63) - 1


def bounded_statistics(checkpointed: DataFrame) -> DataFrame:
    """`checkpointed` (a frame on one `LogicalRDD`, as `localCheckpoint` returns it),
    its data, partitioning and ordering the same, but a size estimate past `LONG_MAX`
    bytes replaced by Spark's own for a size it does not know (`LONG_MAX`): an estimate
    that large decides nothing a `LONG_MAX` one would not (no broadcast, no local hash
    map), and one within it is kept.

    A checkpoint keeps the estimate of the plan it computed, and the estimate of a join
    is the product of its sides': a state checkpointed at every step from a plan over
    the one before grew by a factor at every step, without bound. After a few thousand
    steps the planner's multiplications of those numbers (`SizeInBytesOnlyStatsPlanVisitor`,
    in BigInteger arithmetic on numbers of thousands of digits) took most of a step's
    time (a JFR profile of a replica under 10 appends/s: 97% of its samples)."""
    plan = checkpointed._jdf.logicalPlan()
    stats = plan.computeStats()
    rows = stats.rowCount()
    if stats.sizeInBytes() <= LONG_MAX and (not rows.isDefined() or rows.get() <= LONG_MAX):  # Python ints through py4j
        return checkpointed
    option = static_member("scala.Option")
    session = checkpointed._jdf.sparkSession()
    copied = plan.copy(
        plan.output(), plan.rdd(), plan.outputPartitioning(), plan.outputOrdering(), plan.isStreaming(), plan.stream(),
        session, option.empty(), option.apply(plan.constraints()), plan.isCheckpointedInput(),
    )
    return DataFrame(static_member(_OF_ROWS)(session, copied), checkpointed.sparkSession)


def items(scala_seq: Any) -> list[Any]:
    """The elements of a Scala Seq."""
    return [scala_seq.apply(i) for i in range(scala_seq.size())]


def children(node: Any) -> list[Any]:
    return items(node.children())


def option(scala_option: Any) -> Any | None:
    return scala_option.get() if scala_option.isDefined() else None


def kind(node: Any) -> str:
    """A tree node's class name, e.g. `Project` or `AggregateExpression`: that of
    `node.getClass().getSimpleName()`, in one round trip instead of three (the Class
    proxy's, its name's, and the proxy's release)."""
    return static_member("org.apache.commons.lang3.ClassUtils.getSimpleName")(node)


_OF_ROWS = "org.apache.spark.sql.classic.Dataset.ofRows"


def static_member(name: str) -> Any:
    """The JVM's static method (or field) of that full name, looked up once per gateway.

    py4j asks the JVM at every step of a dotted name, and for each package on the way it
    first tries it as a class, which searches every jar of Spark's class path: a walk
    like `jvm.org.apache.spark.sql.classic.Dataset.ofRows` costs seven round trips and
    five such searches (about 1.3 ms on `local[2]`)."""
    global _MEMBERS_GATEWAY
    gateway = SparkContext._gateway
    if _MEMBERS_GATEWAY is not gateway:  # a restarted context: the old proxies are dead
        _MEMBERS.clear()
        _MEMBERS_GATEWAY = gateway
    member = _MEMBERS.get(name)
    if member is None:
        member = _MEMBERS[name] = reduce(getattr, name.split("."), SparkContext._jvm)
    return member


_MEMBERS: dict[str, Any] = {}
_MEMBERS_GATEWAY: Any = None
