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
import time

from libs.bus.base import Bus, NoResponders
from libs.protocol.codec import DecodeError, decode, encode
from libs.protocol.messages import SubmitReply, SubmitStatus
from services.gateway.request_stream import Pending

RETRY_S = 0.5  # between tries of a resubmit that found no taker


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
