"""One controller-to-replica connection: a `grpc.aio` stream for one replica incarnation.

The task connects (retrying with tenacity backoff until it is cancelled), sends `Hello`
(offering to resume the replica's session, if the instance asked), reports `connected`
with the replica's `HelloAck`, then writes queued commands and reports every response.
It ends on the first failure (a broken stream, a refused send, a refusal, no `HelloAck`)
after reporting it: the instance then rehydrates the replica as a new incarnation with a
new connection, backing off when it failed before (`InstanceOptions.retry_delay_ms`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from history import ComputeCommand, ComputeResponse, Hello, Resume
from protocol import HelloAck, ProtocolError, Refusal, command_to_proto, compute_pb2_grpc, response_from_proto
from protocol.security import ServerSecurity

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
HANDSHAKE_TIMEOUT_S = 10.0  # a live replica answers Hello from its event loop at once


class ConnectFailed(Exception):
    """The replica could not be reached this time; the connection retries."""


@dataclass(eq=False)
class ReplicaConnection:
    """Lifecycle: created for (replica, epoch) by a `Connect` effect; `commands` are
    queued by `Send` effects; cancelled by `Disconnect` or when the replica is dropped."""

    replica: str
    epoch: int  # the replica's incarnation, as the instance numbers it
    controller_epoch: int
    resume: Resume | None
    # Incarnations of this replica that failed in a row before this one: attempts are
    # numbered on from them, so the resolver sees how long the replica has been failing.
    failures: int
    resolve_address: Callable[[int], Awaitable[str]]  # attempt number -> address
    on_connected: Callable[[str, HelloAck], None]  # (this connection's nonce, the answer)
    on_response: Callable[[ComputeResponse], None]
    on_failure: Callable[[str], None]
    security: ServerSecurity = ServerSecurity()  # TLS and the token towards replicas
    costliest_first: bool = False  # the order of the replica's waiting steps (`Hello`)
    commands: asyncio.Queue[ComputeCommand] = field(default_factory=asyncio.Queue)
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex)
    task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"replica-{self.replica}-{self.epoch}")

    def send(self, commands: tuple[ComputeCommand, ...]) -> None:
        for command in commands:
            self.commands.put_nowait(command)

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def _run(self) -> None:
        attempts = 0
        channel = None
        try:
            async for attempt in AsyncRetrying(
                wait=wait_exponential(multiplier=0.1, max=2), retry=retry_if_exception_type(ConnectFailed)
            ):
                with attempt:
                    attempts += 1
                    try:
                        address = await self.resolve_address(self.failures + attempts)
                    except Exception as e:  # e.g. a respawned process exited before it was ready
                        log.warning("replica %s (epoch %d): no address yet: %s", self.replica, self.epoch, e)
                        raise ConnectFailed(str(e)) from None
                    channel = self.security.channel(
                        address,
                        [
                            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                        ],
                    )
                    try:
                        await asyncio.wait_for(channel.channel_ready(), 5)
                    except (asyncio.TimeoutError, grpc.aio.AioRpcError) as e:
                        await channel.close()
                        raise ConnectFailed(f"{address}: {e!r}") from None
            call = compute_pb2_grpc.ComputeReplicaStub(channel).CommandStream(metadata=self.security.metadata)
            await call.write(command_to_proto(Hello(self.controller_epoch, self.nonce, self.resume, self.costliest_first)))
            answer = await self._handshake(call)
            if isinstance(answer, str):
                reason = answer
            else:
                ack, first_response = answer
                self.on_connected(self.nonce, ack)
                if first_response is not None:
                    self.on_response(first_response)
                reason = await self._pump(call)
        except asyncio.CancelledError:
            if channel is not None:
                await channel.close()
            raise
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, ProtocolError) as e:
            reason = f"stream failed: {_describe(e)}"
        if channel is not None:
            await channel.close()
        log.warning("replica %s (epoch %d): %s", self.replica, self.epoch, reason)
        self.on_failure(reason)

    async def _handshake(self, call) -> tuple[HelloAck, ComputeResponse | None] | str:
        """The replica's answer to `Hello` (and a response that came in its place), or
        why there is none."""
        try:
            message = await asyncio.wait_for(call.read(), HANDSHAKE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return f"no answer to Hello within {HANDSHAKE_TIMEOUT_S:.0f} s"
        if message is grpc.aio.EOF:
            return "the replica closed the stream before answering Hello"
        nonce, answer = response_from_proto(message)
        if isinstance(answer, Refusal):
            return f"refused ({answer.code}): {answer.message}"
        if isinstance(answer, HelloAck):
            return answer, None
        # A replica process older than HelloAck (managed replicas outlive a controller
        # upgrade): it ignored the resume offer, so its session is new.
        log.info("replica %s (epoch %d) answers without HelloAck: a new session", self.replica, self.epoch)
        return HelloAck(resumed=False, applied=0), answer if nonce == self.nonce else None

    async def _pump(self, call) -> str:
        """Write queued commands and read responses until one side fails; the reason.
        (`read()`, as in the handshake: grpc.aio refuses to mix it with iteration.)"""
        writer = asyncio.ensure_future(self._write(call))
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                nonce, response = response_from_proto(message)
                if isinstance(response, Refusal):
                    return f"refused ({response.code}): {response.message}"
                if isinstance(response, HelloAck):
                    return "protocol violation: a second HelloAck"
                if nonce == self.nonce:
                    self.on_response(response)
            return "the replica closed the stream"
        finally:
            writer.cancel()

    async def _write(self, call) -> None:
        try:
            while True:
                await call.write(command_to_proto(await self.commands.get()))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            # A refused send breaks the connection: cancelling the read ends the pump.
            log.warning("replica %s (epoch %d): send refused: %s", self.replica, self.epoch, _describe(e))
            call.cancel()


def _describe(error: Exception) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error)
