"""Comparing result rows with what Spark computes itself.

Tandem's sums of floating-point values are exact sums (whatever the order, so every
replica and every path gives the same bits), while Spark's own sum depends on the order
its partitions meet in: the two agree to within floating-point rounding, not bit for bit.
Everything else is compared exactly.
"""

from __future__ import annotations

import math

import pyarrow as pa


def _key(row: dict) -> list:
    return [(v is None, f"{v:.9g}" if isinstance(v, float) else str(v)) for v in row.values()]


def sorted_rows(table: pa.Table) -> list[dict]:
    """The rows as dicts, in an order that ignores the last bits of floats."""
    return sorted(table.to_pylist(), key=_key)


def assert_same_rows(actual: pa.Table, expected: pa.Table, *, rel: float = 1e-12) -> None:
    """Equal rows (as multisets), floats within `rel` of each other."""
    got, want = sorted_rows(actual), sorted_rows(expected)
    assert len(got) == len(want), f"{len(got)} rows, expected {len(want)}:\n{got}\n{want}"
    for a, b in zip(got, want):
        assert a.keys() == b.keys(), (a, b)
        for name in a:
            x, y = a[name], b[name]
            if isinstance(x, float) and isinstance(y, float):
                assert x == y or math.isclose(x, y, rel_tol=rel, abs_tol=rel) or (math.isnan(x) and math.isnan(y)), (name, a, b)
            else:
                assert x == y, (name, a, b)
