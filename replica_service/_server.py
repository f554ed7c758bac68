"""The `ComputeReplica` gRPC service: converts messages and delegates to `Replica`.

One bidirectional stream per controller connection. The first command must be `Hello`,
and the first response is its `HelloAck` (queued by `Replica.connect`) or a refusal. A
refusal is sent as the stream's last response, after which the stream ends.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from history import Hello
from protocol import ProtocolError, Refusal, command_from_proto, compute_pb2_grpc, response_to_proto
from protocol.security import ServerSecurity
from replica_service._replica import Connection, Refused, Replica

log = logging.getLogger(__name__)


class ComputeReplicaServicer(compute_pb2_grpc.ComputeReplicaServicer):
    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    async def CommandStream(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        try:
            hello = command_from_proto(first)
            if not isinstance(hello, Hello):
                raise Refused(Refusal("protocol_violation", f"the first command must be Hello, not {type(hello).__name__}"))
            connection = self.replica.connect(hello)
        except (Refused, ProtocolError) as e:
            await context.write(response_to_proto(_refusal(e), getattr(_safe_hello(first), "nonce", "")))
            return
        reader = asyncio.ensure_future(self._read(context, connection))
        try:
            while (response := await connection.outbox.get()) is not None:
                await context.write(response_to_proto(response, connection.nonce))
                if isinstance(response, Refusal):
                    break
        finally:
            reader.cancel()
            connection.close()
            log.info("controller connection %s ended", connection.nonce)

    async def _read(self, context: grpc.aio.ServicerContext, connection: Connection) -> None:
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                self.replica.handle(connection, command_from_proto(message))
        except (Refused, ProtocolError) as e:
            log.warning("refusing connection %s: %s", connection.nonce, e)
            connection.send(_refusal(e))
        connection.close()


def _refusal(error: Refused | ProtocolError) -> Refusal:
    return error.refusal if isinstance(error, Refused) else Refusal("protocol_violation", str(error))


def _safe_hello(message) -> Hello | None:
    try:
        command = command_from_proto(message)
    except ProtocolError:
        return None
    return command if isinstance(command, Hello) else None


class ReplicaServer:
    """A `grpc.aio` server hosting one `Replica`, with `start()` and `stop(grace)`,
    secured by `security` (TLS, a bearer token; none by default)."""

    def __init__(self, replica: Replica, listen: str, security: ServerSecurity = ServerSecurity()) -> None:
        self.replica = replica
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", 256 * 1024 * 1024),
                ("grpc.max_receive_message_length", 256 * 1024 * 1024),
            ],
            interceptors=security.interceptors(),
        )
        compute_pb2_grpc.add_ComputeReplicaServicer_to_server(ComputeReplicaServicer(replica), self._server)
        self.port = security.add_port(self._server, listen)
        self.host = listen.rsplit(":", 1)[0]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        await self._server.start()

    async def stop(self, grace: float) -> None:
        await self._server.stop(grace)
        await self.replica.shutdown()
