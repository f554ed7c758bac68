"""The events table: appended by the controller, read by `tandem events` and the status
page. Bounded: each append deletes what falls out of the latest `EVENTS_RETAINED`."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from catalog._models import Event
from catalog._records import EventInfo, NewEvent, event_info

EVENTS_RETAINED = 10_000


def record_events(session: Session, events: Sequence[NewEvent]) -> None:
    session.add_all(
        Event(at_ms=e.at_ms, instance=e.instance, kind=e.kind, replica=e.replica, message=e.message) for e in events
    )
    session.flush()
    latest = session.scalar(select(func.max(Event.id)))
    if latest is not None and latest > EVENTS_RETAINED:
        session.execute(delete(Event).where(Event.id <= latest - EVENTS_RETAINED))


def list_events(session: Session, instance: str | None, after: int | None, limit: int) -> list[EventInfo]:
    """Oldest first: those after id `after`, or (`after` None) the latest `limit`."""
    query = select(Event)
    if instance is not None:
        query = query.where(Event.instance == instance)
    if after is None:
        rows = session.scalars(query.order_by(Event.id.desc()).limit(limit)).all()[::-1]
    else:
        rows = session.scalars(query.where(Event.id > after).order_by(Event.id).limit(limit)).all()
    return [event_info(row) for row in rows]
