"""When a request loses its last reader: cancel it, now or after the resume grace period.

A streaming request may be read here by several readers at once (the live stream and resumed
replays). Only when the last of them leaves unfinished does its grace period start, and the
request is paused for it (its sequences stop computing at once); a resume anywhere (a
``ResumeClaim``) or a reader joining here ends it and resumes the request. A claim can arrive
before this gateway notices the disconnect it answers, so claims are remembered for one grace
period: such a leave does not pause, and its grace period does not cancel.
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
    """``cancel(request_id)`` ends a request; ``pause(request_id, resume)`` pauses it when its grace
    period starts and resumes it (``resume`` True) when a reader stops that period."""

    def __init__(
        self,
        grace_s: float,
        cancel: Callable[[str], None],
        pause: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.grace_s = grace_s
        self._cancel = cancel
        self._pause = pause
        self._readers: Counter[str] = Counter()  # request id -> readers here that may cancel it
        self._timers: dict[str, tuple[asyncio.TimerHandle, float]] = {}  # id -> (timer, armed at)
        self._claims: dict[str, float] = {}  # request id -> when it was last claimed

    def joined(self, request_id: str, on_leave: OnLeave) -> None:
        if on_leave == "grace":
            self._readers[request_id] += 1
            self._resume_if_paused(request_id)

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
        now = time.monotonic()
        handle = asyncio.get_running_loop().call_later(self.grace_s, self._over, request_id)
        self._timers[request_id] = (handle, now)
        if self._pause is not None and not self._claimed_since(request_id, now - self.grace_s):
            self._pause(request_id, False)

    def claimed(self, request_id: str) -> bool:
        """A reader elsewhere took the request over; True if that stopped a pending cancel here."""
        now = time.monotonic()
        self._claims = {k: t for k, t in self._claims.items() if now - t < 2 * self.grace_s}
        self._claims[request_id] = now
        return self._resume_if_paused(request_id)

    def _resume_if_paused(self, request_id: str) -> bool:
        """End a pending grace period; True if there was one. The request was paused when it
        began (unless a claim came first: then a resume went out already from the claimer)."""
        if not self._disarm(request_id):
            return False
        if self._pause is not None:
            self._pause(request_id, True)
        return True

    def _claimed_since(self, request_id: str, since: float) -> bool:
        claimed_at = self._claims.get(request_id)
        return claimed_at is not None and claimed_at >= since

    def _disarm(self, request_id: str) -> bool:
        timer = self._timers.pop(request_id, None)
        if timer is not None:
            timer[0].cancel()
        return timer is not None

    def _over(self, request_id: str) -> None:
        _, armed_at = self._timers.pop(request_id, (None, 0.0))
        if self._claimed_since(request_id, armed_at - self.grace_s):
            return  # resumed elsewhere around the time its reader here left
        self._cancel(request_id)
