"""The controller's planner over a real local SparkSession (DESIGN section 6, "Planning").

One module-scoped Planner, so the JVM starts once. Covers: the tables a query reads
(CTEs and aliases left out), output schemas that storage accepts (types, nullability),
index keys, refusal of every nondeterministic and wall-clock function by name, the
mapping of Spark's errors to ControllerError, isolation between plans, and that planning
never runs a Spark job.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from controller._api import ControllerError
from controller._planner import Planner, PlannedQuery
from storage import normalize_ddl, parse_schema

pytestmark = pytest.mark.spark

SALES = (
    "id BIGINT NOT NULL, region STRING, amount DECIMAL(10,2), ts TIMESTAMP, day DATE, "
    "note VARCHAR(20)"
)
REGIONS = "region STRING NOT NULL, name STRING, opened TIMESTAMP_NTZ"
# Columns named like the refused functions.
ODD = "rand DOUBLE, `current_date` DATE, now STRING, `uuid()` STRING"
TABLES = {"sales": SALES, "regions": REGIONS, "odd": ODD}


@pytest.fixture(scope="module")
def planner(tmp_path_factory):
    started = Planner.start(tmp_path_factory.mktemp("planner"))
    # The process's one SparkContext may have run jobs for other test modules before.
    started.jobs_before = set(started._session.sparkContext.statusTracker().getJobIdsForGroup())
    yield started
    started.stop()


def refusal(call, *args, code: str = "INVALID_ARGUMENT") -> str:
    """The message of the ControllerError `call(*args)` raises, after checking its code
    and that it carries no JVM stack trace."""
    with pytest.raises(ControllerError) as caught:
        call(*args)
    error = caught.value
    assert error.code == code, error.message
    assert "\n" not in error.message
    assert "org.apache" not in error.message and "py4j" not in error.message
    return error.message


# --- Referenced tables ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("SELECT * FROM sales", ["sales"]),
        ("SELECT * FROM sales s JOIN regions r ON s.region = r.region", ["sales", "regions"]),
        (
            "SELECT * FROM sales LEFT JOIN regions USING (region) CROSS JOIN odd",
            ["sales", "regions", "odd"],
        ),
        (
            "SELECT * FROM sales WHERE region IN (SELECT region FROM regions) "
            "AND EXISTS (SELECT 1 FROM returns WHERE returns.id = sales.id)",
            ["sales", "regions", "returns"],
        ),
        ("SELECT id, (SELECT max(amount) FROM refunds) AS m FROM sales", ["refunds", "sales"]),
        (
            "WITH big AS (SELECT * FROM sales WHERE amount > 100), "
            "r AS (SELECT * FROM big JOIN regions USING (region)) SELECT * FROM r",
            ["sales", "regions"],
        ),
        # A CTE's body reads the table it shadows; a later reference is the CTE.
        ("WITH sales AS (SELECT * FROM sales WHERE amount > 0) SELECT * FROM sales", ["sales"]),
        (
            "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 3) "
            "SELECT * FROM r JOIN sales ON sales.id = r.n",
            ["sales"],
        ),
        # The CTE is visible inside the subquery only; the outer q is a table.
        ("SELECT (WITH q AS (SELECT 1 AS a) SELECT a FROM q) AS a FROM q", ["q"]),
        ("SELECT * FROM (SELECT * FROM sales) AS regions", ["sales"]),
        (
            "SELECT * FROM sales, "
            "LATERAL (SELECT * FROM regions WHERE regions.region = sales.region)",
            ["sales", "regions"],
        ),
        (
            "SELECT * FROM db.sales JOIN spark_catalog.db.regions USING (region) "
            "JOIN `my.table` USING (id)",
            ["db.sales", "spark_catalog.db.regions", "`my.table`"],
        ),
        ("SELECT * FROM Sales JOIN SALES USING (id) JOIN sales USING (id)", ["Sales"]),
        ("TABLE sales", ["sales"]),
        ("FROM sales |> WHERE amount > 0 |> SELECT id", ["sales"]),
        ("SELECT * FROM IDENTIFIER('sales')", ["sales"]),
        ("SELECT 1 AS one;  ", []),
        ("SELECT * FROM range(3) JOIN VALUES (1), (2) AS v(id) USING (id)", []),
    ],
)
def test_referenced_tables(planner, sql, expected):
    assert planner.referenced_tables(sql) == expected


def test_referenced_tables_honours_the_instance_settings(planner):
    quoted = 'SELECT * FROM "sales" JOIN SALES USING (id)'
    assert "PARSE_SYNTAX_ERROR" in refusal(planner.referenced_tables, quoted)
    ansi_quotes = {"spark.sql.ansi.doubleQuotedIdentifiers": "true"}
    assert planner.referenced_tables(quoted, ansi_quotes) == ["sales"]
    case_sensitive = {"spark.sql.caseSensitive": "true"}
    assert planner.referenced_tables(quoted, {**ansi_quotes, **case_sensitive}) == [
        "sales",
        "SALES",
    ]


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("SELECT * FROM IDENTIFIER('sa' || 'les')", "computed IDENTIFIER(...) at line 1 pos 14"),
        ("DROP TABLE sales", "not by a command (DropTable)"),
        ("INSERT INTO sales SELECT * FROM sales", "not by a command (InsertIntoStatement)"),
        ("SET spark.sql.ansi.enabled = false", "not by a command (SetCommand)"),
        ("SELECT 1; SELECT 2", "[PARSE_SYNTAX_ERROR]"),
        ("SELEC id FROM sales", "[PARSE_SYNTAX_ERROR] Syntax error at or near 'SELEC'"),
        ("   ", "needs SQL"),
    ],
)
def test_referenced_tables_refusals(planner, sql, expected):
    assert expected in refusal(planner.referenced_tables, sql)


# --- Output schemas --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sql", "schema"),
    [
        (
            "SELECT region, count(*) AS n, sum(amount) AS total, avg(amount) AS mean, "
            "max(ts) AS last, min(day) AS first_day FROM sales GROUP BY region",
            "region STRING, n BIGINT NOT NULL, total DECIMAL(20,2), mean DECIMAL(14,6), "
            "last TIMESTAMP, first_day DATE",
        ),
        ("SELECT count(*) FROM sales", "`count(1)` BIGINT NOT NULL"),
        (
            "SELECT s.id, r.name, r.opened FROM sales s JOIN regions r ON s.region = r.region",
            "id BIGINT NOT NULL, name STRING, opened TIMESTAMP_NTZ",
        ),
        # The right side of a left join may be missing: nullable although NOT NULL there.
        (
            "SELECT s.id, r.region AS r_region FROM sales s LEFT JOIN regions r "
            "ON s.region = r.region",
            "id BIGINT NOT NULL, r_region STRING",
        ),
        (
            "SELECT CAST(id AS INT) AS i, CAST(amount AS DOUBLE) AS d, "
            "CAST(day AS TIMESTAMP) AS t, CAST(ts AS DATE) AS dt, CAST(id AS STRING) AS s, "
            "CAST(region AS INT) AS ri, CAST(ts AS TIMESTAMP_NTZ) AS ntz FROM sales",
            "i INT NOT NULL, d DOUBLE, t TIMESTAMP, dt DATE, s STRING NOT NULL, ri INT, "
            "ntz TIMESTAMP_NTZ",
        ),
        (
            "SELECT amount * 2 AS doubled, amount * amount AS squared, amount / 3 AS third, "
            "amount + 0.001 AS plus, CAST(1.5 AS DECIMAL(3,1)) AS lit FROM sales",
            "doubled DECIMAL(12,2), squared DECIMAL(21,4), third DECIMAL(14,6), "
            "plus DECIMAL(12,3), lit DECIMAL(3,1) NOT NULL",
        ),
        (
            "SELECT ts, date_trunc('HOUR', ts) AS hour, to_date(ts) AS d, opened "
            "FROM sales JOIN regions USING (region)",
            "ts TIMESTAMP, hour TIMESTAMP, d DATE, opened TIMESTAMP_NTZ",
        ),
        # VARCHAR(n) inputs are strings, as the replicas see them.
        (
            "SELECT coalesce(region, 'none') AS region, note, id + 1 AS next, id / 2 AS half "
            "FROM sales",
            "region STRING NOT NULL, note STRING, next BIGINT NOT NULL, half DOUBLE",
        ),
        (
            "WITH t AS (SELECT region, count(*) AS n FROM sales GROUP BY region) "
            "SELECT * FROM t WHERE n > (SELECT avg(n) FROM t)",
            "region STRING, n BIGINT NOT NULL",
        ),
        (
            "SELECT 1 AS one, 'x' AS `two words`, X'00' AS b",
            "one INT NOT NULL, `two words` STRING NOT NULL, b BINARY NOT NULL",
        ),
    ],
)
def test_output_schema(planner, sql, schema):
    planned = planner.analyze(sql, TABLES)
    assert isinstance(planned, PlannedQuery)
    assert planned.schema == schema
    assert planned.sql == sql
    # Storage accepts it as it is, and it is storage's normal form.
    assert parse_schema(planned.schema) == planned.arrow_schema
    assert normalize_ddl(planned.schema) == planned.schema
    assert planned.columns == tuple(planned.arrow_schema.names)


def test_count_is_not_null_and_sum_is(planner):
    planned = planner.analyze("SELECT count(*) AS n, sum(id) AS s FROM sales", TABLES)
    assert [f.nullable for f in planned.arrow_schema] == [False, True]


def test_arrow_schemas_and_ddl_give_the_same_plan(planner):
    sql = "SELECT s.*, r.name FROM sales s JOIN regions r USING (region)"
    from_ddl = planner.analyze(sql, {"sales": SALES, "regions": REGIONS})
    from_arrow = planner.analyze(
        sql, {"sales": parse_schema(SALES), "regions": parse_schema(REGIONS)}
    )
    assert from_arrow == from_ddl


def test_table_names_match_ignoring_case(planner):
    planned = planner.analyze("SELECT Id FROM SALES", {"sales": SALES})
    assert planned.columns == ("Id",)


def test_the_instance_settings_decide_types(planner):
    sql = "SELECT '1' + 1 AS x"
    assert planner.analyze(sql, {}, {"spark.sql.ansi.enabled": "true"}).schema == "x BIGINT"
    assert planner.analyze(sql, {}, {"spark.sql.ansi.enabled": "false"}).schema == "x DOUBLE"


def test_plans_do_not_see_each_others_views(planner):
    planner.analyze("SELECT * FROM regions", TABLES)
    message = refusal(planner.analyze, "SELECT * FROM regions", {"sales": SALES}, code="NOT_FOUND")
    assert "`regions`" in message and "sales" in message
    # One name, two schemas: each plan sees its own.
    assert planner.analyze("SELECT * FROM t", {"t": "a INT"}).schema == "a INT"
    planned = planner.analyze("SELECT * FROM t", {"t": "b STRING NOT NULL"})
    assert planned.schema == "b STRING NOT NULL"


def test_concurrent_callers_are_serialized(planner):
    def plan(i: int) -> str:
        return planner.analyze(f"SELECT c{i} FROM t", {"t": f"c{i} BIGINT NOT NULL"}).schema

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(plan, range(8))) == [f"c{i} BIGINT NOT NULL" for i in range(8)]


# --- Index keys --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def totals(planner):
    return planner.analyze(
        "SELECT region, day, count(*) AS n FROM sales GROUP BY region, day", TABLES
    )


def test_index_key_of_output_columns(planner, totals):
    assert planner.check_index_key(totals, ["region", "day"]) == ("region", "day")
    assert planner.check_index_key(totals, ("n",)) == ("n",)
    assert planner.check_index_key(totals, []) == ()  # no key columns: peeks scan


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (
            ["region", "missing"],
            "'missing' is not an output column of the query; "
            "the output columns are: region, day, n",
        ),
        (["Region"], "did you mean 'region'?"),
        (["region", "region"], "'region' appears twice"),
        ("region", "not the string 'region'"),
        ([1], "1 is not a column name"),
    ],
)
def test_bad_index_keys(planner, totals, key, expected):
    assert expected in refusal(planner.check_index_key, totals, key)


# --- Determinism -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sql", "named"),
    [
        # Spark marks these nondeterministic.
        ("SELECT rand() AS r FROM sales", "rand()"),
        ("SELECT id + rand() AS r FROM sales", "rand() in (CAST(sales.id AS DOUBLE) + rand())"),
        ("SELECT id FROM sales WHERE rand() > 0.5", "rand()"),
        ("SELECT random() AS r", "rand()"),
        ("SELECT randn(1) AS r", "randn(1)"),
        ("SELECT uuid() AS u FROM sales", "uuid()"),
        ("SELECT shuffle(array(1, 2)) AS s", "shuffle(array(1, 2))"),
        ("SELECT uniform(1, 10, 3) AS u", "uniform(1, 10, 3)"),
        ("SELECT randstr(3, 1) AS s", "randstr(3, 1)"),
        ("SELECT monotonically_increasing_id() AS i FROM sales", "monotonically_increasing_id()"),
        ("SELECT spark_partition_id() AS p FROM sales", "SPARK_PARTITION_ID()"),
        ("SELECT input_file_name() AS f FROM sales", "input_file_name()"),
        (
            "SELECT reflect('java.util.UUID', 'randomUUID') AS u",
            "reflect('java.util.UUID', 'randomUUID')",
        ),
        ("SELECT transform(array(1, 2), x -> x + rand()) AS t", "rand() in transform("),
        ("SELECT * FROM sales WHERE id IN (SELECT id FROM sales WHERE rand() < 0.5)", "rand()"),
        # Spark calls these deterministic; replicas disagree.
        ("SELECT current_timestamp() AS t", "current_timestamp()"),
        ("SELECT CURRENT_TIMESTAMP AS t", "current_timestamp()"),
        ("SELECT now() AS t FROM sales", "now()"),
        ("SELECT current_date() AS d", "current_date()"),
        ("SELECT CURRENT_DATE AS d", "current_date()"),
        ("SELECT curdate() AS d", "current_date()"),
        ("SELECT localtimestamp() AS t", "localtimestamp()"),
        ("SELECT current_time() AS t", "current_time(6)"),
        ("SELECT current_timezone() AS z", "current_timezone()"),
        (
            "SELECT unix_timestamp() AS t",
            "current_timestamp() in unix_timestamp(current_timestamp()",
        ),
        ("SELECT * FROM sales WHERE ts > now() - INTERVAL 1 DAY", "now()"),
        ("SELECT date_diff(current_date(), day) AS age FROM sales", "current_date()"),
        (
            "WITH recent AS (SELECT * FROM sales WHERE ts > current_timestamp()) "
            "SELECT count(*) AS n FROM recent",
            "current_timestamp()",
        ),
        ("SELECT id, (SELECT max(ts) FROM sales WHERE ts < now()) AS m FROM sales", "now()"),
        ("SELECT CAST('now' AS TIMESTAMP) AS t", "CAST('now' AS TIMESTAMP)"),
        ("SELECT 'tomorrow'::DATE AS d", "CAST('tomorrow' AS DATE)"),
        ("SELECT try_cast(' Today ' AS DATE) AS d", "TRY_CAST(' Today ' AS DATE)"),
        ("SELECT TIMESTAMP 'now' AS t", "TIMESTAMP 'now'"),
        ("SELECT date'today' AS d", "date'today'"),
        ("SELECT current_user() AS u", "current_user()"),
        ("SELECT session_user() AS u", "session_user()"),
        ("SELECT current_database() AS d", "current_schema()"),  # Spark 4's name for it
        ("SELECT current_catalog() AS c", "current_catalog()"),
        ("SELECT version() AS v", "version()"),
        ("SELECT aes_encrypt(note, '0000111122223333') AS e FROM sales", "aes_encrypt("),
        ("SELECT * FROM sales TABLESAMPLE (10 PERCENT)", "TABLESAMPLE"),
        ("SELECT * FROM sales TABLESAMPLE (BUCKET 1 OUT OF 4)", "TABLESAMPLE"),
    ],
)
def test_nondeterministic_sql_is_refused_by_name(planner, sql, named):
    message = refusal(planner.analyze, sql, TABLES)
    assert "nondeterministic" in message
    assert named in message


@pytest.mark.parametrize(
    ("sql", "named"),
    [
        ("SELECT id FROM sales LIMIT 10", "LIMIT without ORDER BY is nondeterministic"),
        ("SELECT region, count(*) AS n FROM sales GROUP BY region LIMIT 2", "LIMIT without ORDER BY"),
        ("SELECT id FROM sales SORT BY amount LIMIT 3", "LIMIT without ORDER BY"),  # each partition alone
        ("SELECT id FROM sales OFFSET 2", "OFFSET without ORDER BY"),
        ("SELECT * FROM sales TABLESAMPLE (2 ROWS)", "TABLESAMPLE (n ROWS) is such a LIMIT"),
        ("SELECT * FROM (SELECT id FROM sales LIMIT 3) JOIN regions", "LIMIT without ORDER BY"),
        ("SELECT id FROM sales WHERE region IN (SELECT region FROM regions ORDER BY name LIMIT 1)", "inside a subquery expression"),  # its plan cannot be completed
        ("SELECT id FROM (SELECT id, map('a', amount) AS m FROM sales) ORDER BY m['a'] LIMIT 2", "cannot break ties"),
    ],
)
def test_a_limit_that_replicas_could_cut_differently_is_refused_saying_to_add_order_by(planner, sql, named):
    assert named in refusal(planner.analyze, sql, TABLES)


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT id FROM sales ORDER BY amount LIMIT 10",
        "SELECT id, amount FROM sales ORDER BY amount DESC LIMIT 3 OFFSET 1",
        "SELECT * FROM (SELECT id, region FROM sales WHERE amount > 1 ORDER BY region LIMIT 2) JOIN regions USING (region)",
    ],
)
def test_an_ordered_limit_is_planned(planner, sql):
    assert planner.analyze(sql, TABLES).not_incremental is not None


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT 'rand()' AS `rand`, 'now' AS x, 'current_timestamp()' AS y, id AS `uuid()` "
        "FROM sales",
        "SELECT rand, current_date, now, `uuid()` FROM odd",
        "SELECT 'timestamp ''now''' AS t, 'date' AS d",
        "SELECT id AS `version()`, note AS aes_encrypt FROM sales",
        "SELECT CAST('epoch' AS DATE) AS e, TIMESTAMP '2024-01-01 00:00:00' AS t",
        "SELECT unix_timestamp(ts) AS u, to_unix_timestamp(day) AS v, date_add(day, 1) AS w "
        "FROM sales",
        "SELECT aes_encrypt(note, '0000111122223333', 'ECB') AS e FROM sales",
        "SELECT aes_encrypt(note, '0000111122223333', 'GCM', 'DEFAULT', "
        "unhex('000000000000000000000000')) AS e FROM sales",
    ],
)
def test_deterministic_sql_that_looks_like_it_is_accepted(planner, sql):
    planner.analyze(sql, TABLES)


# --- Errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        (
            "SELECT sum(id FROM sales",
            "[PARSE_SYNTAX_ERROR] Syntax error at or near 'FROM': missing ')'. "
            "SQLSTATE: 42601 (line 1, pos 14)",
        ),
        (
            "SELECT id FROM sales\nWHERE (id > 1",
            "[PARSE_SYNTAX_ERROR] Syntax error at or near end of input. "
            "SQLSTATE: 42601 (line 2, pos 13)",
        ),
    ],
)
def test_parse_error_is_sparks_first_line(planner, sql, expected):
    assert refusal(planner.analyze, sql, TABLES) == expected


def test_commands_are_refused_before_spark_runs_them(planner):
    message = refusal(planner.analyze, "CREATE TEMPORARY VIEW v AS SELECT 1", TABLES)
    assert "not by a command (CreateViewCommand)" in message
    refusal(planner.analyze, "SELECT * FROM v", TABLES, code="NOT_FOUND")


def test_unknown_table_is_not_found(planner):
    sql = "SELECT * FROM sales JOIN nosuch USING (id)"
    message = refusal(planner.analyze, sql, TABLES, code="NOT_FOUND")
    assert message == (
        "unknown table `nosuch` (line 1 pos 25): the query may read only sales, regions, odd"
    )
    message = refusal(planner.analyze, "SELECT * FROM nosuch", {}, code="NOT_FOUND")
    assert "given no tables" in message


def test_files_are_never_read(planner, tmp_path):
    path = tmp_path / "data.parquet"
    message = refusal(planner.analyze, f"SELECT * FROM parquet.`{path}`", TABLES, code="NOT_FOUND")
    assert str(path) in message


def test_unknown_column_carries_sparks_suggestion(planner):
    message = refusal(planner.analyze, "SELECT amout FROM sales", TABLES)
    assert message.startswith("[UNRESOLVED_COLUMN.WITH_SUGGESTION]")
    assert "`amout`" in message and "`amount`" in message and "line 1 pos 7" in message


def test_unknown_function(planner):
    message = refusal(planner.analyze, "SELECT nosuch(id) FROM sales", TABLES)
    assert message.startswith("[UNRESOLVED_ROUTINE]") and "`nosuch`" in message


@pytest.mark.parametrize(
    ("sql", "column", "type_"),
    [
        ("SELECT map(region, id) AS m FROM sales", "'m'", "MAP<STRING, BIGINT>"),
        ("SELECT collect_list(id) AS ids FROM sales", "'ids'", "ARRAY<BIGINT>"),
        ("SELECT named_struct('a', id) AS s FROM sales", "'s'", "STRUCT<a: BIGINT NOT NULL>"),
        ("SELECT NULL AS nothing FROM sales", "'nothing'", "VOID (a bare NULL: give it a type"),
        ("SELECT ts - ts AS d FROM sales", "'d'", "INTERVAL DAY TO SECOND"),
        ("SELECT region COLLATE UTF8_LCASE AS r FROM sales", "'r'", "STRING COLLATE UTF8_LCASE"),
    ],
)
def test_unsupported_output_types_are_refused(planner, sql, column, type_):
    message = refusal(planner.analyze, sql, TABLES)
    assert f"output column {column} has type {type_}" in message
    assert "storage cannot hold" in message


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("SELECT id, id FROM sales", "column 'id' appears twice"),
        (
            "SELECT s.region, r.region FROM sales s JOIN regions r USING (region)",
            "column 'region' appears twice",
        ),
        ("SELECT id AS _time FROM sales", "reserved by storage"),
    ],
)
def test_output_that_is_not_a_storage_schema(planner, sql, expected):
    message = refusal(planner.analyze, sql, TABLES)
    assert message.startswith("the query's output is not a storage schema") and expected in message


@pytest.mark.parametrize(
    ("tables", "expected"),
    [
        ({"t": "m MAP<STRING, INT>"}, "table 't': column 'm': nested types"),
        ({"t": "x BIGINT, x STRING"}, "table 't': column 'x' appears twice"),
        ({"db.t": "x BIGINT"}, "plain identifier"),
        ({"t": "x BIGINT", "T": "y BIGINT"}, "differ only in case"),
        ({"t": 42}, "a schema is DDL or a pyarrow.Schema"),
    ],
)
def test_bad_input_tables(planner, tables, expected):
    assert expected in refusal(planner.analyze, "SELECT 1 AS one", tables)


# --- Last: nothing ran, and a stopped planner refuses -----------------------------------


# --- Incremental maintenance ----------------------------------------------------------


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT id, amount * 2 AS doubled, CASE WHEN amount > 10 THEN 'big' END AS size FROM sales WHERE day > DATE '2024-01-01'",
        "SELECT region, count(*) AS n, sum(amount) AS total, avg(amount) AS mean FROM sales GROUP BY region",
        "SELECT region, min(amount) AS lo, max(day) AS last, count(DISTINCT id) AS ids FROM sales GROUP BY region HAVING count(*) > 2",
        "SELECT r.name, sum(s.amount) / count(*) AS ratio FROM sales s JOIN regions r ON s.region = r.region GROUP BY r.name",
        "SELECT DISTINCT region FROM sales",
        "SELECT id FROM sales UNION ALL SELECT id FROM sales WHERE amount > 0",
        "SELECT count(*) AS n FROM sales",
        "SELECT region, sum(amount) AS total FROM sales GROUP BY region ORDER BY total DESC",
        "SELECT region, sum(amount) AS total FROM sales GROUP BY region ORDER BY total DESC LIMIT 3",
        "SELECT r.name FROM sales s JOIN regions r ON s.region = r.region GROUP BY r.name ORDER BY sum(s.amount) DESC LIMIT 3",
        "SELECT id FROM sales WHERE region IN (SELECT region FROM regions)",
        "SELECT id FROM sales WHERE amount > (SELECT avg(amount) FROM sales)",
        "WITH big AS (SELECT * FROM sales WHERE amount > 1) SELECT id FROM big",
        "SELECT name FROM regions r WHERE EXISTS (SELECT * FROM sales s WHERE s.region = r.region AND s.amount > 5)",
        "SELECT id FROM sales s WHERE amount > (SELECT avg(amount) FROM sales t WHERE t.region = s.region)",
        "SELECT r.name, t.total FROM (SELECT region, sum(amount) AS total FROM sales GROUP BY region) t JOIN regions r ON t.region = r.region",
        "SELECT name FROM regions r WHERE NOT EXISTS (SELECT * FROM sales s WHERE s.region = r.region)",
        "SELECT id FROM sales s WHERE EXISTS (SELECT * FROM sales t WHERE t.region = s.region AND t.id <> s.id)",
        # The IN and the NOT EXISTS test the same keys of sales: one key stage.
        "SELECT id FROM sales s WHERE region IN (SELECT region FROM regions) "
        "AND NOT EXISTS (SELECT * FROM regions r WHERE r.region = s.region AND r.name = 'x')",
    ],
)
def test_maintainable_shapes_are_incremental(planner, sql):
    assert planner.analyze(sql, TABLES).not_incremental is None


@pytest.mark.parametrize(
    ("sql", "reason"),
    [
        ("SELECT s.id, r.name FROM sales s LEFT JOIN regions r ON s.region = r.region", "left outer join"),
        ("SELECT id FROM sales WHERE region NOT IN (SELECT region FROM regions)", "NOT IN (subquery), a null-aware anti-join"),
        ("SELECT id FROM sales s WHERE id = (SELECT count(*) FROM regions r WHERE r.region = s.region)", "left outer join"),
        ("SELECT id, rank() OVER (ORDER BY amount) AS r FROM sales", "a window function"),
        ("SELECT id FROM sales ORDER BY amount LIMIT 10", "LIMIT over rows that are not an aggregate's"),
        ("SELECT region, stddev(amount) AS sd FROM sales GROUP BY region", "the aggregate stddev"),
        ("SELECT id FROM sales WHERE amount > (SELECT amount FROM sales WHERE id = 1)", "a subquery"),
    ],
)
def test_other_shapes_are_recomputed_and_the_planner_says_why(planner, sql, reason):
    assert reason in planner.analyze(sql, TABLES).not_incremental


def test_planning_ran_no_spark_job_and_stop_is_final(planner):
    tracker = planner._session.sparkContext.statusTracker()
    assert set(tracker.getJobIdsForGroup()) - planner.jobs_before == set()
    planner.stop()
    planner.stop()
    assert "stopped" in refusal(planner.analyze, "SELECT 1 AS one", {}, code="UNAVAILABLE")
    assert "stopped" in refusal(planner.referenced_tables, "SELECT 1", code="UNAVAILABLE")
