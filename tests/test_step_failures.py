"""How a replica's dataflow meets a failed step, without Spark: which errors are retried
(backing off, shown in the status), which fail the dataflow, which ask for a new
session; and a storage poll round that goes on past one reader's failure. The step loop
and the poller run as they do on a replica, over fakes of what they call."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from sqlalchemy.exc import OperationalError

from catalog import AlreadyExists, CompactedAway, FailedPrecondition, InvalidArgument, NotFound
from history import ComputeParameters, Frontier
from replica_service import _spark
from replica_service._replica import Replica
from replica_service._steps import STORAGE_RETRY_MAX_S, TRANSIENT_RETRIES, DataflowSteps, step_failure
from storage import NegativeCount

POLL_S = 0.1
LOST_EXECUTOR = RuntimeError("Job aborted: ExecutorLostFailure (executor 1 exited)")


@pytest.mark.parametrize(
    "error",
    [OSError("disk hiccup"), FailedPrecondition("upper not there yet"), OperationalError("select", {}, Exception("database is locked"))],
)
def test_passing_storage_errors_back_off_from_the_poll_interval_to_a_cap(error):
    delays = [step_failure(error, retries, 0, POLL_S) for retries in range(8)]
    assert {d.action for d in delays} == {"retry"}
    assert [d.delay_s for d in delays] == [min(POLL_S * 2**n, STORAGE_RETRY_MAX_S) for n in range(8)]
    assert delays[-1].delay_s == STORAGE_RETRY_MAX_S
    assert delays[0].message.startswith("storage failed: ")


@pytest.mark.parametrize("error", [NotFound("no collection u9 (dropped)"), InvalidArgument("a bad batch"), AlreadyExists("u9")])
def test_refusals_by_storage_fail_the_dataflow_at_once(error):
    failure = step_failure(error, 0, 0, POLL_S)
    assert (failure.action, failure.message) == ("fail", f"storage refused the step: {error}")


def test_an_input_compacted_past_the_dataflow_asks_for_a_new_session():
    # CompactedAway is an InvalidArgument: it must not be taken for a refusal.
    failure = step_failure(CompactedAway("cannot read u1 from time 3: its since is 9"), 2, 0, POLL_S)
    assert (failure.action, failure.message) == ("new_session", "cannot read u1 from time 3: its since is 9")


def test_a_passing_spark_error_rebuilds_a_bounded_number_of_times_and_wrong_data_fails():
    rebuilds = [step_failure(LOST_EXECUTOR, n, n, POLL_S) for n in range(TRANSIENT_RETRIES + 1)]
    assert [r.action for r in rebuilds] == ["rebuild"] * TRANSIENT_RETRIES + ["fail"]
    assert [r.delay_s for r in rebuilds[:3]] == [2, 4, 8]
    assert step_failure(NegativeCount("row x has count -1 at 5"), 0, 0, POLL_S).action == "fail"
    wrong = step_failure(ValueError("[DIVIDE_BY_ZERO] Division by zero"), 0, 0, POLL_S)
    assert (wrong.action, wrong.message) == ("fail", "[DIVIDE_BY_ZERO] Division by zero")


class _Steps(DataflowSteps):
    """A replica's step loop over fakes: each round's first storage read raises the next
    of `faults` (recording what the status would show at that moment); once they run
    out, the round succeeds and the inputs close, which ends the loop."""

    def __init__(self, faults: list[Exception]) -> None:
        self.faults = faults
        self.seen: list[tuple[int, str | None]] = []  # (retries, retry_error) as each fault is raised
        self.parameters = ComputeParameters(input_poll_interval_ms=int(POLL_S * 1000) // 10)
        self.instance = SimpleNamespace(conf=lambda: {})
        self._step_pool = None
        self.released = 0

    async def spark(self):
        return None

    async def _refresh_readers(self, dataflow):
        if self.faults:
            self.seen.append((dataflow.retries, dataflow.retry_error))
            raise self.faults.pop(0)

    def _advance(self, dataflow, frontier):
        dataflow.frontier = frontier

    def _notify_progress(self):
        pass

    def _release_state(self, dataflow):
        self.released += 1


def _dataflow():
    return SimpleNamespace(
        desc=SimpleNamespace(name="totals", until=Frontier.empty()),
        frontier=Frontier(5),
        input_upper=Frontier.empty,
        next_times=lambda upper: [],
        last_computed=None,
        maintainer=None,
        error=None,
        retries=0,
        retry_error=None,
        needs_new_session=None,
    )


def _run(faults: list[Exception], monkeypatch) -> tuple[_Steps, SimpleNamespace]:
    monkeypatch.setattr(_spark, "dataflow_session", lambda base, conf: "session")
    monkeypatch.setattr(_spark, "jvm_alive", lambda: True)
    steps, dataflow = _Steps(faults), _dataflow()
    asyncio.run(asyncio.wait_for(steps._steps(dataflow, asyncio.Event()), 30))
    return steps, dataflow


def test_storage_hiccups_are_retried_shown_as_retrying_then_forgotten(monkeypatch):
    steps, dataflow = _run([OSError("disk hiccup"), OSError("disk hiccup"), FailedPrecondition("not yet")], monkeypatch)
    assert steps.seen == [(0, None), (1, "storage failed: disk hiccup"), (2, "storage failed: disk hiccup")]
    assert dataflow.frontier.is_empty and dataflow.error is None
    assert (dataflow.retries, dataflow.retry_error) == (0, None)  # the round that succeeded reset them
    assert steps.released == 0  # a storage retry keeps the Spark state


def test_a_dropped_sink_fails_the_dataflow_instead_of_retrying(monkeypatch):
    steps, dataflow = _run([OSError("disk hiccup"), NotFound("no collection u7: it was dropped")], monkeypatch)
    assert dataflow.error == "storage refused the step: no collection u7: it was dropped"
    assert not dataflow.frontier.is_empty and len(steps.seen) == 2


def test_an_input_compacted_past_it_ends_the_dataflow_here_and_asks_for_a_new_session(monkeypatch):
    steps, dataflow = _run([CompactedAway("cannot read u1 from time 5: its since is 9 (compacted away)")], monkeypatch)
    assert dataflow.needs_new_session == "cannot read u1 from time 5: its since is 9 (compacted away)"
    assert dataflow.error is None and dataflow.frontier == Frontier(5)


def test_spark_state_is_rebuilt_for_a_passing_spark_error(monkeypatch):
    steps, dataflow = _run([LOST_EXECUTOR], monkeypatch)  # after a 2 s back-off
    assert steps.released == 1 and dataflow.error is None and dataflow.frontier.is_empty


class _Reader:
    def __init__(self, upper: int, fails: bool) -> None:
        self.upper, self.refreshed_at, self.fails = Frontier(upper), 0.0, fails

    def refresh(self, session) -> None:
        if self.fails:
            raise OSError("manifest read failed")
        self.upper = Frontier(self.upper.time + 1)


def test_a_poll_round_wakes_the_other_readers_dataflows_when_one_manifest_read_fails():
    async def run() -> tuple[bool, bool]:
        replica = SimpleNamespace(
            readers={"u1": _Reader(3, fails=True), "u2": _Reader(3, fails=False)},
            dataflows={
                "d1": SimpleNamespace(desc=SimpleNamespace(imports=[SimpleNamespace(id="u1")])),
                "d2": SimpleNamespace(desc=SimpleNamespace(imports=[SimpleNamespace(id="u2")])),
            },
            wakeups={"d1": asyncio.Event(), "d2": asyncio.Event()},
            storage=SimpleNamespace(catalog=SimpleNamespace(uppers=lambda ids: {id: Frontier(4) for id in ids})),
            parameters=ComputeParameters(input_poll_interval_ms=10),
            _poll_now=asyncio.Event(),
            _refreshing={},
            _io_pool=None,
        )
        replica.spark = lambda: asyncio.sleep(0)
        replica._refresh = lambda id: Replica._refresh(replica, id)
        poller = asyncio.create_task(Replica._poll_storage(replica))
        try:
            await asyncio.wait_for(replica.wakeups["d2"].wait(), 10)
            return replica.wakeups["d1"].is_set(), replica.readers["u2"].upper == Frontier(4)
        finally:
            poller.cancel()

    d1_woken, u2_read = asyncio.run(run())
    assert u2_read and not d1_woken
