"""Typed errors that cross a service boundary; each carries the numbers that explain it."""

from __future__ import annotations

import re

_REASON = re.compile(r"[a-z][a-z ]{0,39}")


class DeepinferError(Exception):
    """Base of the errors deepinfer raises on purpose."""


class QueueFull(DeepinferError):
    def __init__(self, num_waiting: int, max_num_waiting: int) -> None:
        super().__init__(f"queue full: {num_waiting} waiting, limit {max_num_waiting}")
        self.num_waiting = num_waiting
        self.max_num_waiting = max_num_waiting


class NoWorkers(DeepinferError):
    def __init__(self) -> None:
        super().__init__("no worker is available")


def failure_reason(error: str) -> str:
    """A sequence's error as a metric label: its leading words, before the first ':' ("structured
    output: ..." -> "structured_output"), or "other" (what follows is free text: unbounded labels)."""
    head = error.partition(":")[0].strip().lower()
    return head.replace(" ", "_") if _REASON.fullmatch(head) else "other"
