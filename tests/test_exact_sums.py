"""Exact accumulators never overflow where Spark's own query does not (issue 49, item 2),
on real Spark through the path-independence harness (`run_shape`: incremental,
recomputed, hydrated late or rebuilt, each equal to Spark's answer at every time).

Each accumulator was asked where it can overflow that Spark's plain query does not:
- a DECIMAL wider than 18 digits is summed as base-10^9 digits: they are signed, so a
  group of thousands of negative values (refunds) sums as Spark's does (with digits in
  [0, 10^9) a few hundred of them overflowed DECIMAL(38,0) when rebuilt);
- AVG over integers: Spark sums them as doubles, which never overflow, so ours is exact
  in two BIGINT halves (a BIGINT sum failed at six values near 1.7e18);
- SUM over integers is a BIGINT, as Spark's is (both fail loudly past it, in ANSI
  mode); COUNT and the multiplicity are BIGINTs, as Spark's COUNT is; a DECIMAL of up to
  18 digits is two BIGINT halves, exact below 2^31 rows per group.
"""

from __future__ import annotations

from decimal import Decimal

import pytest
from incremental_cases import run_shape, spark_env

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    yield from spark_env(tmp_path_factory)


def row(id: int, k: str, q: str | None = None, n: int | None = None) -> dict:
    return {"id": id, "k": k, "x": None, "q": None if q is None else Decimal(q), "n": n}


def test_wide_decimal_sums_of_thousands_of_negative_positive_and_mixed_values(env):
    # DECIMAL(38,2) and (38,6) arguments: five base-10^9 digits each, the largest values
    # q holds (99999999.99) scaled up to 36 digits.
    sql = (
        "SELECT k, sum(CAST(q AS DECIMAL(38,2))) AS s, avg(CAST(q AS DECIMAL(38,2))) AS a, "
        "sum(CAST(q AS DECIMAL(38,6)) * 3) AS wide, "
        "sum(CAST(q AS DECIMAL(38,2)) * CAST('1000000000000000000' AS DECIMAL(19,0))) AS big "
        "FROM t GROUP BY k"
    )
    negative = [row(i, "neg", "-99999999.99") for i in range(1500)] + [row(1500, "neg", "-1.10")]
    positive = [row(i, "pos", "99999999.99") for i in range(1500)]
    mixed = [row(i, "mix", "-99999999.99" if i % 3 else "99999999.99") for i in range(2000)]
    sequence = [
        (negative + positive + mixed, [], [{"id": 0, "y": 0, "z": "p"}], [], []),
        ([row(9000 + i, "neg", "-0.01") for i in range(200)], list(range(100)), [], [], []),  # retractions too
        ([row(9500, "mix", "99999999.99")], [0, 1, 2], [], [], []),
    ]
    run_shape(env, "wide", sql, sequence, sql, ("late",), frozenset())


def test_avg_of_large_integers_does_not_overflow_where_sparks_does_not(env):
    # Six values near 1.7e18 in one group: their BIGINT sum overflows, Spark's AVG (a
    # double sum) does not; the group's SUM would overflow in Spark too, so it is not asked.
    sql = "SELECT k, avg(CAST(n AS BIGINT) * 850000000) AS a, avg(n) AS an, count(n) AS c FROM t GROUP BY k"
    large = [row(i, "a", n=2_000_000_000) for i in range(6)]
    negative = [row(10 + i, "b", n=-2_000_000_000) for i in range(6)]
    sequence = [
        (large + negative + [row(20, "c", n=7)], [], [{"id": 0, "y": 0, "z": "p"}], [], []),
        ([row(30, "a", n=2_147_483_647), row(31, "b", n=-2_147_483_648)], [0], [], [], []),
        ([], [0, 5], [], [], []),
    ]
    run_shape(env, "avg_large", sql, sequence, sql, ("restored",), frozenset())
