"""Group commit of appends (DESIGN section 3): appends to any source that arrive while a
commit is in flight are written together by the next one, at one timestamp.

One `GroupCommit` per controller. Its task runs one commit at a time
(`Storage.append_group`: a file per source and one catalog transaction); every append
waiting when a commit starts is in it, so a lone writer waits for nobody and a crowd of
writers pays one commit per group, not one per append. The source advancer's tick is an
empty append: it takes a timestamp that moves every idle source's upper, and an append
committed at the same moment does that for it.

Invariants: each append is committed once, whole, at one timestamp (the one its caller
gets), or not at all (its caller gets the error); a group refused for one source's sake
(dropped meanwhile, say) is committed again without it, each source alone. An append
with an idempotency key already committed (a client's retry after a failover, found by
the commit's own transaction) or pending here is not written again: its caller gets
the first one's timestamp.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa

from catalog import CatalogError, FailedPrecondition, Fenced

log = logging.getLogger(__name__)

Commit = Callable[[Sequence[tuple[str, pa.Table]], Sequence[str | None]], tuple[int, Mapping[str, tuple[str, int]]]]
"""Appends (source id, batch) and their idempotency keys committed at one new timestamp
(blocking, `Storage.append_group`): the timestamp, and the keys committed before, each
with its source and timestamp."""


@dataclass(slots=True)
class _Append:
    source: str | None  # None: the advancer's tick, which appends nothing
    batch: pa.Table | None
    done: asyncio.Future[int]
    key: str | None = None


class GroupCommit:
    """Appends committed in groups, one commit at a time (see the module docstring).

    `pending` holds the appends that arrived since the commit in flight started; the
    task takes them all when it starts the next. Counters: `commits` made, `appends`
    committed."""

    def __init__(self, commit: Commit) -> None:
        self._commit = commit
        self.pending: list[_Append] = []
        self._keyed: dict[str, _Append] = {}  # pending or in flight, by idempotency key
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.commits = 0
        self.appends = 0
        self.last_group = 0  # appends in the latest commit

    async def append(self, source: str, batch: pa.Table, key: str | None = None) -> int:
        """Commit `batch` to `source` with the next group, once per idempotency `key`;
        its timestamp. Cancelling the caller does not take the append back (it may be
        committed already)."""
        if key is not None and key in self._keyed:  # the same append sent twice at once
            first = self._keyed[key]
            if first.source != source:
                raise _reused(key)
            return await asyncio.shield(first.done)
        append = _Append(source, batch, asyncio.get_running_loop().create_future(), key)
        if key is not None:
            self._keyed[key] = append
            append.done.add_done_callback(lambda _: self._keyed.pop(key, None))
        return await self._join(append)

    async def advance(self) -> int:
        """Move every source's upper past a new timestamp (with the next group)."""
        return await self._join(_Append(None, None, asyncio.get_running_loop().create_future()))

    async def _join(self, append: _Append) -> int:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        # Its outcome is retrieved even when the caller was cancelled meanwhile.
        append.done.add_done_callback(lambda done: done.cancelled() or done.exception())
        self.pending.append(append)
        self._arrived.set()
        return await asyncio.shield(append.done)

    def stop(self) -> None:
        """Stop committing (the appends still pending get no answer: the process ends)."""
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        """Commit the pending appends, a group at a time, until cancelled (started by
        the first append)."""
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            group, self.pending = self.pending, []
            if group:
                await self._commit_group(group)

    async def _commit_group(self, group: list[_Append]) -> None:
        appends = [a for a in group if a.source is not None]
        try:
            ts, earlier = await asyncio.to_thread(self._commit, [(a.source, a.batch) for a in appends], [a.key for a in appends])
        except Exception as error:
            sources = {a.source for a in group if a.source is not None}
            if isinstance(error, CatalogError) and not isinstance(error, Fenced) and len(sources) > 1:
                log.info("a group commit of %d appends to %d sources was refused (%s): committing each source alone", len(group), len(sources), error)
                for source in sorted(sources):
                    await self._commit_group([a for a in group if a.source == source])
                rest = [a for a in group if a.source is None]
                if rest:
                    await self._commit_group(rest)
                return
            for append in group:
                if not append.done.done():
                    append.done.set_exception(error)
            return
        self.commits += 1
        self.last_group = len(appends) - len(earlier)
        self.appends += self.last_group
        for append in group:
            if append.done.done():
                continue
            if append.key in earlier:
                source, first_ts = earlier[append.key]
                if source == append.source:
                    append.done.set_result(first_ts)
                else:
                    append.done.set_exception(_reused(append.key))
            else:
                append.done.set_result(ts)


def _reused(key: str) -> FailedPrecondition:
    return FailedPrecondition(f"idempotency key {key!r} was given to an append to another source")
