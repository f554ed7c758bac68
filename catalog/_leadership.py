"""Leadership: which `tandem serve` process leads, its lease, and the standbys.

Rules:
- Every function runs inside the caller's transaction and locks the `controller_epoch`
  row first (FOR UPDATE), so that taking the lead, renewing the lease and registering a
  standby are serialized: a standby's `seen_renewal` is exact, and a renewal counts
  every standby registered before it.
- `take_lead` bumps the epoch and names the new leader in one update, when `decide`
  (called with the state under the lock) gives a cause (a standby a handover named
  adopts the epoch the handover bumped); the epoch is the fence, as it was: every write
  of an older leader fails from then on.
- The lease's clock is the catalog's (`now_ms`): the wall clock of whoever writes.
Functions neither commit nor roll back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from catalog._errors import FailedPrecondition
from catalog._models import ControllerEpoch, ControllerProcess


@dataclass(frozen=True, slots=True)
class ControllerInfo:
    """A controller process taking part in leadership (see `ControllerProcess`)."""

    id: str
    role: str  # 'leader' | 'standby'
    address: str
    host: str
    pid: int
    process_start: str | None
    started_ms: int
    heard_ms: int
    seen_renewal: int


@dataclass(frozen=True, slots=True)
class Leadership:
    """The catalog's record of leadership: the `epoch`, the `leader` (None: nobody holds
    a lease), when its lease ends and how often it was renewed, and the standbys."""

    epoch: int
    leader: ControllerInfo | None
    lease_expires_ms: int | None
    lease_renewals: int
    standbys: tuple[ControllerInfo, ...]


def _info(row: ControllerProcess) -> ControllerInfo:
    return ControllerInfo(
        row.id, row.role, row.address, row.host, row.pid, row.process_start, row.started_ms, row.heard_ms, row.seen_renewal
    )


def _locked(session: Session) -> ControllerEpoch:
    return session.scalars(select(ControllerEpoch).where(ControllerEpoch.id == 1).with_for_update()).one()


def leadership(session: Session) -> Leadership:
    row = session.scalars(select(ControllerEpoch).where(ControllerEpoch.id == 1)).one()
    return _leadership(session, row)


def _leadership(session: Session, row: ControllerEpoch) -> Leadership:
    processes = {p.id: _info(p) for p in session.scalars(select(ControllerProcess).order_by(ControllerProcess.id))}
    leader = processes.get(row.leader_id) if row.leader_id is not None else None
    standbys = tuple(p for p in processes.values() if p.role == "standby")
    return Leadership(row.epoch, leader, row.lease_expires_ms, row.lease_renewals, standbys)


@dataclass(frozen=True, slots=True)
class ControllerSpec:
    """What a controller process records of itself."""

    id: str
    address: str
    host: str
    pid: int
    process_start: str | None


def take_lead(
    session: Session, me: ControllerSpec, lease_ms: int, now_ms: int, decide: Callable[[Leadership], str | None]
) -> tuple[int, str] | None:
    """Lead, if `decide` gives a cause under the lock: bump the epoch (unless a
    handover named `me` already, and bumped it), name `me` the leader with a lease until
    `now_ms + lease_ms`; (the epoch, the cause). None: `decide` said no, nothing changed."""
    row = _locked(session)
    cause = decide(_leadership(session, row))
    if cause is None:
        return None
    if row.leader_id != me.id:  # else handed over to `me`: the handover bumped it
        row.epoch += 1
    row.leader_id, row.lease_expires_ms = me.id, now_ms + lease_ms
    row.lease_renewals += 1
    session.execute(delete(ControllerProcess).where(ControllerProcess.role == "leader", ControllerProcess.id != me.id))
    process = session.get(ControllerProcess, me.id)
    if process is None:
        session.add(_row(me, "leader", now_ms, row.lease_renewals))
    else:
        process.role, process.heard_ms = "leader", now_ms
    session.flush()
    return row.epoch, cause


def hand_over(session: Session, me: str, to: str, lease_ms: int, now_ms: int) -> int:
    """Leader `me` (the caller checked the epoch) hands the lead to standby `to`: the
    epoch bumped, `to` the leader with a lease until `now_ms + lease_ms`, `me` no longer
    taking part; the new epoch. `FailedPrecondition` when `to` is no standby."""
    row = _locked(session)
    target = session.get(ControllerProcess, to)
    if row.leader_id != me or target is None or target.role != "standby":
        raise FailedPrecondition(f"controller {to} is not a standby of leader {me}: the lead stays where it is")
    row.epoch += 1
    row.leader_id, row.lease_expires_ms = to, now_ms + lease_ms
    row.lease_renewals += 1
    target.role, target.heard_ms = "leader", now_ms
    session.execute(delete(ControllerProcess).where(ControllerProcess.id == me))
    session.flush()
    return row.epoch


def renew_lease(session: Session, me: str, lease_ms: int, now_ms: int, forget_after_ms: int) -> Leadership:
    """Extend the lease of leader `me` (the caller checked the epoch) to
    `now_ms + lease_ms`, forgetting standbys not heard from for `forget_after_ms`; the
    state, with the standbys this renewal counted."""
    row = _locked(session)
    session.execute(
        delete(ControllerProcess).where(ControllerProcess.role == "standby", ControllerProcess.heard_ms < now_ms - forget_after_ms)
    )
    row.lease_expires_ms = now_ms + lease_ms
    row.lease_renewals += 1
    process = session.get(ControllerProcess, me)
    if process is not None:
        process.heard_ms = now_ms
    session.flush()
    return _leadership(session, row)


def register_standby(session: Session, me: ControllerSpec, now_ms: int) -> Leadership:
    """Record `me` as a standby (again), seeing the lease's renewals as they are now."""
    row = _locked(session)
    process = session.get(ControllerProcess, me.id)
    if process is None:
        session.add(_row(me, "standby", now_ms, row.lease_renewals))
    else:
        process.heard_ms = now_ms
    session.flush()
    return _leadership(session, row)


def leave(session: Session, me: str) -> Leadership:
    """`me` stops taking part: its row goes; a leader's lease ends at once (it serves no
    more), so a standby takes the lead without waiting for it to lapse. The state after,
    with the standbys that may take the lead."""
    row = _locked(session)
    if row.leader_id == me:
        row.leader_id = row.lease_expires_ms = None
    session.execute(delete(ControllerProcess).where(ControllerProcess.id == me))
    return _leadership(session, row)


def _row(me: ControllerSpec, role: str, now_ms: int, seen_renewal: int) -> ControllerProcess:
    return ControllerProcess(
        id=me.id,
        role=role,
        address=me.address,
        host=me.host,
        pid=me.pid,
        process_start=me.process_start,
        started_ms=now_ms,
        heard_ms=now_ms,
        seen_renewal=seen_renewal,
    )
