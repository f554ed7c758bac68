"""The health of a compute instance and its replicas, read off its state: hydration,
lag behind `W` and behind the clock, which dataflows serve where, in-sync replicas, the
instance's health, and gray failure (a replica that loses every read by far).

`InstanceHealth` is a part of `ComputeInstance` (its base class) kept in a file of its
own: it reads the instance's `replicas`, `collections`, `dataflows`, `names`, `options`
and `now_ms`, and changes nothing but the races its replicas lost (`ReplicaState.losing`). Like the instance, it does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Collection, Literal

from history import Frontier, Peek

if TYPE_CHECKING:
    from controller._instance import ReplicaPhase, ReplicaState


@dataclass(frozen=True, slots=True)
class ReplicaHealth:
    """One replica's health (see `ComputeInstance.health`)."""

    name: str
    epoch: int
    phase: ReplicaPhase
    hydrated: bool
    in_sync: bool  # for every dataflow: not failed, hydrated, within max_lag_ms
    in_sync_where_served: bool  # the same, but only for dataflows some replica serves
    lag_ms: int | None  # None: not hydrated somewhere, so the lag is unbounded
    peeks_won: int
    wallclock_lag_ms: int | None = None  # now - its write frontier, at worst; None as lag_ms
    slow: bool = False  # a gray failure: see `ComputeInstance._slow`


@dataclass(slots=True)
class LosingStreak:
    """The races in a row a replica lost by far (see `InstanceHealth._note_race`): when
    the first and the last were lost, and how many."""

    since_ms: int
    last_ms: int
    races: int = 1


class InstanceHealth:
    """The health methods of `ComputeInstance` (see the module)."""

    def _note_race(self, peek: Peek, winner: ReplicaState) -> None:
        """A race for `peek` was won: the winner is not losing; every other active
        replica that still had more than `slow_after_ms` to compute before it could
        answer (its write frontiers that far from the peek's time) lost by that much,
        and one that had less did not lose by far. A loss by far more than
        `slow_period_ms` after the last starts a new streak: in between, nothing said
        whether the replica was behind."""
        winner.losing = None
        for replica in self.replicas.values():
            if replica is winner or replica.phase != "active":
                continue
            behind = 0
            for id in peek.target.collection_ids:
                frontier = replica.frontiers.get(id)
                if frontier is None:
                    behind = None  # not hydrated: slow at something else
                    break
                if not frontier.is_empty:
                    behind = max(behind, peek.timestamp + 1 - frontier.time)
            if behind is None:
                continue
            streak = replica.losing
            if behind <= self.options.slow_after_ms:
                replica.losing = None
            elif streak is None or self.now_ms - streak.last_ms > self.options.slow_period_ms:
                replica.losing = LosingStreak(self.now_ms, self.now_ms)
            else:
                streak.last_ms, streak.races = self.now_ms, streak.races + 1

    def _slow(self, replica: ReplicaState) -> bool:
        """A gray failure (alive, answering heartbeats, but behind): its streak of races
        lost by far holds at least `slow_min_races` races over at least
        `slow_period_ms`, and its last loss is at most `slow_period_ms` old. One race
        lost, or races a while ago (an idle instance's), say nothing."""
        streak = replica.losing
        return (
            replica.phase == "active"
            and streak is not None
            and streak.races >= self.options.slow_min_races
            and streak.last_ms - streak.since_ms >= self.options.slow_period_ms
            and self.now_ms - streak.last_ms <= self.options.slow_period_ms
        )

    def _slowness(self, replica: ReplicaState) -> str:
        """What makes a slow replica slow, in words."""
        streak = replica.losing
        return (
            f"it lost each of the last {streak.races} reads it raced in by more than "
            f"{self.options.slow_after_ms} ms, over {streak.last_ms - streak.since_ms} ms"
        )

    def _dataflow_error(self, replica: ReplicaState, key: str) -> str | None:
        """The error with which `replica` last reported dataflow `key` failed, if it did."""
        status = replica.dataflow_status.get(key)
        return None if status is None else status.error

    def hydrated(self, replica: ReplicaState, id: str) -> bool:
        """`replica` computed collection `id` past the as_of it was given: a replica added
        or rehydrated late is replayed the dataflow at its since, and reports that as_of
        at once. A dropped export (empty since) no longer counts."""
        collection = self.collections[id]
        if collection.since.is_empty:
            return True
        frontier = replica.frontiers.get(id)
        return frontier is not None and frontier > replica.as_ofs.get(id, collection.as_of)

    def _why_not_serving(self, replica: ReplicaState, key: str) -> str | None:
        """Why `replica` cannot answer reads of dataflow `key` now; None when it can: it is
        active, has not reported the dataflow failed, and is hydrated for every export.
        (Replica-wide errors stop progress, not reads of what it holds.)"""
        if replica.phase != "active":
            return f"{replica.name} is {replica.phase}"
        if replica.diverged is not None:
            return f"{replica.name} diverged on {replica.diverged}"
        error = self._dataflow_error(replica, key)
        if error is not None:
            return f"failed on {replica.name}: {error}"
        if not all(self.hydrated(replica, id) for id in self.dataflows[key].export_ids):
            return f"not hydrated on {replica.name}"
        return None

    def _unservable(self) -> dict[str, str]:
        """Dataflow key -> why no replica can serve it (each replica's reason), for every
        dataflow with a readable export."""
        result = {}
        for key, dataflow in self.dataflows.items():
            if all(self.collections[id].since.is_empty for id in dataflow.export_ids):
                continue
            reasons = []
            for replica in self.replicas.values():
                reason = self._why_not_serving(replica, key)
                if reason is None:
                    break
                reasons.append(reason)
            else:
                result[key] = "; ".join(reasons) or "no replicas"
        return result

    def unavailable_dataflows(self) -> dict[str, str]:
        """Live dataflow name -> why no replica can serve it, e.g. "failed on r1: ...;
        not hydrated on r2". A peek of one that every active replica reports failed is
        refused at once (see `peek`)."""
        unservable = self._unservable()
        return {name: unservable[key] for name, key in self.names.items() if key in unservable}

    def _lag_ms(self, replica: ReplicaState, excused: Collection[str] = ()) -> int | None:
        """The most `replica` lags W over the exports of every dataflow not `excused`;
        None when it is not hydrated for one of them (the lag is unbounded)."""
        lag = 0
        for key, dataflow in self.dataflows.items():
            if key in excused:
                continue
            for id in dataflow.export_ids:
                if self.collections[id].since.is_empty:
                    continue
                if not self.hydrated(replica, id):
                    return None
                write, frontier = self.collections[id].write_frontier, replica.frontiers.get(id)
                if frontier is not None and not write.is_empty:
                    lag = max(lag, write.time - (write.time if frontier.is_empty else frontier.time))
        return lag

    def wallclock_lag_ms(self, frontier: Frontier) -> int | None:
        """How far `frontier` is behind the clock (times are ms); None once empty."""
        return None if frontier.is_empty else max(0, self.now_ms - frontier.time)

    def _replica_wallclock_lag_ms(self, replica: ReplicaState) -> int:
        """The most `replica`'s reported write frontiers are behind the clock, over the
        live collections (call only when it is hydrated: each has a report)."""
        lags = [self.wallclock_lag_ms(replica.frontiers[id]) for id, c in self.collections.items() if not c.since.is_empty and id in replica.frontiers]
        return max((lag for lag in lags if lag is not None), default=0)

    def stale_collections(self) -> dict[str, int]:
        """Live collection id -> its wallclock lag, for those whose W is more than
        `max_lag_ms` behind the clock: stale on every replica."""
        result = {}
        for id, collection in self.collections.items():
            lag = self.wallclock_lag_ms(collection.write_frontier)
            if not collection.since.is_empty and lag is not None and lag > self.options.max_lag_ms:
                result[id] = lag
        return result

    def _in_sync(self, replica: ReplicaState, excused: Collection[str] = ()) -> bool:
        """Active, no replica-wide errors, and for every dataflow not `excused`: not failed
        on it, hydrated, and within `max_lag_ms` of W."""
        if replica.phase != "active" or replica.diverged is not None or (replica.status is not None and replica.status.errors):
            return False
        if any(self._dataflow_error(replica, key) is not None for key in self.dataflows if key not in excused):
            return False
        lag = self._lag_ms(replica, excused)
        return lag is not None and lag <= self.options.max_lag_ms

    def health(self) -> list[ReplicaHealth]:
        """Each replica's health. `in_sync` is strict: a replica with a failed dataflow is
        not in sync, even where no replica can serve that dataflow. `in_sync_where_served`
        excuses the dataflows no replica serves: it is what `min_in_sync` counts when a
        replica is dropped (see `check_drop_replica`)."""
        excused = self._unservable()
        result = []
        for replica in self.replicas.values():
            lag = self._lag_ms(replica) if replica.phase == "active" else None
            result.append(
                ReplicaHealth(
                    replica.name,
                    replica.epoch,
                    replica.phase,
                    hydrated=lag is not None,
                    in_sync=self._in_sync(replica),
                    in_sync_where_served=self._in_sync(replica, excused),
                    lag_ms=lag,
                    peeks_won=replica.peeks_won,
                    wallclock_lag_ms=None if lag is None else self._replica_wallclock_lag_ms(replica),
                    slow=self._slow(replica),
                )
            )
        return result

    def state(self) -> Literal["healthy", "degraded", "unavailable"]:
        """`healthy` when at least `min_in_sync` replicas (and at least one) are strictly
        in sync, which implies every dataflow serves, and no collection is stale (W
        within `max_lag_ms` of the clock); `unavailable` when no replica is in sync and
        no dataflow serves anywhere; `degraded` otherwise, e.g. when a dataflow failed on
        every replica while the others serve (`unavailable_dataflows` names it)."""
        in_sync = sum(1 for h in self.health() if h.in_sync)
        if in_sync >= max(1, self.options.min_in_sync):
            return "degraded" if self.stale_collections() else "healthy"
        if in_sync:
            return "degraded"
        serving = any(
            self._why_not_serving(r, key) is None
            for key in self.names.values()
            for r in self.replicas.values()
        )
        return "degraded" if serving else "unavailable"
