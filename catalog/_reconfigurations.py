"""Reconfigurations in progress: one durable record per instance (DESIGN section 13).

Rules: `begin_reconfiguration` records one before anything of it is done, and refuses
a second while one runs (AlreadyExists); `end_reconfiguration` deletes it once it
ended, committed or rolled back. What it changes (replicas added and dropped) are
transactions of their own between the two, each idempotent to carry on after a crash.
Functions neither commit nor roll back.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from catalog._checks import check_int, check_name
from catalog._errors import AlreadyExists, InvalidArgument
from catalog._instances import get_instance
from catalog._models import Reconfiguration
from catalog._records import ReconfigurationInfo, reconfiguration_info


def begin_reconfiguration(
    session: Session,
    instance: str,
    *,
    size: str,
    old: Sequence[str],
    new: Sequence[str],
    started_at_ms: int,
    deadline_ms: int,
    on_timeout: str,
) -> ReconfigurationInfo:
    get_instance(session, instance)  # NotFound
    if on_timeout not in ("rollback", "commit"):
        raise InvalidArgument(f"on_timeout must be 'rollback' or 'commit', not {on_timeout!r}")
    check_int("deadline_ms", deadline_ms, minimum=0)  # one already past ends at once
    if not new or set(old) & set(new):
        raise InvalidArgument(f"a resize adds new replicas {list(new)} beside the old {list(old)}")
    for name in (*old, *new):
        check_name("replica", name)
    running = session.get(Reconfiguration, instance)
    if running is not None:
        raise AlreadyExists(
            f"instance {instance!r} is being resized to {running.size} already (replicas "
            f"{running.new} replacing {running.old}); wait for it to end"
        )
    row = Reconfiguration(
        instance_name=instance,
        kind="resize",
        size=size,
        old=list(old),
        new=list(new),
        started_at_ms=started_at_ms,
        deadline_ms=deadline_ms,
        on_timeout=on_timeout,
    )
    session.add(row)
    session.flush()
    return reconfiguration_info(row)


def end_reconfiguration(session: Session, instance: str) -> None:
    row = session.get(Reconfiguration, instance)
    if row is not None:
        session.delete(row)
        session.flush()


def list_reconfigurations(session: Session) -> list[ReconfigurationInfo]:
    rows = session.scalars(select(Reconfiguration).order_by(Reconfiguration.instance_name))
    return [reconfiguration_info(row) for row in rows]
