"""Serving economics from what was served: revenue at a price list, device time, revenue per
device-hour and gross margin at a rental price. Pure.

Revenue counts the tokens of the generations that ended, as their usage reported them, at the
price list (per million tokens; DeepSeek's list by default: $0.28 uncached input, a cache hit at
1/50 of that, $0.42 output). Device time is the wall time workers were live, by device kind: what
a rental is paid for, busy or idle (``DeviceClock``, fed by every read of the members bucket).

    revenue per device-hour = revenue / (device seconds / 3600)
    gross margin            = 1 - rental per device-hour / revenue per device-hour

Each gateway counts the revenue of the requests it served and the device time of the whole
fleet it sees: with several gateways, sum their revenue and take one gateway's device time
(docs/economics.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

MILLION: Final = 1e6
SECONDS_PER_HOUR: Final = 3600.0
TOKEN_KINDS: Final = ("input_uncached", "input_cached", "output")


@dataclass(frozen=True, slots=True)
class PriceList:
    """Dollars per million tokens by kind, and the rental of one device for an hour."""

    input_per_million: float = 0.28
    cached_input_per_million: float = 0.28 / 50
    output_per_million: float = 0.42
    rental_per_device_hour: float = 7.0

    def __post_init__(self) -> None:
        for name in ("input_per_million", "cached_input_per_million", "output_per_million"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"price {name} must be >= 0, got {getattr(self, name)}")
        if not self.rental_per_device_hour >= 0:
            raise ValueError(f"rental_per_device_hour must be >= 0, got {self.rental_per_device_hour}")

    def per_token(self, kind: str) -> float:
        per_million = {
            "input_uncached": self.input_per_million,
            "input_cached": self.cached_input_per_million,
            "output": self.output_per_million,
        }[kind]
        return per_million / MILLION


@dataclass(slots=True)
class TokenLedger:
    """Tokens served, by kind (``TOKEN_KINDS``)."""

    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOKEN_KINDS, 0))

    @staticmethod
    def split(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> tuple[tuple[str, int], ...]:
        """A usage's tokens by kind."""
        return (
            ("input_uncached", prompt_tokens - cached_tokens),
            ("input_cached", cached_tokens),
            ("output", output_tokens),
        )

    def add(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> None:
        for kind, count in self.split(prompt_tokens, cached_tokens, output_tokens):
            self.tokens[kind] += count

    def revenue(self, prices: PriceList) -> dict[str, float]:
        """Dollars by kind."""
        return {kind: count * prices.per_token(kind) for kind, count in self.tokens.items()}

    def check_integrity(self) -> None:
        assert set(self.tokens) == set(TOKEN_KINDS) and min(self.tokens.values()) >= 0


@dataclass(slots=True)
class DeviceClock:
    """Seconds workers were live, by device kind, from successive views of the live workers: the
    time between two views counts for the workers live at the first (a worker that stops is
    counted up to the view that no longer has it; one that starts, from the view that first has
    it). Views come about once a second (every member heartbeat is a read)."""

    seconds: dict[str, float] = field(default_factory=dict)  # device kind -> seconds
    _last_at: float | None = None
    _last_live: dict[str, str] = field(default_factory=dict)  # worker id -> device kind

    def observe(self, now: float, live: Mapping[str, str] | None) -> None:
        """The live workers (id -> device kind) at ``now``; None: the view is not current (cut off
        from the bus), and the time until the next current view counts for nobody."""
        if self._last_at is not None and now > self._last_at:
            for device in self._last_live.values():
                self.seconds[device] = self.seconds.get(device, 0.0) + (now - self._last_at)
        self._last_at = max(now, self._last_at or now)
        self._last_live = dict(live or {})

    @property
    def live(self) -> Mapping[str, str]:
        return self._last_live

    def check_integrity(self) -> None:
        assert all(s >= 0 for s in self.seconds.values())


def revenue_per_device_hour(revenue: float, device_seconds: float) -> float | None:
    """None before any device time was counted."""
    return revenue / (device_seconds / SECONDS_PER_HOUR) if device_seconds > 0 else None


def gross_margin(revenue_per_hour: float | None, rental_per_hour: float) -> float | None:
    """(revenue - rental) / revenue per device-hour; None without revenue."""
    if not revenue_per_hour:
        return None
    return 1.0 - rental_per_hour / revenue_per_hour
