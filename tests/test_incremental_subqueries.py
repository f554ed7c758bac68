"""Incremental maintenance of queries with stages (aggregates below joins) and
subqueries, on real Spark: the path-independence property of `test_incremental.py`
(incremental, recomputed, hydrated late and rebuilt: the same digest at every time, and
Spark's answer), for `IN`, `EXISTS`, `NOT EXISTS`, scalar subqueries and CTEs, which
the delta planner turns into joins with stages (ARCHITECTURE "Stages")."""

from __future__ import annotations

import pytest
from incremental_cases import check_shape, spark_env

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    yield from spark_env(tmp_path_factory)


SHAPES = {
    "aggregate_join": "SELECT u.z, a.k, a.s, a.m FROM (SELECT k, sum(n) AS s, max(x) AS m FROM t GROUP BY k) a JOIN u ON a.s = u.y",
    "in": "SELECT id, k, x FROM t WHERE id IN (SELECT id FROM u WHERE y > 0) AND n IS NOT NULL",
    "exists": "SELECT u.z, count(*) AS c, sum(u.y) AS s FROM u WHERE EXISTS (SELECT * FROM t WHERE t.id = u.id AND t.n >= 0) GROUP BY u.z",
    "scalar": "SELECT t.k, sum(t.x) AS s, count(*) AS c FROM t WHERE t.n < (SELECT avg(u.y) FROM u WHERE u.id = t.id) GROUP BY t.k",
    "outer_filtered": "SELECT t.id, u.y FROM t LEFT JOIN u ON t.id = u.id WHERE u.y > 0",
    "cte_max": "WITH r AS (SELECT k, sum(n) AS s FROM t GROUP BY k) SELECT k, s FROM r WHERE s = (SELECT max(s) FROM r)",
    "scalar_having": "SELECT k, sum(q) AS s FROM t GROUP BY k HAVING sum(q) > (SELECT sum(y) FROM u) / 10",
    "scalar_projection": "SELECT id, n * (SELECT count(*) FROM u) AS m FROM t",
    "in_pairs": "SELECT id, k, n FROM t WHERE (id, n) IN (SELECT id, y FROM u)",
    "exists_pairs": "SELECT id, k FROM t WHERE EXISTS (SELECT * FROM u WHERE u.id = t.id AND u.y = t.n AND t.n >= 0)",
    "nested": "SELECT id, k FROM t WHERE id IN (SELECT u.id FROM u WHERE u.y > (SELECT sum(b.n) FROM t b WHERE b.id = u.id))",
    # Anti-joins: L less its rows with a match; and a match on another value (`<>`).
    "not_exists": "SELECT id, k, n FROM t WHERE NOT EXISTS (SELECT * FROM u WHERE u.id = t.id AND u.y > 0)",
    "exists_other": "SELECT id, k FROM t a WHERE EXISTS (SELECT * FROM t b WHERE b.id = a.id AND b.k <> a.k)",
    "not_exists_other": (
        "SELECT k, count(*) AS c, sum(q) AS s FROM t a "
        "WHERE NOT EXISTS (SELECT * FROM t b WHERE b.id = a.id AND b.n <> a.n AND b.x > 0) GROUP BY k"
    ),
    # Two anti-joins: the first one's rows (a union) beside the second one's stage.
    "not_exists_twice": "SELECT id, k, n FROM t a WHERE NOT EXISTS (SELECT * FROM u WHERE u.id = a.id AND u.y > 0) AND NOT EXISTS (SELECT * FROM u v WHERE v.y = a.n)",
    "in_aggregate": "SELECT t.k, sum(t.q) AS s, count(*) AS c FROM t WHERE t.id IN (SELECT id FROM u GROUP BY id HAVING count(*) > 1) GROUP BY t.k",
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_incremental_equals_recompute_and_a_late_hydration_at_every_time(env, name):
    check_shape(env, name, SHAPES[name])
