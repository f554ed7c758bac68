"""`reduce_commands` and `CommandHistory` (DESIGN section 5).

The defining property: a replica that applies the reduced history ends in the same state
as one that applies the full history (`history.apply` is the reference replica), and the
reduced length is bounded by the live objects and pending peeks. The generated sequences
come from `history_strategies.command_sequences`, which follows the controller's rules;
the hand-written cases below pin down one reduction rule each.
"""

from __future__ import annotations

import operator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from history import (
    AllowCompaction,
    CancelPeek,
    CancelSubscribe,
    CommandHistory,
    ComputeParameters,
    CreateDataflow,
    CreateInstance,
    DataflowDescription,
    Frontier,
    Hello,
    Import,
    IndexExport,
    IndexTarget,
    InitializationComplete,
    InstanceConfig,
    Peek,
    ReplicaModel,
    ReplicaState,
    Schedule,
    SinkExport,
    Subscribe,
    UpdateConfiguration,
    apply,
    reduce_commands,
)
from history_strategies import INSTANCE, assert_valid, command_sequences

# Enough examples to reach the interesting interleavings while the whole file stays under
# a minute: generating one history of up to 300 steps costs about 20 ms.
DEFINING_EXAMPLES = 300  # the defining property: reduction keeps the meaning
PROPERTY_EXAMPLES = 200
HEAVY_EXAMPLES = 120  # properties that replay every prefix

EMPTY = Frontier.empty()
ORDER = (
    CreateInstance,
    UpdateConfiguration,
    CreateDataflow,
    Schedule,
    Peek,
    Subscribe,
    AllowCompaction,
    InitializationComplete,
)


def at(time: int) -> Frontier:
    return Frontier.at(time)


def bound(state: ReplicaState) -> int:
    """The most commands a reduced history may hold for `state`, as `reduce_commands`
    documents it: CreateInstance, UpdateConfiguration and InitializationComplete, each
    pending peek and open subscription, and per live dataflow 1 + exports (its CreateDataflow, one Schedule,
    and an AllowCompaction for every export but one: the lowest became the `as_of`).

    Tighter than 1 + 2 * exports (a Schedule and a compaction per export) once a
    dataflow has two exports; equal for one.
    """
    live = sum(1 + len(df.desc.export_ids) for df in state.dataflows.values())
    return 3 + len(state.pending_peeks) + len(state.subscriptions) + live


def dataflow(
    *index_ids: str, as_of: int = 0, sinks: tuple[str, ...] = (), imports=()
) -> CreateDataflow:
    return CreateDataflow(
        DataflowDescription(
            name=f"df_{index_ids[0]}",
            sql="SELECT id FROM src",
            imports=tuple(imports) or (Import("src", "u1"),),
            index_exports=tuple(IndexExport(id, ("id",)) for id in index_ids),
            sink_exports=tuple(SinkExport(id) for id in sinks),
            as_of=at(as_of),
            schema="id BIGINT",
        )
    )


def with_as_of(command: CreateDataflow, as_of: int) -> CreateDataflow:
    return CreateDataflow(command.desc.with_as_of(at(as_of)))


def peek(uuid: str, id: str, timestamp: int) -> Peek:
    return Peek(uuid, IndexTarget(id), timestamp)


def assert_reduces_to(commands: list, expected: list) -> None:
    """`commands` reduce to exactly `expected`, which means the same to a replica."""
    reduced = reduce_commands(commands)
    assert reduced == expected
    assert apply(reduced) == apply(commands)
    assert reduce_commands(reduced) == reduced


# --- Properties over generated histories -------------------------------------------------


@settings(max_examples=DEFINING_EXAMPLES, deadline=None)
@given(command_sequences())
def test_reduction_preserves_the_replica_state(commands):
    reduced = reduce_commands(commands)
    assert apply(reduced) == apply(commands)


@settings(max_examples=PROPERTY_EXAMPLES, deadline=None)
@given(command_sequences())
def test_reduced_length_is_bounded_by_live_objects_and_pending_peeks(commands):
    state = apply(commands)
    reduced = reduce_commands(commands)
    assert len(reduced) <= bound(state), reduced


@settings(max_examples=PROPERTY_EXAMPLES, deadline=None)
@given(command_sequences())
def test_reduced_history_is_canonical(commands):
    """A fixed point of reduction, in the fixed order; no cancels; each live dataflow
    once, with its compactions folded into its `as_of` (never below the original); only
    compactions beyond that `as_of` remain; and the result is still a history a
    controller could have sent."""
    reduced = reduce_commands(commands)
    assert reduce_commands(reduced) == reduced
    ranks = [ORDER.index(type(c)) for c in reduced]
    assert ranks == sorted(ranks)
    for singleton in (CreateInstance, UpdateConfiguration, InitializationComplete):
        assert sum(type(c) is singleton for c in reduced) <= 1

    state = apply(commands)
    originals = {c.desc.export_ids[0]: c.desc for c in commands if type(c) is CreateDataflow}
    creates = {c.desc.export_ids[0]: c.desc for c in reduced if type(c) is CreateDataflow}
    assert creates.keys() == state.dataflows.keys()
    for key, desc in creates.items():
        assert desc.same_definition(originals[key])
        assert desc.as_of >= originals[key].as_of
        assert desc.as_of == state.dataflows[key].desc.as_of  # folded: as_of is the since

    owner_as_of = {e: desc.as_of for desc in creates.values() for e in desc.export_ids}
    compactions = [c for c in reduced if type(c) is AllowCompaction]
    assert len({c.id for c in compactions}) == len(compactions)
    for compaction in compactions:
        assert compaction.frontier > owner_as_of[compaction.id]
    owner = {e: key for key, desc in creates.items() for e in desc.export_ids}
    scheduled = [owner[c.id] for c in reduced if type(c) is Schedule]
    assert len(set(scheduled)) == len(scheduled)  # one Schedule per dataflow
    assert set(scheduled) == {key for key, df in state.dataflows.items() if df.scheduled}
    assert not any(type(c) is CancelPeek for c in reduced)
    assert [c.uuid for c in reduced if type(c) is Peek] == list(state.pending_peeks)
    assert not any(type(c) is CancelSubscribe for c in reduced)
    assert [c.uuid for c in reduced if type(c) is Subscribe] == list(state.subscriptions)

    assert_valid(reduced)


@settings(max_examples=PROPERTY_EXAMPLES, deadline=None)
@given(command_sequences())
def test_every_command_of_a_reduced_history_matters(commands):
    """Removing any one command from the reduced history changes the replica state (a
    merged configuration whose fields are all None is the only command with no effect)."""
    reduced = reduce_commands(commands)
    state = apply(reduced)
    for position, command in enumerate(reduced):
        if command == UpdateConfiguration(ComputeParameters()):
            continue
        without = reduced[:position] + reduced[position + 1 :]
        assert apply(without) != state, f"{command!r} at {position} has no effect"


@settings(max_examples=HEAVY_EXAMPLES, deadline=None)
@given(command_sequences())
def test_effective_as_of_never_regresses(commands):
    model = ReplicaModel()
    previous = model.state().dataflows
    for command in commands:
        model.apply(command)
        current = model.state().dataflows
        for key, live in current.items():
            if key in previous:
                assert live.desc.as_of >= previous[key].desc.as_of, command
                assert all(
                    since >= old
                    for (_, since), (_, old) in zip(live.sinces, previous[key].sinces, strict=True)
                )
        previous = current


@settings(max_examples=HEAVY_EXAMPLES, deadline=None)
@given(command_sequences(), st.data())
def test_command_history_keeps_the_meaning_and_stays_bounded(commands, data):
    """Push a generated history command by command. After every push the history means
    what the full prefix means; it reduces exactly when its length exceeds twice the
    length after the last reduction, so its length stays within twice the bound of the
    state at the last reduction. A replica that catches up with `suffix_since` from the
    position it last saw (or replays everything when that returns None) agrees."""
    history = CommandHistory(recent=data.draw(st.integers(1, 60), label="recent"))
    full = ReplicaModel()
    replica = ReplicaModel()
    replica_position = 0
    reduced_length = 0
    bound_at_reduction = 0
    largest_bound = 0
    catch_up_every = data.draw(st.integers(1, 40), label="catch_up_every")
    for count, command in enumerate(commands, start=1):
        length_before, reductions_before = len(history), history.reductions
        history.push(command)
        full.apply(command)
        state = full.state()
        largest_bound = max(largest_bound, bound(state))

        assert history.pushed == history.position == count
        reduced_now = history.reductions != reductions_before
        assert reduced_now == (length_before + 1 > 2 * reduced_length)
        if reduced_now:
            assert history.reductions == reductions_before + 1
            reduced_length = len(history)
            bound_at_reduction = bound(state)
            assert reduced_length <= bound_at_reduction
        else:
            assert len(history) == length_before + 1
        assert len(history) <= 2 * bound_at_reduction + 1
        assert len(history) <= 2 * largest_bound + 1
        assert apply(history.commands) == state

        if count % catch_up_every == 0:
            suffix = history.suffix_since(replica_position)
            if suffix is None:
                replica = ReplicaModel()
                suffix = history.commands
            for caught_up in suffix:
                replica.apply(caught_up)
            replica_position = history.position
            assert replica.state() == state


@settings(max_examples=PROPERTY_EXAMPLES, deadline=None)
@given(command_sequences(), st.integers(1, 30))
def test_suffix_since_is_exactly_what_was_pushed_after(commands, recent):
    """Within the last `recent` pushes, whatever reductions happened meanwhile."""
    history = CommandHistory(commands, recent=recent)
    oldest = max(0, len(commands) - recent)
    assert history.horizon == oldest
    history.reduce()  # the window is not the reduced history
    for position in range(len(commands) + 2):
        suffix = history.suffix_since(position)
        if position < oldest or position > len(commands):
            assert suffix is None, position
        else:  # the very objects pushed (identity: cheap, and stricter than ==)
            expected = commands[position:]
            assert len(suffix) == len(expected)
            assert all(map(operator.is_, suffix, expected)), position


# --- One case per reduction rule --------------------------------------------------------


def test_only_the_first_create_instance_is_kept():
    other = CreateInstance(InstanceConfig.of("other", {"spark.sql.shuffle.partitions": "8"}))
    assert_reduces_to(
        [INSTANCE, other, InitializationComplete(), other], [INSTANCE, InitializationComplete()]
    )


def test_update_configurations_merge_into_one_and_none_keeps_the_old_value():
    commands = [
        INSTANCE,
        UpdateConfiguration(ComputeParameters(max_result_rows=10, heartbeat_interval_ms=500)),
        UpdateConfiguration(ComputeParameters(heartbeat_interval_ms=250, input_poll_interval_ms=7)),
        UpdateConfiguration(ComputeParameters(max_result_rows=None, input_poll_interval_ms=3)),
    ]
    merged = ComputeParameters(
        max_result_rows=10,
        heartbeat_interval_ms=250,
        input_poll_interval_ms=3,
    )
    assert_reduces_to(commands, [INSTANCE, UpdateConfiguration(merged)])
    assert apply(commands).parameters == merged


def test_the_last_compaction_per_id_wins_and_is_folded_into_as_of():
    create = dataflow("u4", as_of=2)
    commands = [INSTANCE, create, AllowCompaction("u4", at(5)), AllowCompaction("u4", at(9))]
    assert_reduces_to(commands, [INSTANCE, with_as_of(create, 9)])


def test_as_of_is_the_meet_of_the_exports_and_only_compactions_beyond_it_remain():
    create = dataflow("u4", "u5", as_of=2, sinks=("u6",))
    commands = [
        INSTANCE,
        create,
        AllowCompaction("u4", at(6)),
        AllowCompaction("u5", at(4)),
        AllowCompaction("u6", at(8)),
        AllowCompaction("u5", at(7)),
    ]
    expected = [
        INSTANCE,
        with_as_of(create, 6),
        AllowCompaction("u5", at(7)),
        AllowCompaction("u6", at(8)),
    ]
    assert_reduces_to(commands, expected)


def test_an_export_never_compacted_holds_the_as_of_back():
    create = dataflow("u4", "u5", as_of=2)
    commands = [INSTANCE, create, AllowCompaction("u5", at(9))]
    assert_reduces_to(commands, [INSTANCE, create, AllowCompaction("u5", at(9))])


def test_a_compaction_equal_to_the_new_as_of_disappears():
    create = dataflow("u4", "u5", as_of=3)
    commands = [INSTANCE, create, AllowCompaction("u4", at(3)), AllowCompaction("u5", at(3))]
    assert_reduces_to(commands, [INSTANCE, create])


def test_a_dataflow_compacted_to_the_empty_frontier_disappears_with_its_schedules():
    dropped, kept = dataflow("u4", "u5", sinks=("u6",)), dataflow("u7")
    commands = [
        INSTANCE,
        dropped,
        kept,
        Schedule("u4"),
        Schedule("u7"),
        AllowCompaction("u4", at(3)),
        AllowCompaction("u4", EMPTY),
        AllowCompaction("u5", EMPTY),
        AllowCompaction("u6", EMPTY),
    ]
    assert_reduces_to(commands, [INSTANCE, kept, Schedule("u7")])
    assert list(apply(commands).dataflows) == ["u7"]


def test_a_peek_and_its_cancel_both_disappear():
    create = dataflow("u4")
    commands = [INSTANCE, create, peek("p1", "u4", 5), peek("p2", "u4", 6), CancelPeek("p1")]
    assert_reduces_to(commands, [INSTANCE, create, peek("p2", "u4", 6)])
    assert_reduces_to(commands + [CancelPeek("p2")], [INSTANCE, create])


def test_a_subscription_lasts_until_its_cancel_or_its_dataflow_and_comes_after_the_peeks():
    create = dataflow("u4", "u5")
    commands = [INSTANCE, create, Subscribe("s1", "u4", 3), peek("p1", "u4", 5), Subscribe("s2", "u5", 4, snapshot=False)]
    assert_reduces_to(commands, [INSTANCE, create, peek("p1", "u4", 5), Subscribe("s1", "u4", 3), Subscribe("s2", "u5", 4, snapshot=False)])
    assert_reduces_to(commands + [CancelSubscribe("s1")], [INSTANCE, create, peek("p1", "u4", 5), Subscribe("s2", "u5", 4, snapshot=False)])
    dropped = [CancelPeek("p1"), AllowCompaction("u4", EMPTY), AllowCompaction("u5", EMPTY)]
    assert_reduces_to(commands + dropped, [INSTANCE])


def test_a_subscription_to_what_is_not_live_yet_or_any_more_disappears():
    create = dataflow("u4")
    assert_reduces_to([INSTANCE, Subscribe("s1", "u4", 0), create], [INSTANCE, create])
    dropped = [INSTANCE, create, AllowCompaction("u4", EMPTY), Subscribe("s1", "u4", 0)]
    assert_reduces_to(dropped, [INSTANCE])


def test_cancels_of_unknown_or_already_canceled_peeks_disappear():
    create = dataflow("u4")
    commands = [
        INSTANCE,
        create,
        peek("p1", "u4", 5),
        CancelPeek("p1"),
        CancelPeek("p1"),
        CancelPeek("nope"),
    ]
    assert_reduces_to(commands, [INSTANCE, create])


def test_dropping_one_export_of_two_keeps_the_dataflow_at_the_other_exports_frontier():
    create = dataflow("u4", "u5", as_of=1)
    commands = [
        INSTANCE,
        create,
        Schedule("u4"),
        AllowCompaction("u4", at(4)),
        AllowCompaction("u4", EMPTY),
        AllowCompaction("u5", at(8)),
    ]
    assert_reduces_to(
        commands, [INSTANCE, with_as_of(create, 8), Schedule("u4"), AllowCompaction("u4", EMPTY)]
    )
    live = apply(commands).dataflows["u4"]
    assert live.desc.as_of == at(8)
    assert live.sinces == (("u4", EMPTY), ("u5", at(8)))
    assert live.scheduled


def test_output_order_is_fixed():
    a, b = dataflow("u4", "u5"), dataflow("u6", as_of=2)
    params = ComputeParameters(max_result_rows=5)
    commands = [
        INSTANCE,
        InitializationComplete(),
        a,
        AllowCompaction("u5", at(3)),
        peek("p1", "u4", 1),
        Schedule("u4"),
        UpdateConfiguration(params),
        b,
        Schedule("u6"),
        peek("p2", "u6", 2),
    ]
    expected = [
        INSTANCE,
        UpdateConfiguration(params),
        a,
        b,
        Schedule("u4"),
        Schedule("u6"),
        peek("p1", "u4", 1),
        peek("p2", "u6", 2),
        AllowCompaction("u5", at(3)),
        InitializationComplete(),
    ]
    assert_reduces_to(commands, expected)


def test_peeks_come_before_compactions_so_a_replay_reads_what_it_held():
    """p1 reads u4 at 3; u4 later compacts to 3 (the hold allows it) and u5 beyond. The
    replayed peek must reach the replica before the compaction of u5 and after the
    dataflow exists at an as_of it can serve."""
    create = dataflow("u4", "u5")
    commands = [
        INSTANCE,
        create,
        peek("p1", "u4", 3),
        AllowCompaction("u4", at(3)),
        AllowCompaction("u5", at(6)),
    ]
    reduced = reduce_commands(commands)
    assert reduced == [
        INSTANCE,
        with_as_of(create, 3),
        peek("p1", "u4", 3),
        AllowCompaction("u5", at(6)),
    ]
    assert_valid(reduced)


def test_duplicate_schedules_collapse():
    create = dataflow("u4")
    commands = [INSTANCE, create, Schedule("u4"), Schedule("u4"), Schedule("u4")]
    assert_reduces_to(commands, [INSTANCE, create, Schedule("u4")])


def test_schedules_naming_different_exports_of_one_dataflow_collapse_to_the_first():
    """Every export names the same dataflow, so a second Schedule is a no-op to the
    replica whichever export it names; keeping it broke the documented length bound
    for dataflows with three exports."""
    create = dataflow("u4", "u5", sinks=("u6",))
    params = UpdateConfiguration(ComputeParameters(max_result_rows=1))
    commands = [
        INSTANCE,
        params,
        create,
        Schedule("u5"),
        Schedule("u6"),
        Schedule("u4"),
        AllowCompaction("u5", at(3)),
        AllowCompaction("u6", at(4)),
        InitializationComplete(),
    ]
    expected = [
        INSTANCE,
        params,
        create,
        Schedule("u5"),
        AllowCompaction("u5", at(3)),
        AllowCompaction("u6", at(4)),
        InitializationComplete(),
    ]
    assert_reduces_to(commands, expected)
    assert len(expected) <= bound(apply(commands))


def test_compactions_of_unknown_ids_vanish():
    create = dataflow("u4")
    commands = [INSTANCE, create, AllowCompaction("u99", at(5)), AllowCompaction("u1", EMPTY)]
    assert_reduces_to(commands, [INSTANCE, create])


def test_a_history_of_nothing_reduces_to_nothing():
    assert reduce_commands([]) == []
    assert apply([]) == apply(reduce_commands([CancelPeek("p1"), AllowCompaction("u4", at(1))]))


@pytest.mark.parametrize("bad", [Hello(1, "nonce"), "CreateInstance", None, Frontier.at(1)])
def test_a_non_command_raises_type_error(bad):
    with pytest.raises(TypeError, match="not a history command"):
        reduce_commands([INSTANCE, bad])


@pytest.mark.parametrize("bad", [Hello(1, "nonce"), "CreateInstance", None])
def test_pushing_a_non_command_raises_and_changes_nothing(bad):
    """Refused at the door: a non-command stored silently would make a later reduction
    raise on an unrelated push, and every one after it."""
    history = CommandHistory([INSTANCE, UpdateConfiguration(ComputeParameters(max_result_rows=1))])
    before = (list(history), history.pushed, history.reductions)
    with pytest.raises(TypeError, match="not a history command"):
        history.push(bad)
    assert (list(history), history.pushed, history.reductions) == before
    history.push(Schedule("u4"))  # still usable
    assert history.pushed == before[1] + 1


def test_the_replica_model_refuses_a_non_command():
    model = ReplicaModel()
    with pytest.raises(TypeError, match="not a history command"):
        model.apply(Hello(1, "nonce"))
    assert model.state() == apply([])


# --- CommandHistory counters ------------------------------------------------------------


def test_counters_follow_the_doubling_rule():
    """Reduction runs when the length exceeds twice the length after the last one; the
    first push always reduces (nothing was reduced yet)."""
    history = CommandHistory()
    assert (len(history), history.pushed, history.reductions) == (0, 0, 0)
    trace = []
    for n in range(1, 8):
        history.push(
            UpdateConfiguration(ComputeParameters(max_result_rows=n)) if n > 1 else INSTANCE
        )
        trace.append((len(history), history.pushed, history.reductions))
    assert trace == [
        (1, 1, 1),  # 1 > 2 * 0: reduce -> [CreateInstance]
        (2, 2, 1),
        (2, 3, 2),  # 3 > 2 * 1: reduce -> [CreateInstance, UpdateConfiguration]
        (3, 4, 2),
        (4, 5, 2),
        (2, 6, 3),  # 5 > 2 * 2
        (3, 7, 3),
    ]
    assert history.position == history.pushed == 7
    assert list(history) == list(history.commands)
    assert history.commands[1] == UpdateConfiguration(ComputeParameters(max_result_rows=6))
    assert repr(history) == "CommandHistory(len=3, pushed=7, reductions=3)"


def test_an_explicit_reduce_counts_and_resets_the_doubling_base():
    history = CommandHistory([INSTANCE, dataflow("u4"), Schedule("u4"), Schedule("u4")])
    reductions = history.reductions
    history.reduce()
    assert history.reductions == reductions + 1
    assert list(history) == [INSTANCE, dataflow("u4"), Schedule("u4")]
    history.push(Schedule("u4"))
    history.push(Schedule("u4"))
    history.push(Schedule("u4"))
    assert len(history) == 6 and history.reductions == reductions + 1  # 6 <= 2 * 3
    history.push(Schedule("u4"))  # 7 > 6
    assert len(history) == 3 and history.reductions == reductions + 2


def test_a_constructed_history_pushes_each_command():
    commands = [INSTANCE, dataflow("u4"), peek("p1", "u4", 0), CancelPeek("p1")]
    history = CommandHistory(commands)
    assert history.pushed == len(commands)
    assert apply(history) == apply(commands)
    assert history.suffix_since(history.position) == []


def test_length_depends_on_what_is_live_not_on_how_much_was_pushed():
    create = dataflow("u4")
    history = CommandHistory([INSTANCE, create, Schedule("u4")])
    longest = 0
    for t in range(1, 20_000):
        history.push(peek(f"p{t}", "u4", t))
        history.push(AllowCompaction("u4", at(t)))
        history.push(CancelPeek(f"p{t}"))
        longest = max(longest, len(history))
    assert history.pushed == 3 + 3 * 19_999
    assert longest <= 2 * 4  # reduced: at most the three above and one pending peek
    history.reduce()
    assert list(history) == [INSTANCE, with_as_of(create, 19_999), Schedule("u4")]
