"""Moving a live request off a scheduler that was lost: resubmit it to another one.

The gateway holds what it takes (the submit, and per choice the output tokens its client has
received, in ``Pending``), so the request goes on from there on any live scheduler: the new one
queues each unfinished choice with those tokens as its output so far (not sent again) and
recomputes their KV over the prefix its workers' tiers hold. Dynamo's request migration lives in
its frontend for the same reason: the frontend is the one part that saw every token go out.

The same path moves a request a scheduler handed back (``Handback``: its worker died and it had
no other). A resubmit is retried for ``window_s`` while no scheduler takes it (none answers yet,
or the one that answers has no worker: the lost scheduler's workers are claimed once they let it
go, and a dead worker's restart rejoins its scheduler).
``migration_limit`` bounds the moves one request makes through the gateway.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from libs.bus.base import Bus, NoResponders, RequestTimeout
from libs.protocol.codec import DecodeError, decode, encode
from libs.protocol.messages import RequestOutput, SchedulerRef, SubmitReply, SubmitStatus
from libs.protocol.stream_messages import StreamRecord
from libs.protocol.subjects import Subjects
from services.gateway.request_stream import Pending

log = logging.getLogger(__name__)

RETRY_S = 0.5  # between tries of a resubmit that found no taker


class Migrations:
    """The moves of one gateway's requests, who moves each, and their count by outcome.

    Exactly one reader moves a request (``movers``): the last to submit or resume it. A reader
    that does not (another gateway resumed the request) waits for that gateway's move, and fails
    after ``orphan_s`` without one. ``on_moved`` hears of each resubmit a scheduler accepted.
    """

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        candidates: Callable[[], list[SchedulerRef]],
        submit_timeout_s: float,
        migration_limit: int,
        window_s: float,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        on_moved: Callable[[Pending, SubmitReply], None],
    ) -> None:
        self.bus = bus
        self.subjects = subjects
        self.candidates = candidates  # the live schedulers' ids
        self.submit_timeout_s = submit_timeout_s
        self.migration_limit = migration_limit
        self.window_s = window_s
        self.spawn = spawn
        self.on_moved = on_moved
        self.num_moves = {"moved": 0, "failed": 0}
        self.movers: dict[str, Pending] = {}  # request id -> the one reader here that moves it

    def moves_it(self, pending: Pending) -> bool:
        return self.movers.get(pending.request_id) is pending

    def release(self, pending: Pending) -> None:
        """Its reader left: nobody here moves the request now (a resume moves it, if need be)."""
        pending.reader_left = True
        if self.moves_it(pending):
            del self.movers[pending.request_id]

    def taken(self, pending: Pending, scheduler: SchedulerRef) -> None:
        """A scheduler accepted the request (a submit, or a resubmit): this reader moves it, should
        that scheduler be lost or hand it back, until another gateway resumes it (or its own
        reader left, or another gateway claimed it meanwhile)."""
        pending.scheduler = scheduler
        pending.accepted_at = time.monotonic()
        pending.orphan_since = None
        if not (pending.reader_left or pending.claimed_away):
            self.movers[pending.request_id] = pending
        if pending.record is not None:  # a resumed stream learns where the request is from it
            schedulers = (*pending.record.schedulers, scheduler)
            record = dataclasses.replace(pending.record, schedulers=schedulers, num_moves=pending.num_moves)
            pending.record = record
            self.spawn(self._store_record(record))

    def claimed(self, request_id: str) -> None:
        """Another gateway resumed the request: it moves it from now on."""
        pending = self.movers.pop(request_id, None)
        if pending is not None:
            pending.claimed_away = True

    def handed_back(self, pending: Pending, out: RequestOutput) -> bool:
        """Its scheduler gave the request up (``out.handback``): whether this reader moves it now."""
        assert out.handback is not None
        pending.num_moves = max(pending.num_moves, out.handback.num_moves)
        pending.num_crashes = max(pending.num_crashes, out.handback.num_crashes)
        if self.moves_it(pending):
            return True
        pending.orphan_since = pending.orphan_since or time.monotonic()  # its mover moves it
        return False

    def on_schedulers(self, readers: list[Pending], gone: Callable[[Pending], bool], now: float) -> None:
        """After a read of the members: move the requests whose scheduler is ``gone``; fail
        those that wait for another gateway's move past ``orphan_s``."""
        lost: dict[SchedulerRef, list[Pending]] = {}
        for pending in readers:
            if pending.moving or pending.failed or not pending.caught_up:
                continue  # (a replay decides once it has read what was there when it started)
            if pending.scheduler is None or not gone(pending):
                continue
            if self.moves_it(pending):
                lost.setdefault(pending.scheduler, []).append(pending)
            else:
                pending.orphan_since = pending.orphan_since or now
        for pending in readers:
            since = pending.orphan_since
            if since is not None and now - since > self.orphan_s and not pending.failed:
                name = pending.scheduler.scheduler_id if pending.scheduler else "?"
                pending.fail(f"scheduler {name} left it, not moved in {self.orphan_s:.0f} s")
        for scheduler, pendings in lost.items():
            scheduler_id = scheduler.scheduler_id
            log.error("scheduler %s lost: moving %d requests", scheduler_id, len(pendings))
            for pending in pendings:
                self.start(pending, f"scheduler {scheduler_id} lost: no heartbeat", lost=scheduler)

    @property
    def orphan_s(self) -> float:
        """How long a reader waits for another gateway to move its request (then it fails): a
        move's longest, and as long again."""
        return 2 * (self.window_s + self.submit_timeout_s)

    def start(
        self, pending: Pending, why: str, lost: SchedulerRef | None = None, avoid: SchedulerRef | None = None
    ) -> None:
        """Resubmit the request to another scheduler: its own is ``lost`` (its outputs are
        dropped from now on), or handed it back (tried last: ``avoid``)."""
        pending.moving = True
        if lost is not None:
            pending.lost_schedulers.add(lost)
        pending.avoid = avoid
        self.spawn(self._run(pending, why))

    async def _run(self, pending: Pending, why: str) -> None:
        try:
            reply = await self.move(pending, why)
        finally:
            pending.moving = False
        if reply is not None:
            self.on_moved(pending, reply)

    async def _store_record(self, record: StreamRecord) -> None:
        try:
            await self.bus.kv_put(self.subjects.streams_bucket, record.request_id, encode(record))
        except Exception as exc:  # a resume then finds the request where the record said before
            log.warning("updating the stream record of %s failed: %r", record.request_id, exc)

    async def move(self, pending: Pending, why: str) -> SubmitReply | None:
        """Resubmit ``pending``'s request (its scheduler is lost or handed it back, ``why``): the
        reply of the scheduler that took it, or None when none did (``pending`` is failed, saying
        why) or nothing was left to run."""
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
            log.error("request %s not moved: %s", pending.request_id, result)
            pending.fail(f"{why}; not moved to another scheduler: {result}")
        return None


async def resubmit(
    bus: Bus,
    subjects: Subjects,
    pending: Pending,
    candidates: Callable[[], list[SchedulerRef]],
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
    target: SchedulerRef | None = None  # the scheduler a try timed out at: retried there while it lives
    refused: set[SchedulerRef] = set()  # tried and refused since the last round over every candidate
    while True:
        req = pending.resubmission()
        if req is None:
            return None
        # the one that handed it back last: it may have a worker again, but others go first
        live = sorted(
            (s for s in candidates() if s not in pending.lost_schedulers), key=lambda s: s == pending.avoid
        )
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
                raw = await bus.request(
                    subjects.submit_to(target.scheduler_id), encode(req), submit_timeout_s
                )
                reply = decode(SubmitReply, raw)
            except RequestTimeout:
                why = f"scheduler {target.scheduler_id} did not answer within {submit_timeout_s:.0f} s"
            except (NoResponders, DecodeError) as exc:
                why = f"scheduler {target.scheduler_id}: {exc!r}"
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
