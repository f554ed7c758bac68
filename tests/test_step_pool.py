"""The step pool: waiting steps in order of cost, a batch at a time."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from replica_service._step_pool import StepPool


@pytest.fixture
def pool():
    pool = StepPool(1, thread_name_prefix="test-step")
    yield pool
    pool.shutdown(wait=True, cancel_futures=True)


def _occupied(pool: StepPool) -> threading.Event:
    """An event that frees the pool's one worker, busy until it is set."""
    release, started = threading.Event(), threading.Event()
    pool.submit(lambda: (started.set(), release.wait(10)))
    assert started.wait(10)
    return release


def _run(pool: StepPool, costs: dict[str, float], plain: str | None = None) -> list[str]:
    """The order in which the pool runs work of these costs, submitted while its one
    worker is busy (one batch), and `plain` work submitted last."""
    release = _occupied(pool)
    ran: list[str] = []
    futures = [pool.submit_costed(cost, ran.append, name) for name, cost in costs.items()]
    if plain is not None:
        futures.append(pool.submit(ran.append, plain))
    release.set()
    for future in futures:
        future.result(10)
    return ran


# "never ran": a hydration, whose cost is unknown until it ran (the costliest, to the replica).
COSTS = {"cheap": 1, "never ran": math.inf, "costly": 500, "nothing": 0, "middling": 30, "costly, later": 500, "nothing, later": 0}


def test_a_batch_runs_the_cheapest_first_and_plain_work_before_any_step(pool):
    order = _run(pool, COSTS, plain="plain")
    assert order == ["plain", "nothing", "nothing, later", "cheap", "middling", "costly", "costly, later", "never ran"]


def test_a_batch_runs_the_costliest_first_when_told(pool):
    pool.cheapest_first = False
    order = _run(pool, COSTS, plain="plain")
    assert order == ["plain", "never ran", "costly", "costly, later", "middling", "cheap", "nothing", "nothing, later"]


def test_work_submitted_once_a_batch_is_taken_waits_for_the_next_batch(pool):
    """A steady stream of cheap steps does not keep a costly one waiting: work joins
    the batch being taken only until a worker takes from it."""
    release = _occupied(pool)
    ran: list[str] = []
    first_taken = threading.Event()
    futures = [
        pool.submit_costed(9, lambda: (ran.append("costly"), first_taken.wait(10))),
        pool.submit_costed(1, lambda: (ran.append("cheap"), first_taken.wait(10))),
    ]
    release.set()
    while not ran:  # the batch (costly, cheap) is being taken: cheap, then costly
        time.sleep(0.01)
    futures.append(pool.submit_costed(0, ran.append, "cheaper, after"))
    first_taken.set()
    for future in futures:
        future.result(10)
    assert ran == ["cheap", "costly", "cheaper, after"]


def test_results_and_errors_reach_the_caller_and_the_worker_goes_on(pool):
    def fail():
        raise ValueError("bad step")

    failed = pool.submit_costed(1, fail)
    with pytest.raises(ValueError, match="bad step"):
        failed.result(10)
    assert pool.submit_costed(1, lambda a, b=0: a + b, 2, b=3).result(10) == 5


def test_a_shutdown_cancels_the_waiting_work_and_refuses_more():
    pool = StepPool(1, thread_name_prefix="test-step")
    release = _occupied(pool)
    waiting = pool.submit_costed(1, lambda: "ran")
    pool.shutdown(wait=False, cancel_futures=True)
    assert waiting.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)
    release.set()
    pool.shutdown(wait=True)
    assert not any(t.is_alive() for t in pool._threads)


def test_a_shutdown_without_cancelling_runs_what_waits(pool):
    release = _occupied(pool)
    waiting = pool.submit_costed(1, lambda: "ran")
    release.set()
    pool.shutdown(wait=True)
    assert waiting.result(0) == "ran"


def test_the_event_loop_runs_plain_work_on_it(pool):
    async def main():
        return await asyncio.get_running_loop().run_in_executor(pool, lambda: threading.current_thread().name)

    assert asyncio.run(main()).startswith("test-step")


def test_workers_run_side_by_side():
    pool = StepPool(3, thread_name_prefix="test-step")
    try:
        together = threading.Barrier(3, timeout=10)
        futures = [pool.submit_costed(cost, together.wait) for cost in (1, 2, 3)]
        assert sorted(f.result(10) for f in futures) == [0, 1, 2]
    finally:
        pool.shutdown(wait=True)
