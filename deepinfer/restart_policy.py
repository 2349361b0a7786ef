"""When a supervised process that died is started again: exponential backoff, and a limit.

Pure (no processes, no clock of its own): the supervisor passes ``now`` in. Deaths older than
``window_s`` are forgotten, so a process that crashes once an hour always restarts quickly, and
one that crash-loops is given up on after ``max_restarts`` restarts within the window.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class RestartPolicy:
    max_restarts: int  # restarts allowed within window_s; the next death gives up
    window_s: float
    backoff_s: float = 0.5  # the delay before the first restart in a window, doubled for each next one
    max_backoff_s: float = 10.0
    _deaths: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        for key in ("window_s", "backoff_s", "max_backoff_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")

    @property
    def num_recent_deaths(self) -> int:
        """Deaths within the window, as of the last ``on_exit``."""
        return len(self._deaths)

    def on_exit(self, now: float) -> float | None:
        """The process died at ``now``: seconds to wait before starting it again, or None when it
        has already been restarted ``max_restarts`` times within ``window_s`` (give up)."""
        while self._deaths and now - self._deaths[0] > self.window_s:
            self._deaths.popleft()
        self._deaths.append(now)
        restarts = len(self._deaths)  # this one included
        if restarts > self.max_restarts:
            return None
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** (restarts - 1))
