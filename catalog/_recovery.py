"""Crash recovery: an instance's command history, rebuilt from the catalog.

DESIGN section 6: `CreateInstance`, the merged configuration, every live dataflow with
`as_of` = its recorded since, their `Schedule`s, then `InitializationComplete`. The result
is already in reduced form (`history.reduce_commands` leaves it unchanged).

One refinement: a dataflow that imports storage only comes back at the meet of its
since and the holds it keeps on its inputs, when those are lower. The controller holds
the inputs at each replica's last computed time, so that a lagging replica can catch up;
coming back at the since moved those holds up past a lagging replica, whose dataflow
every controller restart or takeover then rebuilt from scratch. Held there (until the
replicas report: `ComputeInstance`), a lagging replica keeps its dataflow and catches up
(`replica_service._replica._catches_up`). The controller then allows compaction to the
since again (`ComputeInstance.create_dataflow`'s `sinces`), so no read below it is
served.

The recorded since of an index is its collection's since. A materialized view's is the
hold its dataflow keeps on it (`sink_holder`), when there is one: the view's storage
since may lag it, held lower by its readers or the controller's retention hold, and the
dataflow must not go back there, where its inputs may no longer be readable.

Dataflows come in dependency order: one that imports another's export comes after it.
Ties are broken by id number, so the order is deterministic; it is computed by a
topological sort, not assumed from the ids.
"""

from __future__ import annotations

import heapq

from sqlalchemy import select
from sqlalchemy.orm import Session

from catalog._collections import id_number, list_dataflows
from catalog._instances import get_instance
from catalog._models import Collection, ReadHold, frontier_from_db
from catalog._records import DataflowInfo
from history import (
    ComputeCommand,
    ComputeParameters,
    CreateDataflow,
    CreateInstance,
    Frontier,
    InitializationComplete,
    Schedule,
    UpdateConfiguration,
    meet_all,
)


def dataflow_holder(instance: str, key: str) -> str:
    """The holder of the read hold a dataflow keeps on each storage collection it
    imports; `key` is the dataflow's first export id (the instance's key for it). The
    catalog takes the hold when it records the dataflow; the controller moves it."""
    return f"{instance}/{key}"


def sink_holder(dataflow_id: str) -> str:
    """The holder of the read hold a dataflow keeps on its materialized view, at the
    view's compute since (the controller moves it as that since advances)."""
    return f"{dataflow_id}/sink"


def dependency_order(dataflows: list[DataflowInfo]) -> list[DataflowInfo]:
    """`dataflows` sorted so that each comes after every dataflow it imports from."""
    owner = {export: df.id for df in dataflows for export in df.export_ids}
    by_id = {df.id: df for df in dataflows}
    waiting_on = {df.id: {owner[i.id] for i in df.imports if i.id in owner} for df in dataflows}
    users: dict[str, list[str]] = {df.id: [] for df in dataflows}
    for id, sources in waiting_on.items():
        for source in sources:
            users[source].append(id)
    ready = [(id_number(id), id) for id, sources in waiting_on.items() if not sources]
    heapq.heapify(ready)
    order: list[DataflowInfo] = []
    while ready:
        _, id = heapq.heappop(ready)
        order.append(by_id[id])
        for user in users[id]:
            waiting_on[user].discard(id)
            if not waiting_on[user]:
                heapq.heappush(ready, (id_number(user), user))
    if len(order) != len(dataflows):
        stuck = sorted(set(by_id) - {df.id for df in order}, key=id_number)
        raise RuntimeError(f"the catalog holds a dependency cycle among dataflows {stuck}")
    return order


def recover_history(session: Session, instance: str) -> list[ComputeCommand]:
    info = get_instance(session, instance)
    dataflows = dependency_order(list_dataflows(session, instance))
    sinces = {
        id: frontier_from_db(since)
        for id, since in session.execute(
            select(Collection.id, Collection.since).where(
                Collection.id.in_([e for df in dataflows for e in df.export_ids])
            )
        )
    }
    views = {sink_holder(df.id): df.sink_id for df in dataflows if df.sink_id is not None}
    for holder, id, frontier in session.execute(
        select(ReadHold.holder, ReadHold.collection_id, ReadHold.frontier).where(
            ReadHold.holder.in_(list(views))
        )
    ):
        if views[holder] == id:
            sinces[id] = frontier_from_db(frontier)
    inputs = {df.id: dataflow_holder(instance, df.export_ids[0]) for df in dataflows if df.description().reads_storage_only}
    input_holds: dict[str, Frontier] = {}
    for holder, frontier in session.execute(
        select(ReadHold.holder, ReadHold.frontier).where(ReadHold.holder.in_(list(inputs.values())))
    ):
        input_holds[holder] = input_holds.get(holder, Frontier.empty()).meet(frontier_from_db(frontier))
    commands: list[ComputeCommand] = [CreateInstance(info.config)]
    if info.parameters != ComputeParameters():
        commands.append(UpdateConfiguration(info.parameters))
    live: list[DataflowInfo] = []
    for df in dataflows:
        since = meet_all(sinces.get(e, Frontier.empty()) for e in df.export_ids)
        if since.is_empty:  # every export compacted away: the dataflow is gone
            continue
        # A replica lagging behind the since is kept by the new controller only if the
        # dataflow comes back no later than where that replica stands: its input holds.
        as_of = df.as_of.join(since.meet(input_holds.get(inputs.get(df.id, ""), since)))
        live.append(df)
        commands.append(CreateDataflow(df.description(as_of)))
    commands.extend(Schedule(df.export_ids[0]) for df in live)
    commands.append(InitializationComplete())
    return commands
