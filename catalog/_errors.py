"""Typed errors of the catalog and of storage.

Every error carries a message a user can act on. A call that raises one of these has
written nothing: catalog changes are single transactions, and storage removes the file of
an append that was refused.

The controller maps the four bases to gRPC status codes in one place: `NotFound` to
NOT_FOUND, `AlreadyExists` to ALREADY_EXISTS, `InvalidArgument` to INVALID_ARGUMENT and
`FailedPrecondition` (with its subclasses `Fenced` and `UpperMismatch`) to
FAILED_PRECONDITION.

This module imports nothing of ours but `history`.
"""

from __future__ import annotations

from history import Frontier


class CatalogError(Exception):
    """Base of every refusal by the catalog or storage."""


class NotFound(CatalogError):
    """The named instance, replica, collection or dataflow does not exist (or was dropped)."""


class AlreadyExists(CatalogError):
    """A live object already has that name."""


class InvalidArgument(CatalogError):
    """The request itself is malformed: a bad name, schema, row, frontier or option."""


class CompactedAway(InvalidArgument):
    """A read of times before a collection's since: compaction merged them, and no
    retry can bring them back. A replica's dataflow that meets one has fallen behind
    what the controller holds for it, and needs a new session (`_steps.py`)."""


class FailedPrecondition(CatalogError):
    """The request is well formed but the current state refuses it (e.g. in use)."""


class Fenced(FailedPrecondition):
    """This `Catalog` may not write: it never became controller, or another controller
    has bumped the epoch since. A fenced controller must stop; retrying cannot help.

    `epoch` is the epoch this catalog holds (None if it never became controller),
    `current` the epoch recorded in the catalog (None if it was not read).
    """

    def __init__(self, message: str, *, epoch: int | None, current: int | None) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.current = current


class UpperMismatch(FailedPrecondition):
    """A compare-and-append lost: the collection's upper is not `expected` any more.

    `current` is the upper found, so a writer can tell whether its data is already
    there (`current >= its new upper`) or it must retry from `current`.
    """

    def __init__(self, collection_id: str, expected: Frontier, current: Frontier) -> None:
        super().__init__(
            f"the upper of {collection_id} is {_show(current)}, not the expected "
            f"{_show(expected)}: another writer appended first"
        )
        self.collection_id = collection_id
        self.expected = expected
        self.current = current


def _show(frontier: Frontier) -> str:
    return "[] (closed)" if frontier.is_empty else str(frontier.time)
