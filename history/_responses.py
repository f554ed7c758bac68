"""Responses a replica sends to the controller.

Rows are opaque here: Arrow IPC bytes that only `protocol/` and the replica decode, so the
pure model never depends on pyarrow.

This module may not import anything beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from history._frontier import Frontier


@dataclass(frozen=True, slots=True)
class FrontiersResponse:
    """The write frontier of collection `id` on this replica.

    Rules: never regresses; never below the dataflow's `as_of`; after a drop, one final
    empty frontier and nothing more for `id`.
    """

    id: str
    write_frontier: Frontier


@dataclass(frozen=True, slots=True)
class PeekRows:
    """A peek's answer: the rows as Arrow IPC stream bytes, their count and digest."""

    arrow_ipc: bytes
    row_count: int
    digest: str


@dataclass(frozen=True, slots=True)
class PeekError:
    message: str


@dataclass(frozen=True, slots=True)
class PeekCanceled:
    pass


PeekResult = Union[PeekRows, PeekError, PeekCanceled]


@dataclass(frozen=True, slots=True)
class PeekResponse:
    """The one answer to peek `uuid`."""

    uuid: str
    result: PeekResult


@dataclass(frozen=True, slots=True)
class DataflowStatus:
    """One export's state on a replica: hydrated once its frontier passed `as_of`;
    `error` is set when the dataflow failed (and stays failed)."""

    id: str
    hydrated: bool
    error: str | None = None
    digest: str = ""


@dataclass(frozen=True, slots=True)
class StatusResponse:
    """A heartbeat, sent at least once a second, with what the controller reports.

    `heartbeat` counts the heartbeats this replica process has sent (a sequence number,
    not a time).

    `dataflows_kept` and `dataflows_built` count, since the replica process started, the
    dataflows reconciliation kept running and the ones it had to build.
    """

    heartbeat: int
    dataflows: tuple[DataflowStatus, ...] = ()
    dataflows_kept: int = 0
    dataflows_built: int = 0
    pid: int = 0


ComputeResponse = Union[FrontiersResponse, PeekResponse, StatusResponse]
