"""What a run's tokens would earn at a price list, per device-hour, and the margin over renting the
devices.

Device time is the run's wall time (``duration``) times the number of devices serving: the bench
sees only the client side, so a device idle during the run is paid for all the same.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

DEVICE_TIME_NOTE = (
    "Device time is the bench's wall time per run x the number of devices (--num-devices): "
    "every device is counted busy, and paid for, for the whole run."
)
CACHE_HIT_DISCOUNT = 50  # a cache-hit input token sells at 1/50 of an uncached one by default


@dataclass(frozen=True, slots=True)
class Prices:
    """USD per million tokens, and the rental price of one device for an hour."""

    input_per_m: float = 0.28  # uncached input
    cached_input_per_m: float = 0.28 / CACHE_HIT_DISCOUNT
    output_per_m: float = 0.42
    rental_per_device_hour: float = 7.0
    num_devices: int = 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def economics(run: dict[str, Any], prices: Prices) -> dict[str, float | None]:
    """Revenue, revenue per device-hour and gross margin of one run (``metrics.summarize``'s dict:
    its completed requests' tokens and its duration). Input tokens the server reported as cached
    sell at the cache-hit price; a server that reports none has every input token uncached."""
    cached = int(run["total_cached_input_tokens"])
    uncached = int(run["total_input_tokens"]) - cached
    output = int(run["total_output_tokens"])
    revenue = (
        uncached * prices.input_per_m + cached * prices.cached_input_per_m + output * prices.output_per_m
    ) / 1e6
    device_hours = float(run["duration"]) * prices.num_devices / 3600.0
    rental = device_hours * prices.rental_per_device_hour
    return {
        "uncached_input_tokens": uncached,
        "cached_input_tokens": cached,
        "output_tokens": output,
        "revenue_usd": revenue,
        "device_hours": device_hours,
        "revenue_per_device_hour": revenue / device_hours if device_hours > 0 else None,
        "rental_usd": rental,
        "gross_margin_usd": revenue - rental,
        "gross_margin_per_device_hour": (revenue - rental) / device_hours if device_hours > 0 else None,
        "gross_margin_pct": 100.0 * (revenue - rental) / revenue if revenue > 0 else None,
    }
