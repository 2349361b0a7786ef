"""Moving a live request off a scheduler that was lost: resubmit it to another one.

The gateway holds what it takes (the submit, and per choice the output tokens its client has
received, in ``Pending``), so the request goes on from there on any live scheduler: the new one
queues each unfinished choice with those tokens as its output so far (not sent again) and
recomputes their KV over the prefix its workers' tiers hold. Dynamo's request migration lives in
its frontend for the same reason: the frontend is the one part that saw every token go out.

A resubmit is retried for ``window_s`` while no scheduler takes it (none answers yet, or the one
that answers has no worker: the lost scheduler's workers are claimed once they let it go), since
submits are idempotent by request id. ``migration_limit`` bounds the moves of one request.
"""

from __future__ import annotations

import asyncio
import logging
import time

from libs.bus.base import Bus, NoResponders
from libs.protocol.codec import DecodeError, decode, encode
from libs.protocol.messages import SubmitReply, SubmitStatus
from services.gateway.request_stream import Pending

log = logging.getLogger(__name__)

RETRY_S = 0.5  # between tries of a resubmit that found no taker


class Migrations:
    """The moves of one gateway's requests off lost schedulers, and their count by outcome."""

    def __init__(
        self, bus: Bus, subject: str, submit_timeout_s: float, migration_limit: int, window_s: float
    ) -> None:
        self.bus = bus
        self.subject = subject  # submit, to any scheduler
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
        result = await resubmit(self.bus, self.subject, pending, self.submit_timeout_s, self.window_s)
        if isinstance(result, SubmitReply):
            self.num_moves["moved"] += 1
            return result
        if result is not None:
            self.num_moves["failed"] += 1
            log.error("request %s not moved: %s", pending.submit and pending.submit.request_id, result)
            pending.fail(f"{why}; not moved to another scheduler: {result}")
        return None


async def resubmit(
    bus: Bus, subject: str, pending: Pending, submit_timeout_s: float, window_s: float
) -> SubmitReply | str | None:
    """Resubmit ``pending``'s request: the reply that accepted it, why no scheduler did (a
    string), or None if nothing was left to run (every choice ended meanwhile)."""
    deadline = time.monotonic() + window_s
    why = "no scheduler is available"
    while True:
        req = pending.resubmission()
        if req is None:
            return None
        try:
            raw = await bus.request(subject, encode(req), submit_timeout_s)
            reply = decode(SubmitReply, raw)
        except NoResponders:
            why = "no scheduler is available"
        except TimeoutError:
            why = f"no scheduler answered within {submit_timeout_s:.0f} s"
        except DecodeError as exc:
            why = f"bad submit reply: {exc}"
        else:
            if reply.status is SubmitStatus.ACCEPTED:
                return reply
            why = reply.message
            if reply.status is SubmitStatus.INVALID:
                return why  # the same everywhere: retrying cannot help
        if time.monotonic() + RETRY_S > deadline:
            return why
        await asyncio.sleep(RETRY_S)
