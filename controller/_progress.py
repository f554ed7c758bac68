"""Progress on the terminal for the CLI's long waits (rich), drawn on stderr and only
when stderr is a terminal: scripts, logs and tests see the commands' output alone."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

T = TypeVar("T")

POLL_S = 0.5

# What a poll reports: a description, then how much of how much is done (None: unknown).
Poll = Callable[[], tuple[str, int | None, int | None]]


def _console() -> Console:
    return Console(stderr=True)


def _progress(*columns) -> Progress:
    console = _console()
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), *columns, TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal)


def while_running(call: Callable[[], T], poll: Poll) -> T:
    """`call()`'s result (or exception), with a bar drawn from `poll()` every half second
    meanwhile. `call` runs on a thread; `poll` failing only leaves the bar as it was."""
    done: Future[T] = Future()

    def run() -> None:
        try:
            done.set_result(call())
        except BaseException as error:
            done.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    with _progress(BarColumn(), MofNCompleteColumn()) as progress:
        task = progress.add_task("starting", total=None)
        while not done.done():
            if not progress.disable:
                try:
                    description, completed, total = poll()
                    progress.update(task, description=description, completed=completed or 0, total=total)
                except Exception:
                    pass
            try:
                done.exception(timeout=POLL_S)
            except TimeoutError:
                continue
    return done.result()


def counted_bytes(lines: Iterable[str], total: int | None, what: str) -> Iterator[str]:
    """`lines`, advancing a bar by their UTF-8 size (of `total` bytes) as they are read."""
    with _progress(BarColumn(), DownloadColumn()) as progress:
        task = progress.add_task(what, total=total)
        for line in lines:
            if not progress.disable:
                progress.advance(task, len(line.encode()))
            yield line


@contextmanager
def spinner(text: str) -> Iterator[Callable[[str], None]]:
    """A spinner saying `text` while the block runs; the block is given a function that
    changes what it says."""
    with _progress() as progress:
        task = progress.add_task(text, total=None)
        yield lambda said: progress.update(task, description=said)
