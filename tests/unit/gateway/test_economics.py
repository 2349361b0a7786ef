"""Serving economics: revenue at the price list, device time from views of the live workers,
revenue per device-hour and margin; and the README's worked example from DeepSeek's figures."""

from __future__ import annotations

import pytest

from services.gateway.economics import (
    DeviceClock,
    PriceList,
    TokenLedger,
    gross_margin,
    revenue_per_device_hour,
)


def test_revenue_at_the_price_list() -> None:
    ledger = TokenLedger()
    ledger.add(prompt_tokens=1_000_000, cached_tokens=400_000, output_tokens=2_000_000)
    ledger.check_integrity()
    assert ledger.tokens == {"input_uncached": 600_000, "input_cached": 400_000, "output": 2_000_000}
    revenue = ledger.revenue(PriceList())  # $0.28 / M uncached, a hit at 1/50 of it, $0.42 / M output
    assert revenue == pytest.approx({"input_uncached": 0.168, "input_cached": 0.00224, "output": 0.84})
    custom = PriceList(input_per_million=1.0, cached_input_per_million=0.1, output_per_million=2.0)
    assert sum(ledger.revenue(custom).values()) == pytest.approx(0.6 + 0.04 + 4.0)
    with pytest.raises(ValueError, match="price"):
        PriceList(output_per_million=-1.0)


def test_device_time_counts_the_workers_live_at_each_view() -> None:
    clock = DeviceClock()
    clock.observe(100.0, {"w1": "cpu"})
    clock.observe(101.0, {"w1": "cpu", "g1": "cuda"})  # g1 starts: counted from this view on
    clock.observe(103.0, {"w1": "cpu", "g1": "cuda"})
    clock.observe(104.0, {"g1": "cuda"})  # w1 stopped: counted up to the view without it
    clock.check_integrity()
    assert clock.seconds == {"cpu": 4.0, "cuda": 3.0}
    clock.observe(105.0, None)  # cut off from the bus: the next second counts for nobody
    clock.observe(106.0, {"g1": "cuda"})
    clock.observe(106.5, {"g1": "cuda"})
    assert clock.seconds == {"cpu": 4.0, "cuda": 4.5}
    clock.observe(106.0, {"g1": "cuda"})  # a view from the past adds nothing
    assert clock.seconds == {"cpu": 4.0, "cuda": 4.5} and dict(clock.live) == {"g1": "cuda"}


def test_revenue_per_device_hour_and_margin() -> None:
    assert revenue_per_device_hour(10.0, 0.0) is None
    assert revenue_per_device_hour(10.0, 1800.0) == pytest.approx(20.0)
    assert gross_margin(None, 7.0) is None and gross_margin(0.0, 7.0) is None
    assert gross_margin(20.0, 7.0) == pytest.approx(0.65)
    assert gross_margin(3.5, 7.0) == pytest.approx(-1.0)  # a loss is a negative margin


def test_the_readmes_worked_example() -> None:
    """DeepSeek's figures: a cluster serving 155T tokens a day, $38 of revenue per device-hour at
    list price. Assumed (those figures do not say): the token mix of DeepSeek's published day of
    V3/R1 serving, 608B input tokens of which 56.3% cache hits, and 168B output tokens."""
    tokens_per_day = 155e12
    num_input, num_output = tokens_per_day * 608 / 776, tokens_per_day * 168 / 776
    ledger = TokenLedger()
    ledger.add(round(num_input), round(num_input * 0.563), round(num_output))
    revenue = ledger.revenue(PriceList())
    per_day = sum(revenue.values())
    assert per_day == pytest.approx(29.34e6, rel=1e-3)  # $14.86M + $0.38M + $14.09M
    devices = per_day / (38.0 * 24)  # the devices that revenue implies at $38 / device-hour
    assert devices == pytest.approx(32_170, rel=1e-3)
    assert gross_margin(38.0, 7.0) == pytest.approx(0.816, abs=0.001)  # DeepSeek's ~82% at $7 / hour
