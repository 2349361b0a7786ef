"""Moving a live request off a scheduler that was lost: resubmit it to another one.

The gateway holds what it takes (the submit, and per choice the output tokens its client has
received, in ``Pending``), so the request goes on from there on any live scheduler: the new one
queues each unfinished choice with those tokens as its output so far (not sent again) and
recomputes their KV over the prefix its workers' tiers hold. Dynamo's request migration lives in
its frontend for the same reason: the frontend is the one part that saw every token go out.

A resubmit is retried for ``window_s`` while no scheduler takes it (none answers yet, or the one
that answers has no worker: the lost scheduler's workers are claimed once they let it go).
``migration_limit`` bounds the moves one request makes through the gateway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from libs.bus.base import Bus, NoResponders, RequestTimeout
from libs.protocol.codec import DecodeError, decode, encode
from libs.protocol.messages import SubmitReply, SubmitStatus
from libs.protocol.subjects import Subjects
from services.gateway.request_stream import Pending

log = logging.getLogger(__name__)

RETRY_S = 0.5  # between tries of a resubmit that found no taker


class Migrations:
    """The moves of one gateway's requests off lost schedulers, and their count by outcome."""

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        candidates: Callable[[], list[str]],
        submit_timeout_s: float,
        migration_limit: int,
        window_s: float,
    ) -> None:
        self.bus = bus
        self.subjects = subjects
        self.candidates = candidates  # the live schedulers' ids
        self.submit_timeout_s = submit_timeout_s
        self.migration_limit = migration_limit
        self.window_s = window_s
        self.num_moves = {"moved": 0, "failed": 0}

    async def move(self, pending: Pending, why: str) -> SubmitReply | None:
        """Resubmit ``pending``'s request (its scheduler is lost, ``why``): the reply of the
        scheduler that took it, or None when none did (``pending`` is failed, saying why) or
        nothing was left to run."""
        if pending.num_moves >= self.migration_limit:
            self.num_moves["failed"] += 1
            pending.fail(f"{why}; the migration limit ({self.migration_limit} moves) is reached")
            return None
        pending.num_moves += 1
        timeout_s, window_s = self.submit_timeout_s, self.window_s
        try:
            result = await resubmit(self.bus, self.subjects, pending, self.candidates, timeout_s, window_s)
        except Exception as exc:  # whatever it was, the stream must end, not hang
            log.exception("moving a request failed")
            result = f"{exc!r}"
        if isinstance(result, SubmitReply):
            self.num_moves["moved"] += 1
            return result
        if result is not None:
            self.num_moves["failed"] += 1
            log.error("request %s not moved: %s", pending.submit and pending.submit.request_id, result)
            pending.fail(f"{why}; not moved to another scheduler: {result}")
        return None


async def resubmit(
    bus: Bus,
    subjects: Subjects,
    pending: Pending,
    candidates: Callable[[], list[str]],
    submit_timeout_s: float,
    window_s: float,
) -> SubmitReply | str | None:
    """Resubmit ``pending``'s request: the reply that accepted it, why no scheduler did (a
    string), or None if nothing was left to run (every choice ended meanwhile).

    Each try names one scheduler (``candidates()``: the live ones, in the gateway's view; never one
    taken for lost, never the queue group), so the request runs in one place: a try that timed out
    goes to the same scheduler again (it may have taken it, and takes a retry as the same
    request); one that was refused, or found none answering, moves on to the next."""
    deadline = time.monotonic() + window_s
    why = "no scheduler is available"
    target: str | None = None  # the scheduler a try timed out at: retried there while it lives
    refused: set[str] = set()  # tried and refused since the last round over every candidate
    while True:
        req = pending.resubmission()
        if req is None:
            return None
        live = [s for s in candidates() if s not in pending.lost_schedulers]
        if target not in live:
            fresh = [s for s in live if s not in refused]
            if not fresh:
                refused.clear()
            pool = fresh or live
            target = pool[0] if pool else None
        if target is None:
            why = "no scheduler is available"
        else:
            try:
                raw = await bus.request(subjects.submit_to(target), encode(req), submit_timeout_s)
                reply = decode(SubmitReply, raw)
            except RequestTimeout:
                why = f"scheduler {target} did not answer within {submit_timeout_s:.0f} s"
            except (NoResponders, DecodeError) as exc:
                why = f"scheduler {target}: {exc!r}"
                refused.add(target)
                target = None
            else:
                if reply.status is SubmitStatus.INVALID:
                    return reply.message  # the same everywhere: retrying cannot help
                if reply.status is SubmitStatus.ACCEPTED:
                    return reply
                why = reply.message
                refused.add(target)
                target = None
        if time.monotonic() + RETRY_S > deadline:
            return why
        await asyncio.sleep(RETRY_S)
