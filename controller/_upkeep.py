"""Storage upkeep: what keeps the batches and manifest rows of every storage collection
bounded under a steady stream of appends (DESIGN section 3, "Storage compaction").

Rules of this module:
- Every live storage collection carries the read hold `tandem/retention` at
  `upper - 1 - retention_ms` (never below since, never moved back): its since follows its
  upper at that distance when no dataflow holds it lower, so even a source that nothing
  reads gets compacted. A pass acquires the hold when it is missing and moves it forward;
  a dropped collection loses it with its other holds (the catalog deletes them).
- The retention window is also what keeps `create_dataflow` safe: it picks `as_of` at
  `upper - 1` and its dataflow takes its own holds a moment later, by which time this
  hold has moved at most as far as the upper, still `retention_ms` behind it.
- A collection is compacted once at least `compact_min_batches` of its batches lie wholly
  below since. Garbage is collected at most once per `gc_interval_ms`, with a grace of
  `gc_grace_ms`: a batch retired by compaction is deleted only after it, so a reader
  holding a plan must be done with it within the grace (see `storage._storage`).
- A pass blocks (catalog and files): the controller runs it on a worker thread. It moves
  no upper, so appends never wait for it, nor it for them.
- Every pass first removes the read holds whose owner is gone (`remove_orphans`: a
  dropped dataflow's, a feed of an older controller or one this controller closed),
  which would otherwise hold a since back for good; the controller does it at start
  too, and makes each removal an event and a count.
- `Fenced` propagates: a fenced controller must stop. Any other failure with one
  collection is logged and the pass goes on with the others; the next pass retries it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from catalog import CollectionInfo, Fenced, HoldInfo, HoldOwner, InvalidArgument, ManifestState, NotFound
from history import Frontier
from storage import DEFAULT_GRACE_MS, GarbageReport, Storage

log = logging.getLogger(__name__)

RETENTION_HOLDER = "tandem/retention"  # instance holders are "<instance>/u<n>": no clash


@dataclass(frozen=True, slots=True)
class UpkeepOptions:
    """How often upkeep runs and how much it keeps (times in milliseconds). A bad value
    is InvalidArgument."""

    interval_ms: int = 5_000
    retention_ms: int = 60_000
    compact_min_batches: int = 8
    gc_grace_ms: int = DEFAULT_GRACE_MS
    gc_interval_ms: int = 60_000

    def __post_init__(self) -> None:
        minimums = {"interval_ms": 1, "compact_min_batches": 2}
        for name in self.__dataclass_fields__:
            value, minimum = getattr(self, name), minimums.get(name, 0)
            if type(value) is not int or value < minimum:
                raise InvalidArgument(f"{name} must be an int >= {minimum}, not {value!r}")


@dataclass(slots=True)
class UpkeepPass:
    """What one pass did: the orphaned holds it removed, batches replaced per compacted
    collection, and the garbage report if it collected garbage."""

    orphans: tuple[HoldInfo, ...] = ()
    compacted: dict[str, int] = field(default_factory=dict)
    garbage: GarbageReport | None = None


class StorageUpkeep:
    """Retention holds, compaction and garbage collection over one `Storage`, whose
    catalog must be the controller's (its writes are fenced). `open_feeds` names the
    holders of the controller's open storage feeds (`_subscribe.OpenFeeds`). `clock`
    (seconds, monotonic) paces garbage collection."""

    def __init__(
        self,
        storage: Storage,
        options: UpkeepOptions = UpkeepOptions(),
        *,
        open_feeds: Callable[[], Collection[str]] = frozenset,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.storage = storage
        self.options = options
        self._open_feeds = open_feeds
        self._clock = clock
        self._last_gc: float | None = None  # when this object last collected garbage

    def remove_orphans(self) -> list[HoldInfo]:
        """Remove the holds whose owner is gone; returns them."""
        return self.storage.catalog.remove_orphaned_holds(self._open_feeds)

    def run_once(self) -> UpkeepPass:
        """Orphaned holds, then one pass over every live storage collection, then
        garbage if it is due."""
        result = UpkeepPass(orphans=tuple(self.remove_orphans()))
        for info in self.storage.catalog.list_collections():
            if info.namespace != "storage":
                continue
            try:
                replaced = self._keep(info)
            except Fenced:
                raise
            except NotFound:
                continue  # dropped since the listing: its holds went with it
            except Exception:
                log.exception("storage upkeep of %s (%s) failed", info.id, info.name)
                continue
            if replaced:
                result.compacted[info.id] = replaced
        now = self._clock()
        if self._last_gc is None or now - self._last_gc >= self.options.gc_interval_ms / 1000:
            result.garbage = self.storage.collect_garbage(self.options.gc_grace_ms)
            self._last_gc = now
        return result

    def _keep(self, info: CollectionInfo) -> int:
        """Move the retention hold of one collection, then compact it if enough batches
        lie below its since; returns how many batches compaction replaced."""
        state = self.storage.catalog.manifest(info.id)
        since = self._retain(state)
        below = sum(1 for batch in state.batches if batch.upper <= since)
        if below < self.options.compact_min_batches:
            return 0
        return self.storage.compact(info.id, min_batches=self.options.compact_min_batches)

    def _retain(self, state: ManifestState) -> Frontier:
        """Hold the collection at `upper - 1 - retention_ms`; returns its since."""
        info = state.collection
        if info.upper.is_empty:
            return info.since  # closed: no later time to follow, the hold stays put
        target = info.upper.step_back(1 + self.options.retention_ms).join(info.since)
        held = dict(state.holds).get(RETENTION_HOLDER)
        if held is None:
            return self.storage.acquire_read_hold(info.id, RETENTION_HOLDER, target, HoldOwner.retention())
        if target > held:
            return self.storage.downgrade_read_hold(info.id, RETENTION_HOLDER, target)
        return info.since
