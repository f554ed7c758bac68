"""Blocking catalog and storage calls from the event loop, with catalog refusals as the
`ControllerError`s the client API answers (the one place their codes are chosen)."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import Any, Awaitable, Callable, Iterator, Mapping, TypeVar

from catalog import AlreadyExists, CatalogError, FailedPrecondition, Fenced, InvalidArgument, NotFound
from controller._api import ControllerError

T = TypeVar("T")

_CATALOG_CODES: Mapping[type, str] = {
    NotFound: "NOT_FOUND",
    AlreadyExists: "ALREADY_EXISTS",
    InvalidArgument: "INVALID_ARGUMENT",
    FailedPrecondition: "FAILED_PRECONDITION",
}


async def blocking(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking catalog or storage call on a worker thread; catalog refusals become
    `ControllerError`s (`refused`)."""
    return await refused(asyncio.to_thread(function, *args, **kwargs))


def inline(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a short call that does no I/O on the event loop itself (cheaper than a worker
    thread's round trip), its catalog refusals translated as `refused` does."""
    with _translated():
        return function(*args, **kwargs)


async def refused(call: Awaitable[T]) -> T:
    """`call`'s result; catalog refusals become `ControllerError`s with the status that
    fits (a fenced controller is UNAVAILABLE: the client should go to the newer one)."""
    with _translated():
        return await call


@contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except Fenced as e:
        raise ControllerError("UNAVAILABLE", str(e)) from None
    except CatalogError as e:
        code = next((c for kind, c in _CATALOG_CODES.items() if isinstance(e, kind)), "INTERNAL")
        raise ControllerError(code, str(e)) from None
