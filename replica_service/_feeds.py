"""Subscriptions on a replica: a task per open subscription of the session reports its
index's changes per time, as the dataflow's frontier moves: the snapshot at `as_of`
first if asked and still computable here, then from the last reported time, or from the
arrangement's since where this replica was built or compacted past it (the controller
forwards each time once, from whichever replica reports it first).

`Subscriptions` holds `Replica`'s methods for them; they run on its event loop and use
its state (`feeds`, `connection`, the arrangements).
"""

from __future__ import annotations

import asyncio
import logging

from history import Subscribe, SubscribeChanges, SubscribeResponse
from protocol import table_to_ipc
from replica_service._arrangement import Arrangement, Version, changes, timed_changes
from replica_service._steps import spark_error_message

log = logging.getLogger("replica_service._replica")


class PeekFailed(Exception):
    """A read (a peek, a subscription's report) that cannot be answered with rows; its
    message goes to the controller."""


class Subscriptions:
    """`Replica`'s subscription feeds (a mixin: the state is the replica's)."""

    async def _feed(self, command: Subscribe) -> None:
        """Report subscription `command`'s changes as its index's frontier moves, until
        canceled; an error (the index is not here, its dataflow failed, its rows cannot
        be diffed) is reported once and ends it."""
        loop = asyncio.get_running_loop()
        reported = command.as_of + 1  # every change before it is reported (or skipped)
        snapshot = command.snapshot
        try:
            while True:
                # Taken before looking: progress made while a report is computed (off the
                # loop) sets it, so the versions it brought are looked at at once, not at
                # some later, unrelated progress (never, once the inputs are closed).
                progress = self.progress
                _, arrangement = self._readable(command.id, command.as_of, compacted_ok=True)
                since = arrangement.since.time
                times = arrangement.times
                # Every version below `complete` is final (a closed index: every version).
                complete = arrangement.upper.time if not arrangement.upper.is_empty else times[-1] + 1
                if snapshot and since > command.as_of:
                    snapshot = False  # built or compacted past it here: another replica sends it
                    log.info("subscription %s: %s is compacted past as_of %d here", command.uuid, command.id, command.as_of)
                if snapshot and complete > command.as_of and times:
                    snapshot = False
                    version = await self._version(arrangement, command.as_of)
                    self.connection.send(await loop.run_in_executor(self._io_pool, _snapshot, command, version))
                    continue  # the arrangement may have moved meanwhile: look again
                base = max(reported - 1, since)
                if not snapshot and complete > base + 1 and times:
                    report = await loop.run_in_executor(self._io_pool, _changes_between, command.uuid, arrangement, base, complete)
                    self.connection.send(report)
                    reported = complete
                await progress.wait()
        except Exception as e:  # PeekFailed (not readable here), ValueError (no diff), a bug
            message = str(e) if isinstance(e, (PeekFailed, ValueError)) else spark_error_message(e)
            if self.feeds.get(command.uuid) is asyncio.current_task():
                del self.feeds[command.uuid]
                self.connection.send(SubscribeResponse(command.uuid, reported, reported, error=message))


def _snapshot(command: Subscribe, version: Version) -> SubscribeResponse:
    """The report of subscription `command`'s contents at `as_of`, from `version`."""
    rows = changes(None, version.table, command.as_of)
    chunk = (SubscribeChanges(command.as_of, table_to_ipc(rows), rows.num_rows),) if rows.num_rows else ()
    return SubscribeResponse(command.uuid, command.as_of, command.as_of + 1, chunk)


def _changes_between(uuid: str, arrangement: Arrangement, base: int, end: int) -> SubscribeResponse:
    """The report of the times `(base, end)`: the changes of each of `arrangement`'s
    versions in it, from the one before (kept as such: nothing is diffed)."""
    chunks = []
    for time, rows in arrangement.changes_between(base, end - 1):
        if rows.num_rows:
            chunks.append(SubscribeChanges(time, table_to_ipc(timed_changes(rows, time)), rows.num_rows))
    return SubscribeResponse(uuid, base + 1, end, tuple(chunks))
