"""The asyncio driver of one instance: every change to its `ComputeInstance` goes through it.

Client requests, replica responses, failures and clock ticks all become steps; each step
is one synchronous call into the state machine, after which the driver carries out the
effects it returned, in order. A step runs at once, in the task or callback that asks
for it: steps and effects never await, and no effect calls back into the driver, so
steps on the one event loop never interleave (a reentrant step is refused). Effects that
need the catalog (durable holds and sinces) run on one worker thread, off the loop,
coalesced to the latest value per hold or since, and written as one transaction per
batch; the batch's sinces are then reported back together (`sinces_recorded`), which lets the
replicas compact.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Sequence

from catalog import Fenced
from controller._api import ControllerError
from controller._connection import ReplicaConnection
from controller._instance import (
    Arbitrate,
    ComputeInstance,
    Connect,
    Disconnect,
    Effect,
    Event,
    InstanceError,
    PeekDone,
    Send,
    SinceAdvanced,
    StorageHold,
    SubscribeEnded,
    SubscribeForward,
)
from controller._subscribe import IndexFeed
from history import ComputeResponse, DataflowDescription, PeekResult, StatusResponse
from protocol.security import ServerSecurity

log = logging.getLogger(__name__)

TICK_S = 0.25
RECORD_RETRY_S = 1.0  # after a failed write of holds and sinces
# Events an operator must look at, logged as warnings; the others (replicas added,
# hydrated, reconciled, ...) are routine, at INFO.
WARNING_EVENTS = frozenset({"replica_failed", "dataflow_failed", "slow", "diverged", "arbitration"})

Step = Callable[[ComputeInstance], Any]


class InstanceDriver:
    """Owns one `ComputeInstance` and the connections to its replicas.

    Lifecycles: `connections` holds one entry per replica with a live `Connect`, replaced
    on rehydration and removed on `Disconnect`; `peek_waiters` holds a future per peek
    issued through `peek_result`, resolved by its `PeekDone`; `feeds` holds the feed of
    each open subscription, from `open_feed` until the feed stops (`stop` ends every
    one, UNAVAILABLE).
    """

    def __init__(
        self,
        instance: ComputeInstance,
        controller_epoch: int,
        resolve_address: Callable[[str, int], Awaitable[str]],
        durable: Callable[[Sequence[StorageHold | SinceAdvanced]], None],
        on_fenced: Callable[[Fenced], None] = lambda error: None,
        security: ServerSecurity = ServerSecurity(),
        recompute: Callable[[DataflowDescription, int], Awaitable[str]] | None = None,
        on_status: Callable[[str, ComputeResponse], None] = lambda replica, response: None,
        record_events: Callable[[Sequence[Event]], None] = lambda events: None,
    ) -> None:
        self.instance = instance
        self.controller_epoch = controller_epoch
        # (replica, attempt) -> address; attempts count on across failed incarnations.
        self._resolve_address = resolve_address
        self._durable = durable  # records StorageHolds and SinceAdvanceds, atomically (blocking)
        self._on_fenced = on_fenced
        self._security = security  # how replicas are reached: TLS, token
        # (dataflow, time) -> the digest of its version recomputed from storage.
        self._recompute = recompute
        self._arbitrating: set[asyncio.Task] = set()
        self._on_status = on_status  # sees every replica's status report (metrics)
        self._durable_pool = ThreadPoolExecutor(1, thread_name_prefix=f"durable-{instance.config.name}")
        # Holds and sinces only move forward, so only the latest per (kind, id, holder)
        # needs writing: the backlog is bounded by the number of keys, however fast
        # frontiers move (one write per effect fell behind at 100 dataflows).
        self._durable_pending: dict[tuple, StorageHold | SinceAdvanced] = {}
        self._durable_flush: asyncio.Task | None = None
        self.connections: dict[str, ReplicaConnection] = {}
        self.peek_waiters: dict[str, asyncio.Future[tuple[PeekResult, str | None]]] = {}
        self.feeds: dict[str, IndexFeed] = {}
        self._stepping = False
        self._tasks: list[asyncio.Task] = []
        # Serializes the requests that check the instance, write the catalog, then change
        # the instance (creating and dropping dataflows, dropping replicas): a check must
        # still hold when its change lands.
        self.ddl = asyncio.Lock()
        self._events_logged = 0  # of the instance's `events_total`
        self._record_events = record_events  # appends to the catalog's events (blocking)
        self._events_pending: list[Event] = []
        self._events_flush: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return self.instance.config.name

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._tick())]

    async def stop(self, why: ControllerError | None = None) -> None:
        """Stop driving: open feeds and waiting peeks fail with `why` (by default
        UNAVAILABLE: dropped or stopping), so their clients go elsewhere at once."""
        why = why or ControllerError("UNAVAILABLE", f"instance {self.name} was dropped or its controller is stopping")
        for feed in list(self.feeds.values()):
            feed.fail(why)
        for waiter in self.peek_waiters.values():
            if not waiter.done():
                waiter.set_exception(why)
        self.peek_waiters.clear()
        for task in [*self._tasks, *self._arbitrating, *filter(None, [self._durable_flush, self._events_flush])]:
            task.cancel()
        for connection in self.connections.values():
            connection.close()
        self.connections.clear()
        self._durable_pool.shutdown(wait=True)

    # --- Steps --------------------------------------------------------------------------

    async def call(self, step: Step) -> Any:
        """Run `step` on the instance and return its result (effects are carried out).

        An `InstanceError` raised by the step becomes a `ControllerError`; the instance is
        unchanged by a refused step."""
        return self._execute(step)

    def post(self, step: Step) -> None:
        """Run `step` for its effects alone (responses, failures, ticks)."""
        try:
            self._execute(step)
        except ControllerError:
            pass  # a refusal no one waits for
        except Exception:
            pass  # a bug, logged by _execute; the driver carries on

    def _execute(self, step: Step) -> Any:
        if self._stepping:
            raise RuntimeError(f"instance {self.name}: a step started inside another step")
        self._stepping = True
        try:
            result = step(self.instance)
            effects, value = result if isinstance(result, tuple) else (result, None)
            self._apply(effects or [])
            self._log_events()
            return value
        except InstanceError as e:
            raise ControllerError(e.code, str(e)) from None
        except Exception:
            log.exception("instance %s: step failed", self.name)
            raise
        finally:
            self._stepping = False

    def _log_events(self) -> None:
        """Log the instance's new events and queue them for the catalog."""
        events = self.instance.events
        new = list(events)[len(events) - min(self.instance.events_total - self._events_logged, len(events)) :]
        self._events_logged = self.instance.events_total
        if not new:
            return
        for event in new:
            log.log(logging.WARNING if event.kind in WARNING_EVENTS else logging.INFO, "instance %s: %s", self.name, event.message)
        self._events_pending += new
        if self._events_flush is None or self._events_flush.done():
            self._events_flush = asyncio.get_running_loop().create_task(self._flush_events())

    async def _flush_events(self) -> None:
        """Record queued events in order, a batch per write, retrying a failed one.
        They share the serial worker with holds and sinces, so the loop never blocks."""
        loop = asyncio.get_running_loop()
        while self._events_pending:
            batch, self._events_pending = self._events_pending, []
            try:
                await loop.run_in_executor(self._durable_pool, self._record_events, batch)
            except Fenced:
                return  # the holds' writer reports it; a fenced controller records nothing
            except Exception as e:
                log.error("instance %s: recording %d events failed (retrying): %s", self.name, len(batch), e)
                self._events_pending = batch + self._events_pending
                await asyncio.sleep(RECORD_RETRY_S)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            now = int(time.time() * 1000)
            self.post(lambda instance: instance.tick(now))

    # --- Effects ------------------------------------------------------------------------

    def _apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            _EFFECTS[type(effect)](self, effect)

    def _send(self, effect: Send) -> None:
        connection = self.connections.get(effect.replica)
        if connection is not None and connection.epoch == effect.epoch:
            connection.send(effect.commands)

    def _connect(self, effect: Connect) -> None:
        old = self.connections.pop(effect.replica, None)
        if old is not None:
            old.close()
        name, epoch = effect.replica, effect.epoch
        connection = ReplicaConnection(
            replica=name,
            epoch=epoch,
            controller_epoch=self.controller_epoch,
            resume=effect.resume,
            costliest_first=effect.costliest_first,
            failures=effect.failures,
            resolve_address=lambda attempt: self._resolve_address(name, attempt),
            on_connected=lambda nonce, ack: self.post(
                lambda instance: instance.replica_connected(name, epoch, nonce, ack.resumed, ack.applied)
            ),
            on_response=lambda response: self._response(name, epoch, response),
            on_failure=lambda reason: self.post(lambda instance: instance.replica_failed(name, epoch, reason)),
            security=self._security,
        )
        self.connections[name] = connection
        connection.start()

    def _response(self, name: str, epoch: int, response: ComputeResponse) -> None:
        if isinstance(response, StatusResponse):
            self._on_status(name, response)
        self.post(_response_step(name, epoch, response))

    def _disconnect(self, effect: Disconnect) -> None:
        connection = self.connections.get(effect.replica)
        if connection is not None and connection.epoch == effect.epoch:
            del self.connections[effect.replica]
            connection.close()

    def _peek_done(self, effect: PeekDone) -> None:
        waiter = self.peek_waiters.pop(effect.uuid, None)
        if waiter is not None and not waiter.done():
            waiter.set_result((effect.result, effect.replica))

    def open_feed(self, make_feed: Callable[[Callable[[str], None]], IndexFeed], subscribe: Step) -> IndexFeed:
        """Open the feed `make_feed(cancel)` builds for the subscription the step
        `subscribe` opens (refused, it registers nothing). The feed's `cancel` closes
        the subscription, after the current step."""
        loop = asyncio.get_running_loop()

        def cancel(uuid: str) -> None:
            self.feeds.pop(uuid, None)
            loop.call_soon(self.post, lambda instance: instance.cancel_subscribe(uuid))

        feed = make_feed(cancel)
        self.feeds[feed.uuid] = feed
        try:
            self._execute(subscribe)
        except Exception:
            del self.feeds[feed.uuid]
            raise
        return feed

    def _subscribe_forward(self, effect: SubscribeForward) -> None:
        feed = self.feeds.get(effect.uuid)
        if feed is not None:
            feed.forward(effect.changes, effect.progress)

    def _subscribe_ended(self, effect: SubscribeEnded) -> None:
        feed = self.feeds.get(effect.uuid)
        if feed is not None:
            feed.fail(ControllerError(effect.code, effect.message))

    def _arbitrate(self, effect: Arbitrate) -> None:
        """Recompute the disputed version off the loop; report its digest (or why not)."""
        desc = self.instance.dataflows[effect.key].desc

        async def settle() -> None:
            digest, why = None, "this controller has no way to recompute"
            if self._recompute is not None:
                try:
                    digest = await self._recompute(desc, effect.time)
                except Exception as e:
                    why = getattr(e, "message", None) or str(e) or type(e).__name__
            self.post(lambda instance: instance.arbitrated(effect.key, effect.time, digest, why))

        task = asyncio.get_running_loop().create_task(settle())
        self._arbitrating.add(task)
        task.add_done_callback(self._arbitrating.discard)

    def _record(self, effect: StorageHold | SinceAdvanced) -> None:
        self._durable_pending[(type(effect), effect.id, getattr(effect, "holder", ""))] = effect
        if self._durable_flush is None or self._durable_flush.done():
            self._durable_flush = asyncio.get_running_loop().create_task(self._flush_durable())

    @property
    def durable_backlog(self) -> int:
        """Sinces and holds waiting for their batch to be written."""
        return len(self._durable_pending)

    async def _flush_durable(self) -> None:
        """Write what is pending as one batch, until nothing is. The batch is the latest
        value of every key that moved, taken between steps: one consistent cut of the
        instance's frontiers. A failed write is retried (values that moved meanwhile
        supersede its own); a fenced one stops recording for good."""
        loop = asyncio.get_running_loop()
        while self._durable_pending:
            pending, self._durable_pending = self._durable_pending, {}
            batch = list(pending.values())
            try:
                await loop.run_in_executor(self._durable_pool, self._durable, batch)
            except Fenced as fenced:
                log.critical("instance %s: fenced, no longer recording frontiers: %s", self.name, fenced)
                self._on_fenced(fenced)
                return
            except Exception as e:
                log.error("instance %s: recording %d holds and sinces failed (retrying): %s", self.name, len(batch), e)
                self._durable_pending = {**pending, **self._durable_pending}
                await asyncio.sleep(RECORD_RETRY_S)
                continue
            recorded = {e.id: e.since for e in batch if isinstance(e, SinceAdvanced)}
            if recorded:
                self.post(lambda instance: instance.sinces_recorded(recorded))


def _response_step(name: str, epoch: int, response: ComputeResponse) -> Step:
    return lambda instance: instance.handle_response(name, epoch, response)


_EFFECTS: dict[type, Callable[[InstanceDriver, Any], None]] = {
    Send: InstanceDriver._send,
    Connect: InstanceDriver._connect,
    Disconnect: InstanceDriver._disconnect,
    PeekDone: InstanceDriver._peek_done,
    StorageHold: InstanceDriver._record,
    SinceAdvanced: InstanceDriver._record,
    Arbitrate: InstanceDriver._arbitrate,
    SubscribeForward: InstanceDriver._subscribe_forward,
    SubscribeEnded: InstanceDriver._subscribe_ended,
}
