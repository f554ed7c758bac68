"""Durable reconfiguration (DESIGN section 13): an instance resize is one record in the
catalog, carried from its start to its end by whichever controller runs.

A resize records what it will do (`Catalog.begin_reconfiguration`: the new replicas'
names and size, the old ones, a deadline on the catalog's clock, what to do on timeout)
before it adds anything, then `carry_out` does it: adds the new replicas still missing,
waits until they are in sync (where served, as `drop_replica` counts) or the deadline
passes, and ends it:
- in sync in time: committed, the old replicas dropped;
- not, `on_timeout="rollback"` (the default): the new replicas dropped, the old kept,
  and the caller gets DEADLINE_EXCEEDED;
- not, `on_timeout="commit"`: the old replicas dropped all the same (forced).
Then the record is deleted. Every step is idempotent (a replica added or dropped
already is skipped), so `resume` at a controller's start carries on a resize its
predecessor left halfway, from the record alone; a deadline that passed meanwhile ends
it at once by its `on_timeout`. A takeover by a new leader (issue 51) calls `resume`
the same way. Each end is an event of the instance.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from catalog import ReconfigurationInfo
from controller._api import ControllerError, ReplicaView
from controller._blocking import blocking as _blocking
from controller._orchestrator import size_of

if TYPE_CHECKING:
    from controller.runtime import Controller

log = logging.getLogger(__name__)

OnTimeout = Literal["rollback", "commit"]
ON_TIMEOUT: tuple[OnTimeout, ...] = ("rollback", "commit")


async def resize(controller: Controller, instance: str, size: str, *, timeout_ms: int, on_timeout: str) -> list[ReplicaView]:
    """Replace `instance`'s replicas by as many of `size` (one at least), durably: see
    the module. The replicas after it; DEADLINE_EXCEEDED once rolled back."""
    size_of(size)  # INVALID_ARGUMENT for an unknown size
    if on_timeout not in ON_TIMEOUT:
        raise ControllerError("INVALID_ARGUMENT", f"on_timeout must be one of {', '.join(ON_TIMEOUT)}, not {on_timeout!r}")
    if type(timeout_ms) is not int or timeout_ms < 1:
        raise ControllerError("INVALID_ARGUMENT", f"timeout_ms must be a positive number of milliseconds, not {timeout_ms!r}")
    controller._driver(instance)  # NOT_FOUND
    old = [r.name for r in await _blocking(controller.catalog.list_replicas, instance)]
    new: list[str] = []
    for number in range(max(len(old), 1)):
        new.append(_fresh_name(f"{size}_{number + 1}", old + new))
    try:
        record = await _blocking(
            controller.catalog.begin_reconfiguration,
            instance,
            size=size,
            old=old,
            new=new,
            deadline_ms=controller.catalog.now_ms() + timeout_ms,
            on_timeout=on_timeout,
        )
    except ControllerError as error:
        if error.code == "ALREADY_EXISTS":
            raise ControllerError("FAILED_PRECONDITION", error.message) from None
        raise
    await _note(controller, instance, "resize_started", f"resize to {size}: replicas {new} to replace {old}, in sync within {timeout_ms} ms or {on_timeout}")
    return await carry_out(controller, record)


async def carry_out(controller: Controller, record: ReconfigurationInfo) -> list[ReplicaView]:
    """Bring `record` to its end (see the module); the instance's replicas then."""
    instance, catalog = record.instance, controller.catalog
    driver = controller._driver(instance)
    present = {r.name for r in await _blocking(catalog.list_replicas, instance)}
    for name in record.new:
        if name not in present:
            await controller.add_replica(instance, name, size=record.size)
    left_s = max(0.0, (record.deadline_ms - catalog.now_ms()) / 1000)
    in_sync = await controller._await_in_sync(driver, record.new, time.monotonic() + left_s, where_served=True)
    if in_sync or record.on_timeout == "commit":
        await _drop(controller, instance, record.old, force=not in_sync)
        await _blocking(catalog.end_reconfiguration, instance)
        how = "its new replicas in sync" if in_sync else "on timeout, as asked: the new replicas were not in sync yet"
        await _note(controller, instance, "resize_committed", f"resize to {record.size} committed ({how}): replicas {list(record.old)} dropped")
        return list((await controller.status(instance))[0].replicas)
    await _drop(controller, instance, record.new, force=True)
    await _blocking(catalog.end_reconfiguration, instance)
    message = f"the new {record.size} replicas {list(record.new)} did not get in sync in time; the resize was rolled back: they were dropped, the old replicas {list(record.old)} are kept"
    await _note(controller, instance, "resize_rolled_back", message)
    raise ControllerError("DEADLINE_EXCEEDED", message)


async def resume(controller: Controller) -> list[asyncio.Task]:
    """At recovery (a restart, or a new leader taking over): carry on, in the
    background, every reconfiguration the catalog records. A failure is logged; the
    record stays for the next controller."""
    tasks = []
    for record in await _blocking(controller.catalog.list_reconfigurations):
        log.info("carrying on the resize of %s to %s left by an earlier controller", record.instance, record.size)
        tasks.append(asyncio.get_running_loop().create_task(_carry_on(controller, record)))
    return tasks


async def _carry_on(controller: Controller, record: ReconfigurationInfo) -> None:
    try:
        await carry_out(controller, record)
    except ControllerError as error:
        if error.code != "DEADLINE_EXCEEDED":  # a rollback is an end: its event says so
            log.error("the resize of %s could not be carried on: %s", record.instance, error.message)
    except Exception:
        log.exception("the resize of %s could not be carried on", record.instance)


async def _drop(controller: Controller, instance: str, names: tuple[str, ...], *, force: bool) -> None:
    """Drop those of `names` the instance still has (a step after a crash finds some
    dropped already)."""
    present = {r.name for r in await _blocking(controller.catalog.list_replicas, instance)}
    for name in names:
        if name in present:
            await controller.drop_replica(instance, name, force=force)


async def _note(controller: Controller, instance: str, kind: str, message: str) -> None:
    await controller._driver(instance).call(lambda inst: inst.note(kind, message))



def _fresh_name(name: str, taken: Sequence[str]) -> str:
    candidate, number = name, 1
    while candidate in taken:
        number += 1
        candidate = f"{name}_{number}"
    return candidate
