"""What pins storage: each collection's read holds, with their owners and how far each
holds the since back (`tandem storage`), and the events of orphaned holds removed.

A since that stops moving stops compaction and garbage collection of its collection;
this view names the hold that does it. Built from one listing of the holds and one of
the collections (blocking: the controller runs it on a worker thread). The CLI's table
of it is `cli._storage`.
"""

from __future__ import annotations

from collections.abc import Sequence

from catalog import Catalog, HoldInfo, NewEvent
from controller._api import HoldView, StorageView

ORPHAN_EVENT = "hold_removed"


def storage_views(catalog: Catalog) -> list[StorageView]:
    """Every live storage collection (by id) and its holds, least frontier first."""
    holds: dict[str, list[HoldInfo]] = {}
    for hold in catalog.list_holds():
        holds.setdefault(hold.collection_id, []).append(hold)
    views = []
    for info in catalog.list_collections():
        if info.namespace != "storage":
            continue
        latest = None if info.upper.is_empty else info.upper.time - 1
        mine = sorted(holds.get(info.id, ()), key=lambda h: (h.frontier.time, h.holder))
        views.append(
            StorageView(
                info.id,
                info.name,
                info.kind,
                info.since.time,
                info.upper.time,
                tuple(
                    HoldView(h.holder, str(h.owner), h.frontier.time, None if latest is None else max(0, latest - h.frontier.time))
                    for h in mine
                ),
            )
        )
    return views


def _behind(now_ms: int, frontier_ms: int) -> str:
    """How far a hold's frontier is behind `now_ms`, as an operator reads it (a raw
    epoch time says nothing at a glance)."""
    return f"{max(0, now_ms - frontier_ms) / 1000:.1f} s behind the clock"


def orphan_events(orphans: Sequence[HoldInfo], at_ms: int) -> list[NewEvent]:
    """One event per removed hold; of no instance ("": storage is shared by all)."""
    return [
        NewEvent(
            at_ms,
            "",
            ORPHAN_EVENT,
            f"removed the read hold {h.holder!r} on {h.collection_id}, {_behind(at_ms, h.frontier.time)}: "
            f"its owner ({h.owner}) is gone, and it held the since back for good",
        )
        for h in orphans
    ]
