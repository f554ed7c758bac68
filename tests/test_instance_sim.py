"""`ComputeInstance` (DESIGN sections 5 and 6) under simulated replicas and seeded faults.

The random runs drive the instance with `simulation.Simulation`: a client workload
(dataflows, some importing others' indexes; serializable, explicit-time and SQL peeks;
drops; replica adds and drops; refused commands) interleaved with crashes, hangs, slow
replicas, duplicate and late responses, peeks answered with errors, refused connections
and controller restarts. After every call into the instance the simulator checks that W,
every replica's frontier and every since never regress, that no since passes a hold,
that an input's since never passes the write frontier an active replica reported for a
dataflow reading it, that the history stays bounded, and that a replica called hydrated
has computed; every peek answer must equal the reference answer at the peek's time, and
an error may answer a peek only once every active replica has answered it with one, and
no replica may reconnect in a hot loop. At the end faults stop, the system quiesces,
every peek must have been answered exactly once and the instance must be healthy with
every replica running exactly the live dataflows.

The stories below pin down one rule each; the ones named after a bug were first found by
a seed of the random runs and then minimized.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from catalog import DEFAULT_MAX_LAG_MS, DEFAULT_MIN_IN_SYNC, DEFAULT_REPLICA_TIMEOUT_MS
from controller._instance import (
    Arbitrate,
    DIGEST_TIMES_KEPT,
    HOLD_BACK_DOUBLINGS,
    ComputeInstance,
    Connect,
    Disconnect,
    InstanceError,
    InstanceOptions,
    PeekDone,
    Send,
    SinceAdvanced,
    StorageHold,
    SubscribeEnded,
    SubscribeForward,
    SubscriptionState,
)
from history import (
    AllowCompaction,
    CancelPeek,
    CancelSubscribe,
    ComputeCommand,
    ComputeParameters,
    CreateDataflow,
    CreateInstance,
    DataflowDescription,
    DataflowStatus,
    Frontier,
    FrontiersResponse,
    Import,
    IndexExport,
    IndexTarget,
    InitializationComplete,
    Peek,
    PeekCanceled,
    PeekError,
    PeekResponse,
    PeekRows,
    Resume,
    Schedule,
    StatusResponse,
    Subscribe,
    SubscribeChanges,
    SubscribeResponse,
    apply,
    reduce_commands,
)
from simulation import CONFIG, SimOptions, Simulation, SimulationFailure, run_seed

# 200 seeds of 400 steps (about 12 s of simulated time each, plus quiescing) keep this
# file under a minute.
SEEDS = 200

EMPTY = Frontier.empty()
SOURCE = Import("src", "u1", "storage")


# --- Helpers for the stories ------------------------------------------------------------


def dataflow(
    first: str, *more: str, imports: tuple[Import, ...] = (SOURCE,), as_of: int = 0
) -> DataflowDescription:
    exports = tuple(IndexExport(id, ("k",)) for id in (first, *more))
    return DataflowDescription(
        f"df_{first}", f"SELECT ... /* {first} */", imports, exports, as_of=Frontier(as_of)
    )


def new_instance(**options) -> ComputeInstance:
    return ComputeInstance(CONFIG, InstanceOptions(**options))


def connect(instance: ComputeInstance, name: str) -> tuple[ComputeCommand, ...]:
    """Add replica `name` (if new) and open its connection as a new session; the replayed
    commands."""
    if name not in instance.replicas:
        costliest = sum(r.costliest_first for r in instance.replicas.values())
        fewer_costliest_first = costliest < len(instance.replicas) - costliest
        assert instance.add_replica(name) == [Connect(name, 1, costliest_first=fewer_costliest_first)]
    epoch = instance.replicas[name].epoch
    (send,) = instance.replica_connected(name, epoch, f"{name}-{epoch}")
    assert isinstance(send, Send) and (send.replica, send.epoch) == (name, epoch)
    return send.commands


def two_replicas_computing_u2() -> ComputeInstance:
    instance = new_instance()
    connect(instance, "r1")
    connect(instance, "r2")
    instance.create_dataflow(dataflow("u2", as_of=100))
    return instance


def recorded(instance: ComputeInstance, effects: list) -> list:
    """`effects`, followed by what the instance does once the driver has recorded their
    sinces (and then those of what that moved), as the driver does it: by batch."""
    result, batch = list(effects), effects
    while sinces := {e.id: e.since for e in batch if isinstance(e, SinceAdvanced)}:
        batch = instance.sinces_recorded(sinces)
        result += batch
    return result


def report(instance: ComputeInstance, name: str, id: str, time: int | None) -> list:
    """Replica `name` reports `id`'s write frontier; its sinces are recorded at once."""
    epoch = instance.replicas[name].epoch
    return recorded(instance, instance.handle_response(name, epoch, FrontiersResponse(id, Frontier(time))))


def rows(text: str) -> PeekRows:
    return PeekRows(text.encode(), 1, text)


def sent(effects: list, name: str | None = None) -> list:
    """The commands `effects` send (to replica `name`, or to any)."""
    return [
        c for e in effects if isinstance(e, Send) and name in (None, e.replica) for c in e.commands
    ]


def storage_holds(effects: list) -> list[Frontier]:
    return [e.frontier for e in effects if isinstance(e, StorageHold)]


def snapshot(instance: ComputeInstance) -> tuple:
    """The state a refused command must leave as it was: history, holds, sinces, peeks."""
    return (
        tuple(instance.history.commands),
        instance.history.pushed,
        {id: (c.since, c.write_frontier, dict(c.holds)) for id, c in instance.collections.items()},
        {k: dict(d.input_holds) for k, d in instance.dataflows.items()},
        tuple(instance.peeks),
        {n: (r.epoch, r.phase, dict(r.frontiers)) for n, r in instance.replicas.items()},
    )


# --- Stories ----------------------------------------------------------------------------


def test_first_response_wins_and_the_rest_are_counted_late():
    instance = new_instance()
    connect(instance, "r1")
    connect(instance, "r2")
    instance.create_dataflow(dataflow("u2"))
    instance.peek(Peek("p1", IndexTarget("u2"), 5))
    report(instance, "r1", "u2", 10)
    report(instance, "r2", "u2", 10)
    assert instance.collections["u2"].since == Frontier(5)  # held by the peek, not at W - 1

    effects = instance.handle_response("r2", 1, PeekResponse("p1", rows("from r2")))

    # The caller gets the answer, then CancelPeek goes everywhere, then the hold goes:
    # the since moves, to be recorded before the replicas may compact.
    assert effects[0] == PeekDone("p1", rows("from r2"), "r2")
    assert sent(effects[1:3]) == [CancelPeek("p1"), CancelPeek("p1")]
    assert effects[3:] == [SinceAdvanced("u2", Frontier(9))]
    assert AllowCompaction("u2", Frontier(9)) in sent(recorded(instance, effects))
    assert Peek("p1", IndexTarget("u2"), 5) not in reduce_commands(instance.history.commands)  # cancelled
    assert instance.replicas["r2"].peeks_won == 1

    # r1's answer, a duplicate of r2's, and r1's reply to the CancelPeek are all late.
    for name, response in [
        ("r1", rows("from r1")),
        ("r2", rows("from r2")),
        ("r1", PeekCanceled()),
    ]:
        assert instance.handle_response(name, 1, PeekResponse("p1", response)) == []
    assert instance.late_peek_responses == 3
    assert instance.replicas["r1"].peeks_won == 0


def test_a_crashed_replica_is_rehydrated_with_the_next_epoch_and_replays_the_reduced_history():
    instance = two_replicas_computing_u2()
    instance.create_dataflow(dataflow("u3", imports=(Import("in", "u2", "index"),), as_of=100))
    for time in range(150, 400, 50):  # many compactions: the history grows, then reduces
        for name in ("r1", "r2"):
            report(instance, name, "u2", time)
            report(instance, name, "u3", time)
    instance.peek(Peek("p1", IndexTarget("u3"), 360))
    full_before = apply(instance.history.commands)

    effects = instance.replica_failed("r1", 1, "stream broken")

    assert effects[0] == Disconnect("r1", 1)
    (offer,) = [e for e in effects if isinstance(e, Connect)]
    assert (offer.epoch, offer.resume.nonce) == (2, "r1-1")  # the process, if alive, may resume
    # Its frontiers hold its inputs while it may resume its session ...
    assert instance.replicas["r1"].phase == "connecting" and instance.replicas["r1"].frontiers
    stale = FrontiersResponse("u2", Frontier(500))
    assert instance.handle_response("r1", 1, stale) == []  # of the old epoch: ignored
    assert instance.replica_failed("r1", 1, "again") == []  # so is its failure
    replay = connect(instance, "r1")
    assert instance.replicas["r1"].epoch == 2
    assert instance.replicas["r1"].frontiers == {}  # ... and go once a new session starts
    assert list(replay) == reduce_commands(replay)  # reduced: a fixed point
    assert replay[0] == CreateInstance(CONFIG) and replay[-1] == InitializationComplete()
    assert apply(replay) == full_before  # the same meaning as everything sent so far
    assert [c.desc.as_of for c in replay if isinstance(c, CreateDataflow)] == [
        Frontier(349),
        Frontier(349),
    ]
    assert Peek("p1", IndexTarget("u3"), 360) in replay
    assert sum(isinstance(c, Schedule) for c in replay) == 2


def sent_to(effects: list, name: str) -> list[ComputeCommand]:
    return [c for e in effects if isinstance(e, Send) and e.replica == name for c in e.commands]


def resumable_instance(**options) -> tuple[ComputeInstance, list[ComputeCommand]]:
    """One replica r1 with four dataflows and a pending peek; what r1 was sent."""
    instance = new_instance(**options)
    received = list(connect(instance, "r1"))
    for id in ("u2", "u3", "u5", "u6"):
        received += sent_to(instance.create_dataflow(dataflow(id, as_of=100)), "r1")
    received += sent_to(report(instance, "r1", "u2", 150), "r1")
    received += sent_to(instance.peek(Peek("p1", IndexTarget("u2"), 149)), "r1")
    return instance, received


@pytest.mark.parametrize("lost_in_flight", [0, 2])
def test_a_live_replica_resumes_its_session_with_just_the_commands_it_missed(lost_in_flight: int):
    instance, sent = resumable_instance()
    received = sent[: len(sent) - lost_in_flight]  # the last ones died with the stream
    effects = instance.replica_failed("r1", 1, "stream broken")
    (offer,) = [e for e in effects if isinstance(e, Connect)]
    assert offer.epoch == 2 and offer.resume.nonce == "r1-1"
    assert offer.resume.min_applied <= len(received)  # what it missed is still held
    # While it is away, the instance moves on: a compaction and a second peek.
    instance.create_dataflow(dataflow("u4", as_of=120))
    instance.peek(Peek("p2", IndexTarget("u2"), 149))

    (send,) = instance.replica_connected("r1", 2, "r1-2", True, len(received))

    assert send.replica == "r1" and send.epoch == 2
    suffix = list(send.commands)
    # The pending peek p1 again if it had arrived (its answer may have been lost in
    # flight), the commands lost in flight (p1 among them), then what was pushed
    # meanwhile: CreateDataflow, Schedule, Peek.
    p1 = Peek("p1", IndexTarget("u2"), 149)
    assert suffix.count(p1) == 1
    assert len(suffix) == (0 if lost_in_flight else 1) + lost_in_flight + 3
    assert apply(received + suffix) == apply(instance.history.commands)
    replica = instance.replicas["r1"]
    assert (replica.phase, replica.resumes, replica.replays) == ("active", 1, 1)
    assert replica.as_ofs["u4"] == Frontier(120)
    # The kept session answers the peek it had before the break, on the new connection.
    effects = instance.handle_response("r1", 2, PeekResponse("p1", rows("a")))
    assert PeekDone("p1", rows("a"), "r1") in effects
    # The session's position still maps: a second break resumes after what was sent.
    sent_after = sent_to(effects, "r1")
    instance.replica_failed("r1", 2, "stream broken again")
    instance.tick(500)  # a second failure in a row waits retry_base_ms
    (send,) = instance.replica_connected("r1", 3, "r1-3", True, len(received) + len(suffix) + len(sent_after))
    assert [type(c) for c in send.commands] == [Peek]  # only p2 is pending: sent again


def test_a_session_cut_partway_through_a_resume_resumes_again():
    instance, received = resumable_instance()
    instance.replica_failed("r1", 1, "stream broken")
    for time in range(160, 400, 10):  # 24 commands to catch up on
        instance.update_configuration(ComputeParameters(heartbeat_interval_ms=time))
    (send,) = instance.replica_connected("r1", 2, "r1-2", True, len(received))
    batch = list(send.commands)  # the pending peek again, then the 24
    received += batch[:10]  # cut again after 10 of them
    instance.replica_failed("r1", 2, "stream broken again")
    instance.tick(500)

    (send,) = instance.replica_connected("r1", 3, "r1-3", True, len(received))

    assert send.commands[1:] == tuple(batch[10:])  # the peek again, then the rest
    assert apply(received + list(send.commands)) == apply(instance.history.commands)
    assert instance.replicas["r1"].resumes == 2


def test_a_session_is_not_resumed_once_what_it_missed_left_the_window():
    instance, received = resumable_instance(resume_window=20)
    instance.replica_failed("r1", 1, "stream broken")
    for time in range(160, 400, 10):  # 24 more pushes (and reductions) meanwhile
        instance.update_configuration(ComputeParameters(heartbeat_interval_ms=time))
    assert instance.history.horizon > instance.replicas["r1"].session.position(len(received))

    effects = instance.replica_connected("r1", 2, "r1-2", True, len(received))

    # The replica resumed (it could not know), but its suffix is gone: fail it, and offer
    # no resume to the next incarnation, which replays the reduced history.
    assert effects[0] == Disconnect("r1", 2)
    assert Connect("r1", 3, None, failures=2) in instance.tick(500)
    replay = connect(instance, "r1")
    assert replay[0] == CreateInstance(CONFIG) and apply(replay) == apply(instance.history.commands)
    assert (instance.replicas["r1"].resumes, instance.replicas["r1"].replays) == (0, 2)


def test_a_replica_that_lost_its_session_replays_the_reduced_history():
    instance, _ = resumable_instance()
    instance.replica_failed("r1", 1, "process killed")
    replay = connect(instance, "r1")  # a new process: HelloAck(resumed=False)
    assert replay[0] == CreateInstance(CONFIG) and apply(replay) == apply(instance.history.commands)
    assert instance.replicas["r1"].session.nonce == "r1-2"


def test_a_failed_replica_holds_its_inputs_until_its_resume_offer_expires():
    instance = new_instance(replica_timeout_ms=1_000)
    connect(instance, "r1")
    connect(instance, "r2")
    instance.create_dataflow(dataflow("u2", as_of=100))
    report(instance, "r1", "u2", 200)
    report(instance, "r2", "u2", 500)
    assert instance.dataflows["u2"].input_holds["u1"] == Frontier(199)  # r1 lags: its next step reads u1 as of 199

    instance.tick(1_000)
    instance.replica_failed("r1", 1, "stream broken")  # detached at 1000
    report(instance, "r2", "u2", 600)
    # Its session may resume at 200 and read its inputs from 199: they stay held, even
    # as new incarnations fail before answering Hello (and back off: 500 ms, then 1 s).
    assert instance.tick(1_400) == []
    effects = instance.replica_failed("r1", 2, "no answer to Hello within 10 s")
    assert storage_holds(effects) == [] and instance.dataflows["u2"].input_holds["u1"] == Frontier(199)
    assert instance.tick(1_899) == []
    (connect_3,) = instance.tick(1_900)
    assert connect_3.resume.nonce == "r1-1"  # still offering the session
    effects = instance.replica_failed("r1", 3, "no answer to Hello within 10 s")  # waits until 2900
    assert storage_holds(effects) == [] and instance.dataflows["u2"].input_holds["u1"] == Frontier(199)
    assert instance.tick(2_000) == []  # exactly the timeout since it detached

    effects = instance.tick(2_001)

    # The offer is withdrawn, and with it the hold: u2's since (W - 1).
    assert storage_holds(effects) == [Frontier(599)]
    assert instance.replicas["r1"].frontiers == {} and instance.replicas["r1"].session is None
    assert instance.tick(2_899) == []
    assert instance.tick(2_900) == [Connect("r1", 4, None, failures=3)]  # offering nothing


def test_a_new_session_elsewhere_does_not_spoil_a_resume_in_flight():
    instance, received = resumable_instance()
    instance.replica_failed("r1", 1, "stream broken")
    connect(instance, "r2")  # a new session: replayed the reduced history meanwhile

    (send,) = instance.replica_connected("r1", 2, "r1-2", True, len(received))

    assert apply(received + list(send.commands)) == apply(instance.history.commands)
    assert instance.replicas["r1"].resumes == 1


def test_peeks_find_dataflows_by_name_while_they_live():
    instance = new_instance()
    connect(instance, "r1")
    instance.create_dataflow(dataflow("u2"))
    assert instance.dataflow_named("df_u2").export_ids == ("u2",)
    with pytest.raises(InstanceError) as error:
        instance.create_dataflow(replace(dataflow("u3"), name="df_u2"))
    assert error.value.code == "ALREADY_EXISTS"
    instance.peek(Peek("p1", IndexTarget("u2"), 0))  # holds u2 after the drop

    instance.drop_dataflow("u2")

    with pytest.raises(InstanceError) as error:
        instance.dataflow_named("df_u2")
    assert error.value.code == "NOT_FOUND" and "u2" in instance.dataflows  # still held
    instance.create_dataflow(replace(dataflow("u3"), name="df_u2"))  # the name is free again
    assert instance.dataflow_named("df_u2").export_ids == ("u3",)


def test_a_crashed_replica_comes_back_in_the_simulator_and_serves_again():
    sim = Simulation(SimOptions(seed=7, faults=False, restarts=False, replicas=2))
    sim.workload_on = False
    for _ in range(10):
        sim.step()
    for _ in range(3):
        sim._create_dataflow()
    for _ in range(40):
        sim.step()
    sim.crash(sim.replicas["r1"], until=sim.now + 1_000)
    for _ in range(10):
        sim._peek_serializable()
        sim.step()
    sim.quiesce()
    assert sim.instance.replicas["r1"].epoch == 2 and sim.instance.replicas["r1"].failures == 1
    process = sim.replicas["r1"]  # a new process, which built every live dataflow again
    assert process.incarnation == 2 and process.built == len(sim.instance.dataflows) > 0
    assert all(len(p.answers) == 1 for p in sim.peeks.values())


def test_a_hung_replica_is_failed_after_replica_timeout_ms():
    instance = new_instance(replica_timeout_ms=2_000)
    instance.tick(1_000)
    connect(instance, "r1")  # heard at 1000
    instance.tick(2_500)
    instance.handle_response("r1", 1, StatusResponse(1))  # heard at 2500

    assert instance.tick(4_500) == []  # silent for exactly the timeout: still fine
    effects = instance.tick(4_501)

    assert Disconnect("r1", 1) in effects and Connect("r1", 2, Resume("r1-1", 2), failures=1) in effects
    replica = instance.replicas["r1"]
    assert (replica.phase, replica.epoch, replica.failures) == ("connecting", 2, 1)
    assert replica.last_failure == "no message for 2001 ms"
    # Its resume offer (and the input holds kept for it) expire after the timeout too;
    # the next incarnation (a second failure: after 500 ms) starts a new session and
    # waits for as long as it takes.
    assert instance.tick(6_501) == []
    effects = instance.tick(6_502)
    assert Disconnect("r1", 2) in effects
    assert replica.last_failure == "did not resume its session within 2001 ms"
    assert Connect("r1", 3, None, failures=2) in instance.tick(7_002)
    assert instance.tick(20_000) == []


def test_a_replica_that_keeps_failing_backs_off_across_incarnations():
    """A replica that refuses right after connecting (a fenced controller, a refused
    CreateInstance) or whose process keeps dying was connected again at once, forever.
    Its incarnations now back off, 500 ms doubling to 30 s, and each Connect carries the
    failures in a row (the runtime replaces a process that keeps failing); once it
    stayed active for stable_ms, a failure reconnects at once again."""
    instance = new_instance(replica_timeout_ms=100_000)
    effects, now, connects = instance.add_replica("r1"), 0, []
    while True:
        (connect,) = [e for e in effects if isinstance(e, Connect)]
        connects.append((now, connect.failures))
        if len(connects) == 11:
            break
        effects = instance.replica_failed("r1", connect.epoch, "refused (STALE_EPOCH): epoch 1 < 2")
        while not any(isinstance(e, Connect) for e in effects):
            assert instance.replicas["r1"].retry_at_ms > now  # failed, waiting
            now += 100
            effects = instance.tick(now)

    assert connects == [
        (0, 0),
        (0, 1),  # a first failure: at once (a live process resumes its session)
        (500, 2),
        (1_500, 3),
        (3_500, 4),
        (7_500, 5),
        (15_500, 6),
        (31_500, 7),
        (61_500, 8),  # capped at 30 s
        (91_500, 9),
        (121_500, 10),
    ]
    replica = instance.replicas["r1"]
    assert (replica.consecutive_failures, replica.failures) == (10, 10)
    instance.replica_connected("r1", connect.epoch, "r1-new")
    for now in range(now, now + 60_001, 10_000):  # active (and heard from) for stable_ms
        instance.handle_response("r1", connect.epoch, StatusResponse(1))
        instance.tick(now)
    assert replica.consecutive_failures == 0
    effects = instance.replica_failed("r1", connect.epoch, "stream broken")
    assert Connect("r1", connect.epoch + 1, Resume("r1-new", 2), failures=1) in effects


def test_instance_options_default_to_the_catalogs():
    """One source for an instance's defaults: a ComputeInstance built without options
    behaves as one the catalog records with its defaults."""
    assert InstanceOptions() == InstanceOptions(
        DEFAULT_MIN_IN_SYNC, DEFAULT_MAX_LAG_MS, DEFAULT_REPLICA_TIMEOUT_MS
    )


def test_drop_replica_is_refused_below_min_in_sync_without_force():
    instance = new_instance(min_in_sync=1)
    connect(instance, "r1")
    connect(instance, "r2")
    instance.create_dataflow(dataflow("u2"))
    report(instance, "r1", "u2", 10)
    assert [h.in_sync for h in instance.health()] == [True, False]

    before = snapshot(instance)
    with pytest.raises(InstanceError) as refused:
        instance.drop_replica("r1")
    assert refused.value.code == "FAILED_PRECONDITION"
    assert snapshot(instance) == before

    assert instance.drop_replica("r2")[0] == Disconnect("r2", 1)  # not in sync: allowed
    assert instance.drop_replica("r1", force=True)[0] == Disconnect("r1", 1)
    assert instance.replicas == {} and instance.state() == "unavailable"


def status(instance: ComputeInstance, name: str, *failed: tuple[str, str], errors=()) -> list:
    """Replica `name` reports a heartbeat: dataflows (id, error) failed, the rest fine."""
    epoch = instance.replicas[name].epoch
    dataflows = tuple(DataflowStatus(id, hydrated=False, error=error) for id, error in failed)
    return instance.handle_response(name, epoch, StatusResponse(1, dataflows, errors=tuple(errors)))


def two_replicas_serving(*ids: str, **options) -> ComputeInstance:
    """Replicas r1 and r2, both hydrated and in sync for dataflows `ids`."""
    instance = new_instance(**options)
    connect(instance, "r1")
    connect(instance, "r2")
    for id in ids:
        instance.create_dataflow(dataflow(id))
        for name in ("r1", "r2"):
            report(instance, name, id, 10)
    assert instance.state() == "healthy"
    return instance


def test_a_replica_with_a_failed_dataflow_is_not_in_sync():
    instance = two_replicas_serving("u2", "u3")

    status(instance, "r1", ("u2", "division by zero"))

    health = {h.name: h for h in instance.health()}
    assert not health["r1"].in_sync and health["r2"].in_sync
    assert instance.state() == "healthy" and instance.unavailable_dataflows() == {}
    status(instance, "r1")  # a later heartbeat without the error: in sync again
    assert all(h.in_sync for h in instance.health())


def test_a_replica_whose_input_was_compacted_past_a_dataflow_is_rehydrated_at_once():
    """A replica's dataflow that meets its input compacted past its frontier cannot go
    on in its session (it fell behind what the holds keep for it): its status says so,
    and the instance starts a new session at once instead of waiting to evict it."""
    instance = two_replicas_serving("u2")
    epoch = instance.replicas["r1"].epoch
    stuck = DataflowStatus("u2", True, needs_new_session="cannot read u1 from time 5: its since is 9 (compacted away)")
    effects = instance.handle_response("r1", epoch, StatusResponse(1, (stuck,)))

    r1 = instance.replicas["r1"]
    assert Disconnect("r1", epoch) in effects
    assert [e for e in effects if isinstance(e, Connect)] == [Connect("r1", epoch + 1, None, failures=1)]  # no resume: a new session
    assert r1.last_failure == "dataflow df_u2 cannot go on: cannot read u1 from time 5: its since is 9 (compacted away)"
    assert r1.frontiers == {}  # its holds go: the new session starts at the sinces
    assert instance.replicas["r2"].phase == "active"


def test_replica_wide_errors_put_a_replica_out_of_sync_but_it_still_serves():
    instance = two_replicas_serving("u2")
    status(instance, "r1", errors=["no live executors"])
    assert [h.in_sync for h in instance.health()] == [False, True]
    status(instance, "r2", errors=["no live executors"])

    # Nothing is in sync, but both hold hydrated indexes that answer peeks.
    assert instance.state() == "degraded" and instance.unavailable_dataflows() == {}


def test_a_dataflow_failed_everywhere_degrades_the_instance_and_is_named():
    instance = two_replicas_serving("u2", "u3", min_in_sync=2)

    status(instance, "r1", ("u2", "boom on r1"))
    status(instance, "r2", ("u2", "boom on r2"))

    assert instance.state() == "degraded"  # u3 still serves: not unavailable
    assert instance.unavailable_dataflows() == {"df_u2": "failed on r1: boom on r1; failed on r2: boom on r2"}
    health = instance.health()
    assert not any(h.in_sync for h in health)
    # min_in_sync counts replicas in sync where some replica serves: the failed dataflow
    # does not let the last replicas serving u3 go unforced.
    assert all(h.in_sync_where_served for h in health)
    before = snapshot(instance)
    with pytest.raises(InstanceError) as refused:
        instance.drop_replica("r1")
    assert refused.value.code == "FAILED_PRECONDITION" and snapshot(instance) == before


def test_a_dataflow_hydrating_everywhere_degrades_and_nothing_serving_is_unavailable():
    instance = two_replicas_serving("u2")
    instance.create_dataflow(dataflow("u3", as_of=10))

    assert instance.state() == "degraded"
    assert instance.unavailable_dataflows() == {"df_u3": "not hydrated on r1; not hydrated on r2"}
    instance.replica_failed("r2", 1, "stream broken")
    assert instance.unavailable_dataflows() == {"df_u3": "not hydrated on r1; r2 is connecting"}

    status(instance, "r1", ("u2", "boom"))  # now nothing serves anywhere

    assert instance.state() == "unavailable"
    assert instance.unavailable_dataflows()["df_u2"] == "failed on r1: boom; r2 is connecting"


def peek_error(instance: ComputeInstance, name: str, uuid: str, message: str) -> list:
    epoch = instance.replicas[name].epoch
    return instance.handle_response(name, epoch, PeekResponse(uuid, PeekError(message)))


def answers(effects: list) -> list[PeekDone]:
    return [e for e in effects if isinstance(e, PeekDone)]


def test_an_error_does_not_answer_a_peek_another_replica_may_answer():
    instance = two_replicas_serving("u2")
    instance.peek(Peek("p1", IndexTarget("u2"), 9))

    assert peek_error(instance, "r1", "p1", "out of memory") == []  # r2 may still answer

    effects = instance.handle_response("r2", 1, PeekResponse("p1", rows("from r2")))
    assert answers(effects) == [PeekDone("p1", rows("from r2"), "r2")]


def test_errors_answer_a_peek_once_every_active_replica_answered_one():
    instance = two_replicas_serving("u2")
    instance.peek(Peek("p1", IndexTarget("u2"), 9))
    peek_error(instance, "r2", "p1", "dataflow df_u2 failed: boom")

    effects = peek_error(instance, "r1", "p1", "out of memory")

    message = "replica r1: out of memory; replica r2: dataflow df_u2 failed: boom"
    assert effects[0] == PeekDone("p1", PeekError(message), None)
    assert sent(effects[1:3]) == [CancelPeek("p1"), CancelPeek("p1")]  # then the holds go
    assert instance.peeks == {} and "peek:p1" not in instance.collections["u2"].holds
    assert instance.replicas["r1"].peeks_won == instance.replicas["r2"].peeks_won == 0


@pytest.mark.parametrize("leaves", ["fails", "is dropped"])
def test_an_error_answers_a_peek_once_no_other_active_replica_is_left(leaves: str):
    instance = two_replicas_serving("u2")
    instance.peek(Peek("p1", IndexTarget("u2"), 9))
    peek_error(instance, "r1", "p1", "out of memory")

    if leaves == "fails":
        effects = instance.replica_failed("r2", 1, "stream broken")
    else:
        effects = instance.drop_replica("r2", force=True)

    assert answers(effects) == [PeekDone("p1", PeekError("replica r1: out of memory"), None)]


def test_an_error_of_a_dropped_replica_is_no_answer_of_one_added_under_its_name():
    instance = two_replicas_serving("u2")
    instance.peek(Peek("p1", IndexTarget("u2"), 9))
    peek_error(instance, "r1", "p1", "out of memory")
    instance.drop_replica("r1", force=True)
    connect(instance, "r1")  # a new replica, epoch 1 again

    assert peek_error(instance, "r2", "p1", "timed out") == []  # the new r1 may answer

    effects = instance.handle_response("r1", 1, PeekResponse("p1", rows("from the new r1")))
    assert answers(effects) == [PeekDone("p1", rows("from the new r1"), "r1")]


def test_a_replica_that_becomes_active_while_a_peek_waits_must_answer_it_too():
    instance = two_replicas_serving("u2")
    instance.peek(Peek("p1", IndexTarget("u2"), 9))
    peek_error(instance, "r1", "p1", "out of memory")
    instance.replica_failed("r1", 1, "stream broken")
    replay = connect(instance, "r1")  # its next incarnation gets the peek again ...
    assert Peek("p1", IndexTarget("u2"), 9) in replay
    replay = connect(instance, "r3")  # ... and so does a new replica
    assert Peek("p1", IndexTarget("u2"), 9) in replay

    assert peek_error(instance, "r2", "p1", "timed out") == []  # r1 (again) and r3 may answer
    assert peek_error(instance, "r3", "p1", "timed out") == []
    effects = peek_error(instance, "r1", "p1", "out of memory again")

    message = "replica r1: out of memory again; replica r2: timed out; replica r3: timed out"
    assert answers(effects) == [PeekDone("p1", PeekError(message), None)]


def test_a_peek_of_a_dataflow_every_replica_reports_failed_fails_at_once():
    instance = two_replicas_serving("u2", "u3")
    instance.peek(Peek("p1", IndexTarget("u2"), 9))
    assert status(instance, "r1", ("u2", "boom")) == []  # r2 may still answer p1

    effects = status(instance, "r2", ("u2", "bang"))

    message = "replica r1: dataflow df_u2 failed: boom; replica r2: dataflow df_u2 failed: bang"
    assert answers(effects) == [PeekDone("p1", PeekError(message), None)]
    before = snapshot(instance)
    with pytest.raises(InstanceError) as refused:
        instance.peek(Peek("p2", IndexTarget("u2"), 9))
    assert (refused.value.code, str(refused.value)) == ("FAILED_PRECONDITION", message)
    assert snapshot(instance) == before
    instance.peek(Peek("p3", IndexTarget("u3"), 9))  # the other dataflow serves


def test_a_peek_below_since_is_refused_and_changes_nothing():
    instance = new_instance()
    connect(instance, "r1")
    instance.create_dataflow(dataflow("u2", as_of=100))
    report(instance, "r1", "u2", 200)
    assert instance.collections["u2"].since == Frontier(199)

    before = snapshot(instance)
    with pytest.raises(InstanceError) as refused:
        instance.peek(Peek("p1", IndexTarget("u2"), 198))
    assert refused.value.code == "FAILED_PRECONDITION"
    assert snapshot(instance) == before
    with pytest.raises(InstanceError) as refused:
        instance.peek(Peek("p2", IndexTarget("u9"), 300))
    assert refused.value.code == "NOT_FOUND"
    assert snapshot(instance) == before


def test_dropping_a_dataflow_used_by_another_is_refused_and_changes_nothing():
    instance = new_instance()
    connect(instance, "r1")
    instance.create_dataflow(dataflow("u2"))
    instance.create_dataflow(dataflow("u3", imports=(Import("in", "u2", "index"),)))

    before = snapshot(instance)
    with pytest.raises(InstanceError) as refused:
        instance.drop_dataflow("u2")
    assert refused.value.code == "FAILED_PRECONDITION"
    assert "df_u3" in str(refused.value)
    assert snapshot(instance) == before

    assert sent(instance.drop_dataflow("u3")) == [AllowCompaction("u3", EMPTY)]
    assert sent(instance.drop_dataflow("u2")) == [AllowCompaction("u2", EMPTY)]
    assert instance.collections == {} and instance.dataflows == {}


# --- Bugs the random runs found, minimized ----------------------------------------------


def test_a_dropped_dataflow_releases_its_storage_holds():
    """Found by the random runs (140 of the 200 seeds fail without the fix): a dataflow
    over storage was dropped after a replica had reported; its storage hold followed that
    replica's frontier instead of going, and the dataflow was forgotten still holding."""
    instance = new_instance()
    connect(instance, "r1")
    assert storage_holds(instance.create_dataflow(dataflow("u2", as_of=100))) == []  # the catalog took it
    assert storage_holds(report(instance, "r1", "u2", 150)) == [Frontier(149)]

    effects = instance.drop_dataflow("u2")

    assert AllowCompaction("u2", EMPTY) in sent(effects)
    assert storage_holds(effects)[-1] == EMPTY
    assert instance.dataflows == {}


def test_input_holds_wait_for_a_new_replica_to_report():
    """Found by the random runs (182 of 200 seeds): a replica added late was replayed
    dataflow u2 at as_of 857; the other replica's reports then moved u2's hold on its
    storage input to 969 before the new one had reported, and it then reported 857: its
    input was released below its own frontier (DESIGN 6: since(input) <= min_r w_r(c)).
    A replica that has not reported starts at the as_of it was given."""
    instance = new_instance()
    connect(instance, "r1")
    instance.create_dataflow(dataflow("u2", as_of=0), compaction_window_ms=300)
    report(instance, "r1", "u2", 1158)
    assert instance.collections["u2"].since == Frontier(857)
    replay = connect(instance, "r2")
    assert [c.desc.as_of for c in replay if isinstance(c, CreateDataflow)] == [Frontier(857)]

    effects = report(instance, "r1", "u2", 1270)  # since(u2) moves on to 969 ...

    assert instance.collections["u2"].since == Frontier(969)
    assert all(hold <= Frontier(857) for hold in storage_holds(effects))  # ... the input does not
    assert instance.dataflows["u2"].input_holds["u1"] == Frontier(857)
    assert storage_holds(report(instance, "r2", "u2", 857)) == []  # r2 starts at its as_of
    assert storage_holds(report(instance, "r2", "u2", 900)) == [Frontier(899)]


def test_a_replica_is_hydrated_only_once_past_the_as_of_it_was_given():
    """Found by the random runs (134 of 200 seeds): a replica added (or rehydrated)
    late is replayed its dataflows at their since, and its first report is that as_of,
    past the dataflow's original as_of: the instance called it hydrated and in sync
    before it had computed anything, so the resize flow (add, wait until in sync, drop
    the old ones) could drop the only hydrated replica."""
    instance = new_instance(min_in_sync=1)
    connect(instance, "r1")
    instance.create_dataflow(dataflow("u2", as_of=0))
    report(instance, "r1", "u2", 1000)
    replay = connect(instance, "r2")
    assert [c.desc.as_of for c in replay if isinstance(c, CreateDataflow)] == [Frontier(999)]

    report(instance, "r2", "u2", 999)  # built at its as_of, nothing computed yet

    r2 = next(h for h in instance.health() if h.name == "r2")
    assert not r2.hydrated and not r2.in_sync
    before = snapshot(instance)
    with pytest.raises(InstanceError):
        instance.drop_replica("r1")  # r2 cannot serve yet
    assert snapshot(instance) == before

    report(instance, "r2", "u2", 1000)  # computed at 999
    assert all(h.hydrated and h.in_sync for h in instance.health())
    assert instance.drop_replica("r1") == [Disconnect("r1", 1)]


def test_an_upstream_can_be_dropped_once_its_dependents_were_dropped():
    """Found by the random runs (24 of 200 seeds): dataflow u3 (importing u2) was
    dropped but lingered, held by a pending peek; dropping its upstream was then refused
    as "used by df_u3; drop those first"."""
    instance = new_instance()
    connect(instance, "r1")
    instance.create_dataflow(dataflow("u2", as_of=10))
    instance.create_dataflow(dataflow("u3", imports=(Import("in", "u2", "index"),), as_of=10))
    instance.peek(Peek("p1", IndexTarget("u3"), 40))
    report(instance, "r1", "u2", 50)
    report(instance, "r1", "u3", 50)
    instance.drop_dataflow("u3")
    assert instance.collections["u3"].since == Frontier(40)  # lingers for the peek

    effects = instance.drop_dataflow("u2")

    assert AllowCompaction("u2", EMPTY) not in sent(effects)  # still read by u3
    assert instance.collections["u2"].since <= Frontier(40)
    effects = instance.handle_response("r1", 1, PeekResponse("p1", rows("answer")))
    assert effects[0] == PeekDone("p1", rows("answer"), "r1")
    assert AllowCompaction("u3", EMPTY) in sent(effects)
    # u3 is cleaned up (and lets go of u2) by the next maintenance step, u2 by the one
    # after: clean-up visits dataflows in creation order, upstreams first.
    assert sent(instance.tick(1)) == [AllowCompaction("u2", EMPTY)]
    instance.tick(2)
    assert instance.collections == {} and instance.dataflows == {}


def test_an_upstream_since_follows_a_forwarded_input_hold_in_the_same_step():
    """Found while writing the rehydration story (and then by 181 of 200 seeds, once the
    simulator checked that every since equals the meet of its holds): when a lagging
    replica's report moves a dataflow's input hold while no since changes,
    `_update_holds` stopped before the upstream's since followed, although it promises a
    fixed point; the AllowCompaction waited for the next, unrelated call."""
    instance = new_instance()
    connect(instance, "r1")
    connect(instance, "r2")
    instance.create_dataflow(dataflow("u2"))
    instance.create_dataflow(dataflow("u3", imports=(Import("in", "u2", "index"),)))
    for name, time in (("r1", 100), ("r2", 100)):
        report(instance, name, "u2", time)
    report(instance, "r1", "u3", 100)
    report(instance, "r2", "u3", 50)  # r2 lags: its next step reads u2 as of 49
    assert instance.collections["u3"].since == Frontier(99)
    assert instance.collections["u2"].since == Frontier(49)

    effects = report(instance, "r2", "u3", 100)  # since(u3) stays; the hold on u2 moves

    assert AllowCompaction("u2", Frontier(99)) in sent(effects)
    assert instance.collections["u2"].since == Frontier(99)


def test_recovery_keeps_each_exports_since():
    """Found by the random runs: recovery rebuilds every live dataflow with as_of = its
    recorded since (DESIGN 6; `catalog._recovery` takes the meet over the exports). A
    dataflow with two exports (say an index and a materialized view) has two sinces;
    with one as_of both come back at their meet, so the new controller accepts peeks
    and imports of the other export below the since that surviving replicas already
    compacted it to, and they answer those with an error (23 of 200 seeds, e.g. a
    serializable peek right after the restart). Recovery therefore passes each export's
    recorded since along with the one as_of."""
    instance = new_instance()
    connect(instance, "r1")
    desc = dataflow("u2", "u3", as_of=0)
    instance.create_dataflow(desc)
    instance.peek(Peek("p1", IndexTarget("u2"), 5))  # holds u2 back
    effects = report(instance, "r1", "u2", 100) + report(instance, "r1", "u3", 100)
    recorded = {e.id: e.since for e in effects if isinstance(e, SinceAdvanced)}
    assert recorded == {"u2": Frontier(5), "u3": Frontier(99)}

    recovered = new_instance()
    recovered.create_dataflow(desc.with_as_of(Frontier(5)), sinces=recorded)  # as_of: the meet of 5 and 99

    assert recovered.collections["u3"].since == Frontier(99)


def test_a_recovered_dataflow_holds_its_inputs_where_the_catalog_had_them_until_its_replicas_report():
    """The controller holds a dataflow's inputs where its slowest replica stands, while
    its since follows the fastest. Recovered at the meet of the two, the dataflow's
    holds moved up to the since at once (no replica had connected yet): a replica that
    lagged then found its inputs compacted past it, and was rebuilt. They wait for
    every replica's first report, or for `replica_timeout_ms`."""
    recovered = new_instance(replica_timeout_ms=10_000)
    recovered.create_dataflow(dataflow("u2", as_of=40), sinces={"u2": Frontier(99)})  # inputs held at 40
    connect(recovered, "fast")
    connect(recovered, "slow")

    assert storage_holds(report(recovered, "fast", "u2", 120) + recovered.maintain()) == []  # the slow one has not reported
    assert storage_holds(report(recovered, "slow", "u2", 45)) == [Frontier(44)]  # where the slow one stands

    alone = new_instance(replica_timeout_ms=10_000)
    alone.create_dataflow(dataflow("u2", as_of=40), sinces={"u2": Frontier(99)})
    assert storage_holds(alone.tick(5_000)) == []
    assert storage_holds(alone.tick(10_001)) == [Frontier(99)]  # no replica came


# --- Random runs --------------------------------------------------------------------------


def options(seed: int) -> dict:
    """Vary the shape with the seed: one to three replicas to start, min_in_sync 1 or 2,
    and now and then a resume window so short that resumes fall back to replays."""
    return {
        "replicas": (1, 2, 2, 3)[seed % 4],
        "min_in_sync": 2 if seed % 5 == 4 else 1,
        "resume_window": 8 if seed % 3 == 2 else 10_000,
    }


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_workload_with_faults(seed: int):
    sim = run_seed(seed, **options(seed))
    assert all(len(p.answers) == (0 if p.lost else 1) for p in sim.peeks.values())
    assert sim.instance.state() == "healthy"


def test_random_runs_exercise_every_fault():
    """The seeds above are worth running: together they hit every fault and refusal."""
    totals: dict[str, int] = {}
    for seed in range(20):
        for key, count in run_seed(seed, **options(seed)).stats.items():
            totals[key] = totals.get(key, 0) + count
    for key in (
        "fault crash",
        "fault hang",
        "fault slow",
        "fault duplicate",
        "fault late",
        "fault peek errors",
        "fault refuse",
        "connections refused",
        "controller restarts",
        "duplicated",
        "late responses delivered",
        "peeks answered",
        "peeks cancelled by the client",
        "peeks answered with errors",  # every active replica answered with an error
        "peeks answered with rows after an error",  # an error did not win
        "refused peek",
        "refused create_dataflow",
        "refused drop_dataflow",
        "refused drop_replica",
        "sessions started",
        "sessions resumed",  # near-horizon rehydration
        "feed progress",  # changes delivered and checked against the reference
        "feed changes",
        "feeds ended by a drop",
        "refused subscribe",
    ):
        assert totals.get(key, 0) > 0, f"no {key!r} in 20 seeds: {totals}"


def test_a_seed_replays_exactly():
    first, second = run_seed(11), run_seed(11)
    assert (first.now, first.step_number, first.stats) == (
        second.now,
        second.step_number,
        second.stats,
    )
    assert list(first.instance.history.commands) == list(second.instance.history.commands)


def test_the_simulator_catches_a_wrong_answer(monkeypatch):
    """A replica answering wrong bytes is caught at the client."""
    import simulation

    monkeypatch.setattr(
        simulation, "peek_rows", lambda payload, count: PeekRows(payload + b"!", count, "x")
    )
    with pytest.raises(SimulationFailure, match="answered by"):
        run_seed(0)


def test_the_simulator_catches_an_error_that_wins_a_read(monkeypatch):
    """An instance that lets the first error answer a peek, while another active replica
    could still answer it with rows, is caught."""

    def first_error_wins(self, pending):
        errors = sorted(pending.errors.items())
        return "; ".join(f"replica {name}: {message}" for name, (_, message) in errors) or None

    monkeypatch.setattr(ComputeInstance, "_peek_failure", first_error_wins)
    with pytest.raises(SimulationFailure, match="could still answer it"):
        for seed in range(1, 20):
            run_seed(seed, **options(seed))


def test_the_simulator_catches_a_time_forwarded_twice(monkeypatch):
    """An instance that forwards every report of a subscription, not only its times not
    forwarded yet, is caught."""
    forward = ComputeInstance._subscribe_response

    def forward_everything(self, replica, response):
        subscription = self.subscriptions.get(response.uuid)
        if subscription is not None and response.upper > subscription.frontier:
            subscription.frontier = min(subscription.frontier, response.lower)
        return forward(self, replica, response)

    monkeypatch.setattr(ComputeInstance, "_subscribe_response", forward_everything)
    with pytest.raises(SimulationFailure, match="delivered twice|after progress|consolidated through"):
        for seed in range(20):
            run_seed(seed, **options(seed))


def test_the_simulator_catches_a_subscription_that_does_not_hold_its_index(monkeypatch):
    """Without its hold, replicas compact past what a feed forwarded: their reports then
    start past it, and an instance that takes them leaves a gap; one that does not
    stalls (the feed never catches up, or cannot be resumed after a restart)."""
    monkeypatch.setattr(SubscriptionState, "hold", lambda self: Frontier.empty())
    forward = ComputeInstance._subscribe_response

    def take_any_report(self, replica, response):
        subscription = self.subscriptions.get(response.uuid)
        if subscription is not None and response.lower > subscription.frontier:
            subscription.frontier = response.lower
        return forward(self, replica, response)

    with pytest.raises(SimulationFailure, match="did not settle|did not catch up|compacted away"):
        for seed in range(20):
            run_seed(seed, **options(seed))
    monkeypatch.setattr(ComputeInstance, "_subscribe_response", take_any_report)
    with pytest.raises(SimulationFailure, match="consolidated through"):
        for seed in range(20):
            run_seed(seed, **{**options(seed), "restarts": False})


def changes(time: int) -> SubscribeChanges:
    return SubscribeChanges(time, f"changes at {time}".encode(), 1)


def subscribed(*replicas: str) -> ComputeInstance:
    """An instance with `replicas` and a subscription `s1` to dataflow u2 as of 5."""
    instance = new_instance()
    for name in replicas:
        connect(instance, name)
    instance.create_dataflow(dataflow("u2"))
    instance.subscribe(Subscribe("s1", "u2", 5))
    return instance


def test_a_subscription_forwards_each_time_once_from_whichever_replica_reports_it_first():
    instance = subscribed("r1", "r2")
    first = instance.handle_response("r1", 1, SubscribeResponse("s1", 5, 6, (changes(5),)))
    assert [e for e in first if isinstance(e, SubscribeForward)] == [SubscribeForward("s1", (changes(5),), 5)]
    assert instance.collections["u2"].holds["subscribe:s1"] == Frontier(5)
    # r2 reports the same time and more in one range: only the times not forwarded go on.
    second = instance.handle_response("r2", 1, SubscribeResponse("s1", 5, 9, (changes(5), changes(7))))
    assert [e for e in second if isinstance(e, SubscribeForward)] == [SubscribeForward("s1", (changes(7),), 8)]
    assert instance.subscribe_duplicates == 1
    # r1 is behind: its report is all forwarded already. A report starting past what
    # was forwarded cannot say what changed in between, and is not taken either.
    assert instance.handle_response("r1", 1, SubscribeResponse("s1", 6, 9, (changes(7),))) == []
    assert instance.handle_response("r1", 1, SubscribeResponse("s1", 10, 12, (changes(11),))) == []
    assert instance.subscriptions["s1"].frontier == 9 and instance.collections["u2"].holds["subscribe:s1"] == Frontier(8)
    # Closing it tells the replicas and releases the hold.
    effects = instance.cancel_subscribe("s1")
    assert CancelSubscribe("s1") in [c for e in effects if isinstance(e, Send) for c in e.commands]
    assert "subscribe:s1" not in instance.collections["u2"].holds and "s1" not in instance.subscriptions


def test_a_subscription_is_refused_below_the_since_and_ends_with_its_dataflow():
    instance = subscribed("r1")
    with pytest.raises(InstanceError) as refused:
        instance.subscribe(Subscribe("s1", "u2", 5))
    assert refused.value.code == "ALREADY_EXISTS"
    with pytest.raises(InstanceError) as refused:
        instance.subscribe(Subscribe("s2", "nope", 5))
    assert refused.value.code == "NOT_FOUND"
    instance.collections["u2"].holds["implied"] = Frontier(9)
    instance.cancel_subscribe("s1")  # the since may now move to 9
    with pytest.raises(InstanceError) as refused:
        instance.subscribe(Subscribe("s3", "u2", 8))
    assert refused.value.code == "FAILED_PRECONDITION" and "since is 9" in str(refused.value)
    instance.subscribe(Subscribe("s4", "u2", 9))
    effects = instance.drop_dataflow("u2")
    assert SubscribeEnded("s4", "NOT_FOUND", "dataflow df_u2 was dropped") in effects
    assert not instance.subscriptions


def test_a_subscription_ends_with_errors_only_once_every_active_replica_reported_one():
    instance = subscribed("r1", "r2")
    assert instance.handle_response("r1", 1, SubscribeResponse("s1", 5, 5, error="cannot diff a MAP column")) == []
    ended = instance.handle_response("r2", 1, SubscribeResponse("s1", 5, 5, error="cannot diff a MAP column"))
    assert ended[0] == SubscribeEnded("s1", "FAILED_PRECONDITION", "replica r1: cannot diff a MAP column; replica r2: cannot diff a MAP column")


def test_the_simulator_catches_a_hot_loop(monkeypatch):
    """An instance that connects a failing replica again at once, however often it
    failed, is caught."""
    monkeypatch.setattr(InstanceOptions, "retry_delay_ms", lambda self, failures: 0)
    with pytest.raises(SimulationFailure, match="no backoff"):
        for seed in range(20):
            run_seed(seed, **options(seed))


def test_a_replica_held_back_too_far_is_evicted_from_the_holds_and_rehydrated():
    """A replica alive but stuck (its heartbeats arrive, its frontier does not move)
    held its dataflows' inputs at its frontier forever. Past `max_hold_back_ms` behind
    W it holds nothing and starts a new session at the current sinces."""
    instance = new_instance(max_hold_back_ms=1_000, replica_timeout_ms=60_000)
    connect(instance, "r1")
    connect(instance, "r2")
    instance.create_dataflow(dataflow("u2", as_of=100))
    report(instance, "r1", "u2", 200)
    report(instance, "r2", "u2", 200)
    for time in range(300, 1_300, 100):  # r2 stays at 200
        report(instance, "r1", "u2", time)
        assert instance.dataflows["u2"].input_holds["u1"] == Frontier(199)
        assert instance.tick(time) == []  # within the bound: it holds them
    effects = recorded(instance, report(instance, "r1", "u2", 1_201) + instance.tick(1_201))

    assert Disconnect("r2", 1) in effects
    assert instance.replicas["r2"].session is None  # no resume: that would hold again
    assert "1001 ms behind W on u2, more than 1000 ms (max_hold_back_ms = 1000)" in instance.replicas["r2"].last_failure
    assert storage_holds(effects)[-1] == Frontier(1_200)  # the inputs follow r1 alone
    assert next(h for h in instance.health() if h.name == "r2").in_sync is False
    (reconnect,) = [e for e in effects if isinstance(e, Connect)]
    assert reconnect.resume is None
    replay = connect(instance, "r2")
    assert [c.desc.as_of for c in replay if isinstance(c, CreateDataflow)] == [Frontier(1_200)]


def test_the_hold_back_bound_doubles_with_each_consecutive_failure_so_a_slow_hydration_ends():
    """A replica whose hydration takes longer than `max_hold_back_ms` was evicted again
    and again, never in sync. Each consecutive failure doubles its bound (at most
    HOLD_BACK_DOUBLINGS times); once it stays in sync for `stable_ms`, the bound is back.
    Hydrating past `stable_ms` does not count as stable: counted from connecting, the
    failures were forgotten mid-hydration and the bound fell back (evictions after 1.1,
    2.1, 2.1, 2.1 and 2.1 s here)."""
    instance = new_instance(max_hold_back_ms=1_000, replica_timeout_ms=60_000, stable_ms=2_000)
    instance.tick(100)
    connect(instance, "r1")
    connect(instance, "r2")
    instance.create_dataflow(dataflow("u2", as_of=100))
    now, evicted_after = 100, []
    for _ in range(HOLD_BACK_DOUBLINGS + 2):
        given = now
        while instance.replicas["r2"].phase == "active":
            now += 100
            report(instance, "r1", "u2", now)  # W follows r1; r2 hydrates, says nothing
            instance.tick(now)
        evicted_after.append(now - given)
        now = instance.replicas["r2"].retry_at_ms
        instance.tick(now)
        connect(instance, "r2")
    assert evicted_after == [1_100, 2_100, 4_100, 8_100, 8_100]
    r2 = instance.replicas["r2"]
    assert "more than 8000 ms (max_hold_back_ms = 1000, doubled for 3 consecutive failures)" in r2.last_failure

    for now in range(now + 100, now + 2_200, 100):  # hydrated, and in sync for stable_ms
        report(instance, "r1", "u2", now)
        report(instance, "r2", "u2", now)
        instance.tick(now)
    assert (r2.phase, r2.consecutive_failures) == ("active", 0)
    for now in range(now + 100, now + 1_200, 100):  # the bound is 1 s again
        report(instance, "r1", "u2", now)
        instance.tick(now)
    assert "more than 1000 ms (max_hold_back_ms = 1000)" in r2.last_failure


def test_a_replica_that_ignores_a_dataflow_does_not_freeze_its_inputs():
    """A replica that never reports a dataflow it was given (it could not build it and
    said nothing) held the dataflow's inputs at its as_of forever: the instance waits
    for a new session's first report. Past `max_hold_back_ms` it is rehydrated."""
    instance = new_instance(max_hold_back_ms=1_000, replica_timeout_ms=60_000)
    instance.tick(100)
    connect(instance, "r1")
    connect(instance, "r2")
    instance.create_dataflow(dataflow("u2", as_of=100))
    for time in range(200, 1_200, 100):
        report(instance, "r1", "u2", time)  # r2 says nothing of u2
        assert instance.dataflows["u2"].input_holds["u1"] == Frontier(100)
        assert instance.tick(time) == []
    effects = recorded(instance, instance.tick(1_101))

    assert Disconnect("r2", 1) in effects
    assert "it has not reported u2 for 1001 ms" in instance.replicas["r2"].last_failure
    assert instance.dataflows["u2"].input_holds["u1"] == Frontier(1_099)


def test_wallclock_lag_is_staleness_and_a_stale_dataflow_degrades_the_instance():
    """With one replica `W - w_r` is always 0: the instance looked healthy while its
    only replica had stopped moving. Lag against the clock shows it, and a collection
    more than `max_lag_ms` behind the clock on every replica degrades the instance."""
    instance = new_instance(max_lag_ms=500, replica_timeout_ms=60_000, max_hold_back_ms=60_000)
    instance.tick(1_000)
    connect(instance, "r1")
    instance.create_dataflow(dataflow("u2", as_of=900))
    report(instance, "r1", "u2", 1_000)
    (health,) = instance.health()
    assert (health.lag_ms, health.wallclock_lag_ms) == (0, 0)
    assert instance.state() == "healthy"

    instance.tick(1_400)
    assert next(iter(instance.health())).wallclock_lag_ms == 400 and instance.state() == "healthy"
    instance.tick(1_501)
    (health,) = instance.health()
    assert (health.lag_ms, health.wallclock_lag_ms, health.in_sync) == (0, 501, True)
    assert instance.stale_collections() == {"u2": 501}
    assert instance.state() == "degraded"
    report(instance, "r1", "u2", 1_500)
    assert instance.state() == "healthy"


def test_a_replica_added_before_the_first_tick_is_not_silent_since_1970():
    """A controller recovering adds its replicas before the driver's first tick; the
    instance's clock starts at the driver's time, so that tick fails none of them."""
    instance = ComputeInstance(CONFIG, InstanceOptions(replica_timeout_ms=4_000), now_ms=1_800_000_000_000)
    instance.add_replica("r1")
    connect(instance, "r1")
    assert not any(isinstance(e, Disconnect) for e in instance.tick(1_800_000_000_500))
    assert instance.replicas["r1"].phase == "active"


def last_event(instance: ComputeInstance, kind: str) -> str:
    return [e.message for e in instance.events if e.kind == kind][-1]


def test_what_happens_to_replicas_and_dataflows_is_recorded_as_events():
    """Failures, new sessions, resumes, hydration, reconciliation, dataflow errors and
    slow replicas each leave one event naming the replica, in the order they happened."""
    instance = new_instance(slow_after_ms=100, slow_period_ms=1_000)
    connect(instance, "r1")
    connect(instance, "r2")
    instance.create_dataflow(dataflow("u2", as_of=100))
    report(instance, "r1", "u2", 200)
    # The first status is the baseline: what the process did before this instance knew
    # it (a controller restarted finds the counters of the previous one's sessions).
    instance.handle_response("r1", 1, StatusResponse(1, pid=7, dataflows_kept=3, dataflows_built=2))
    instance.handle_response("r1", 1, StatusResponse(2, pid=7, dataflows_kept=3, dataflows_built=3))
    instance.handle_response("r1", 1, StatusResponse(3, pid=7, dataflows_kept=3, dataflows_built=3))  # nothing new
    failing = DataflowStatus("u2", False, error="CAST_INVALID_INPUT")
    instance.handle_response("r2", 1, StatusResponse(1, (failing,)))
    instance.handle_response("r2", 1, StatusResponse(2, (failing,)))  # reported once
    instance.replica_failed("r1", 1, "stream broke")
    instance.tick(10)
    instance.replica_connected("r1", 2, "r1-2", resumed=True, applied=len(instance.history))
    instance.replica_failed("r2", 1, "no message for 30000 ms")
    instance.replicas["r2"].session = None
    instance.tick(20)
    connect(instance, "r2")
    report(instance, "r2", "u2", 400)
    for n, now in enumerate((20, 300, 600, 900, 1_100)):  # five races over 1000 ms
        instance.tick(now)
        instance.peek(Peek(f"p{n}", IndexTarget("u2"), 399))  # r1, at 200, has 200 ms to go when r2 wins
        instance.handle_response("r2", 2, PeekResponse(f"p{n}", rows("")))
    instance.tick(1_200)

    assert [(e.kind, e.replica) for e in instance.events] == [
        ("rehydrating", "r1"),
        ("rehydrating", "r2"),
        ("hydrated", "r1"),
        ("reconciled", "r1"),
        ("dataflow_failed", "r2"),
        ("replica_failed", "r1"),
        ("resumed", "r1"),
        ("replica_failed", "r2"),
        ("rehydrating", "r2"),
        ("hydrated", "r2"),
        ("slow", "r1"),
    ]
    assert [e.message for e in instance.events if e.kind == "reconciled"] == ["replica r1 kept 0 and built 1 dataflows"]
    assert last_event(instance, "hydrated") == "replica r2 serves dataflow df_u2, 0 ms after it was given it"
    assert last_event(instance, "dataflow_failed") == "dataflow df_u2 failed on replica r2: CAST_INVALID_INPUT"
    assert last_event(instance, "replica_failed").startswith("replica r2 (incarnation 1) failed: no message for 30000 ms")
    assert instance.events_total == len(instance.events)


def digest_report(instance: ComputeInstance, name: str, id: str, time: int, digest: str) -> list:
    epoch = instance.replicas[name].epoch
    status = StatusResponse(1, (DataflowStatus(id, True, digest=digest, digest_time=time),))
    return recorded(instance, instance.handle_response(name, epoch, status))


def test_a_replica_whose_digest_disagrees_with_the_majority_answers_nothing_and_is_rehydrated():
    instance = new_instance()
    for name in ("r1", "r2", "r3"):
        connect(instance, name)
    instance.create_dataflow(dataflow("u2", as_of=100))
    for name in ("r1", "r2", "r3"):
        report(instance, name, "u2", 200)
    assert digest_report(instance, "r3", "u2", 150, "bad") == []  # nothing to compare yet
    assert digest_report(instance, "r1", "u2", 150, "good") == []  # one against one: wait
    instance.peek(Peek("p1", IndexTarget("u2"), 199))

    effects = digest_report(instance, "r2", "u2", 150, "good")

    r3 = instance.replicas["r3"]
    assert Disconnect("r3", 1) in effects and r3.session is None  # rehydrated, not resumed
    assert r3.diverged.startswith("dataflow df_u2 at 150: digest bad, 2 of 3 replicas have good")
    assert instance.divergences == 1 and "replica r3 diverged" in last_event(instance, "diverged")
    connect(instance, "r3")
    report(instance, "r3", "u2", 200)
    assert instance.handle_response("r3", 2, PeekResponse("p1", rows("wrong"))) == []  # not trusted
    assert not next(h for h in instance.health() if h.name == "r3").in_sync
    assert instance.handle_response("r1", 1, PeekResponse("p1", rows("right")))[0] == PeekDone("p1", rows("right"), "r1")

    digest_report(instance, "r3", "u2", 180, "good2")  # recomputed: it agrees again
    digest_report(instance, "r1", "u2", 180, "good2")
    assert r3.diverged is None and "agrees with the others again" in last_event(instance, "agreed")
    assert next(h for h in instance.health() if h.name == "r3").in_sync


def test_two_replicas_that_disagree_are_settled_by_a_fresh_recompute():
    """No majority: the version is recomputed from storage (once per time), and the
    replica that disagrees with it has diverged."""
    instance = two_replicas_computing_u2()
    digest_report(instance, "r1", "u2", 150, "a")
    assert digest_report(instance, "r2", "u2", 150, "b") == [Arbitrate("u2", 150)]
    assert digest_report(instance, "r2", "u2", 150, "b") == []  # asked once
    assert instance.divergences == 1 and "no majority" in last_event(instance, "arbitration")
    assert all(r.diverged is None for r in instance.replicas.values())  # not yet decided

    effects = instance.arbitrated("u2", 150, "b")

    assert Disconnect("r1", 1) in effects and "a fresh recompute from storage has b" in instance.replicas["r1"].diverged
    assert instance.replicas["r2"].diverged is None
    assert instance.divergences == 1  # one disagreement, counted once


def test_a_disputed_time_is_kept_until_its_recompute_answers():
    """A recompute from storage can take longer than the replicas take to report many
    newer times: the disputed time's digests are kept beyond the window until it answers,
    so the answer still finds the replica that disagreed."""
    instance = two_replicas_computing_u2()
    digest_report(instance, "r1", "u2", 150, "right")
    assert digest_report(instance, "r2", "u2", 150, "wrong") == [Arbitrate("u2", 150)]
    for time in range(151, 151 + 2 * DIGEST_TIMES_KEPT):  # both agree, while the recompute runs
        digest_report(instance, "r1", "u2", time, f"v{time}")
        digest_report(instance, "r2", "u2", time, f"v{time}")
    assert len(instance.digests["u2"]) == DIGEST_TIMES_KEPT + 1  # the window, and the disputed time

    effects = instance.arbitrated("u2", 150, "right")

    assert Disconnect("r2", 1) in effects and "a fresh recompute from storage has right" in instance.replicas["r2"].diverged
    assert instance.replicas["r1"].diverged is None
    assert not any("no replica matches" in e.message for e in instance.events)
    assert 150 not in instance.digests["u2"]  # settled: the window alone again
    digest_report(instance, "r1", "u2", 500, "x")
    assert len(instance.digests["u2"]) == DIGEST_TIMES_KEPT


def test_a_recompute_that_fails_or_matches_no_one_decides_nothing():
    instance = two_replicas_computing_u2()
    digest_report(instance, "r1", "u2", 150, "a")
    digest_report(instance, "r2", "u2", 150, "b")
    assert instance.arbitrated("u2", 150, None, "its input was compacted") == []
    assert "could not recompute dataflow df_u2 at 150" in last_event(instance, "arbitration")
    assert all(r.diverged is None for r in instance.replicas.values())
    digest_report(instance, "r1", "u2", 160, "c")
    digest_report(instance, "r2", "u2", 160, "d")
    effects = instance.arbitrated("u2", 160, "e")
    assert any("no replica matches a fresh recompute" in e.message for e in instance.events)
    assert {Disconnect("r1", 1), Disconnect("r2", 1)} <= set(effects)  # neither is trusted


def test_a_replica_that_loses_every_race_by_far_for_a_while_is_slow():
    """A gray failure: r2 answers heartbeats and keeps computing, but always more than
    `slow_after_ms` behind r1, so every peek at the readable time goes to r1. After
    `slow_min_races` races lost so over `slow_period_ms` it is reported slow; with
    `replace_slow`, rehydrated. A race it loses by little clears it, and so does a
    period without races lost by far: one race lost on an idle instance says nothing."""

    def racing(**options) -> tuple[ComputeInstance, Callable[..., list]]:
        instance = new_instance(slow_after_ms=100, slow_period_ms=1_000, slow_min_races=5, max_lag_ms=60_000, **options)
        instance.tick(0)
        connect(instance, "r1")
        connect(instance, "r2")
        instance.create_dataflow(dataflow("u2", as_of=0))

        def race(now: int, lost_by: int = 150) -> list:
            effects = instance.tick(now)
            report(instance, "r1", "u2", now + 100)
            report(instance, "r2", "u2", now + 100 - lost_by)
            instance.peek(Peek(f"p{now}", IndexTarget("u2"), now + 99))
            return effects + instance.handle_response("r1", 1, PeekResponse(f"p{now}", rows("r1")))

        return instance, race

    def slow(instance: ComputeInstance) -> list[str]:
        return [h.name for h in instance.health() if h.slow]

    instance, race = racing()
    race(100, lost_by=50)  # not by far
    assert instance.replicas["r2"].losing is None
    for now in (200, 450, 700, 950):
        race(now)
    assert slow(instance) == []  # four races over 750 ms: not yet
    race(1_200)
    assert slow(instance) == ["r2"]  # five races over 1000 ms
    instance.tick(1_210)  # the event is noted at the next tick
    assert last_event(instance, "slow") == "replica r2 is slow: it lost each of the last 5 reads it raced in by more than 100 ms, over 1000 ms"
    instance.tick(2_300)
    assert slow(instance) == []  # no race for longer than the period: nothing says it is behind
    race(2_400)
    assert instance.replicas["r2"].losing.races == 1 and slow(instance) == []  # a new streak
    race(2_500, lost_by=10)  # it caught up
    assert instance.replicas["r2"].losing is None and slow(instance) == []

    # An idle instance: one read, lost by far, then none for a long while.
    instance, race = racing()
    race(200)
    for now in range(1_000, 30_000, 1_000):
        instance.tick(now)
        assert slow(instance) == []
    assert not [e for e in instance.events if e.kind == "slow"]

    instance, race = racing(replace_slow=True)
    for now in (200, 450, 700, 950):
        race(now)
    assert instance.replicas["r2"].phase == "active"  # four races over 750 ms: not yet
    race(1_200)
    effects = instance.tick(1_200)
    assert Disconnect("r2", 1) in effects and instance.replicas["r2"].session is None
    assert instance.replicas["r2"].last_failure.startswith("slow: it lost each of the last 5 reads it raced in by more than 100 ms")


def test_replicas_take_their_waiting_steps_in_opposite_orders_and_keep_theirs_when_reconnected_or_others_dropped():
    """Two replicas take opposite orders (the first answer to each dataflow then comes
    from whichever reaches it first); a replica's next incarnation keeps its order; a
    replica added after a drop takes the order fewer replicas take."""
    instance = new_instance()
    orders = {name: instance.add_replica(name)[0].costliest_first for name in ("r1", "r2", "r3")}
    assert orders == {"r1": False, "r2": True, "r3": False}
    for name in orders:
        connect(instance, name)
    effects = instance.replica_failed("r2", 1, "stream broken") + instance.tick(10_000)
    (reconnect,) = [e for e in effects if isinstance(e, Connect)]
    assert (reconnect.replica, reconnect.epoch, reconnect.costliest_first) == ("r2", 2, True)
    instance.drop_replica("r2", force=True)
    assert instance.add_replica("r4")[0].costliest_first  # r1 and r3 take the cheapest first
    instance.drop_replica("r1", force=True)
    assert not instance.add_replica("r5")[0].costliest_first  # one of each: the cheapest first
