"""When a request loses its last reader: cancel it, now or after the resume grace period.

A streaming request may be read here by several readers at once (the live stream and resumed
replays). Only when the last of them leaves unfinished does its grace period start; a resume
anywhere (a ``ResumeClaim``) cancels it. A claim can arrive before this gateway notices the
disconnect it answers, so claims are remembered for one grace period and checked when it ends.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Literal

# "grace": cancel after the grace period unless resumed; "now": cancel at once (nothing can
# resume it: a non-streaming request, or a failed one); "never": not the reader's to cancel
# (a background response).
OnLeave = Literal["grace", "now", "never"]


class GracePeriods:
    def __init__(self, grace_s: float, cancel: Callable[[str], None]) -> None:
        self.grace_s = grace_s
        self._cancel = cancel
        self._readers: Counter[str] = Counter()  # request id -> readers here that may cancel it
        self._timers: dict[str, tuple[asyncio.TimerHandle, float]] = {}  # id -> (timer, armed at)
        self._claims: dict[str, float] = {}  # request id -> when it was last claimed

    def joined(self, request_id: str, on_leave: OnLeave) -> None:
        if on_leave == "grace":
            self._readers[request_id] += 1
            self._disarm(request_id)

    def left(self, request_id: str, on_leave: OnLeave, finished: bool, failed: bool = False) -> None:
        """``failed``: the reader gave up on an error; what still runs is cancelled at once."""
        if on_leave == "grace":
            self._readers[request_id] -= 1
            if self._readers[request_id] <= 0:
                del self._readers[request_id]
            elif not failed:
                return  # someone here still reads it
        if finished or on_leave == "never":
            return
        if failed or on_leave == "now" or self.grace_s <= 0:
            self._disarm(request_id)
            self._cancel(request_id)
            return
        self._disarm(request_id)
        handle = asyncio.get_running_loop().call_later(self.grace_s, self._over, request_id)
        self._timers[request_id] = (handle, time.monotonic())

    def claimed(self, request_id: str) -> bool:
        """A reader elsewhere took the request over; True if that stopped a pending cancel here."""
        now = time.monotonic()
        self._claims = {k: t for k, t in self._claims.items() if now - t < 2 * self.grace_s}
        self._claims[request_id] = now
        return self._disarm(request_id)

    def _disarm(self, request_id: str) -> bool:
        timer = self._timers.pop(request_id, None)
        if timer is not None:
            timer[0].cancel()
        return timer is not None

    def _over(self, request_id: str) -> None:
        _, armed_at = self._timers.pop(request_id, (None, 0.0))
        claimed_at = self._claims.get(request_id)
        if claimed_at is not None and claimed_at >= armed_at - self.grace_s:
            return  # resumed elsewhere around the time its reader here left
        self._cancel(request_id)
