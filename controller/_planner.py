"""The controller's planner: a small local SparkSession that analyzes dataflow SQL.

Before a dataflow enters an instance's history (DESIGN section 6, "Planning") the
controller asks the planner three things, and nothing is written until all are answered:
- `referenced_tables(sql)`: the names the query reads (parse only), so the controller can
  resolve them to collection ids;
- `analyze(sql, tables)`: the output schema, derived by Spark's analyzer over EMPTY temp
  views of the inputs' schemas, checked to be a storage schema, and a refusal of any SQL
  that two replicas could evaluate differently;
- `check_index_key(planned, key)`: the index key names output columns.

Rules of this module:
- Analysis only, never a Spark job: the SQL must parse as one query (`parseQuery`: no
  DDL, DML, SET or EXPLAIN, which `session.sql` would run eagerly), it is analyzed via
  `QueryExecution.analyzed`, and the views are empty `LocalRelation`s. Reading files
  directly (`parquet.`/path``) is switched off (`spark.sql.runSQLOnFiles=false`).
- Every `analyze` call registers its views in a fresh `newSession()` with the instance's
  result-deciding settings (ANSI mode, time zone, ...), so one plan never sees another's
  views and the analysis uses the settings the replicas will use.
- Determinism (DESIGN sections 6 and 7): refused are expressions Spark marks
  nondeterministic (`rand()`, `uuid()`, `shuffle()`, `reflect()`, ...), and those Spark
  calls deterministic although replicas disagree on them: the clock (`current_timestamp()`,
  `now()`, `current_date()`, `localtimestamp()`, `current_time()`, `unix_timestamp()`
  without an argument, `CAST('now' AS TIMESTAMP)`, typed literals such as
  `TIMESTAMP 'now'`), the session (`current_timezone()`, `current_user()`,
  `current_database()`, `current_catalog()`, `version()`), `aes_encrypt()` with a random
  IV, and `TABLESAMPLE`. Every refusal names the offending expression. A `LIMIT` or
  `OFFSET` without `ORDER BY` is refused too, and one in a subquery expression
  (`dataplane._orders.unordered_limit`): which rows it keeps depends on how each
  replica reads its files. Ties of an `ORDER BY ... LIMIT` are broken by every column.
- Every refusal is a `ControllerError` (INVALID_ARGUMENT, or NOT_FOUND for an unknown
  table) carrying Spark's own first line where Spark found the problem, never a JVM
  stack trace.
- Calls block (py4j). A lock runs one call at a time; the controller calls the planner
  from one worker thread, never on its event loop.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
from py4j.protocol import Py4JError
from pyspark.errors.exceptions.captured import CapturedException, ParseException
from pyspark.sql import SparkSession

from catalog import DETERMINISTIC_SPARK_CONF, InvalidArgument
from controller._api import ControllerError
from replica_service._spark import SparkSettings, dataflow_session, launch_jvm, start_session
from history import DataflowDescription
from replica_service._arrangement import Version
from replica_service.dataplane import DeltaPlan, NotIncremental, StorageReader, delta_plan, maintainer, spark_type, unordered_limit
from replica_service.dataplane._jvm import Jvm
from replica_service.dataplane._plan import ACC_VIEW, ACCROW, DIFF, TIME
from storage import Storage
from replica_service.dataplane._rows import quote
from storage import parse_schema, schema_to_ddl

log = logging.getLogger(__name__)

PLANNER_SPARK_CONF: Mapping[str, str] = {"spark.sql.runSQLOnFiles": "false"}
"""Applied on top of the instance's settings: planning never touches a file."""

VIEW_CACHE_SIZE = 256
"""Prototype views kept (per table name and schema): registering a cached one costs one
py4j call, building one ~30 ms (createDataFrame plus a CreateViewCommand)."""

_MAX_FIELDS = 2**31 - 1  # treeString without "... N more fields"
_VIEW_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a collection's name (catalog check_name)

# --- Determinism: what is refused, and why --------------------------------------------

_CLOCK = (
    "it reads the clock, and each replica evaluates it at a different moment (Spark calls "
    "it deterministic only because it is fixed within one query); pass times in as data"
)
_SESSION = (
    "its value comes from the replica's Spark session, not from the data, and need not be "
    "the same on every replica"
)
_RANDOM = "Spark marks it nondeterministic, so replicas would compute different rows"
_RANDOM_IV = (
    "without an explicit iv it draws a random initialization vector (GCM and CBC modes); "
    "pass an iv or use mode 'ECB'"
)
_TABLESAMPLE = (
    "nondeterministic TABLESAMPLE: Spark samples at random (with a new seed each time it "
    "parses the query unless REPEATABLE is given, and draws that depend on how rows are "
    "partitioned), so replicas could keep different rows"
)

# Expressions Spark marks deterministic that replicas still disagree on, by class name.
# Spark's optimizer rules ComputeCurrentTime and ReplaceCurrentLike rewrite all of them but
# SparkVersion (checked against Spark 4.3): the planner runs those rules to detect them,
# and finds version() by a text hint.
_REFUSED_CLASSES: Mapping[str, str] = {
    "CurrentTimestamp": _CLOCK,  # current_timestamp(), CURRENT_TIMESTAMP, unix_timestamp()
    "Now": _CLOCK,
    "CurrentDate": _CLOCK,  # current_date(), curdate(), CURRENT_DATE
    "LocalTimestamp": _CLOCK,
    "CurrentTime": _CLOCK,  # current_time() (TIME type, Spark 4.1+)
    "CurrentTimeZone": _SESSION,
    "CurrentUser": _SESSION,  # current_user(), user(), session_user()
    "CurrentDatabase": _SESSION,  # current_database(), current_schema()
    "CurrentCatalog": _SESSION,
    "SparkVersion": _SESSION,  # version()
}

# Special datetime strings: Spark turns them into the current time (SPARK_NOTES).
_SPECIAL_DATETIME = ("now", "today", "yesterday", "tomorrow")  # 'epoch' is a fixed time
_DATETIME_TYPES = ("date", "timestamp", "timestamp_ntz", "timestamp_ltz")

# A typed literal (TIMESTAMP 'now', DATE 'today') is converted when the SQL is PARSED, so
# the analyzed plan holds a constant that differs on every replica: only the text shows it.
# The pattern may also match inside a string or a comment; such SQL is refused too.
_SPECIAL_TYPED_LITERAL = re.compile(
    r"\b(?:DATE|TIMESTAMP(?:_LTZ|_NTZ)?)\s*[rR]?(['\"])\s*"
    r"(?:now|today|yesterday|tomorrow)\b[^'\"]*\1",
    re.IGNORECASE,
)

# Cheap text hints (in the analyzed plan's tree string) for what the rules cannot detect;
# a hint only triggers the exact walk, which decides.
_TREE_HINTS = re.compile(r"^[\s:|+-]*Sample\b|aes_encrypt\(|version\(\)", re.MULTILINE)

# --- Output types --------------------------------------------------------------------

# Spark's JSON type names of the types storage holds, as storage DDL.
_STORAGE_TYPES: Mapping[str, str] = {
    "boolean": "BOOLEAN",
    "byte": "TINYINT",
    "short": "SMALLINT",
    "integer": "INT",
    "long": "BIGINT",
    "float": "FLOAT",
    "double": "DOUBLE",
    "string": "STRING",
    "date": "DATE",
    "timestamp": "TIMESTAMP",
    "timestamp_ntz": "TIMESTAMP_NTZ",
    "binary": "BINARY",
}
STORAGE_TYPES = (
    "BOOLEAN, TINYINT, SMALLINT, INT, BIGINT, FLOAT, DOUBLE, DECIMAL(p,s), STRING, CHAR(n), "
    "VARCHAR(n), BINARY, DATE, TIMESTAMP, TIMESTAMP_NTZ"
)
_SIZED_TYPE = re.compile(r"(decimal|char|varchar)\((\d+(?:,\s*\d+)?)\)\Z")
_COLLATIONS_KEY = "__COLLATIONS"  # field metadata of a collated STRING


@dataclass(frozen=True, slots=True)
class PlannedQuery:
    """A query the planner accepted: deterministic, over the tables it was given.

    `schema` is the output schema in storage's normal DDL form (`storage.schema_to_ddl`),
    e.g. "region STRING, n BIGINT NOT NULL"; `columns` its column names in order, exactly
    as Spark names them (e.g. `count(1)` for an unaliased `count(*)`); `arrow_schema` the
    same as `storage.parse_schema(schema)`. `not_incremental` is None when replicas can
    maintain the query incrementally, else the part of it that cannot be.
    """

    sql: str
    schema: str
    columns: tuple[str, ...]
    arrow_schema: pa.Schema
    not_incremental: str | None = None


class Planner:
    """Analysis of dataflow SQL in a local SparkSession of the controller's own.

    Create it with `Planner.start`; call it from one worker thread (a lock serializes
    calls from several threads, so they are safe but never concurrent); `stop()` it
    last. Each method blocks for the py4j round trips: a warm `analyze` takes tens of
    milliseconds.
    """

    def __init__(self, session: SparkSession) -> None:
        """Wrap a running session; use `Planner.start` to launch one."""
        self._session = session
        self._jvm = session._jvm
        self._lock = threading.Lock()
        self._stopped = False
        # Prototype views: (name, Spark DDL) -> TemporaryViewRelation. Filled by
        # `_view`, evicted least recently used beyond VIEW_CACHE_SIZE.
        self._views: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._scratch = session._jsparkSession.newSession()  # builds the prototypes
        jvm = self._jvm
        optimizer = jvm.org.apache.spark.sql.catalyst.optimizer
        catalog_manager = session._jsparkSession.sessionState().catalogManager()
        # Rules that rewrite exactly the wall-clock and session expressions (and the
        # casts of special datetime strings): a plan they change contains one.
        self._detectors = (
            optimizer.ComputeCurrentTime,
            optimizer.ReplaceCurrentLike(catalog_manager),
            optimizer.SpecialDatetimeValues,
        )
        self._plan_expression = jvm.java.lang.Class.forName(
            "org.apache.spark.sql.catalyst.expressions.PlanExpression"
        )
        self._skip_commands = jvm.org.apache.spark.sql.execution.CommandExecutionMode.SKIP()

    @classmethod
    def launch(cls, work_dir: Path, settings: SparkSettings | None = None) -> Future[Planner]:
        """Start the planner's SparkSession (local[1], 512m driver, the replica's quiet and
        fast-starting settings, scratch space under `work_dir`) and warm it up; the future
        gives the planner.

        Returns once the JVM is launched (a second or two); the session is built and
        warmed up on a thread of its own (a few seconds more), so the controller can
        recover and serve peeks meanwhile. Call this BEFORE any gRPC server or channel
        exists in the process: launching the JVM forks, and a fork while gRPC's threads
        run broke the JVM launch in the replica (see replica_service/__main__.py). It also
        sets PYSPARK_PYTHON, SPARK_LOCAL_IP and SPARK_LOCAL_DIRS in this process's
        environment, as the replica does. There is one SparkSession per process
        (`getOrCreate`): the planner is the controller's.
        """
        if settings is None:
            settings = SparkSettings(
                "local[1]", "512m", {"spark.app.name": f"tandem-planner-{os.getpid()}"}
            )
        gateway = launch_jvm(settings, work_dir)
        future: Future[Planner] = Future()

        def build() -> None:
            try:
                planner = cls(start_session(settings, work_dir, gateway=gateway))
                # The first parse and analysis load and compile classes (~1 s): pay it
                # now, not on the first user's CREATE DATAFLOW.
                planner.analyze(
                    "SELECT k, count(*) AS n FROM t WHERE k IS NOT NULL GROUP BY k",
                    {"t": "k BIGINT"},
                )
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(planner)

        threading.Thread(target=build, name="planner-start", daemon=True).start()
        return future

    @classmethod
    def start(cls, work_dir: Path, settings: SparkSettings | None = None) -> Planner:
        """`launch`, then wait for the planner."""
        return cls.launch(work_dir, settings).result()

    def stop(self) -> None:
        """Stop the session. Later calls raise UNAVAILABLE. Idempotent."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._views.clear()
                self._session.stop()

    # --- Referenced tables -------------------------------------------------------------

    def referenced_tables(self, sql: str, conf: Mapping[str, str] | None = None) -> list[str]:
        """The table names `sql` reads, in order of first appearance, each once.

        Parse only: nothing needs to exist. Names of CTEs (`WITH x AS ...`) and aliases
        (`(SELECT ...) AS x`, `FROM t AS x`) are not tables and are left out; tables read
        in subqueries, CTE bodies and joins are in. A name is returned as written in the
        SQL (Spark's quoting: a qualified name as `db.t`, a part that needs quotes in
        backquotes, e.g. `my.tab`), once per spelling that differs other than in case.

        Matching: Spark resolves table names ignoring case (unless the instance sets
        `spark.sql.caseSensitive=true`), so the caller matches each name to a collection
        case-insensitively (`name.lower() == collection.lower()`) and passes the input to
        `analyze` under the collection's own name, which is also the import name the
        replicas register: `SALES` in the SQL then reads the view `sales`. A qualified or
        quoted name (one containing `.` or a backquote) cannot name a collection, whose
        names are plain identifiers: the caller reports it NOT_FOUND.

        `conf` is the instance's Spark settings (default `DETERMINISTIC_SPARK_CONF`); the
        parser honours e.g. `spark.sql.ansi.doubleQuotedIdentifiers`.
        Raises INVALID_ARGUMENT when the SQL is not one query, or names a table with a
        computed `IDENTIFIER(...)`.
        """
        text = _query_text(sql)
        with self._lock, self._spark_errors(None):
            session = self._fresh_session(conf)
            plan = self._parse(session, text)
            case_sensitive = session.conf().get("spark.sql.caseSensitive") == "true"
            relations = sorted(self._relations(plan, case_sensitive))
        names: list[str] = []
        seen: set[str] = set()
        for _position, name in relations:
            folded = name if case_sensitive else name.lower()
            if folded not in seen:
                seen.add(folded)
                names.append(name)
        return names

    def _relations(self, plan: Any, case_sensitive: bool) -> Iterator[tuple[int, str]]:
        """(position in the SQL, quoted name) of every UnresolvedRelation in the parsed
        plan that is not a reference to a CTE in scope.

        CTE scoping as in Spark: a definition sees the CTEs defined before it (and
        itself in WITH RECURSIVE), the main query sees all of them, subqueries see what
        their enclosing query sees; only one-part names can refer to a CTE.
        """

        def fold(name: str) -> str:
            return name if case_sensitive else name.lower()

        stack: list[tuple[Any, frozenset[str]]] = [(plan, frozenset())]
        while stack:
            node, ctes = stack.pop()
            kind = node.nodeName()
            if kind == "UnresolvedRelation":
                parts = _seq(node.multipartIdentifier())
                if not (len(parts) == 1 and fold(parts[0]) in ctes):
                    yield _start_index(node), node.tableName()
            elif kind == "PlanWithUnresolvedIdentifier":
                raise ControllerError(
                    "INVALID_ARGUMENT",
                    f"a table named by a computed IDENTIFIER(...) at {_position(node)}: the "
                    "planner must see every table a dataflow reads; write the name itself",
                )
            elif kind == "UnresolvedWith":
                visible = set(ctes)
                recursive = bool(node.allowRecursion())
                for definition in _seq(node.cteRelations()):
                    name = fold(definition._1())
                    scope = visible | {name} if recursive else set(visible)
                    stack.append((definition._2(), frozenset(scope)))
                    visible.add(name)
                ctes = frozenset(visible)
            for child in _seq(node.children()):
                stack.append((child, ctes))
            for subquery in _seq(node.subqueries()):
                stack.append((subquery, ctes))

    # --- Analysis ----------------------------------------------------------------------

    def analyze(
        self,
        sql: str,
        tables: Mapping[str, str | pa.Schema],
        conf: Mapping[str, str] | None = None,
    ) -> PlannedQuery:
        """Analyze `sql` over empty views of `tables` and return its output schema.

        `tables` maps each name the SQL reads (a collection's name: a plain identifier) to
        its schema, as storage DDL or as the Arrow schema `storage.parse_schema` gives;
        tables the SQL does not read are ignored. `conf` is the instance's Spark settings
        (default `DETERMINISTIC_SPARK_CONF`): ANSI mode and the like change result types.

        Refuses, with INVALID_ARGUMENT unless noted: SQL that is not one query; a parse
        error (Spark's message: condition and position); a table not in `tables`
        (NOT_FOUND, naming it); an unknown column (Spark's message, with its
        suggestions); any other analysis error (Spark's first line); nondeterministic
        SQL, naming the expression ("nondeterministic expression rand() ..."); an output
        that is not a storage schema (a column of a type storage cannot hold, such as a
        MAP, ARRAY or bare NULL, named with its type; duplicate or reserved names).
        """
        text = _query_text(sql)
        views = _view_schemas(tables)
        with self._lock, self._spark_errors(views):
            session = self._fresh_session(conf)
            catalog = session.sessionState().catalog()
            for name, ddl in views.items():
                catalog.createTempView(name, self._view(name, ddl), True)
            plan = self._parse(session, text)
            execution = session.sessionState().executePlan(plan, self._skip_commands)
            execution.assertAnalyzed()
            analyzed = execution.analyzed()
            self._refuse_nondeterminism(analyzed, text)
            unordered = unordered_limit(analyzed)
            if unordered is not None:
                raise ControllerError("INVALID_ARGUMENT", unordered)
            not_incremental = self._not_incremental(session, analyzed, views)
            schema = analyzed.schema()
            fields = json.loads(schema.json())["fields"]
            unsupported = [
                (field["name"], schema.apply(i).dataType().sql())
                for i, field in enumerate(fields)
                if _storage_type(field) is None
            ]
        if unsupported:
            name, column_type = unsupported[0]
            hint = ""
            if column_type == "VOID":
                hint = " (a bare NULL: give it a type, e.g. CAST(NULL AS BIGINT))"
            raise ControllerError(
                "INVALID_ARGUMENT",
                f"output column {name!r} has type {column_type}{hint}, which storage cannot "
                f"hold (it holds {STORAGE_TYPES}): cast the column or leave it out",
            )
        ddl = ", ".join(
            f"{quote(f['name'])} {_storage_type(f)}{'' if f['nullable'] else ' NOT NULL'}"
            for f in fields
        )
        try:
            arrow_schema = parse_schema(ddl)
        except InvalidArgument as error:
            raise ControllerError(
                "INVALID_ARGUMENT", f"the query's output is not a storage schema: {error}"
            ) from None
        return PlannedQuery(
            sql=sql,
            schema=schema_to_ddl(arrow_schema),
            columns=tuple(arrow_schema.names),
            arrow_schema=arrow_schema,
            not_incremental=not_incremental,
        )

    def check_index_key(self, planned: PlannedQuery, key: Sequence[str]) -> tuple[str, ...]:
        """The index key as a tuple, once every column is an output column of `planned`.

        Names match the output's exactly (case included: they name Arrow columns in the
        arrangement), and no column may appear twice; otherwise INVALID_ARGUMENT naming
        the column and listing the available ones. The empty key is valid (an index
        without key columns: every peek scans it).
        """
        if isinstance(key, str):
            raise ControllerError(
                "INVALID_ARGUMENT",
                f"an index key is a sequence of column names, not the string {key!r}",
            )
        columns = tuple(key)
        available = ", ".join(planned.columns)
        seen: set[str] = set()
        for column in columns:
            if not isinstance(column, str):
                raise ControllerError(
                    "INVALID_ARGUMENT", f"index key column {column!r} is not a column name"
                )
            if column in seen:
                raise ControllerError(
                    "INVALID_ARGUMENT", f"index key column {column!r} appears twice"
                )
            seen.add(column)
            if column not in planned.columns:
                near = [c for c in planned.columns if c.lower() == column.lower()]
                hint = f" (names match exactly: did you mean {near[0]!r}?)" if near else ""
                raise ControllerError(
                    "INVALID_ARGUMENT",
                    f"index key column {column!r} is not an output column of the query"
                    f"{hint}; the output columns are: {available}",
                )
        return columns

    def recompute_digest(self, desc: DataflowDescription, time: int, storage: Storage, conf: Mapping[str, str]) -> str:
        """The digest of `desc`'s index version at `time`, computed from scratch from its
        storage inputs with the replica's own code (`maintainer`, a `Version`), in a
        session of this planner's Spark with the instance's settings: what a correct
        replica reports for that time. Settles a disagreement between two replicas."""
        session = dataflow_session(self._session, conf)
        readers = {source.name: StorageReader(storage, source.id) for source in desc.imports}
        try:
            for reader in readers.values():
                reader.refresh(session)
            fresh = replace(desc, sink_exports=(), strategy="recompute")
            partitions = int(conf.get("spark.sql.shuffle.partitions", "200"))
            output = maintainer(fresh, session, readers, {}, partitions).step([time])
            _, rows = output.versions(None)
            output.finish()
        finally:
            for reader in readers.values():
                reader.close()
        return Version.build(time, rows, desc.index_exports[0].key).digest

    # --- Spark plumbing (callers hold the lock) ----------------------------------------

    def _fresh_session(self, conf: Mapping[str, str] | None) -> Any:
        """A new session (own temp views) with the instance's runtime settings."""
        if self._stopped:
            raise ControllerError("UNAVAILABLE", "the planner is stopped")
        settings = {**(DETERMINISTIC_SPARK_CONF if conf is None else conf), **PLANNER_SPARK_CONF}
        return dataflow_session(self._session, settings)._jsparkSession

    def _parse(self, session: Any, text: str) -> Any:
        """The parsed plan of `text`, which must be one query (never a command)."""
        with self._active(session):
            parser = session.sessionState().sqlParser()
            try:
                return parser.parseQuery(text)
            except ParseException as error:
                try:
                    statement = parser.parsePlan(text)
                except CapturedException:
                    raise error from None  # not a statement of any kind: Spark's message
                raise ControllerError(
                    "INVALID_ARGUMENT",
                    "a dataflow is defined by one query (SELECT, WITH, VALUES, TABLE or "
                    f"FROM ...), not by a command ({statement.nodeName()})",
                ) from None

    @contextmanager
    def _active(self, session: Any) -> Iterator[None]:
        """Make `session` the JVM thread's active session, whose settings the parser
        reads (Spark's own `sql()` does the same)."""
        spark_session = self._jvm.org.apache.spark.sql.SparkSession
        previous = spark_session.getActiveSession()
        spark_session.setActiveSession(session)
        try:
            yield
        finally:
            if previous.isDefined():
                spark_session.setActiveSession(previous.get())
            else:
                spark_session.clearActiveSession()

    def _view(self, name: str, ddl: str) -> Any:
        """The TemporaryViewRelation of an empty view `name` with Spark schema `ddl`.

        Built once in the scratch session and cached: a temp view's definition is an
        immutable analyzed plan, shared by every session it is registered in (as Spark
        shares it between the queries that read one view).
        """
        key = (name, ddl)
        relation = self._views.get(key)
        if relation is not None:
            self._views.move_to_end(key)
            return relation
        jvm = self._jvm
        struct = jvm.org.apache.spark.sql.types.StructType.fromDDL(ddl)
        self._scratch.createDataFrame(jvm.java.util.ArrayList(), struct).createOrReplaceTempView(
            name
        )
        catalog = self._scratch.sessionState().catalog()
        relation = catalog.getRawTempView(name).get()
        catalog.dropTempView(name)
        self._views[key] = relation
        if len(self._views) > VIEW_CACHE_SIZE:
            self._views.popitem(last=False)
        return relation

    # --- Incremental maintenance ---------------------------------------------------------

    def _not_incremental(self, session: Any, analyzed: Any, views: Mapping[str, str]) -> str | None:
        """None if replicas can maintain the query incrementally (its delta plan builds
        and every template of it analyzes to the query's own output), else why not."""
        try:
            plan = delta_plan(session, analyzed, {name.lower(): name for name in views})
        except NotIncremental as reason:
            return str(reason)
        try:
            self._check_delta_plan(session, plan, views, _columns(analyzed.schema()))
        except (CapturedException, Py4JError, AssertionError) as error:
            # A shape the rewrite claims but does not carry through: recompute it, and
            # keep the evidence; it is a defect of the delta planner.
            log.exception("planner: the delta plan of a supported shape did not analyze")
            return f"its delta plan did not analyze ({_first_line(str(error))})"
        return None

    def _check_delta_plan(self, session: Any, plan: DeltaPlan, views: Mapping[str, str], expected: list[tuple[str, str]]) -> None:
        """Analyze every template of `plan` (and of its stages) over empty views; each
        must give the `expected` output columns and types (plus `_diff` and `_time`; a
        ranked query's template, neither; its timed template, `_time` and `__accrow`)."""
        # First (each stage binds the same view names), and once for a stage that
        # several leaves share.
        stages = {id(leaf.stage): leaf for leaf in plan.leaves if leaf.stage is not None}
        for leaf in stages.values():
            self._check_delta_plan(session, leaf.stage, views, list(zip(leaf.stage.output_columns, leaf.types)))
        catalog = session.sessionState().catalog()
        for leaf in plan.leaves:
            if leaf.stage is None:
                ddl = f"{views[leaf.name]}, `{DIFF}` BIGINT, `{TIME}` BIGINT"
            else:
                ddl = ", ".join([*(f"`{c}` {t}" for c, t in zip(leaf.columns, leaf.types)), f"`{DIFF}` BIGINT", f"`{TIME}` BIGINT"])
            catalog.createTempView(leaf.view, self._view(leaf.view, ddl), True)
        jvm = Jvm(session)
        shape = plan.aggregate
        if shape is None:
            outputs = [plan.full, *plan.terms]
        else:
            accumulators = [f"`__k{i}` {t}" for i, t in enumerate(shape.key_types)]
            accumulators += [f"`__a{i}` {c.result_type}" for i, c in enumerate(shape.calls)]
            ddl = ", ".join([*accumulators, f"`{DIFF}` BIGINT", f"`{TIME}` BIGINT"])
            catalog.createTempView(ACC_VIEW, self._view(ACC_VIEW, ddl), True)
            for template in (plan.full, *plan.terms):
                jvm.dataframe_jdf(template)
            outputs = [shape.post] if plan.ranked is None else []
        for template in outputs:
            produced = _columns(jvm.dataframe_jdf(template).schema())
            assert produced == [*expected, (DIFF, "BIGINT"), (TIME, "BIGINT")], f"{produced} is not {expected} + {DIFF}, {TIME}"
        if plan.ranked is not None:
            produced = _columns(jvm.dataframe_jdf(plan.ranked).schema())
            assert produced == expected, f"{produced} is not {expected}"
            produced = [name for name, _ in _columns(jvm.dataframe_jdf(plan.ranked_timed).schema())]
            assert produced == [*(name for name, _ in expected), TIME, ACCROW], f"{produced} is not {expected} + {TIME}, {ACCROW}"

    # --- Determinism ---------------------------------------------------------------------

    def _refuse_nondeterminism(self, analyzed: Any, text: str) -> None:
        """Raise INVALID_ARGUMENT naming the first expression replicas could disagree on.

        Cheap, exact checks decide whether to look (Spark's `deterministic`; the optimizer
        rules that rewrite the clock and session expressions; the parse-time typed
        literals in the text; text hints for the rest); only then is the plan walked
        expression by expression (one py4j call per node) to name the culprit.
        """
        literal = _SPECIAL_TYPED_LITERAL.search(text)
        if literal:
            raise ControllerError(
                "INVALID_ARGUMENT",
                f"nondeterministic expression {literal.group(0)}: Spark turns it into the "
                "time at which it parses the query, which differs on every replica; pass "
                "times in as data",
            )
        suspect = (
            not analyzed.deterministic()
            or any(not analyzed.fastEquals(rule.apply(analyzed)) for rule in self._detectors)
            or _TREE_HINTS.search(analyzed.treeString(False, False, _MAX_FIELDS, False, False))
        )
        if suspect:
            culprit = self._culprit(analyzed)
            if culprit is not None:
                raise ControllerError("INVALID_ARGUMENT", culprit)

    def _culprit(self, analyzed: Any) -> str | None:
        """The refusal message for the first offending expression or TABLESAMPLE in the
        plan (subqueries and CTE bodies included), or None if there is none (a hint that
        was only a column name, or a cast of 'epoch')."""
        stack = [analyzed]
        while stack:
            node = stack.pop()
            if node.nodeName() == "Sample":
                return _TABLESAMPLE
            for top in _seq(node.expressions()):
                found = self._offending(top)
                if found is not None:
                    expression, reason = found
                    described = expression.sql()
                    context = top.child() if top.nodeName() == "Alias" else top
                    whole = context.sql()
                    where = f" in {whole}" if whole != described else ""
                    return f"nondeterministic expression {described}{where}: {reason}"
            stack.extend(reversed(_seq(node.subqueries())))
            stack.extend(reversed(_seq(node.children())))
        return None

    def _offending(self, expression: Any) -> tuple[Any, str] | None:
        """The innermost offending expression in `expression`'s tree, with the reason."""
        if self._plan_expression.isInstance(expression):
            return None  # a subquery: `_culprit` walks its plan
        children = _seq(expression.children())
        for child in children:
            found = self._offending(child)
            if found is not None:
                return found
        kind = expression.getClass().getSimpleName()
        if kind in _REFUSED_CLASSES:
            return expression, _REFUSED_CLASSES[kind]
        if kind == "Cast" and _casts_special_datetime(expression):
            return expression, _CLOCK
        if kind == "AesEncrypt" and _random_iv(expression):
            return expression, _RANDOM_IV
        # Nondeterministic itself, not by a child (a child subquery's plan is walked).
        if not expression.deterministic() and all(c.deterministic() for c in children):
            return expression, _RANDOM
        return None

    # --- Errors ----------------------------------------------------------------------------

    @contextmanager
    def _spark_errors(self, views: Mapping[str, str] | None) -> Iterator[None]:
        """Turn Spark's exceptions into ControllerErrors with Spark's first line; `views`
        are the tables the query was given (None when parsing only)."""
        try:
            yield
        except ControllerError:
            raise
        except CapturedException as error:
            raise _controller_error(error, views) from None
        except Py4JError as error:
            log.exception("planner: py4j failed")
            raise ControllerError(
                "INTERNAL", f"the planner's Spark session failed: {_first_line(str(error))}"
            ) from None


# --- Helpers ---------------------------------------------------------------------------


def _query_text(sql: object) -> str:
    """The SQL without trailing semicolons (Spark's query rule refuses them)."""
    if not isinstance(sql, str) or not sql.strip():
        raise ControllerError("INVALID_ARGUMENT", "a dataflow needs SQL: one query")
    text = sql.rstrip()
    while text.endswith(";"):
        text = text[:-1].rstrip()
    return text


def _view_schemas(tables: Mapping[str, str | pa.Schema]) -> dict[str, str]:
    """Each table's schema as the Spark DDL its empty view is built from.

    Checked like storage checks a schema. Spark gets the types the replicas see: CHAR(n)
    and VARCHAR(n) become STRING (Spark refuses them in a DataFrame, and Arrow has only
    strings), TIMESTAMP is spelled TIMESTAMP_LTZ (independent of spark.sql.timestampType).
    """
    if not isinstance(tables, Mapping):
        raise ControllerError("INVALID_ARGUMENT", "tables must map table names to schemas")
    views: dict[str, str] = {}
    folded: dict[str, str] = {}
    for name, schema in tables.items():
        if not isinstance(name, str) or not _VIEW_NAME.fullmatch(name):
            raise ControllerError(
                "INVALID_ARGUMENT",
                f"table name {name!r}: a view name is a plain identifier (letters, digits, "
                "underscores)",
            )
        if name.lower() in folded:
            raise ControllerError(
                "INVALID_ARGUMENT",
                f"tables {folded[name.lower()]!r} and {name!r} differ only in case, which "
                "Spark ignores",
            )
        folded[name.lower()] = name
        try:
            arrow = parse_schema(schema) if isinstance(schema, str) else schema
            if not isinstance(arrow, pa.Schema):
                raise InvalidArgument(f"a schema is DDL or a pyarrow.Schema, not {schema!r}")
            arrow = parse_schema(schema_to_ddl(arrow))  # storage's checks, for Arrow too
        except InvalidArgument as error:
            raise ControllerError("INVALID_ARGUMENT", f"table {name!r}: {error}") from None
        views[name] = ", ".join(
            f"{quote(field.name)} {spark_type(field)}"
            f"{'' if field.nullable else ' NOT NULL'}"
            for field in arrow
        )
    return views


def _storage_type(field: Mapping[str, Any]) -> str | None:
    """The storage DDL type of an output field (Spark's JSON form), or None."""
    json_type = field["type"]
    if not isinstance(json_type, str):
        return None  # ARRAY, MAP, STRUCT, UDT
    if json_type == "string" and _COLLATIONS_KEY in field.get("metadata", {}):
        return None  # STRING COLLATE ...: storage keeps no collation
    if json_type in _STORAGE_TYPES:
        return _STORAGE_TYPES[json_type]
    sized = _SIZED_TYPE.match(json_type)
    if sized:
        return f"{sized.group(1).upper()}({sized.group(2).replace(' ', '')})"
    return None


def _casts_special_datetime(cast: Any) -> bool:
    """A cast of a constant string such as 'now' to a date or timestamp type, which
    Spark's optimizer replaces with the current time."""
    child = cast.child()
    if cast.dataType().typeName() not in _DATETIME_TYPES or not child.foldable():
        return False
    if child.dataType().typeName() != "string":
        return False
    value = child.eval(None)
    words = str(value).strip().lower().split() if value is not None else []
    return bool(words) and words[0] in _SPECIAL_DATETIME


def _random_iv(aes: Any) -> bool:
    """aes_encrypt without a constant non-empty iv, in a mode other than a constant ECB."""
    mode = aes.mode()
    if mode.foldable() and str(mode.eval(None)).strip().upper() == "ECB":
        return False
    iv = aes.iv()
    return not (iv.foldable() and len(iv.eval(None) or b"") > 0)


def _columns(struct: Any) -> list[tuple[str, str]]:
    """(name, Spark type) of each field of a StructType."""
    return [(f.name(), f.dataType().sql()) for f in _seq(struct)]


def _seq(scala_seq: Any) -> list[Any]:
    return [scala_seq.apply(i) for i in range(scala_seq.size())]


def _start_index(node: Any) -> int:
    index = node.origin().startIndex()
    return index.get() if index.isDefined() else -1


def _position(node: Any) -> str:
    origin = node.origin()
    line, position = origin.line(), origin.startPosition()
    if line.isDefined() and position.isDefined():
        return f"line {line.get()} pos {position.get()}"
    return "an unknown position"


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[0].rstrip(";").rstrip() if lines else message


def _controller_error(error: CapturedException, views: Mapping[str, str] | None) -> ControllerError:
    """The ControllerError for a Spark exception: Spark's condition and first line."""
    condition = error.getCondition() or ""
    message = str(error)
    if condition == "TABLE_OR_VIEW_NOT_FOUND":
        relation = error.getMessageParameters().get("relationName", "?")
        where = re.search(r"line (\d+),? pos (\d+)", message)
        at = f" (line {where.group(1)} pos {where.group(2)})" if where else ""
        if views is None:
            known = ""
        elif views:
            known = f": the query may read only {', '.join(views)}"
        else:
            known = ": the query was given no tables to read"
        return ControllerError("NOT_FOUND", f"unknown table {relation}{at}{known}")
    code = "INTERNAL" if condition.startswith("INTERNAL_ERROR") else "INVALID_ARGUMENT"
    return ControllerError(code, _first_line(message))
