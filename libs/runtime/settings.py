"""Build a service's frozen Config from CLI flags and ``DEEPINFER_*`` environment variables.

Each Config field becomes ``--field-name`` (help from ``field(metadata={"help": ...})``) whose default
is ``$DEEPINFER_FIELD_NAME`` when set, else the dataclass default. Precedence: flag > env > default.
Values are converted by the field's type; a bad value names its key. Only ``main()`` calls this.
The paths that several services read from one flag (cache dir, G3 store) are resolved here too, so
that they read it alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "DEEPINFER_"
KV_STORE_OFF = "none"  # the kv_store_path that turns G3 off (any case)
KV_STORE_DIR_NAME = "kv-store"  # under the cache dir when kv_store_path is not set
MEDIA_DIR_NAME = "media"  # under the cache dir when media_path is not set


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _caster(tp: Any) -> Any:
    return _parse_bool if tp is bool else tp


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: frozenset[str] = frozenset()) -> None:
    """Add one flag per field of ``cls`` (fields already added or in ``skip`` are left out)."""
    hints = typing.get_type_hints(cls)
    existing = {a.dest for a in parser._actions}
    for f in dataclasses.fields(cls):
        if f.name in skip or f.name in existing:
            continue
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
        parser.add_argument(
            flag_name(f.name),
            dest=f.name,
            type=_caster(hints[f.name]),
            default=None,
            help=f"{help_text} [env {env_name(f.name)}]",
        )


def build_config(cls: type[T], args: argparse.Namespace, env: Mapping[str, str]) -> T:
    """Resolve every field (flag > env > default) and construct the frozen Config."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        flag_value = getattr(args, f.name, None)
        if flag_value is not None:
            values[f.name] = flag_value
        elif env_name(f.name) in env:
            raw = env[env_name(f.name)]
            try:
                values[f.name] = _caster(hints[f.name])(raw)
            except ValueError as exc:
                raise ValueError(f"{env_name(f.name)}={raw!r}: {exc}") from exc
    return cls(**values)


def to_argv(config: object, names: frozenset[str] | None = None) -> list[str]:
    """Flags that rebuild ``config`` (or the named fields of it) in a child process, but for its
    secrets (fields marked ``"secret"``): ``secret_env`` hands those over, out of ps's sight."""
    argv: list[str] = []
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        if (names is not None and f.name not in names) or f.metadata.get("secret"):
            continue
        argv += [flag_name(f.name), str(getattr(config, f.name))]
    return argv


def secret_env(config: object) -> dict[str, str]:
    """The environment that carries ``config``'s secrets to a child process (set ones only)."""
    return {
        env_name(f.name): str(getattr(config, f.name))
        for f in dataclasses.fields(config)  # type: ignore[arg-type]
        if f.metadata.get("secret") and getattr(config, f.name)
    }


def resolve_cache_dir(configured: str, env: Mapping[str, str]) -> str:
    """``configured`` if set, else ``$XDG_CACHE_HOME/deepinfer`` (``~/.cache/deepinfer``)."""
    if configured:
        return configured
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME", ".")) / ".cache")
    return str(Path(base) / "deepinfer")


def kv_store_root(kv_store_path: str, cache_dir: str) -> Path | None:
    """The G3 store directory ``kv_store_path`` names, given the resolved ``cache_dir``: "" ->
    ``<cache_dir>/kv-store``; "none" -> None (G3 off); "~" expanded. The worker (which writes the
    store) and kvcache (which indexes and trims it) both read the shared flag through this."""
    if kv_store_path.strip().lower() == KV_STORE_OFF:
        return None
    return Path(kv_store_path).expanduser() if kv_store_path else Path(cache_dir) / KV_STORE_DIR_NAME


def media_root(media_path: str, cache_dir: str) -> Path:
    """The media store directory (images and encoder outputs, ``libs/kvstore/media_store.py``):
    "" -> ``<cache_dir>/media``. Gateways, encoders and workers read the shared flag through this;
    on several hosts it is a directory all of them mount, as the G3 store is."""
    return Path(media_path).expanduser() if media_path else Path(cache_dir) / MEDIA_DIR_NAME
