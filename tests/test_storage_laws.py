"""Laws of storage, checked with generated histories on SQLite and PostgreSQL:

- consolidation: the snapshot at t is the multiset sum of every update at or before t,
  and the changes in (a, b] are the updates in that range, summed per row and time;
- compaction does not change any read at or above since.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from history import Frontier
from storage import Storage, merge_run

Row = tuple[int, "str | None"]
Update = tuple[Row, int, int]  # (row, time, diff)

_names = itertools.count()
_ROWS = st.tuples(st.integers(0, 3), st.sampled_from(["a", "b", None]))


@st.composite
def histories(draw: st.DrawFn) -> list[tuple[int, list[Update]]]:
    """Appends as (new upper, updates in [previous upper, new upper)). Retractions
    never take a row's count below zero."""
    appends, upper, counts = [], 0, Counter[Row]()
    for _ in range(draw(st.integers(1, 5))):
        new_upper = upper + draw(st.integers(1, 3))
        updates = []
        for _ in range(draw(st.integers(0, 4))):
            row = draw(_ROWS)
            time = draw(st.integers(upper, new_upper - 1))
            updates.append((row, time, draw(st.sampled_from([1, 2, -1]))))
        updates.sort(key=lambda u: u[1])
        fixed = []
        for row, time, diff in updates:
            diff = diff if counts[row] + diff >= 0 else 1
            counts[row] += diff
            fixed.append((row, time, diff))
        appends.append((new_upper, fixed))
        upper = new_upper
    return appends


def write(storage: Storage, appends: list[tuple[int, list[Update]]]) -> str:
    id = storage.create_source(f"s{next(_names)}", "k INT NOT NULL, tag STRING").id
    upper = 0
    for new_upper, updates in appends:
        table = pa.table(
            {
                "k": [r[0] for r, _, _ in updates],
                "tag": pa.array([r[1] for r, _, _ in updates], pa.string()),
                "_time": [t for _, t, _ in updates],
                "_diff": [d for _, _, d in updates],
            }
        )
        storage.compare_and_append(id, Frontier(upper), Frontier(new_upper), table)
        upper = new_upper
    return id


def snapshot(storage: Storage, id: str, t: int) -> Counter[Row]:
    return Counter((r["k"], r["tag"]) for r in storage.read_snapshot(id, t).to_pylist())


def changes(storage: Storage, id: str, a: int, b: int) -> dict[tuple[Row, int], int]:
    return {
        ((r["k"], r["tag"]), r["_time"]): r["_diff"]
        for r in storage.read_changes(id, a, b).to_pylist()
    }


LAWS = settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@LAWS
@given(appends=histories())
def test_a_snapshot_is_the_sum_of_the_updates_up_to_it(storage: Storage, appends) -> None:  # type: ignore[no-untyped-def]
    id = write(storage, appends)
    updates = [u for _, batch in appends for u in batch]
    upper = appends[-1][0]
    for t in range(upper):
        expected = Counter[Row]()
        for row, time, diff in updates:
            if time <= t:
                expected[row] += diff
        assert snapshot(storage, id, t) == +expected, t
    for a, b in [(0, upper - 1), (upper // 2, upper - 1), (0, upper // 2)]:
        expected_changes: Counter[tuple[Row, int]] = Counter()
        for row, time, diff in updates:
            if a < time <= b:
                expected_changes[(row, time)] += diff
        assert changes(storage, id, a, b) == {k: v for k, v in expected_changes.items() if v}


@LAWS
@given(appends=histories(), data=st.data())
def test_compaction_keeps_every_read_at_or_above_since(storage: Storage, appends, data) -> None:  # type: ignore[no-untyped-def]
    id = write(storage, appends)
    upper = appends[-1][0]
    since = data.draw(st.integers(0, upper - 1), label="since")
    storage.acquire_read_hold(id, "law", Frontier(since))
    times = range(since, upper)
    # Changes after since - 1 are readable too: merged updates are stamped below since.
    starts = range(max(since - 1, 0), upper - 1)
    ranges = [(a, upper - 1) for a in starts] + [(a, b) for a in starts[:1] for b in times if b >= a]
    before = [snapshot(storage, id, t) for t in times]
    before_changes = [changes(storage, id, a, b) for a, b in ranges]

    merged = storage.compact(id)

    batches = storage.catalog.manifest(id).batches
    # What is left below since holds nothing worth merging: each batch more than twice
    # the rows of those after it.
    assert len(merge_run([b for b in batches if b.upper <= Frontier(since)])) <= 1
    assert merged == 0 or merged >= 2
    assert [snapshot(storage, id, t) for t in times] == before
    assert [changes(storage, id, a, b) for a, b in ranges] == before_changes
