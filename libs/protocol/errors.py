"""Typed errors that cross a service boundary; each carries the numbers that explain it."""

from __future__ import annotations


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
