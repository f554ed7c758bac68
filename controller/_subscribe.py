"""Subscriptions: the change feed of a collection, in time order, for as long as the
client reads it.

A feed is a sequence of `SubscribeBatch`es: updates `(row, _time, _diff)` and progress.
Progress `P` promises that every update at a time at or before `P` has been delivered:
the feed consolidated through `P` is the collection at `P`, and a client that lost its
stream resumes with `as_of=P, snapshot=False` to get exactly the changes after it.

Storage collections (sources and materialized views) are read from their batches, which
are durable: the feed is exactly once by construction, whatever replicas do. While the
feed is open it holds the collection's `since` where it has to read next. The hold is
owned by the feed of this controller's epoch (`HoldOwner.feed`), and the feed is among
`OpenFeeds` from before it takes the hold until it is done with it: a hold a crashed or
fenced controller left, or one whose release failed, is removed by storage upkeep
(`Catalog.remove_orphaned_holds`).

A dataflow's index is followed through its replicas: the instance subscribes every
replica to it and forwards each time's changes once, from whichever replica reports
that time first (`ComputeInstance.subscribe`); the driver hands them to the feed.

A slow consumer cannot grow the controller's memory: the feed is produced into a
bounded queue, and a producer that finds it full ends the feed with
RESOURCE_EXHAUSTED, saying where to resume.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pyarrow as pa

from controller._api import ControllerError, SubscribeBatch
from history import Frontier, SubscribeChanges
from catalog import FailedPrecondition, HoldOwner, InvalidArgument, NotFound
from protocol import ipc_to_table
from storage import DIFF, TIME, Storage

POLL_S = 0.05  # how often an open feed looks for a new upper
CLOSED_THROUGH = 2**62  # "every time" for the last read of a closed collection
QUEUE_BATCHES = 256  # batches produced and not yet taken by the client, at most

log = logging.getLogger(__name__)


class OpenFeeds:
    """The holders of this controller's open storage feeds. Thread-safe: feeds add and
    discard themselves on worker threads, storage upkeep reads it on its own; calling
    it gives a copy."""

    def __init__(self) -> None:
        self._holders: set[str] = set()
        self._lock = threading.Lock()

    def add(self, holder: str) -> None:
        with self._lock:
            self._holders.add(holder)

    def discard(self, holder: str) -> None:
        with self._lock:
            self._holders.discard(holder)

    def __call__(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._holders)


@dataclass(frozen=True, slots=True)
class FeedRequest:
    collection_id: str
    name: str
    as_of: int
    up_to: int | None
    snapshot: bool
    progress: bool


class _Feed:
    """What every feed does for its client: a bounded queue of batches, then None (the
    end) or a `ControllerError` (how it ended)."""

    def __init__(self, request: FeedRequest) -> None:
        self.request = request
        self.delivered: int | None = None  # progress of the last batch the client took
        self._queue: asyncio.Queue[SubscribeBatch | ControllerError | None] = asyncio.Queue(QUEUE_BATCHES)

    def __aiter__(self) -> AsyncIterator[SubscribeBatch]:
        return self._batches()

    async def _batches(self) -> AsyncIterator[SubscribeBatch]:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, ControllerError):
                raise item
            if item.progress is not None:
                self.delivered = item.progress
            yield item

    def _put(self, item: SubscribeBatch | None) -> None:
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            resume = (
                f"with as_of={self.delivered} and snapshot off, the last progress it received"
                if self.delivered is not None
                else "as before: it received nothing"
            )
            raise ControllerError(
                "RESOURCE_EXHAUSTED",
                f"the subscriber to {self.request.name} fell {QUEUE_BATCHES} batches behind and was dropped; subscribe again {resume}",
            ) from None

    def _end(self, error: ControllerError) -> None:
        """End the feed with `error` as the client's next item: what is queued was never
        taken, and a client resumes from the progress it did take."""
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(error)


class StorageFeed(_Feed):
    """The feed of one storage collection. Take its hold with `hold` (or it refuses and
    holds nothing), `start` it, iterate it; `close` it (it always releases the hold)."""

    def __init__(self, storage: Storage, request: FeedRequest, open_feeds: OpenFeeds) -> None:
        super().__init__(request)
        self.storage = storage
        self.holder = f"subscribe:{uuid.uuid4().hex}"
        self._open_feeds = open_feeds
        self._producer: asyncio.Task | None = None

    def hold(self) -> None:
        """Take the feed's hold at `as_of` (blocking), owned by the feed of the storage
        catalog's controller epoch: `FailedPrecondition` when the since moved past it
        after it was checked. Then `start` it."""
        request = self.request
        self._open_feeds.add(self.holder)  # before the hold exists: upkeep must see it open
        try:
            owner = HoldOwner.feed(self.storage.catalog.epoch or 0)
            self.storage.acquire_read_hold(request.collection_id, self.holder, Frontier(request.as_of), owner)
        except InvalidArgument as error:
            self._open_feeds.discard(self.holder)
            raise FailedPrecondition(f"cannot subscribe to {request.name} as of {request.as_of}: {error}") from None
        except BaseException:
            self._open_feeds.discard(self.holder)
            raise

    def start(self) -> StorageFeed:
        self._producer = asyncio.get_running_loop().create_task(self._produce())
        return self

    async def close(self) -> None:
        if self._producer is not None:
            self._producer.cancel()
            try:
                await self._producer
            except (asyncio.CancelledError, Exception):
                pass
        await asyncio.to_thread(self._release)

    def _release(self) -> None:
        try:
            self.storage.release_read_hold(self.request.collection_id, self.holder)
        except NotFound:
            pass  # dropped with its collection, or removed by upkeep already
        except Exception as error:  # the catalog away, fenced: upkeep removes it, as the feed is closed
            log.warning("the feed of %s could not release its hold %s: %s; storage upkeep removes it", self.request.name, self.holder, error)
        finally:
            self._open_feeds.discard(self.holder)

    # --- Producing ------------------------------------------------------------------------

    async def _produce(self) -> None:
        request, id = self.request, self.request.collection_id
        try:
            last = request.as_of  # every update at or before it is delivered (or skipped)
            await self._complete_through(last)
            if request.snapshot:
                rows = await asyncio.to_thread(self.storage.read_snapshot, id, last)
                snapshot = rows.append_column(TIME, pa.array([last] * rows.num_rows, pa.int64()))
                self._put(SubscribeBatch(snapshot.append_column(DIFF, pa.array([1] * rows.num_rows, pa.int64())), last))
            end = None if request.up_to is None else request.up_to - 1  # the last time to deliver
            while end is None or last < end:
                upper = await self._complete_through(last + 1)
                if upper.is_empty:  # closed: everything it will ever hold is written
                    through = CLOSED_THROUGH if end is None else end
                else:
                    through = upper.time - 1 if end is None else min(upper.time - 1, end)
                changes = await asyncio.to_thread(self.storage.read_changes, id, last, through)
                last = through
                if changes.num_rows or request.progress:
                    self._put(SubscribeBatch(changes, last))
                if upper.is_empty:
                    break
                # Later reads need only the changes after `last`: since may follow.
                await asyncio.to_thread(self.storage.downgrade_read_hold, id, self.holder, Frontier(last))
            self._put(None)
        except ControllerError as error:
            self._end(error)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # dropped meanwhile, storage gone: say so and end
            self._end(ControllerError("UNAVAILABLE", f"the feed of {request.name} ended: {error}"))

    async def _complete_through(self, time: int) -> Frontier:
        """Wait until every update at `time` is written; the collection's upper then."""
        while True:
            upper = await asyncio.to_thread(self.storage.upper, self.request.collection_id)
            if upper.is_complete(time):
                return upper
            await asyncio.sleep(POLL_S)


class IndexFeed(_Feed):
    """The feed of one dataflow's index, fed by the instance driver: `forward` each
    `SubscribeForward`, `fail` on its `SubscribeEnded`. `close` it: it then cancels the
    subscription (through `cancel`), which releases the index's hold.

    `empty` is an empty table of the index's columns plus `_time` and `_diff`, the
    updates of a batch that brings progress alone.
    """

    def __init__(self, request: FeedRequest, subscription: str, empty: pa.Table, cancel: Callable[[str], None]) -> None:
        super().__init__(request)
        self.uuid = subscription
        self._empty = empty
        self._cancel = cancel
        self._open = True
        self._snapshot_due = request.snapshot  # the first batch goes out, empty or not

    def forward(self, changes: tuple[SubscribeChanges, ...], progress: int) -> None:
        """Queue the changes of one forward (times ascending, each time once) and its
        progress, cut at `up_to`; a full queue ends the feed (RESOURCE_EXHAUSTED)."""
        if not self._open:
            return
        request = self.request
        tables = [ipc_to_table(c.arrow_ipc) for c in changes if request.up_to is None or c.time < request.up_to]
        # Replicas may differ in nullability flags, never in values or types.
        updates = pa.concat_tables(tables, promote_options="permissive") if tables else self._empty
        done = request.up_to is not None and progress >= request.up_to - 1
        if done:
            progress = request.up_to - 1
        try:
            if updates.num_rows or request.progress or done or self._snapshot_due:
                self._snapshot_due = False
                self._put(SubscribeBatch(updates, progress))
            if done:
                self._put(None)
                self._stop()
        except ControllerError as error:
            self.fail(error)

    def fail(self, error: ControllerError) -> None:
        if self._open:
            self._end(error)
            self._stop()

    def _stop(self) -> None:
        self._open = False
        self._cancel(self.uuid)

    async def close(self) -> None:
        if self._open:
            self._stop()
