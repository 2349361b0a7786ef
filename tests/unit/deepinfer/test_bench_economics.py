"""deepinfer bench's economics: revenue at the price list, per device-hour, and the gross margin."""

from __future__ import annotations

import pytest

from deepinfer.bench.economics import Prices, economics


def run(input_tokens: int, cached: int, output: int, duration_s: float) -> dict[str, float]:
    return {
        "total_input_tokens": input_tokens,
        "total_cached_input_tokens": cached,
        "total_output_tokens": output,
        "duration": duration_s,
    }


def test_defaults_are_the_price_list() -> None:
    prices = Prices()
    assert (prices.input_per_m, prices.output_per_m, prices.rental_per_device_hour) == (0.28, 0.42, 7.0)
    assert prices.cached_input_per_m == pytest.approx(0.28 / 50)
    assert prices.num_devices == 1


def test_revenue_per_device_hour_and_margin() -> None:
    # 2M input of which 1M cached, 1M output, in one hour on two devices
    e = economics(run(2_000_000, 1_000_000, 1_000_000, 3600.0), Prices(num_devices=2))
    revenue = 0.28 + 0.28 / 50 + 0.42
    assert (e["uncached_input_tokens"], e["cached_input_tokens"], e["output_tokens"]) == (1e6, 1e6, 1e6)
    assert e["revenue_usd"] == pytest.approx(revenue)
    assert e["device_hours"] == pytest.approx(2.0)
    assert e["revenue_per_device_hour"] == pytest.approx(revenue / 2)
    assert e["rental_usd"] == pytest.approx(14.0)
    assert e["gross_margin_usd"] == pytest.approx(revenue - 14.0)
    assert e["gross_margin_per_device_hour"] == pytest.approx(revenue / 2 - 7.0)
    assert e["gross_margin_pct"] == pytest.approx(100 * (revenue - 14.0) / revenue)


def test_a_profitable_run() -> None:
    # 36 s on one device at $1/h: $0.01 of rental; 100k output tokens at $1/M: $0.10
    e = economics(run(0, 0, 100_000, 36.0), Prices(output_per_m=1.0, rental_per_device_hour=1.0))
    assert e["revenue_usd"] == pytest.approx(0.1)
    assert e["revenue_per_device_hour"] == pytest.approx(10.0)
    assert e["gross_margin_pct"] == pytest.approx(90.0)


def test_no_revenue_or_no_time_has_no_ratio() -> None:
    e = economics(run(0, 0, 0, 0.0), Prices())
    assert e["revenue_usd"] == 0.0
    assert e["revenue_per_device_hour"] is None and e["gross_margin_pct"] is None
