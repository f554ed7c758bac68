"""Timestamps and frontiers over a total order of non-negative int timestamps.

A frontier is a lower bound on the times that may still change. Because times are
totally ordered, a frontier is either a single timestamp or *empty*: closed, nothing will
ever change again. Ordered by the times they admit, the empty frontier is the top
element: `meet` is min, `join` is max.

This module may not import anything beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

Timestamp = int


@dataclass(frozen=True, slots=True)
class Frontier:
    """A frontier: one timestamp, or empty (`time is None`).

    Invariants: `time` is None or a non-negative int. `Frontier.minimum()` is the bottom
    element, `Frontier.empty()` the top; every pair has a meet and a join.
    """

    time: Timestamp | None

    def __post_init__(self) -> None:
        if self.time is not None and (type(self.time) is not int or self.time < 0):
            raise ValueError(f"a frontier time must be a non-negative int, not {self.time!r}")

    @staticmethod
    def minimum() -> Frontier:
        return _MINIMUM

    @staticmethod
    def empty() -> Frontier:
        return _EMPTY

    @staticmethod
    def at(time: Timestamp) -> Frontier:
        return Frontier(time)

    @property
    def is_empty(self) -> bool:
        return self.time is None

    def includes(self, time: Timestamp) -> bool:
        """True iff updates at `time` may still arrive: `time` is not complete."""
        return self.time is not None and time >= self.time

    def is_complete(self, time: Timestamp) -> bool:
        """True iff every update at `time` is known (`time < frontier`)."""
        return not self.includes(time)

    # meet and join compare times directly rather than through `_key`: they are the
    # controller's inner loop (every frontier report recomputes holds with them).
    def meet(self, other: Frontier) -> Frontier:
        """Greatest lower bound: the smaller frontier."""
        mine, theirs = self.time, other.time
        if mine is None:
            return other
        return self if theirs is None or mine <= theirs else other

    def join(self, other: Frontier) -> Frontier:
        """Least upper bound: the larger frontier."""
        mine, theirs = self.time, other.time
        if mine is None:
            return self
        return other if theirs is None or theirs > mine else self

    def step_back(self, by: int = 1) -> Frontier:
        """The frontier `by` ticks earlier, saturating at the minimum; empty stays empty.

        Used for the largest readable time below a write frontier (`W - 1`).
        """
        if self.time is None:
            return self
        return Frontier(max(self.time - by, 0))

    def _key(self) -> float:
        return float("inf") if self.time is None else self.time

    def __lt__(self, other: Frontier) -> bool:
        return self._key() < other._key()

    def __le__(self, other: Frontier) -> bool:
        return self._key() <= other._key()

    def __gt__(self, other: Frontier) -> bool:
        return self._key() > other._key()

    def __ge__(self, other: Frontier) -> bool:
        return self._key() >= other._key()

    def __repr__(self) -> str:
        return "Frontier([])" if self.time is None else f"Frontier([{self.time}])"


_MINIMUM = Frontier(0)
_EMPTY = Frontier(None)


def meet_all(frontiers: Iterable[Frontier]) -> Frontier:
    """The meet of any number of frontiers; the empty frontier (top) if there are none."""
    result = _EMPTY
    for frontier in frontiers:
        result = result.meet(frontier)
    return result


def join_all(frontiers: Iterable[Frontier]) -> Frontier:
    """The join of any number of frontiers; the minimum (bottom) if there are none."""
    result = _MINIMUM
    for frontier in frontiers:
        result = result.join(frontier)
    return result
