"""``deepinfer api-key``: mint an API key and add its entry (its SHA-256, never the key) to a keys
file, which the gateway reads with ``--api-keys-file`` and reloads on SIGHUP. The key is printed
once, on stdout; nothing keeps it."""

from __future__ import annotations

import argparse
import fcntl
import os
import sys
import tempfile
from pathlib import Path

from services.gateway.api_keys import ApiKey, dump_keys, hash_key, new_key, parse_entry, parse_keys


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--file", required=True, help="the keys file (created, mode 0600, if absent)")
    parser.add_argument("--tenant", required=True, help="whose KV cache and usage the key's requests are")
    parser.add_argument("--requests-per-minute", type=int, default=0, help="the key's rate limit (0: none)")
    parser.add_argument("--priority", type=int, default=0, help="lower runs first among waiting requests")
    share = "the tenant's share of admissions when tenants wait together"
    parser.add_argument("--weight", type=float, default=1.0, help=share)
    parser.add_argument("--name", default="", help="how logs name the key (default: its hash's start)")


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` at once (a reload never reads half a file), keeping an existing
    file's mode (its readers may be a group); a new file is 0600."""
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o600
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(args: argparse.Namespace) -> None:
    path = Path(args.file)
    # Two mints at once must not lose an entry: the read-modify-replace runs under a lock file.
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _add_key(args, path)


def _add_key(args: argparse.Namespace, path: Path) -> None:
    keys = parse_keys(path.read_text(), str(path)) if path.exists() else ()
    key = new_key()
    entry = {"sha256": hash_key(key), "tenant": args.tenant, "requests_per_minute": args.requests_per_minute}
    entry |= {"priority": args.priority, "weight": args.weight} | ({"name": args.name} if args.name else {})
    added: ApiKey = parse_entry(entry, "the new key")  # the same checks as the gateway's (ValueError)
    write_atomically(path, dump_keys([*keys, added]))
    print(key)
    print(
        f"added key {added.label} for tenant {added.tenant!r} to {path}; the gateway reads it on "
        "start or SIGHUP. The key is shown only now.",
        file=sys.stderr,
    )
