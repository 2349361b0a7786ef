"""Helpers of bench/fleet.py's reports: nearest-rank percentiles, milliseconds, ratios against a
baseline and summary rows against a goal."""

from __future__ import annotations

import math

from throughput import fmt_ratio


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank: the smallest value with at least ``q`` of them at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.0f}"


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den; inf when only the baseline is 0 (e.g. no hit at all without cache-aware routing)."""
    if num is None or den is None or (num == den == 0):
        return None
    return num / den if den else math.inf


def target_row(name: str, value: float | None, goal: float, at_least: bool) -> list[str]:
    """A summary row: the ratio measured against its goal."""
    met = value is not None and (value >= goal if at_least else value <= goal)
    status = "n/a" if value is None else ("met" if met else "missed")
    return [name, f"{'>=' if at_least else '<='} {goal}x", fmt_ratio(value), status]
