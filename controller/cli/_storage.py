"""`tandem storage`: the storage collections and the read holds that pin their since
(`ControllerApi.storage`), one row per collection and one per hold under it. A module
of its own, registered by the CLI's parser with one call (`register`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from controller._api import StorageView

HEADERS = ("ID", "NAME", "KIND", "SINCE", "UPPER", "HOLDER", "OWNER", "HELD_BACK_MS")


def render(views: list[StorageView], table: Callable[[Sequence[str], Any], str]) -> str:
    """The collections, each followed by its holds (least frontier first: the one that
    sets the since)."""
    rows: list[list[Any]] = []
    for view in views:
        rows.append([view.id, view.name, view.kind, view.since, view.upper, None, None, None])
        rows.extend(["", "", "", "", "", hold.holder, hold.owner, hold.held_back_ms] for hold in view.holds)
    return table(HEADERS, rows)


def register(commands: Any, leaf: Callable[..., Any], table: Callable[[Sequence[str], Any], str]) -> None:
    """Add `tandem storage` to the parser's `commands`, through its `leaf` helper."""
    leaf(
        commands,
        "storage",
        "storage collections and the read holds that pin their since: holder, owner, how far behind the upper",
        lambda client, args: client.storage_holds(),
        lambda views: render(views, table),
    )
