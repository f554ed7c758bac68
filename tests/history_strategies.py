"""Hypothesis strategies for command histories, and the rules they follow.

`command_sequences()` generates *valid* sequences: the commands a controller would push
into an instance's history, drawn step by step while `ControllerRules` simulates what the
controller knows (live dataflows, their compaction frontiers, who imports what, pending
peeks). Every command the strategy emits is checked by the same `ControllerRules`, and
`assert_valid` replays any sequence through them, so a test can also ask whether a
*reduced* history is still something a controller could have sent.

The rules (DESIGN sections 4 and 6):
- `CreateInstance` first, exactly once.
- `CreateDataflow`: fresh export ids; index imports are live, not dropped, and readable at
  `as_of` (their compaction frontier is not beyond it).
- `Schedule` names an export of a live dataflow.
- `AllowCompaction` names a live export, never regresses, and never passes the timestamp
  of a pending peek on that id nor the effective `as_of` of a live dataflow importing it.
  The empty frontier (a drop) only for exports nobody imports or peeks.
- `Peek` reads live index exports at a timestamp not below their compaction frontier.
- `Subscribe` reads a live index export; while it is open the export is not dropped.
  It may compact past the `as_of` (a replica starts its feed where it can), so a
  reduced history's `Subscribe` may name an `as_of` below the dataflow's.
- `CancelPeek`, `CancelSubscribe`, `UpdateConfiguration`, `InitializationComplete`:
  always allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from hypothesis import strategies as st

from history import (
    AllowCompaction,
    CancelPeek,
    CancelSubscribe,
    ComputeCommand,
    ComputeParameters,
    CreateDataflow,
    CreateInstance,
    DataflowDescription,
    Frontier,
    Import,
    IndexExport,
    IndexTarget,
    InitializationComplete,
    InstanceConfig,
    Peek,
    Schedule,
    SinkExport,
    SqlTarget,
    Subscribe,
    UpdateConfiguration,
)

STORAGE_IDS = ("u1", "u2", "u3")  # durable sources: never exported by a dataflow
INSTANCE = CreateInstance(
    InstanceConfig.of(
        "main", {"spark.sql.shuffle.partitions": "4", "spark.sql.adaptive.enabled": "false"}
    )
)

MAX_LIVE_DATAFLOWS = 6
MAX_TIME_STEP = 4  # small steps: equal frontiers (the interesting case) are frequent


class InvalidCommand(AssertionError):
    """A command a controller following DESIGN sections 4 and 6 would never send."""


@dataclass
class ControllerRules:
    """What the controller knows about one instance, updated command by command.

    Lifecycles: `dataflows`/`owner` gain entries on `CreateDataflow` and lose them when the
    last export is compacted to the empty frontier; `sinces` holds every export of a live
    dataflow (empty once that export was dropped on its own); `peeks` gains a uuid on
    `Peek` and loses it on `CancelPeek`, which moves it to `canceled`; `subscriptions`
    likewise with `Subscribe` and `CancelSubscribe`.
    """

    dataflows: dict[str, DataflowDescription] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)  # export id -> dataflow key
    sinces: dict[str, Frontier] = field(default_factory=dict)  # export id -> compaction
    used_ids: set[str] = field(default_factory=lambda: set(STORAGE_IDS))
    peeks: dict[str, Peek] = field(default_factory=dict)
    canceled: list[str] = field(default_factory=list)
    subscriptions: dict[str, Subscribe] = field(default_factory=dict)
    seen_uuids: set[str] = field(default_factory=set)
    commands: int = 0
    initialized: bool = False

    # --- queries used by the strategy and the checks --------------------------------

    def effective_as_of(self, key: str) -> Frontier:
        desc = self.dataflows[key]
        since = Frontier.empty()
        for export_id in desc.export_ids:
            since = since.meet(self.sinces[export_id])
        return desc.as_of.join(since)

    def live_exports(self) -> list[str]:
        """Exports of live dataflows that have not been dropped on their own."""
        return [e for e, since in self.sinces.items() if not since.is_empty]

    def live_indexes(self) -> list[str]:
        return [
            e.id
            for desc in self.dataflows.values()
            for e in desc.index_exports
            if not self.sinces[e.id].is_empty
        ]

    def compaction_limit(self, export_id: str) -> Frontier:
        """The highest frontier `export_id` may be compacted to now."""
        limit = Frontier.empty()
        for peek in self.peeks.values():
            if export_id in peek.target.collection_ids:
                limit = limit.meet(Frontier.at(peek.timestamp))
        for key, desc in self.dataflows.items():
            if export_id in desc.import_ids:
                limit = limit.meet(self.effective_as_of(key))
        return limit

    def held(self) -> set[str]:
        """Exports under a read hold: targets of pending peeks and open subscriptions, and
        imports of live dataflows."""
        held = {id for peek in self.peeks.values() for id in peek.target.collection_ids}
        held.update(subscription.id for subscription in self.subscriptions.values())
        held.update(id for desc in self.dataflows.values() for id in desc.import_ids)
        return held

    def droppable_dataflows(self) -> list[str]:
        held = self.held()
        return [
            key
            for key, desc in self.dataflows.items()
            if not any(e in held for e in desc.export_ids)
        ]

    # --- validation and state change ------------------------------------------------

    def apply(self, command: ComputeCommand) -> None:
        """Check `command` against the rules, then record it. Raises InvalidCommand."""
        kind = type(command)
        if (kind is CreateInstance) != (self.commands == 0):
            raise InvalidCommand(f"CreateInstance must come first, once: {command!r}")
        handler = _RULES.get(kind)
        if handler is None:
            raise InvalidCommand(f"not a history command: {command!r}")
        handler(self, command)  # checks everything before it changes anything
        self.commands += 1

    def _create_instance(self, command: CreateInstance) -> None:
        pass

    def _create_dataflow(self, command: CreateDataflow) -> None:
        desc = command.desc
        if desc.as_of.is_empty or not desc.export_ids:
            raise InvalidCommand(f"a dataflow needs exports and a non-empty as_of: {desc!r}")
        for export_id in desc.export_ids:
            if export_id in self.used_ids:
                raise InvalidCommand(f"export id {export_id} is not fresh")
        for imported in desc.imports:
            if imported.kind != "index":
                continue
            since = self.sinces.get(imported.id)
            if since is None or since.is_empty:
                raise InvalidCommand(f"import {imported.id} is not a live index")
            if since > desc.as_of:
                raise InvalidCommand(
                    f"import {imported.id} compacted to {since}, past {desc.as_of}"
                )
        key = desc.export_ids[0]
        self.dataflows[key] = desc
        for export_id in desc.export_ids:
            self.used_ids.add(export_id)
            self.owner[export_id] = key
            self.sinces[export_id] = desc.as_of

    def _schedule(self, command: Schedule) -> None:
        if command.id not in self.owner:
            raise InvalidCommand(f"Schedule of {command.id}, which no live dataflow exports")

    def _allow_compaction(self, command: AllowCompaction) -> None:
        since = self.sinces.get(command.id)
        if since is None or since.is_empty:
            raise InvalidCommand(f"AllowCompaction of {command.id}, not a live export")
        if command.frontier < since:
            raise InvalidCommand(f"{command!r} regresses from {since}")
        if command.frontier.is_empty and any(c.id == command.id for c in self.subscriptions.values()):
            raise InvalidCommand(f"{command!r} drops an export with an open subscription")
        limit = self.compaction_limit(command.id)
        if command.frontier > limit:
            raise InvalidCommand(f"{command!r} passes a read hold at {limit}")
        self.sinces[command.id] = command.frontier
        key = self.owner[command.id]
        desc = self.dataflows[key]
        if all(self.sinces[e].is_empty for e in desc.export_ids):
            del self.dataflows[key]
            for export_id in desc.export_ids:
                del self.sinces[export_id]
                del self.owner[export_id]

    def _peek(self, command: Peek) -> None:
        if command.uuid in self.seen_uuids:
            raise InvalidCommand(f"peek uuid {command.uuid} reused")
        index_ids = set(self.live_indexes())
        for target_id in command.target.collection_ids:
            if target_id not in index_ids:
                raise InvalidCommand(f"peek of {target_id}, not a live index")
            if not self.sinces[target_id].includes(command.timestamp):
                raise InvalidCommand(
                    f"peek of {target_id} at {command.timestamp}, below {self.sinces[target_id]}"
                )
        self.seen_uuids.add(command.uuid)
        self.peeks[command.uuid] = command

    def _cancel_peek(self, command: CancelPeek) -> None:
        if self.peeks.pop(command.uuid, None) is not None:
            self.canceled.append(command.uuid)

    def _subscribe(self, command: Subscribe) -> None:
        if command.uuid in self.seen_uuids:
            raise InvalidCommand(f"subscription uuid {command.uuid} reused")
        if command.id not in self.live_indexes():
            raise InvalidCommand(f"subscription to {command.id}, not a live index")
        self.seen_uuids.add(command.uuid)
        self.subscriptions[command.uuid] = command

    def _cancel_subscribe(self, command: CancelSubscribe) -> None:
        self.subscriptions.pop(command.uuid, None)

    def _update_configuration(self, command: UpdateConfiguration) -> None:
        pass

    def _initialization_complete(self, command: InitializationComplete) -> None:
        self.initialized = True


_RULES = {
    CreateInstance: ControllerRules._create_instance,
    CreateDataflow: ControllerRules._create_dataflow,
    Schedule: ControllerRules._schedule,
    AllowCompaction: ControllerRules._allow_compaction,
    Peek: ControllerRules._peek,
    CancelPeek: ControllerRules._cancel_peek,
    Subscribe: ControllerRules._subscribe,
    CancelSubscribe: ControllerRules._cancel_subscribe,
    UpdateConfiguration: ControllerRules._update_configuration,
    InitializationComplete: ControllerRules._initialization_complete,
}


def assert_valid(commands: Iterable[ComputeCommand]) -> ControllerRules:
    """Replay `commands` through the rules; raises InvalidCommand naming the first bad one."""
    rules = ControllerRules()
    for position, command in enumerate(commands):
        try:
            rules.apply(command)
        except InvalidCommand as error:
            raise InvalidCommand(f"command {position}: {error}") from None
    return rules


# --- The strategy -----------------------------------------------------------------------

# Strategies built once: constructing them per draw dominated the generation time.
_COIN = st.booleans()
_STEP = st.integers(0, MAX_TIME_STEP)
_INDEXES = tuple(st.integers(0, n) for n in range(64))  # _INDEXES[n] draws from 0..n
_PARAMETER_VALUES = [None, 1, 2, 3]


class _Generator:
    """Draws one controller action at a time; `rules` is the controller's view so far.

    Choices among a changing set are drawn as an index (`pick`), which shrinks well and
    avoids building a strategy per draw.
    """

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw
        self.rules = ControllerRules()
        self.out: list[ComputeCommand] = []
        self.next_id = len(STORAGE_IDS) + 1
        self.next_uuid = 1

    def emit(self, command: ComputeCommand) -> None:
        self.rules.apply(command)  # the strategy never emits what the rules refuse
        self.out.append(command)

    def pick(self, items: list):
        last = len(items) - 1
        return items[self.draw(_INDEXES[last] if last < len(_INDEXES) else st.integers(0, last))]

    def pick_one_or_two(self, items: list) -> list:
        first = self.pick(items)
        rest = [item for item in items if item != first]
        return [first, self.pick(rest)] if rest and self.draw(_COIN) else [first]

    def fresh_id(self) -> str:
        self.next_id += 1
        return f"u{self.next_id - 1}"

    def droppable_single_exports(self) -> list[str]:
        """Exports nobody holds whose drop leaves their dataflow alive."""
        rules = self.rules
        held = rules.held()
        result = []
        for desc in rules.dataflows.values():
            alive = [e for e in desc.export_ids if not rules.sinces[e].is_empty]
            if len(alive) > 1:
                result += [e for e in alive if e not in held]
        return result

    def step(self) -> None:
        """One controller action. Weights favour compactions, as in a running instance.

        A drop that turns out impossible (everything is held) becomes a compaction, so
        the costly check runs only when a drop was drawn.
        """
        rules = self.rules
        actions = ["config", "cancel"]
        if len(rules.dataflows) < MAX_LIVE_DATAFLOWS:
            actions += ["create"] * 3
        if rules.dataflows:
            actions += ["schedule"] * 2 + ["compact"] * 8 + ["peek"] * 3 + ["drop"] * 2
            actions += ["drop_export", "subscribe"]
        if rules.peeks:
            actions += ["cancel"] * 2
        actions += ["unsubscribe"] * (1 + 2 * bool(rules.subscriptions))
        if not rules.initialized:
            actions += ["initialized"]
        getattr(self, f"_{self.pick(actions)}")()

    def _create(self) -> None:
        draw, rules = self.draw, self.rules
        storage = self.pick_one_or_two(list(STORAGE_IDS)) if draw(_COIN) else []
        imports = [Import(f"s{i}", id) for i, id in enumerate(storage)]
        live_indexes = sorted(rules.live_indexes())
        if live_indexes and draw(_COIN):
            chosen = self.pick_one_or_two(live_indexes)
            imports += [Import(f"i{i}", id, "index") for i, id in enumerate(chosen)]
        floor = Frontier.minimum()
        for imported in imports:
            if imported.kind == "index":
                floor = floor.join(rules.sinces[imported.id])
        index_exports = tuple(IndexExport(self.fresh_id(), ("id",)) for _ in range(1 + draw(_COIN)))
        sink_exports = (SinkExport(self.fresh_id()),) if draw(_COIN) else ()
        desc = DataflowDescription(
            name=f"df_{index_exports[0].id}",
            sql="SELECT * FROM s0" if imports else "SELECT 1 AS id",
            imports=tuple(imports),
            index_exports=index_exports,
            sink_exports=sink_exports,
            as_of=Frontier.at(floor.time + draw(_STEP)),
            schema="id BIGINT",
        )
        self.emit(CreateDataflow(desc))
        if draw(_COIN):
            self.emit(Schedule(desc.export_ids[0]))

    def _schedule(self) -> None:
        if self.out and type(self.out[-1]) is Schedule and self.draw(_COIN):
            self.emit(self.out[-1])  # a duplicate
        else:
            self.emit(Schedule(self.pick(sorted(self.rules.live_exports()))))

    def _compact(self) -> None:
        rules = self.rules
        export_id = self.pick(sorted(rules.live_exports()))
        since = rules.sinces[export_id].time
        limit = rules.compaction_limit(export_id)
        highest = (
            since + MAX_TIME_STEP if limit.is_empty else min(limit.time, since + MAX_TIME_STEP)
        )
        self.emit(AllowCompaction(export_id, Frontier.at(self.draw(st.integers(since, highest)))))

    def _drop(self) -> None:
        rules = self.rules
        candidates = sorted(rules.droppable_dataflows())
        if not candidates:
            return self._compact()
        key = self.pick(candidates)
        alive = [e for e in rules.dataflows[key].export_ids if not rules.sinces[e].is_empty]
        for export_id in alive:  # the last one removes the dataflow from `rules`
            self.emit(AllowCompaction(export_id, Frontier.empty()))

    def _drop_export(self) -> None:
        candidates = sorted(self.droppable_single_exports())
        if not candidates:
            return self._compact()
        self.emit(AllowCompaction(self.pick(candidates), Frontier.empty()))

    def _peek(self) -> None:
        rules = self.rules
        live_indexes = sorted(rules.live_indexes())
        if not live_indexes:  # every index export was dropped on its own
            return self._compact()
        if self.draw(_COIN):
            target = IndexTarget(self.pick(live_indexes))
        else:
            chosen = self.pick_one_or_two(live_indexes)
            imports = tuple(Import(f"t{i}", id, "index") for i, id in enumerate(chosen))
            target = SqlTarget("SELECT * FROM t0", imports)
        floor = Frontier.minimum()
        for target_id in target.collection_ids:
            floor = floor.join(rules.sinces[target_id])
        uuid = f"p{self.next_uuid}"
        self.next_uuid += 1
        self.emit(Peek(uuid, target, floor.time + self.draw(_STEP)))

    def _cancel(self) -> None:
        rules = self.rules
        choices = ["unknown"]
        if rules.peeks:
            choices += ["pending"] * 4
        if rules.canceled:
            choices += ["canceled"]
        which = self.pick(choices)
        if which == "pending":
            uuid = self.pick(sorted(rules.peeks))
        elif which == "canceled":
            uuid = self.pick(rules.canceled)
        else:
            uuid = f"never-{self.draw(_STEP)}"
        self.emit(CancelPeek(uuid))

    def _subscribe(self) -> None:
        live_indexes = sorted(self.rules.live_indexes())
        if not live_indexes:
            return self._compact()
        id = self.pick(live_indexes)
        uuid = f"s{self.next_uuid}"
        self.next_uuid += 1
        self.emit(Subscribe(uuid, id, self.rules.sinces[id].time + self.draw(_STEP), self.draw(_COIN)))

    def _unsubscribe(self) -> None:
        open_uuids = sorted(self.rules.subscriptions)
        uuid = self.pick(open_uuids) if open_uuids and self.draw(_COIN) else f"never-{self.draw(_STEP)}"
        self.emit(CancelSubscribe(uuid))

    def _config(self) -> None:
        values = [self.pick(_PARAMETER_VALUES) for _ in ComputeParameters.__dataclass_fields__]
        self.emit(UpdateConfiguration(ComputeParameters(*values)))

    def _initialized(self) -> None:
        self.emit(InitializationComplete())


@st.composite
def command_sequences(draw: st.DrawFn, max_steps: int = 300) -> list[ComputeCommand]:
    """A valid history: `CreateInstance`, then up to `max_steps` controller actions.

    An action emits one command, or a few (a create followed by its `Schedule`, a drop
    compacting every export to the empty frontier).
    """
    generator = _Generator(draw)
    generator.emit(INSTANCE)
    for _ in range(draw(st.integers(0, max_steps))):
        generator.step()
    return generator.out
