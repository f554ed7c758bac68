"""The asyncio driver of one instance: every change to its `ComputeInstance` goes through it.

Client requests, replica responses, failures and clock ticks all become steps; each step
is one synchronous call into the state machine, after which the driver carries out the
effects it returned, in order. A step runs at once, in the task or callback that asks
for it: steps and effects never await, and no effect calls back into the driver, so
steps on the one event loop never interleave (a reentrant step is refused). Effects that
need the catalog (durable holds and sinces) run on one worker thread, off the loop,
coalesced to the latest value per hold or since.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

from controller._api import ControllerError
from controller._connection import ReplicaConnection
from controller._instance import (
    ComputeInstance,
    Connect,
    Disconnect,
    Effect,
    InstanceError,
    PeekDone,
    Send,
    SinceAdvanced,
    StorageHold,
)
from history import ComputeResponse, PeekResult

log = logging.getLogger(__name__)

TICK_S = 0.25

Step = Callable[[ComputeInstance], Any]


class InstanceDriver:
    """Owns one `ComputeInstance` and the connections to its replicas.

    Lifecycles: `connections` holds one entry per replica with a live `Connect`, replaced
    on rehydration and removed on `Disconnect`; `peek_waiters` holds a future per peek
    issued through `peek_result`, resolved by its `PeekDone`.
    """

    def __init__(
        self,
        instance: ComputeInstance,
        controller_epoch: int,
        resolve_address: Callable[[str, int], Awaitable[str]],
        durable: Callable[[Effect], None],
    ) -> None:
        self.instance = instance
        self.controller_epoch = controller_epoch
        # (replica, attempt) -> address; attempts count on across failed incarnations.
        self._resolve_address = resolve_address
        self._durable = durable  # records a StorageHold or SinceAdvanced (blocking)
        self._durable_pool = ThreadPoolExecutor(1, thread_name_prefix=f"durable-{instance.config.name}")
        # Holds and sinces only move forward, so only the latest per (kind, id, holder)
        # needs writing: the backlog is bounded by the number of keys, however fast
        # frontiers move (one write per effect fell behind at 100 dataflows).
        self._durable_pending: dict[tuple, StorageHold | SinceAdvanced] = {}
        self._durable_flush: asyncio.Task | None = None
        self.connections: dict[str, ReplicaConnection] = {}
        self.peek_waiters: dict[str, asyncio.Future[tuple[PeekResult, str | None]]] = {}
        self._stepping = False
        self._tasks: list[asyncio.Task] = []

    @property
    def name(self) -> str:
        return self.instance.config.name

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._tick())]

    async def stop(self) -> None:
        for task in [*self._tasks, *filter(None, [self._durable_flush])]:
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
            return value
        except InstanceError as e:
            raise ControllerError(e.code, str(e)) from None
        except Exception:
            log.exception("instance %s: step failed", self.name)
            raise
        finally:
            self._stepping = False

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
            failures=effect.failures,
            resolve_address=lambda attempt: self._resolve_address(name, attempt),
            on_connected=lambda nonce, ack: self.post(
                lambda instance: instance.replica_connected(name, epoch, nonce, ack.resumed, ack.applied)
            ),
            on_response=lambda response: self.post(_response_step(name, epoch, response)),
            on_failure=lambda reason: self.post(lambda instance: instance.replica_failed(name, epoch, reason)),
        )
        self.connections[name] = connection
        connection.start()

    def _disconnect(self, effect: Disconnect) -> None:
        connection = self.connections.get(effect.replica)
        if connection is not None and connection.epoch == effect.epoch:
            del self.connections[effect.replica]
            connection.close()

    def _peek_done(self, effect: PeekDone) -> None:
        waiter = self.peek_waiters.pop(effect.uuid, None)
        if waiter is not None and not waiter.done():
            waiter.set_result((effect.result, effect.replica))

    def _record(self, effect: StorageHold | SinceAdvanced) -> None:
        self._durable_pending[(type(effect), effect.id, getattr(effect, "holder", ""))] = effect
        if self._durable_flush is None or self._durable_flush.done():
            self._durable_flush = asyncio.get_running_loop().create_task(self._flush_durable())

    async def _flush_durable(self) -> None:
        loop = asyncio.get_running_loop()
        while self._durable_pending:
            batch, self._durable_pending = list(self._durable_pending.values()), {}
            for effect in batch:
                try:
                    await loop.run_in_executor(self._durable_pool, self._durable, effect)
                except Exception as e:  # logged; the next value for this key supersedes it
                    log.error("instance %s: recording %s failed: %s", self.name, effect, e)


def _response_step(name: str, epoch: int, response: ComputeResponse) -> Step:
    return lambda instance: instance.handle_response(name, epoch, response)


_EFFECTS: dict[type, Callable[[InstanceDriver, Any], None]] = {
    Send: InstanceDriver._send,
    Connect: InstanceDriver._connect,
    Disconnect: InstanceDriver._disconnect,
    PeekDone: InstanceDriver._peek_done,
    StorageHold: InstanceDriver._record,
    SinceAdvanced: InstanceDriver._record,
}
