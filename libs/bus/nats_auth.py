"""How a service proves itself to NATS and checks the server: user/password, an nkey, TLS with a CA.

Every service's Config inherits ``NatsConfig`` (its URL and these credentials), so one set of flags
and ``DEEPINFER_NATS_*`` variables serves every process, and ``deepinfer serve`` hands them to all
of its children (and configures its embedded nats-server with them, deepinfer/serve.py).

- ``--nats-user`` / ``--nats-password`` (prefer ``DEEPINFER_NATS_PASSWORD``: a flag shows in ps);
- ``--nats-nkey-seed-file``: a file holding a user nkey seed (``SU...``); the server knows the
  public key (``nkey_public_key``);
- ``--nats-tls-ca-file``: verify the server's certificate against this CA (the URL may stay
  ``nats://``: the client upgrades when the server requires TLS); ``--nats-tls-cert-file`` and
  ``--nats-tls-key-file``: a client certificate, for servers that verify clients.

Decentralized JWT credentials (``.creds`` files made by ``nsc``) are not offered: ``nsc`` is not
available to build or test them here.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NATS_URL_DEFAULT = "nats://127.0.0.1:4222"


@dataclass(frozen=True, slots=True)
class NatsConfig:
    """The fields every service's Config shares for its NATS connection."""

    nats_url: str = field(default=NATS_URL_DEFAULT, metadata={"help": "NATS server URL"})
    nats_user: str = field(default="", metadata={"help": "NATS user name ('' = no user/password)"})
    nats_password: str = field(
        default="",
        # secret: handed to child processes in their environment, never as a flag (ps shows flags)
        metadata={"help": "NATS password (set it as DEEPINFER_NATS_PASSWORD, not as a flag)", "secret": True},
    )
    nats_nkey_seed_file: str = field(
        default="", metadata={"help": "file holding this service's NATS user nkey seed (SU...)"}
    )
    nats_tls_ca_file: str = field(
        default="", metadata={"help": "CA certificate that signed the NATS server's (turns TLS on)"}
    )
    nats_tls_cert_file: str = field(default="", metadata={"help": "NATS client certificate (mutual TLS)"})
    nats_tls_key_file: str = field(default="", metadata={"help": "key of --nats-tls-cert-file"})

    def __post_init__(self) -> None:
        self.nats_auth.check()

    @property
    def nats_auth(self) -> NatsAuth:
        return NatsAuth(
            self.nats_user,
            self.nats_password,
            self.nats_nkey_seed_file,
            self.nats_tls_ca_file,
            self.nats_tls_cert_file,
            self.nats_tls_key_file,
        )


@dataclass(frozen=True, slots=True)
class NatsAuth:
    user: str = ""
    password: str = ""
    nkey_seed_file: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""

    def check(self) -> None:
        """ValueError for a combination that cannot work (found at start, not at the first connect)."""
        if self.password and not self.user:
            raise ValueError("nats_password needs nats_user")
        if self.password.startswith("$2"):
            raise ValueError("nats_password must not start with '$2': nats-server reads it as a bcrypt hash")
        if self.user and self.nkey_seed_file:
            raise ValueError("give nats_user/nats_password or nats_nkey_seed_file, not both")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("nats_tls_cert_file and nats_tls_key_file go together")
        if self.tls_cert_file and not self.tls_ca_file:
            raise ValueError("a NATS client certificate needs nats_tls_ca_file (the server's CA)")
        for name in ("nkey_seed_file", "tls_ca_file", "tls_cert_file", "tls_key_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"nats_{name}: no such file {path!r}")

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``."""
        options: dict[str, Any] = {}
        if self.user:
            options |= {"user": self.user, "password": self.password}
        if self.nkey_seed_file:
            options["nkeys_seed"] = self.nkey_seed_file
        if self.tls_ca_file:
            context = ssl.create_default_context(cafile=self.tls_ca_file)
            if self.tls_cert_file:
                context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
            options["tls"] = context
        return options


def nkey_public_key(seed_file: str) -> str:
    """The public key (``U...``) of the user nkey seed in ``seed_file``: what the server lists."""
    import nkeys  # the nkeys package (nats-py's own dependency for nkey auth)

    seed = bytearray(Path(seed_file).read_bytes().strip())
    return str(nkeys.from_seed(seed).public_key.decode())
