"""NATS credentials against a real nats-server started with them: user/password, an nkey, TLS with
a CA (made here with ``cryptography``); a client with the wrong or no credentials is refused, and
the settings' checks and the child-process handover keep the password out of argv."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
from collections.abc import Iterator
from pathlib import Path

import nats
import nkeys
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from libs.bus.nats_auth import NatsAuth
from libs.bus.nats_bus import NatsBus
from libs.bus.nats_server import EmbeddedNatsServer
from libs.runtime.settings import secret_env, to_argv
from services.gateway.config import Config as GatewayConfig
from services.worker.config import Config as WorkerConfig

CONNECT_S = 10.0


async def round_trip(url: str, auth: NatsAuth) -> bytes:
    """Connect with ``auth``, answer one request on a subject and return the answer."""
    bus = await asyncio.wait_for(NatsBus.connect(url, name="auth-test", auth=auth), CONNECT_S)
    try:

        async def echo(msg: object) -> None:
            await bus.respond(msg, b"pong")  # type: ignore[arg-type]

        await bus.subscribe("auth.ping", echo)
        return await bus.request("auth.ping", b"ping", 5.0)
    finally:
        await bus.close()


async def refused(url: str, **options: object) -> bool:
    """Whether a one-shot plain nats-py client is refused (no reconnect loop to wait out)."""
    try:
        nc = await asyncio.wait_for(
            nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3, **options),  # type: ignore[arg-type]
            CONNECT_S,
        )
    except Exception:
        return True
    await nc.close()
    return False


def test_user_and_password() -> None:
    auth = NatsAuth(user="svc", password='p"w\\ördé')  # quoted into the server's config as written
    with EmbeddedNatsServer(auth=auth) as server:
        assert asyncio.run(round_trip(server.url, auth)) == b"pong"
        assert asyncio.run(refused(server.url))
        assert asyncio.run(refused(server.url, user="svc", password="wrong"))
        assert not asyncio.run(refused(server.url, **auth.connect_options()))  # the probe can pass


def test_nkey(tmp_path: Path) -> None:
    seeds = []
    for name in ("ours", "other"):
        seed = tmp_path / f"{name}.nk"
        seed.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
        seeds.append(str(seed))
    with EmbeddedNatsServer(auth=NatsAuth(nkey_seed_file=seeds[0])) as server:
        assert asyncio.run(round_trip(server.url, NatsAuth(nkey_seed_file=seeds[0]))) == b"pong"
        assert asyncio.run(refused(server.url, nkeys_seed=seeds[1]))
        assert asyncio.run(refused(server.url))


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate | None,
          issuer_key: ec.EllipticCurvePrivateKey | None) -> x509.Certificate:  # fmt: skip
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if issuer is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    else:
        san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        builder = builder.add_extension(san, critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def write_pki(tmp: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it: (ca, cert, key) files."""
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert(f"{name} test CA", ca_key, None, None)
    server = _cert("127.0.0.1", server_key, ca, ca_key)
    files = tmp / f"{name}-ca.pem", tmp / f"{name}-server.pem", tmp / f"{name}-server.key"
    files[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    files[2].write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return files


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[EmbeddedNatsServer, Path, Path]]:
    ca, cert, key = write_pki(tmp_path, "ours")
    other_ca, _, _ = write_pki(tmp_path, "other")
    tls = f'tls {{ cert_file: "{cert}", key_file: "{key}" }}\n'
    with EmbeddedNatsServer(auth=NatsAuth(user="svc", password="pw"), extra_conf=tls) as server:
        yield server, ca, other_ca


def test_tls_with_a_ca(tls_server: tuple[EmbeddedNatsServer, Path, Path]) -> None:
    server, ca, other_ca = tls_server
    auth = NatsAuth(user="svc", password="pw", tls_ca_file=str(ca))
    assert asyncio.run(round_trip(server.url, auth)) == b"pong"  # nats:// upgraded to TLS
    assert asyncio.run(refused(server.url, user="svc", password="pw"))  # no TLS: the server requires it
    wrong = NatsAuth(user="svc", password="pw", tls_ca_file=str(other_ca)).connect_options()
    assert asyncio.run(refused(server.url, **wrong))  # a server this CA did not sign


def test_settings_refuse_what_cannot_work(tmp_path: Path) -> None:
    for fields, says in (
        ({"nats_password": "pw"}, "needs nats_user"),
        ({"nats_user": "u", "nats_password": "$2a$11$abc"}, "bcrypt"),
        ({"nats_user": "u", "nats_nkey_seed_file": __file__}, "not both"),
        ({"nats_tls_cert_file": __file__}, "go together"),
        ({"nats_tls_cert_file": __file__, "nats_tls_key_file": __file__}, "needs nats_tls_ca_file"),
        ({"nats_tls_ca_file": str(tmp_path / "missing.pem")}, "no such file"),
    ):
        with pytest.raises(ValueError, match=says):
            GatewayConfig(**fields)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=says):
            WorkerConfig(**fields)  # type: ignore[arg-type]


def test_a_password_goes_to_a_child_in_its_environment_not_its_argv() -> None:
    config = GatewayConfig(nats_user="svc", nats_password="s3cret")
    argv = to_argv(config)
    assert "s3cret" not in argv and "--nats-password" not in argv
    assert argv[argv.index("--nats-user") + 1] == "svc"
    assert secret_env(config) == {"DEEPINFER_NATS_PASSWORD": "s3cret"}
    assert secret_env(GatewayConfig()) == {}
