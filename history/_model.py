"""A reference model of the state a replica reaches by applying commands.

It knows nothing of data: it tracks which dataflows are live, with their effective
`as_of` and per-export `since`, which are scheduled, which peeks are pending, and the
merged configuration. Tests compare the state reached from a full history with the state
reached from its reduction; the controller's simulator builds on it.

This module may not import anything beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping

from history._commands import (
    AllowCompaction,
    CancelPeek,
    CancelSubscribe,
    ComputeCommand,
    ComputeParameters,
    CreateDataflow,
    CreateInstance,
    DataflowDescription,
    InitializationComplete,
    InstanceConfig,
    Peek,
    Schedule,
    Subscribe,
    UpdateConfiguration,
)
from history._frontier import Frontier, meet_all


@dataclass(frozen=True, slots=True)
class LiveDataflow:
    """A dataflow as a replica holds it.

    `desc.as_of` is the *effective* as_of: join(as_of, meet of the exports' sinces), so
    a compaction folded into the as_of and one still pending compare equal.
    """

    desc: DataflowDescription
    sinces: tuple[tuple[str, Frontier], ...]
    scheduled: bool


@dataclass(frozen=True, slots=True)
class ReplicaState:
    instance: InstanceConfig | None
    parameters: ComputeParameters
    dataflows: Mapping[str, LiveDataflow]  # first export id -> dataflow
    pending_peeks: Mapping[str, Peek]  # uuid -> peek
    subscriptions: Mapping[str, Subscribe]  # uuid -> open subscription
    initialized: bool


@dataclass(slots=True)
class ReplicaModel:
    """Applies commands one at a time; `state()` is a frozen snapshot.

    Lifecycles: a dataflow enters on `CreateDataflow` and leaves when every export has
    been compacted to the empty frontier; a peek enters on `Peek` and leaves on its
    `CancelPeek` (the model does not answer peeks by itself); a subscription enters on
    `Subscribe` to an export of a live dataflow, and leaves on its `CancelSubscribe` or
    with that dataflow (a new `CreateDataflow` of the export ends it too).
    """

    instance: InstanceConfig | None = None
    parameters: ComputeParameters = field(default_factory=ComputeParameters)
    dataflows: dict[str, DataflowDescription] = field(default_factory=dict)
    sinces: dict[str, Frontier] = field(default_factory=dict)  # export id -> since
    owner: dict[str, str] = field(default_factory=dict)  # export id -> dataflow key
    scheduled: set[str] = field(default_factory=set)  # dataflow keys
    pending_peeks: dict[str, Peek] = field(default_factory=dict)
    subscriptions: dict[str, Subscribe] = field(default_factory=dict)
    initialized: bool = False

    def apply(self, command: ComputeCommand) -> None:
        """Apply one command. Raises TypeError, and changes nothing, for a non-command."""
        handler = _APPLY.get(type(command))
        if handler is None:
            raise TypeError(f"not a history command: {command!r}")
        handler(self, command)

    def _create_instance(self, command: CreateInstance) -> None:
        if self.instance is None:
            self.instance = command.config

    def _update_configuration(self, command: UpdateConfiguration) -> None:
        self.parameters = self.parameters.update(command.params)

    def _create_dataflow(self, command: CreateDataflow) -> None:
        desc = command.desc
        key = desc.export_ids[0]
        self.dataflows[key] = desc
        for export_id in desc.export_ids:
            self.owner[export_id] = key
            self.sinces[export_id] = desc.as_of
        self._end_subscriptions(desc.export_ids)

    def _schedule(self, command: Schedule) -> None:
        key = self.owner.get(command.id)
        if key in self.dataflows:
            self.scheduled.add(key)

    def _allow_compaction(self, command: AllowCompaction) -> None:
        key = self.owner.get(command.id)
        if key not in self.dataflows:
            return
        self.sinces[command.id] = self.sinces[command.id].join(command.frontier)
        desc = self.dataflows[key]
        if all(self.sinces[e].is_empty for e in desc.export_ids):
            del self.dataflows[key]
            self.scheduled.discard(key)
            for export_id in desc.export_ids:
                del self.sinces[export_id]
                del self.owner[export_id]
            self._end_subscriptions(desc.export_ids)

    def _peek(self, command: Peek) -> None:
        self.pending_peeks[command.uuid] = command

    def _cancel_peek(self, command: CancelPeek) -> None:
        self.pending_peeks.pop(command.uuid, None)

    def _subscribe(self, command: Subscribe) -> None:
        if command.id in self.owner:
            self.subscriptions[command.uuid] = command

    def _cancel_subscribe(self, command: CancelSubscribe) -> None:
        self.subscriptions.pop(command.uuid, None)

    def _end_subscriptions(self, export_ids: tuple[str, ...]) -> None:
        self.subscriptions = {u: c for u, c in self.subscriptions.items() if c.id not in export_ids}

    def _initialization_complete(self, command: InitializationComplete) -> None:
        self.initialized = True

    def state(self) -> ReplicaState:
        dataflows = {}
        for key, desc in self.dataflows.items():
            sinces = tuple((e, self.sinces[e]) for e in desc.export_ids)
            as_of = desc.as_of.join(meet_all(since for _, since in sinces))
            dataflows[key] = LiveDataflow(desc.with_as_of(as_of), sinces, key in self.scheduled)
        return ReplicaState(
            instance=self.instance,
            parameters=self.parameters,
            dataflows=MappingProxyType(dataflows),
            pending_peeks=MappingProxyType(dict(self.pending_peeks)),
            subscriptions=MappingProxyType(dict(self.subscriptions)),
            initialized=self.initialized,
        )


_APPLY = {
    CreateInstance: ReplicaModel._create_instance,
    UpdateConfiguration: ReplicaModel._update_configuration,
    CreateDataflow: ReplicaModel._create_dataflow,
    Schedule: ReplicaModel._schedule,
    AllowCompaction: ReplicaModel._allow_compaction,
    Peek: ReplicaModel._peek,
    CancelPeek: ReplicaModel._cancel_peek,
    Subscribe: ReplicaModel._subscribe,
    CancelSubscribe: ReplicaModel._cancel_subscribe,
    InitializationComplete: ReplicaModel._initialization_complete,
}


def apply(commands: Iterable[ComputeCommand]) -> ReplicaState:
    """The state a fresh replica reaches by applying `commands` in order."""
    model = ReplicaModel()
    for command in commands:
        model.apply(command)
    return model.state()
