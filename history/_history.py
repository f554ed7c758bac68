"""`CommandHistory`: an instance's commands, reduced as it grows.

The controller pushes every command here *before* sending it, so the history exists with
zero replicas and a new or rehydrated replica is brought up by replaying it. Reduction
keeps the meaning (a replica that applies the reduced history ends in the same state as
one that applies the full history) and bounds the length by the live objects and pending
peeks, not by how many commands were ever pushed.

This module may not import anything beyond the standard library.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Iterable, Sequence, get_args

from history._commands import (
    AllowCompaction,
    CancelPeek,
    CancelSubscribe,
    ComputeCommand,
    ComputeParameters,
    CreateDataflow,
    CreateInstance,
    InitializationComplete,
    Peek,
    Schedule,
    Subscribe,
    UpdateConfiguration,
)
from history._frontier import Frontier


_HISTORY_COMMANDS = frozenset(get_args(ComputeCommand))  # what `push` accepts
# A few seconds of a busy instance (a peek pushes two commands), at a few MB of memory.
RECENT_COMMANDS = 10_000
_EMPTY = Frontier.empty()


def reduce_commands(commands: Iterable[ComputeCommand]) -> list[ComputeCommand]:
    """The reduced form of `commands` (DESIGN section 5).

    - one `CreateInstance` (the first); all `UpdateConfiguration`s merged into one;
    - `AllowCompaction`: the last one per id wins, then is folded into its dataflow's
      `as_of` = join(as_of, meet of the exports' frontiers); one equal to (or below) the
      new `as_of` disappears; a dataflow whose `as_of` became empty disappears with its
      `Schedule`s; compactions of ids no dataflow here exports disappear;
    - a `Peek` and its `CancelPeek` both disappear; `Schedule`s collapse to one per live
      dataflow (the first, whichever export it names: they all start the same dataflow);
    - a `Subscribe` and its `CancelSubscribe` both disappear, and so does a `Subscribe`
      whose target is not an export of a live dataflow created before it;
    - order: CreateInstance, UpdateConfiguration, CreateDataflow*, Schedule*, Peek*,
      Subscribe*, AllowCompaction*, InitializationComplete.

    Invariants: the result is a fixed point (`reduce_commands(r) == r`), and its length
    is at most 3 + pending peeks + open subscriptions + sum over live dataflows of
    (1 + exports): per dataflow its CreateDataflow, one Schedule, and a compaction for
    every export but the lowest, which the `as_of` absorbed.
    """
    create_instance: CreateInstance | None = None
    parameters: ComputeParameters | None = None
    # first export id -> (its latest CreateDataflow, its export ids)
    dataflows: dict[str, tuple[CreateDataflow, tuple[str, ...]]] = {}
    owner: dict[str, str] = {}  # export id -> first export id of its dataflow
    schedules: dict[str, Schedule] = {}  # scheduled id -> its first Schedule, in order
    peeks: dict[str, Peek] = {}  # pending uuid -> Peek
    subscriptions: dict[str, Subscribe] = {}  # open uuid -> Subscribe
    compactions: dict[str, AllowCompaction] = {}  # id -> its last AllowCompaction
    initialized = False

    # Ordered by how often each command occurs in a long-running history (the reduced
    # prefix brings every live CreateDataflow and Schedule back at each reduction).
    # Commands are kept as they came wherever the reduced form is the same command, so a
    # reduction allocates only for what it rewrites.
    for command in commands:
        kind = type(command)
        if kind is AllowCompaction:
            compactions[command.id] = command
        elif kind is Peek:
            peeks[command.uuid] = command
        elif kind is CancelPeek:
            peeks.pop(command.uuid, None)
        elif kind is CreateDataflow:
            export_ids = command.desc.export_ids
            key = export_ids[0]
            dataflows[key] = (command, export_ids)
            for export_id in export_ids:
                owner[export_id] = key
            if subscriptions:  # they followed another dataflow's export of that id
                subscriptions = {u: c for u, c in subscriptions.items() if c.id not in export_ids}
        elif kind is Schedule:
            schedules.setdefault(command.id, command)
        elif kind is UpdateConfiguration:
            parameters = command.params if parameters is None else parameters.update(command.params)
        elif kind is CreateInstance:
            if create_instance is None:
                create_instance = command
        elif kind is InitializationComplete:
            initialized = True
        elif kind is Subscribe:
            if command.id in owner:
                subscriptions[command.uuid] = command
        elif kind is CancelSubscribe:
            subscriptions.pop(command.uuid, None)
        else:
            raise TypeError(f"not a history command: {command!r}")

    reduced: list[ComputeCommand] = []
    if create_instance is not None:
        reduced.append(create_instance)
    if parameters is not None:
        reduced.append(UpdateConfiguration(parameters))

    live: set[str] = set()
    kept_compactions: list[ComputeCommand] = []
    for key, (create, export_ids) in dataflows.items():
        original = create.desc.as_of
        latest = [compactions.get(export_id) for export_id in export_ids]
        since = _EMPTY
        for compaction in latest:
            since = since.meet(original if compaction is None else compaction.frontier)
        as_of = original.join(since)
        if as_of.is_empty:
            continue
        live.add(key)
        if as_of != original:
            create = CreateDataflow(create.desc.with_as_of(as_of))
        reduced.append(create)
        for compaction in latest:
            if compaction is not None and compaction.frontier > as_of:
                kept_compactions.append(compaction)

    scheduled: set[str] = set()
    for id, schedule in schedules.items():
        key = owner.get(id)
        if key in live and key not in scheduled:
            scheduled.add(key)
            reduced.append(schedule)
    reduced.extend(peeks.values())
    reduced.extend(c for c in subscriptions.values() if owner[c.id] in live)
    reduced.extend(kept_compactions)
    if initialized:
        reduced.append(InitializationComplete())
    return reduced


class CommandHistory:
    """An instance's command history, reduced whenever it doubles.

    Invariants: applying `commands` gives the same replica state as applying every
    command ever pushed, in order; after each push, `len(self) <= 2 * reduced_length`
    unless the push itself triggered a reduction. Positions are absolute counts of
    pushed commands. The last `recent` pushes are also kept as pushed, whatever the
    reductions did, so a replica that stands at position p (having applied the
    equivalent of every command before p) is caught up with `suffix_since(p)` while p is
    among them: reduction bounds what a replay sends, this bounds how long a
    disconnected replica can be caught up with just what it missed.
    """

    __slots__ = ("_commands", "_reduced_length", "_recent", "pushed", "reductions")

    def __init__(self, commands: Iterable[ComputeCommand] = (), *, recent: int = RECENT_COMMANDS) -> None:
        self._commands: list[ComputeCommand] = []
        self._reduced_length = 0  # length right after the last reduction
        self._recent: deque[ComputeCommand] = deque(maxlen=recent)  # the last pushes, as pushed
        self.pushed = 0  # commands pushed, ever
        self.reductions = 0  # reductions done, ever
        for command in commands:
            self.push(command)

    def push(self, command: ComputeCommand) -> None:
        """Append `command`; reduce when the length exceeds twice the reduced length.

        Raises TypeError, and changes nothing, for anything but a history command: stored,
        it would make some later, unrelated push fail in `reduce`.
        """
        if type(command) not in _HISTORY_COMMANDS:
            raise TypeError(f"not a history command: {command!r}")
        commands = self._commands
        commands.append(command)
        self._recent.append(command)
        self.pushed += 1
        if len(commands) > 2 * self._reduced_length:
            self.reduce()

    def reduce(self) -> None:
        self._commands = reduce_commands(self._commands)
        self._reduced_length = len(self._commands)
        self.reductions += 1

    @property
    def commands(self) -> Sequence[ComputeCommand]:
        """The current commands, oldest first. Do not mutate."""
        return self._commands

    @property
    def position(self) -> int:
        """The absolute position after the newest command (= commands pushed)."""
        return self.pushed

    @property
    def horizon(self) -> int:
        """The oldest position `suffix_since` accepts: the last `recent` pushes back."""
        return self.pushed - len(self._recent)

    def suffix_since(self, position: int) -> Sequence[ComputeCommand] | None:
        """The commands pushed after absolute `position`, as pushed, or None when that is
        further back than the last `recent` pushes (the caller must then replay the
        reduced history)."""
        horizon = self.horizon
        if position < horizon or position > self.pushed:
            return None
        return list(islice(self._recent, position - horizon, None))

    def __len__(self) -> int:
        return len(self._commands)

    def __iter__(self):
        return iter(self._commands)

    def __repr__(self) -> str:
        return (
            f"CommandHistory(len={len(self._commands)}, pushed={self.pushed}, "
            f"reductions={self.reductions})"
        )
