"""A pool of step workers that takes waiting steps in order of cost, a batch at a time.

When one append touches many dataflows, their steps are queued at once, in the order the
dataflows were created, and the time until every dataflow reflects the append is the
time the replica needs for all of them. Replicas of an instance compute the same steps
and the first answer wins, so they do better taking them in different orders: one the
cheapest first (most dataflows answer soonest), another the costliest first (the one
that would answer last starts first). Together, each step is answered by the replica
that reaches it first: ideally all in about half the time either replica takes for all
of them, less on replicas that share cores, and only where a replica runs few steps
side by side (`bench/RESULTS.md`: with four workers a pool the mean answer came 8-13%
sooner; with two, TPC-H's last answer came 10.0-19.4 s after a change, against
13.4-22.4 s with four). The controller says which order a replica takes
(`Hello.costliest_first`: each replica added takes the order fewer replicas of its
instance take).

A step's cost is unknown until it ran, so the pool is told the last one's
(`submit_costed`). Ordered by cost alone, a stream of cheap steps could keep a costly one
waiting for ever (or the other way round); so the pool orders by cost within a *batch*:
the work that waits when a worker takes from it. Work submitted after that waits for the
next batch, which starts when this one is taken. Between batches, work goes first come
first served: a step waits at most for its own batch and the one before.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

_Work = tuple[bool, float, int, Future, Callable[[], Any]]  # costed, rank, order of submission, ...


class StepPool(Executor):
    """`workers` threads taking waiting work a batch at a time, each batch in order of
    cost (`cheapest_first`, else the costliest first), in order of submission between
    equal costs. Plain `submit`s (a session's set-up, its stop) rank before every step
    of their batch: they are short, and steps may wait on them."""

    def __init__(self, workers: int, thread_name_prefix: str, *, cheapest_first: bool = True) -> None:
        self.cheapest_first = cheapest_first  # read as work is submitted
        self._batch: list[_Work] = []  # a heap: what workers take from
        self._open = True  # no worker took from `_batch` yet: submitted work joins it
        self._next: list[_Work] = []  # a heap: the batch after it
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._shut_down = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{thread_name_prefix}_{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        return self._submit(False, 0.0, fn, args, kwargs)

    def submit_costed(self, cost: float, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Run `fn(*args, **kwargs)`, in its batch, after the work of a lower cost
        (`cheapest_first`) or of a higher one. An unknown cost is `math.inf`."""
        return self._submit(True, cost if self.cheapest_first else -cost, fn, args, kwargs)

    def _submit(self, costed: bool, rank: float, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Future:
        future: Future = Future()
        with self._changed:
            if self._shut_down:
                raise RuntimeError("cannot schedule new work after shutdown")
            heapq.heappush(self._batch if self._open else self._next, (costed, rank, next(self._order), future, lambda: fn(*args, **kwargs)))
            self._changed.notify()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more work is taken; with `cancel_futures`, the waiting work is cancelled
        (else it still runs); with `wait`, returns once the workers have ended."""
        with self._changed:
            self._shut_down = True
            if cancel_futures:
                for *_, future, _ in self._batch + self._next:
                    future.cancel()
                self._batch, self._next = [], []
            self._changed.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()

    def _take(self) -> _Work | None:
        """The next work (None: shut down with nothing left), blocking until there is
        some. Holds `_changed`."""
        while True:
            if not self._batch and self._next:
                self._batch, self._next = self._next, []
            if self._batch:
                self._open = False
                return heapq.heappop(self._batch)
            self._open = True  # taken whole: what comes now is the next batch
            if self._shut_down:
                return None
            self._changed.wait()

    def _work(self) -> None:
        while True:
            with self._changed:
                work = self._take()
            if work is None:
                return
            *_, future, call = work
            if not future.set_running_or_notify_cancel():  # cancelled while it waited
                continue
            try:
                result = call()
            except BaseException as error:  # as ThreadPoolExecutor: the caller's to see
                future.set_exception(error)
            else:
                future.set_result(result)
            del work, call, future  # a step's result (a whole version) is not kept by an idle worker
