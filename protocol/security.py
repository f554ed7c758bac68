"""TLS and bearer tokens for both gRPC services (the controller API and the replica).

Defaults stay loopback and plaintext; when configured:
- A server given a certificate and key serves TLS (`server_credentials`); given a client
  CA too, it requires a client certificate signed by it (mutual TLS).
- A server given a token requires `authorization: Bearer <token>` on every call
  (`TokenCheck`); a missing or wrong one is UNAUTHENTICATED before any handler runs, so
  it changes nothing. Tokens are compared in constant time.
- A client sends the token as call metadata (`token_metadata`), over TLS or not, and
  verifies the server against a CA when given one (`channel_credentials`).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc

AUTHORIZATION = "authorization"


def read_token(path: str | Path) -> str:
    """The token in file `path` (surrounding whitespace dropped); ValueError if empty."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token` (none without one)."""
    return () if token is None else ((AUTHORIZATION, f"Bearer {token}"),)


@dataclass(frozen=True, slots=True)
class Tls:
    """A TLS identity: this side's certificate and key (PEM files) and the CA (PEM) that
    signs the other side's certificates: a server requires client certificates signed
    by it, a client checks the server's against it. Every field is optional on a client:
    no CA means the system's roots, no certificate means no client certificate."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a TLS certificate and its key go together: give both or neither")

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ValueError("a TLS server needs a certificate and its key")
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))],
            root_certificates=None if self.ca is None else _read(self.ca),
            require_client_auth=self.ca is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=None if self.ca is None else _read(self.ca),
            private_key=None if self.key is None else _read(self.key),
            certificate_chain=None if self.cert is None else _read(self.cert),
        )


def _read(path: Path) -> bytes:
    return Path(path).read_bytes()


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call that lacks `authorization: Bearer
    <token>` with this server's token."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get(AUTHORIZATION)
        if given is not None and hmac.compare_digest(str(given).encode(), self._expected):
            return handler
        message = "a bearer token is required" if given is None else "the bearer token is wrong"
        return _refusal(handler, message)


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that ends the call UNAUTHENTICATED, reading nothing."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    streaming_in = handler is not None and handler.request_streaming
    streaming_out = handler is not None and handler.response_streaming
    if streaming_in and streaming_out:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if streaming_in:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if streaming_out:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """How a server (controller API or replica) is secured, and, for the controller, how
    it reaches replicas: with `tls`, TLS with this certificate (also the controller's
    client certificate towards replicas) and `tls.ca` as the CA of the deployment (it
    signs clients' certificates, which are then required, and replicas'); with `token`,
    a bearer token required on every call (and sent to replicas). The defaults secure
    nothing: plaintext, no token."""

    tls: Tls | None = None
    token_file: Path | None = None
    token: str | None = None

    @classmethod
    def of(cls, tls_cert: Path | None, tls_key: Path | None, tls_client_ca: Path | None, token_file: Path | None) -> ServerSecurity:
        """From the command-line flags (`add_server_arguments`); ValueError names what
        is wrong with them."""
        if tls_client_ca is not None and tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: client certificates are checked over TLS")
        tls = None if tls_cert is None and tls_key is None else Tls(tls_cert, tls_key, tls_client_ca)
        return cls(tls, token_file, None if token_file is None else read_token(token_file))

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [] if self.token is None else [TokenCheck(self.token)]

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind `server` to `address`, with TLS when configured; the port bound."""
        if self.tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.tls.server_credentials())

    def argv(self) -> list[str]:
        """The flags that give a spawned replica this same security."""
        args: list[str] = []
        if self.tls is not None:
            args += ["--tls-cert", str(self.tls.cert), "--tls-key", str(self.tls.key)]
            if self.tls.ca is not None:
                args += ["--tls-client-ca", str(self.tls.ca)]
        if self.token_file is not None:
            args += ["--auth-token-file", str(self.token_file)]
        return args

    def channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        """The controller's channel to a replica at `address`."""
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, self.tls.channel_credentials(), options=options)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return token_metadata(self.token)


def add_server_arguments(parser: Any) -> None:
    """The security flags of a server's command line (`ServerSecurity.of` reads them)."""
    parser.add_argument("--tls-cert", type=Path, help="serve TLS with this certificate (PEM); with --tls-key")
    parser.add_argument("--tls-key", type=Path, help="the private key (PEM) of --tls-cert")
    parser.add_argument(
        "--tls-client-ca", type=Path, help="require client certificates signed by this CA (PEM), which also signs the replicas'"
    )
    parser.add_argument("--auth-token-file", type=Path, help="require this bearer token (the file's content) on every call")
