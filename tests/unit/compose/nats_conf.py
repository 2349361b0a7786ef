"""Reading nats-server's config syntax: sizes, and a small subset of the config file, flattened.

Shared with the k8s checks, whose ConfigMap holds a nats.conf too; no checks here.
"""

from __future__ import annotations

import re

_SIZE_UNITS = {"": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2, "g": 1000**3, "gb": 1024**3}


def parse_size(text: str) -> int:
    """A nats-server size (``8MB`` = 8 MiB, ``8M`` = 8e6, plain bytes)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a nats size: {text!r}")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]


_NATS_BARE_VALUE = re.compile(r"[^\s,;}\]]+")
_NATS_QUOTED_VALUE = re.compile(r"\"([^\"]*)\"|'([^']*)'")
_NATS_ITEM_SEPARATOR = re.compile(r"[\s,;]*")


def _nats_value(text: str, pos: int, where: str) -> tuple[str, int]:
    """The scalar or ``[...]`` array at ``pos``: an array's items are joined by ``,``."""
    if text.startswith("[", pos):
        items: list[str] = []
        pos += 1
        while True:
            separator = _NATS_ITEM_SEPARATOR.match(text, pos)
            pos = separator.end() if separator else pos
            if pos >= len(text):
                raise ValueError(f"unclosed array in nats config at {where!r}")
            if text[pos] == "]":
                return ",".join(items), pos + 1
            if text[pos] in "[{":
                raise ValueError(f"nested arrays and maps are not read here: {where!r}")
            item, pos = _nats_value(text, pos, where)
            items.append(item)
    m = _NATS_QUOTED_VALUE.match(text, pos) or _NATS_BARE_VALUE.match(text, pos)
    if m is None:
        raise ValueError(f"no value for {where!r} in nats config")
    return next((g for g in m.groups() if g is not None), m.group(0)), m.end()


def parse_nats_conf(text: str) -> dict[str, str]:
    """A small subset of the nats config syntax, flattened: ``{"port": "4222", "jetstream": "{}",
    "jetstream.store_dir": "/data", "cluster.routes": "nats://a:6222,nats://b:6222"}``. Enough for
    the keys checked here (and the k8s manifests' config, whose cluster routes are an array)."""
    body = "\n".join(re.sub(r"(^|\s)(#|//).*", "", line) for line in text.splitlines())
    out: dict[str, str] = {}
    stack: list[str] = []
    key_re = re.compile(r"([A-Za-z_][\w.-]*)\s*[:=]?\s*")
    pos = 0
    while pos < len(body):
        if body[pos].isspace() or body[pos] in ",;":
            pos += 1
            continue
        if body[pos] == "}":
            if stack:
                stack.pop()
            pos += 1
            continue
        m = key_re.match(body, pos)
        if m is None:
            line = body[pos:].split("\n", 1)[0]
            raise ValueError(f"cannot parse nats config line: {line!r}")
        key = ".".join([*stack, m.group(1)])
        pos = m.end()
        if body.startswith("{", pos):
            out[key] = "{}"
            stack.append(m.group(1))
            pos += 1
            continue
        out[key], pos = _nats_value(body, pos, key)
    return out
