"""Serving economics through real processes: a gateway with its own price list on the shared
stack serves known traffic; the revenue it reports equals the usage it returned at those prices,
its device time follows the wall clock for the live workers, and revenue per device-hour and
margin follow from the two."""

from __future__ import annotations

import time

import httpx
import pytest

from libs.bus.nats_server import free_port
from tests.system.serve_proc import scrape
from tests.system.stack import READY_TIMEOUT_S, Stack, wait_healthy

MODEL = "SmolLM2-135M-Instruct"
PRICES = {"input_uncached": 1000.0, "input_cached": 10.0, "output": 2000.0}  # dollars per M tokens
RENTAL = 3.5


def test_known_traffic_gives_the_reported_revenue_and_margin(stack: Stack) -> None:
    port = free_port()
    gateway = stack.spawn_gateway(
        port,
        *("--price-input-per-million", str(PRICES["input_uncached"])),
        *("--price-cached-input-per-million", str(PRICES["input_cached"])),
        *("--price-output-per-million", str(PRICES["output"])),
        *("--rental-per-device-hour", str(RENTAL)),
    )
    root = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{root}/health", [gateway], stack.log, READY_TIMEOUT_S)
        before, started = scrape(port), time.monotonic()
        tokens = dict.fromkeys(PRICES, 0)
        for content in ("Say hi.", "Say hi.", "Name three colors."):  # the repeat hits the prefix cache
            body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": content}]}
            usage = httpx.post(f"{root}/v1/chat/completions", json=body, timeout=120).json()["usage"]
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            tokens["input_uncached"] += usage["prompt_tokens"] - cached
            tokens["input_cached"] += cached
            tokens["output"] += usage["completion_tokens"]
        time.sleep(2.0)  # device time to measure beyond the requests'
        after, elapsed = scrape(port), time.monotonic() - started
    finally:
        gateway.terminate()
        gateway.wait(30)
    assert tokens["input_cached"] > 0 and tokens["output"] > 0  # every kind was priced
    for kind, price in PRICES.items():
        key = ("deepinfer_revenue_dollars_total", (("kind", kind),))
        assert after[key] - before.get(key, 0.0) == pytest.approx(tokens[kind] * price / 1e6, rel=1e-9)
        assert after[("deepinfer_price_per_million_tokens_dollars", (("kind", kind),))] == price
    workers = after[("deepinfer_workers", (("device", "cpu"),))]
    assert workers == before[("deepinfer_workers", (("device", "cpu"),))] >= 1
    seconds = ("deepinfer_device_seconds_total", (("device", "cpu"),))
    # views come about once a second: the clock lags the scrape by at most that
    assert after[seconds] - before[seconds] == pytest.approx(workers * elapsed, abs=workers * 1.5)
    revenue = sum(after[("deepinfer_revenue_dollars_total", (("kind", k),))] for k in PRICES)
    per_hour = after[("deepinfer_revenue_per_device_hour_dollars", ())]
    assert per_hour == pytest.approx(revenue / (after[seconds] / 3600), rel=1e-6)  # one scrape, one clock
    assert after[("deepinfer_gross_margin_ratio", ())] == pytest.approx(1 - RENTAL / per_hour, rel=1e-9)
    assert after[("deepinfer_rental_per_device_hour_dollars", ())] == RENTAL
