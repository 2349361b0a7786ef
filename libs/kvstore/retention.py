"""Retention classes of stored KV blocks: how long each class is kept and who goes first under pressure.

A request names a class (``agent`` by default, ``chat``, or one an operator configures); every block
it stores or reuses gets ``expires_at = now + ttl`` of that class. Priority is soft, never pinning:
under pressure the victims are, in order,

    1. expired blocks (they hold space on no claim),
    2. then blocks of the lowest-priority class,
    3. and within a class the least recently used,

so a high class is still evicted when nothing else is left. ``eviction_key`` states that order once;
the index implements it with heaps, and the tests check the index against it.

Times are unix seconds passed in by the caller (``now``): nothing here reads a clock.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

SECONDS_PER_DAY: Final = 86_400.0
_NAME: Final = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_UNITS: Final = {"s": 1.0, "m": 60.0, "h": 3_600.0, "d": SECONDS_PER_DAY}


@dataclass(frozen=True, slots=True)
class RetentionClass:
    name: str
    ttl_s: float  # a block unused this long expires
    priority: int  # under pressure a lower priority is evicted first

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"retention class name {self.name!r} must match {_NAME.pattern}")
        if not self.ttl_s > 0:
            raise ValueError(f"retention class {self.name!r}: ttl_s={self.ttl_s} must be > 0")

    def expires_at(self, now: float) -> float:
        return now + self.ttl_s


# NOTE: chat ranks above agent by default only because it is promised longer; an operator whose
# agent prefixes are worth more swaps the priorities in the config.
DEFAULT_RETENTION_CLASSES: Final = (
    RetentionClass("agent", 3 * SECONDS_PER_DAY, priority=0),
    RetentionClass("chat", 7 * SECONDS_PER_DAY, priority=1),
)
DEFAULT_RETENTION_CLASS: Final = "agent"
# The same defaults as a config string: the gateway, worker and kvcache configs share these flags.
DEFAULT_RETENTION_SPEC: Final = "agent=3d:0,chat=7d:1"


class UnknownRetentionClass(ValueError):
    """A request or a config named a class the policy does not define (a 400 at the gateway)."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = tuple(sorted(known))
        super().__init__(f"unknown retention class {name!r}; known: {', '.join(self.known)}")


def expires_at(retention_class: RetentionClass, now: float) -> float:
    return retention_class.expires_at(now)


def eviction_key(expires_at: float, priority: int, last_use: float, now: float) -> tuple[bool, int, float]:
    """Sort key of eviction victims, smallest first: expired, then low priority, then old last use."""
    return (expires_at > now, priority, last_use)


class RetentionPolicy:
    """The configured classes and the default one; immutable once built."""

    def __init__(
        self,
        classes: Iterable[RetentionClass] = DEFAULT_RETENTION_CLASSES,
        default: str = DEFAULT_RETENTION_CLASS,
    ) -> None:
        by_name: dict[str, RetentionClass] = {}
        for c in classes:
            if c.name in by_name:
                raise ValueError(f"retention class {c.name!r} is defined twice")
            by_name[c.name] = c
        if default not in by_name:
            raise UnknownRetentionClass(default, by_name)
        self._classes = by_name
        self.default = by_name[default]

    @property
    def classes(self) -> Mapping[str, RetentionClass]:
        return dict(self._classes)

    def get(self, name: str) -> RetentionClass:
        try:
            return self._classes[name]
        except KeyError:
            raise UnknownRetentionClass(name, self._classes) from None

    def parse(self, value: str | None) -> RetentionClass:
        """The class a request asks for: None or blank means the default; case and surrounding
        spaces are ignored; an unknown name raises ``UnknownRetentionClass``."""
        if value is None or not value.strip():
            return self.default
        return self.get(value.strip().lower())

    def stronger(self, a: RetentionClass, b: RetentionClass) -> RetentionClass:
        """The class a block keeps when two requests claim it: the higher priority (``a`` on a tie)."""
        return b if b.priority > a.priority else a


def parse_ttl(text: str) -> float:
    """``"90s"``, ``"30m"``, ``"12h"``, ``"3d"`` or plain seconds -> seconds."""
    text = text.strip().lower()
    unit = _UNITS.get(text[-1:], None)
    number = text[:-1] if unit is not None else text
    try:
        value = float(number) * (unit or 1.0)
    except ValueError:
        raise ValueError(f"bad ttl {text!r}: want a number with an optional s/m/h/d unit") from None
    if not value > 0:
        raise ValueError(f"bad ttl {text!r}: must be > 0")
    return value


def parse_retention_classes(spec: str) -> tuple[RetentionClass, ...]:
    """Classes from a config string: ``"agent=3d:0,chat=7d:1"`` (``name=ttl[:priority]``, priority
    0 when left out). Errors name the bad item."""
    classes: list[RetentionClass] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, rest = item.partition("=")
        if not sep:
            raise ValueError(f"bad retention class {item!r}: want name=ttl[:priority]")
        ttl, _, priority = rest.partition(":")
        try:
            classes.append(RetentionClass(name.strip().lower(), parse_ttl(ttl), int(priority or 0)))
        except ValueError as e:
            raise ValueError(f"bad retention class {item!r}: {e}") from None
    if not classes:
        raise ValueError("no retention classes given")
    return tuple(classes)


def policy_from_config(retention_classes: str, default_retention_class: str) -> RetentionPolicy:
    """The policy a service's ``retention_classes`` / ``default_retention_class`` config values
    describe; a ValueError names the key at fault (services build it in ``__post_init__``)."""
    try:
        classes = parse_retention_classes(retention_classes)
    except ValueError as e:
        raise ValueError(f"retention_classes={retention_classes!r}: {e}") from None
    try:
        return RetentionPolicy(classes, default_retention_class)
    except UnknownRetentionClass as e:
        raise ValueError(f"default_retention_class={default_retention_class!r}: {e}") from None
    except ValueError as e:  # a class defined twice
        raise ValueError(f"retention_classes={retention_classes!r}: {e}") from None
