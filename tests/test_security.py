"""TLS and bearer tokens on both gRPC services (issue 13).

A throwaway CA signs a server certificate (for 127.0.0.1 and localhost) and a client
certificate; a second CA signs a client certificate the servers must refuse. The
controller API is served by a `ControllerServer` over the fake API of
`test_client_api` and the CLI runs in-process. The replica service is tested end to
end, in one replica process that a secured `tandem serve` spawns (a JVM start is the
costly part): real controllers, and the controller's own connection code for clients
that must not get in.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from test_client_api import FakeApi, ServerThread

from controller._connection import ReplicaConnection
from controller._process import ControllerProcess, kill_replicas
from controller.cli import main
from controller.client import Client, TandemError
from protocol.security import ServerSecurity, Tls

TOKEN = "s3cret-token"


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _cert(subject: str, key, issuer: x509.Name, issuer_key, *, ca: bool = False, sans=()) -> x509.Certificate:
    now = dt.datetime.now(dt.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, name: str, cert: x509.Certificate, key=None) -> tuple[Path, Path | None]:
    cert_path = directory / f"{name}.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is None:
        return cert_path, None
    key_path = directory / f"{name}.key"
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("pki")
    files: dict[str, Path] = {}
    for ca_name in ("ca", "rogue_ca"):
        ca_key = _key()
        ca_cert = _cert(ca_name, ca_key, _name(ca_name), ca_key, ca=True)
        files[ca_name], _ = _write(directory, ca_name, ca_cert)
        leaves = {"server": [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")], "client": []}
        for leaf, sans in leaves.items():
            key = _key()
            name = leaf if ca_name == "ca" else f"rogue_{leaf}"
            files[f"{name}_cert"], files[f"{name}_key"] = _write(directory, name, _cert(name, key, _name(ca_name), ca_key, sans=sans), key)
    files["token"] = directory / "token"
    files["token"].write_text(TOKEN + "\n")
    return files


def _serve(pki, *, tls: bool = True, client_ca: bool = False, token: bool = False) -> tuple[FakeApi, ServerThread]:
    security = ServerSecurity.of(
        pki["server_cert"] if tls else None,
        pki["server_key"] if tls else None,
        pki["ca"] if client_ca else None,
        pki["token"] if token else None,
    )
    api = FakeApi()
    return api, ServerThread(api, security)


def test_the_controller_api_over_tls(pki):
    api, server = _serve(pki)
    try:
        with Client.connect(server.address, tls_ca=pki["ca"], timeout=10) as client:
            client.create_instance("secure")
            assert [v.name for v in client.list_instances()] == ["secure"]
        with pytest.raises(TandemError) as plaintext:  # the server closes a plaintext connection
            Client.connect(server.address, timeout=1)
        assert plaintext.value.code == grpc.StatusCode.UNAVAILABLE and "Socket closed" in plaintext.value.message
        with pytest.raises(TandemError) as distrusted:  # nor one that trusts another CA
            Client.connect(server.address, tls_ca=pki["rogue_ca"], timeout=1)
        assert distrusted.value.code == grpc.StatusCode.UNAVAILABLE and "CERTIFICATE_VERIFY_FAILED" in distrusted.value.message
    finally:
        server.close()


def test_with_a_client_ca_only_its_client_certificates_get_in(pki):
    api, server = _serve(pki, client_ca=True)
    try:
        for identity in ({}, {"tls_cert": pki["rogue_client_cert"], "tls_key": pki["rogue_client_key"]}):
            with pytest.raises(TandemError) as refused:  # the server closes the connection
                Client.connect(server.address, tls_ca=pki["ca"], timeout=1, **identity)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE and "Socket closed" in refused.value.message
        with Client.connect(server.address, tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"], timeout=10) as client:
            client.create_source("s", "id BIGINT")
        assert [c[0] for c in api.calls if c[0] == "create_source"] == ["create_source"]
    finally:
        server.close()


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_a_token_is_required_on_every_call_and_a_refusal_changes_nothing(pki, tls):
    api, server = _serve(pki, tls=tls, token=True)
    ca = {"tls_ca": pki["ca"]} if tls else {}
    try:
        for token, problem in ((None, "a bearer token is required"), ("wrong", "the bearer token is wrong")):
            client = Client(server.address, token=token, **ca)
            with pytest.raises(TandemError) as refused:
                client.create_source("s", "id BIGINT")
            assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED and problem in refused.value.message
            client.close()
        assert not [c for c in api.calls if c[0] == "create_source"]  # no handler ran
        with Client.connect(server.address, token=TOKEN, timeout=10, **ca) as client:
            client.create_source("s", "id BIGINT")
            assert [s.name for s in client.list_sources()] == ["s"]
    finally:
        server.close()


def test_the_cli_takes_its_token_from_a_file_or_the_environment(pki, monkeypatch, capsys):
    api, server = _serve(pki, tls=False, token=True)
    try:
        assert main(["source", "list", "--address", server.address]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert main(["source", "list", "--address", server.address, "--token-file", str(pki["token"])]) == 0
        monkeypatch.setenv("TANDEM_TOKEN", TOKEN)
        assert main(["source", "list", "--address", server.address]) == 0
        monkeypatch.setenv("TANDEM_TOKEN", "wrong")
        assert main(["source", "list", "--address", server.address]) == 1
        assert "the bearer token is wrong" in capsys.readouterr().err
    finally:
        server.close()


async def _hello(address: str, security: ServerSecurity) -> str:
    """Connect to the replica at `address` as the controller does; what happened."""
    outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def resolve(attempt: int) -> str:
        if attempt > 2 and not outcome.done():
            outcome.set_result("unreachable")
        return address

    connection = ReplicaConnection(
        replica="r",
        epoch=1,
        controller_epoch=1,
        resume=None,
        failures=0,
        resolve_address=resolve,
        on_connected=lambda nonce, ack: outcome.done() or outcome.set_result("connected"),
        on_response=lambda response: None,
        on_failure=lambda reason: outcome.done() or outcome.set_result(f"failed: {reason}"),
        security=security,
    )
    connection.start()
    try:
        return await asyncio.wait_for(outcome, 60)
    finally:
        connection.close()


def test_the_security_flags_are_checked_before_anything_starts(pki, tmp_path):
    with pytest.raises(ValueError, match="needs --tls-cert"):
        ServerSecurity.of(None, None, pki["ca"], None)
    with pytest.raises(ValueError, match="give both or neither"):
        ServerSecurity.of(pki["server_cert"], None, None, None)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        ServerSecurity.of(None, None, None, empty)
    assert ServerSecurity.of(pki["server_cert"], pki["server_key"], pki["ca"], pki["token"]).argv() == [
        "--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"]),
        "--tls-client-ca", str(pki["ca"]), "--auth-token-file", str(pki["token"]),
    ]


def test_a_secured_controller_secures_the_replicas_it_spawns(pki, tmp_path):
    """One set of flags: `tandem serve` with TLS, client certificates and a token; its
    managed replica is started with the same, the controller reaches it with its
    certificate and token, and a dataflow answers through the whole chain. Nobody else
    gets in: not plaintext, not a certificate of another CA, and not a controller with
    the right certificate but no token, whose status shows the replica failed; the
    secured controller's dataflow answers on."""
    tls_flags = ["--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"]), "--tls-client-ca", str(pki["ca"])]
    secured = ControllerProcess(tmp_path / "secured", serve_args=[*tls_flags, "--auth-token-file", str(pki["token"])])
    tokenless = None
    identity = {"tls_ca": pki["ca"], "tls_cert": pki["client_cert"], "tls_key": pki["client_key"]}
    try:
        with pytest.raises(TandemError) as no_token:
            Client.connect(secured.address, timeout=3, **identity)
        assert no_token.value.code == grpc.StatusCode.UNAUTHENTICATED
        with Client.connect(secured.address, token=TOKEN, timeout=30, **identity) as client:
            client.create_instance("sec")
            client.add_replica("sec", "r1", size="xsmall")
            client.create_source("s", "id BIGINT NOT NULL")
            client.append("s", [{"id": 1}, {"id": 2}])
            client.create_dataflow("sec", "everything", "select id from s", index_key=["id"])
            assert client.peek("sec", "everything", key=2, consistency="strict", timeout_ms=180_000).rows == [{"id": 2}]
            (replica,) = client.status("sec")[0].replicas
        rogue = Tls(pki["rogue_client_cert"], pki["rogue_client_key"], pki["ca"])
        # The replica lives (it answers below); these never get a stream to it.
        assert asyncio.run(_hello(replica.address, ServerSecurity(rogue, pki["token"], TOKEN))) == "unreachable"
        assert asyncio.run(_hello(replica.address, ServerSecurity())) == "unreachable"  # plaintext

        tokenless = ControllerProcess(tmp_path / "tokenless", serve_args=tls_flags)
        with Client.connect(tokenless.address, timeout=30, **identity) as client:
            client.create_instance("other")
            client.add_replica("other", "theirs", address=replica.address)
            # It retries with backoff; each attempt is refused. Now and then gRPC's core
            # reports a refused stream as INTERNAL ("Internal error from Core") instead,
            # so the test waits for an attempt that says why.
            deadline = time.monotonic() + 90
            while "UNAUTHENTICATED" not in ((theirs := client.status("other")[0].replicas[0]).last_failure or "") and time.monotonic() < deadline:
                assert theirs.state != "active", theirs
                time.sleep(0.2)
        assert theirs.state != "active" and "UNAUTHENTICATED" in (theirs.last_failure or ""), theirs

        with Client.connect(secured.address, token=TOKEN, timeout=30, **identity) as client:
            client.append("s", [{"id": 3}])
            assert client.peek("sec", "everything", key=3, consistency="strict", timeout_ms=60_000).rows == [{"id": 3}]
    finally:
        for controller in (secured, tokenless):
            if controller is not None:
                controller.stop()
        kill_replicas(tmp_path / "secured")
