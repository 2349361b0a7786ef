"""Membership and liveness in the members KV bucket: a key per process, refreshed under its TTL.

Each process ``announce``s itself: its ``MemberInfo`` is put every ``REFRESH_S`` with a heartbeat
counter one higher. A ``MembershipView`` (one per process that cares: gateway, scheduler) reads
the bucket every ``WATCH_S`` in the background and keeps a local picture, so callers (``/health``,
the reaping of dead workers) ask it without a round trip. A member is live while its heartbeat
keeps changing: one unchanged for ``silence_s`` is dead even before the TTL removes its entry, and
one missing from a read counts as silent since it was last heard (not as dead at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from libs.bus.base import Bus
from libs.protocol.codec import DecodeError, decode, encode
from libs.protocol.member_messages import MemberInfo, MemberKind

log = logging.getLogger(__name__)

# An entry not refreshed for this long is gone from the bucket. The refresh comes from a loop kept
# free of long CPU work (that runs in threads), so five missed refreshes mean a stopped process.
MEMBER_TTL_S = 6.0
REFRESH_S = 1.0
WATCH_S = 1.0  # how often a view reads the bucket
READ_TIMEOUT_S = 2.0  # a read that takes longer counts as failed: the bus is unreachable
# A view whose last good read is older than this knows nothing: callers treat it as "no members".
STALE_VIEW_S = 3 * WATCH_S + READ_TIMEOUT_S

InfoSource = MemberInfo | Callable[[], MemberInfo]


def member_key(info: MemberInfo) -> str:
    return f"{info.kind.name.lower()}.{info.member_id}"


async def announce(bus: Bus, bucket: str, info: InfoSource, stop: asyncio.Event) -> None:
    """Keep ``info`` (or what it returns, read at each refresh) in the bucket until ``stop`` is
    set, then remove it (a clean leave)."""
    await bus.ensure_kv(bucket, MEMBER_TTL_S)
    current = info if callable(info) else lambda: info
    heartbeat = 0
    failing = False
    while not stop.is_set():
        heartbeat += 1
        entry = replace(current(), heartbeat=heartbeat)
        try:
            await asyncio.wait_for(bus.kv_put(bucket, member_key(entry), encode(entry)), READ_TIMEOUT_S)
        except Exception as exc:  # a NATS outage must not kill the process; the TTL covers it
            if not failing:  # once per outage: the bus logs its own disconnect and reconnect
                log.warning("membership refresh of %s failed: %r (retrying quietly)", member_key(entry), exc)
            failing = True
        else:
            if failing:
                log.info("membership refresh of %s works again", member_key(entry))
            failing = False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), REFRESH_S)
    try:
        await asyncio.wait_for(bus.kv_delete(bucket, member_key(current())), READ_TIMEOUT_S)
    except Exception as exc:
        log.warning("membership leave failed: %r", exc)


async def live_members(bus: Bus, bucket: str, kind: MemberKind) -> list[MemberInfo]:
    """The ready members of ``kind`` in the bucket now (one round trip; no heartbeat check)."""
    await bus.ensure_kv(bucket, MEMBER_TTL_S)
    items = await bus.kv_items(bucket)
    members = [decode(MemberInfo, v) for k, v in items.items() if k.startswith(kind.name.lower() + ".")]
    return [m for m in members if m.ready]


@dataclass(slots=True)
class _Seen:
    info: MemberInfo
    heard_at: float  # monotonic time its heartbeat was last seen to change
    # Its heartbeat moved since the first read (or the last gap): it is up now, not merely an
    # entry still in the bucket (after a restart of the bus, the entries of the dead are too).
    confirmed: bool


class MembershipView:
    """The members bucket as last read, with when each member's heartbeat last moved.

    ``silence_s``: a heartbeat unchanged for this long means the member is dead. A read after a
    gap (this process itself was stalled or cut off from the bus) starts every member's silence
    afresh: a stall here is no evidence against them.
    """

    def __init__(
        self,
        bus: Bus,
        bucket: str,
        silence_s: float = MEMBER_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bus = bus
        self.bucket = bucket
        self.silence_s = silence_s
        self.clock = clock
        self._seen: dict[str, _Seen] = {}
        self._read_at = -float("inf")  # the last good read
        self._failing = False
        self._bound = False  # ensure_kv done (once: the bucket outlives a restart of the server)

    @property
    def current(self) -> bool:
        """Whether the last good read is recent enough to say anything."""
        return self.clock() - self._read_at <= STALE_VIEW_S

    async def refresh(self) -> bool:
        """Read the bucket once; False (and nothing changed) when the bus did not answer."""
        try:
            if not self._bound:
                await asyncio.wait_for(self.bus.ensure_kv(self.bucket, MEMBER_TTL_S), READ_TIMEOUT_S)
                self._bound = True
            items = await asyncio.wait_for(self.bus.kv_items(self.bucket), READ_TIMEOUT_S)
        except Exception as exc:
            if not self._failing:
                log.warning("reading members failed: %r (retrying quietly)", exc)
            self._failing = True
            return False
        self._failing = False
        now = self.clock()
        after_gap = now - self._read_at > STALE_VIEW_S
        seen: dict[str, _Seen] = {}
        for key, raw in items.items():
            try:
                info = decode(MemberInfo, raw)
            except DecodeError:
                continue
            before = self._seen.get(key)
            if info.heartbeat == 0:
                # A process from before heartbeats (a rolling upgrade): live while its entry is
                # in the bucket, as membership meant then (the TTL removes a dead one).
                seen[key] = _Seen(info, now, confirmed=True)
            elif after_gap or before is None:
                seen[key] = _Seen(info, now, confirmed=False)
            elif before.info.heartbeat != info.heartbeat:
                seen[key] = _Seen(info, now, confirmed=True)
            else:
                seen[key] = _Seen(info, before.heard_at, before.confirmed)
        if not after_gap:
            # A key missing from one read is no proof of death (a listing under load can miss
            # one): the member's silence decides. One whose entry expired was silent for a TTL
            # already, and a clean leave is noticed once its silence passes the caller's bound.
            keep_s = max(self.silence_s, 2 * MEMBER_TTL_S)
            for key, before in self._seen.items():
                if key not in seen and now - before.heard_at <= keep_s:
                    seen[key] = before
        self._seen, self._read_at = seen, now
        return True

    async def watch(self, stop: asyncio.Event, on_change: Callable[[], None] | None = None) -> None:
        """``refresh`` every ``WATCH_S`` until ``stop``; ``on_change`` after each read."""
        while not stop.is_set():
            await self.refresh()
            try:
                if on_change is not None:
                    on_change()
            except Exception:  # the watcher outlives one bad reaction: liveness depends on it
                log.exception("reacting to the members failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), WATCH_S)

    def get(self, kind: MemberKind, member_id: str) -> MemberInfo | None:
        """The member if live: in the bucket, ready, heartbeat moving, and the view current."""
        seen = self._seen.get(member_key(MemberInfo(kind, member_id)))
        if seen is None or not self._alive(seen):
            return None
        return seen.info

    def silent(self, kind: MemberKind, member_id: str) -> bool:
        """Whether the current view holds the member but its heartbeat has stopped (or it is no
        longer ready): about to be judged dead. A member not in the view yet is not silent."""
        seen = self._seen.get(member_key(MemberInfo(kind, member_id)))
        return seen is not None and self.current and not self._alive(seen)

    def live(
        self, kind: MemberKind, confirmed: bool = False, silence_s: float | None = None
    ) -> list[MemberInfo]:
        """The live members of ``kind``; ``confirmed``: only those seen to heartbeat since the
        first read or the last gap (not yet: not known dead, but not known up either);
        ``silence_s``: this view's own bound, or a longer one (failing work on a member's death
        is worth a surer verdict than readiness is)."""
        prefix = kind.name.lower() + "."
        return [
            s.info
            for k, s in self._seen.items()
            if k.startswith(prefix) and self._alive(s, silence_s) and (s.confirmed or not confirmed)
        ]

    def silent_for(self, kind: MemberKind, member_id: str) -> float | None:
        """Seconds since the member's heartbeat was last seen to move (None: not in the bucket)."""
        seen = self._seen.get(member_key(MemberInfo(kind, member_id)))
        return None if seen is None else self.clock() - seen.heard_at

    def can_serve(self) -> bool:
        """A confirmed scheduler that drives a worker (or does not say) and a confirmed worker,
        not stuck in a step nor draining nor only a prefill worker, free or that scheduler's."""
        schedulers = {
            m.member_id for m in self.live(MemberKind.SCHEDULER, confirmed=True) if m.num_workers != 0
        }
        workers = self.live(MemberKind.WORKER, confirmed=True)
        return bool(schedulers) and any(
            not w.stuck and not w.draining and w.role != "prefill" and w.owner in ("", *schedulers)
            for w in workers
        )

    def _alive(self, seen: _Seen, silence_s: float | None = None) -> bool:
        bound = self.silence_s if silence_s is None else silence_s
        return self.current and seen.info.ready and self.clock() - seen.heard_at <= bound
