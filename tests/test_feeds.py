"""A replica's subscription feed (`replica_service._feeds`) on its own event loop, with
an arrangement in memory: a version that arrives while a report is being computed (off
the loop) is reported at once, not at some later, unrelated progress (issue 49, item 4:
once the inputs are closed there is none, and the feed's last versions would stall)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from history import Frontier, Subscribe
from replica_service import _feeds
from replica_service._arrangement import Arrangement, Version
from replica_service._feeds import Subscriptions


def version(time: int, ids: list[int]) -> Version:
    return Version.build(time, pa.table({"id": pa.array(ids, pa.int64())}), ("id",))


class Replica(Subscriptions):
    """The state a feed reads on a replica: its arrangements, progress and connection."""

    def __init__(self, arrangement: Arrangement) -> None:
        self.arrangement = arrangement
        self.progress = asyncio.Event()
        self.feeds: dict[str, asyncio.Task] = {}
        self.sent: list = []
        self.reported = asyncio.Event()
        self._io_pool = ThreadPoolExecutor(1)

        replica = self

        class Connection:
            def send(self, response) -> None:
                replica.sent.append(response)
                replica.reported.set()

        self.connection = Connection()

    def _readable(self, id: str, as_of: int, *, compacted_ok: bool) -> tuple[None, Arrangement]:
        return None, self.arrangement

    def add(self, later: Version, upper: int) -> None:
        """A step's version and the frontier it moved, as the loop records them."""
        self.arrangement.insert(later)
        self.arrangement.upper = Frontier(upper)
        self.progress.set()
        self.progress = asyncio.Event()


def test_a_version_arriving_while_a_report_is_computed_is_reported_without_more_progress(monkeypatch):
    async def scenario() -> list:
        arrangement = Arrangement("idx", ("id",), Frontier(1), Frontier(3), [version(1, [1]), version(2, [1, 2])])
        replica = Replica(arrangement)
        loop = asyncio.get_running_loop()
        computing = _feeds._changes_between
        arrived = threading.Event()

        def changes_between(*args):
            if not arrived.is_set():  # the first report: the next version arrives meanwhile
                loop.call_soon_threadsafe(lambda: (replica.add(version(3, [1, 2, 3]), 4), arrived.set()))
                arrived.wait(5)
            return computing(*args)

        monkeypatch.setattr(_feeds, "_changes_between", changes_between)
        feed = asyncio.ensure_future(replica._feed(Subscribe("u", "idx", 1, snapshot=False)))
        try:
            while not replica.sent or replica.sent[-1].upper < 4:
                replica.reported.clear()
                await asyncio.wait_for(replica.reported.wait(), 5)  # no other progress comes
        finally:
            feed.cancel()
            replica._io_pool.shutdown()
        return replica.sent

    sent = asyncio.run(scenario())
    assert [(r.lower, r.upper, [c.time for c in r.changes]) for r in sent] == [(2, 3, [2]), (3, 4, [3])]
