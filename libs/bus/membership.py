"""Membership and liveness in the members KV bucket: a key per process, refreshed under its TTL."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from libs.bus.base import Bus
from libs.protocol.codec import decode, encode
from libs.protocol.messages import MemberInfo, MemberKind

log = logging.getLogger(__name__)

# An entry not refreshed for this long is gone: the process is presumed dead. Generous on
# purpose: a busy process on a loaded host can miss a refresh or two, and a false "dead"
# flaps /health; real deaths are also seen sooner by the step loop (WorkerLost).
MEMBER_TTL_S = 10.0
REFRESH_S = 2.0


def member_key(info: MemberInfo) -> str:
    return f"{info.kind.name.lower()}.{info.member_id}"


async def announce(bus: Bus, bucket: str, info: MemberInfo, stop: asyncio.Event) -> None:
    """Keep ``info`` in the bucket until ``stop`` is set, then remove it (a clean leave)."""
    await bus.ensure_kv(bucket, MEMBER_TTL_S)
    while not stop.is_set():
        try:
            await bus.kv_put(bucket, member_key(info), encode(info))
        except Exception as exc:  # a NATS outage must not kill the process; the TTL covers it
            log.warning("membership refresh failed: %s", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), REFRESH_S)
    try:
        await bus.kv_delete(bucket, member_key(info))
    except Exception as exc:
        log.warning("membership leave failed: %s", exc)


async def live_members(bus: Bus, bucket: str, kind: MemberKind) -> list[MemberInfo]:
    await bus.ensure_kv(bucket, MEMBER_TTL_S)
    items = await bus.kv_items(bucket)
    members = [decode(MemberInfo, v) for k, v in items.items() if k.startswith(kind.name.lower() + ".")]
    return [m for m in members if m.ready]
