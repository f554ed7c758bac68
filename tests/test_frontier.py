"""Lattice laws of `Frontier` (DESIGN section 2): meet is min, join is max, the empty
frontier is the top and the minimum (0) the bottom, and the order agrees with both."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from history import Frontier, join_all, meet_all

# Small times make equal frontiers, and frontiers at 0, frequent.
times = st.integers(0, 20) | st.integers(0, 2**62)
frontiers = st.one_of(
    st.just(Frontier.empty()), st.just(Frontier.minimum()), times.map(Frontier.at)
)

EMPTY = Frontier.empty()
BOTTOM = Frontier.minimum()


def test_empty_and_minimum_are_what_they_say():
    assert EMPTY.is_empty and EMPTY.time is None
    assert not BOTTOM.is_empty and BOTTOM.time == 0
    assert Frontier.at(0) == BOTTOM
    assert Frontier(None) == EMPTY


@given(frontiers, frontiers)
def test_meet_and_join_commute(a, b):
    assert a.meet(b) == b.meet(a)
    assert a.join(b) == b.join(a)


@given(frontiers, frontiers, frontiers)
def test_meet_and_join_associate(a, b, c):
    assert a.meet(b).meet(c) == a.meet(b.meet(c))
    assert a.join(b).join(c) == a.join(b.join(c))


@given(frontiers)
def test_meet_and_join_are_idempotent(a):
    assert a.meet(a) == a
    assert a.join(a) == a


@given(frontiers, frontiers)
def test_absorption(a, b):
    assert a.meet(a.join(b)) == a
    assert a.join(a.meet(b)) == a


@given(frontiers, frontiers)
def test_meet_is_min_and_join_is_max_of_the_two(a, b):
    assert a.meet(b) in (a, b) and a.join(b) in (a, b)
    assert a.meet(b) <= a and a.meet(b) <= b
    assert a.join(b) >= a and a.join(b) >= b


@given(frontiers)
def test_empty_is_top_and_minimum_is_bottom(a):
    assert a <= EMPTY and a.meet(EMPTY) == a and a.join(EMPTY) == EMPTY
    assert BOTTOM <= a and a.join(BOTTOM) == a and a.meet(BOTTOM) == BOTTOM


@given(frontiers, frontiers)
def test_order_agrees_with_meet_and_join(a, b):
    le = a <= b
    assert le == (a.meet(b) == a)
    assert le == (a.join(b) == b)
    assert (a < b) == (le and a != b)
    assert (a >= b) == (b <= a)
    assert (a > b) == (b < a)


@given(frontiers, frontiers)
def test_order_is_total(a, b):
    assert a <= b or b <= a
    assert (a <= b and b <= a) == (a == b)
    assert [a < b, a == b, a > b].count(True) == 1


@given(frontiers, frontiers, frontiers)
def test_order_is_transitive(a, b, c):
    if a <= b and b <= c:
        assert a <= c


@given(times, times)
def test_order_of_times_is_the_order_of_ints(s, t):
    assert (Frontier.at(s) <= Frontier.at(t)) == (s <= t)
    assert Frontier.at(s) < EMPTY


@given(frontiers, st.integers(0, 30))
def test_step_back_is_below_the_input_and_saturates_at_zero(a, by):
    back = a.step_back(by)
    assert back <= a
    if a.is_empty:
        assert back == EMPTY
    else:
        assert back.time == max(a.time - by, 0)


@given(frontiers, frontiers, st.integers(0, 30))
def test_step_back_is_monotone(a, b, by):
    if a <= b:
        assert a.step_back(by) <= b.step_back(by)


def test_step_back_examples():
    assert Frontier.at(10).step_back() == Frontier.at(9)
    assert Frontier.at(0).step_back() == BOTTOM
    assert Frontier.at(3).step_back(5) == BOTTOM
    assert EMPTY.step_back(100) == EMPTY


@given(frontiers, times)
def test_includes_and_is_complete(a, t):
    """A time is included (may still change) iff it is not complete; the empty frontier
    includes nothing, the minimum includes everything."""
    assert a.includes(t) != a.is_complete(t)
    assert a.includes(t) == (a.time is not None and t >= a.time)
    assert not EMPTY.includes(t) and EMPTY.is_complete(t)
    assert BOTTOM.includes(t)


@given(frontiers, frontiers, times)
def test_includes_shrinks_as_the_frontier_advances(a, b, t):
    if a <= b and b.includes(t):
        assert a.includes(t)


def test_includes_at_the_boundary():
    f = Frontier.at(5)
    assert f.includes(5) and f.includes(6)
    assert not f.includes(4) and f.is_complete(4)


@given(st.lists(frontiers))
def test_meet_all_and_join_all_fold(items):
    expected_meet, expected_join = EMPTY, BOTTOM
    for item in items:
        expected_meet, expected_join = expected_meet.meet(item), expected_join.join(item)
    assert meet_all(items) == expected_meet
    assert join_all(items) == expected_join
    assert meet_all(iter(items)) == expected_meet  # any iterable, consumed once
    if items:
        assert meet_all(items) == min(items) and join_all(items) == max(items)


def test_meet_all_and_join_all_identities_on_empty_input():
    assert meet_all([]) == EMPTY  # top: the identity of meet
    assert join_all([]) == BOTTOM  # bottom: the identity of join
    assert meet_all(iter(())) == EMPTY and join_all(iter(())) == BOTTOM


@given(frontiers)
def test_frontiers_are_values(a):
    assert Frontier(a.time) == a and hash(Frontier(a.time)) == hash(a)
    with pytest.raises(AttributeError):
        a.time = 3  # type: ignore[misc]
    assert a.time == Frontier(a.time).time


def test_repr_is_readable():
    assert repr(EMPTY) == "Frontier([])"
    assert repr(BOTTOM) == "Frontier([0])"
    assert repr(Frontier.at(1234)) == "Frontier([1234])"


@pytest.mark.parametrize("bad", [-1, -(2**70), 1.0, 0.0, "3", True, False, [1], (1,)])
def test_invalid_times_are_rejected(bad):
    with pytest.raises(ValueError, match="non-negative int"):
        Frontier(bad)
    with pytest.raises(ValueError, match="non-negative int"):
        Frontier.at(bad)


@given(st.integers(max_value=-1))
def test_every_negative_time_is_rejected(t):
    with pytest.raises(ValueError):
        Frontier.at(t)
