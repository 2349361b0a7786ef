"""The bus side of the gateway's KV router: feeds it every worker's load reports and every
stream of KV events, asks a publisher for a dump when a stream has a gap, and picks the subject
a submit goes to (one scheduler replica's own, or the queue group when the router names none).

Events and dumps run inside the kv_events handler, one message at a time: while a dump is asked
for, later events wait in the subscription's queue, and those it already covers are ignored when
they come. A dump that fails leaves the stream empty (never held) and is not asked again for
``RESYNC_BACKOFF_S``; the stream's next event asks again after that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Container, Sequence

from libs.bus.base import Bus, Message, NoResponders, RequestTimeout
from libs.protocol.codec import DecodeError, decode, decode_or_warn, encode
from libs.protocol.kv_messages import KVDump, KVDumpRequest, KVEvents
from libs.protocol.member_messages import WorkerLoad
from libs.protocol.messages import ImageSpan
from libs.protocol.subjects import Subjects
from services.gateway.kv_router import KVRouter, Route, StreamKey, hash_chains

log = logging.getLogger(__name__)

RESYNC_BACKOFF_S = 1.0


class RouterFeed:
    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        router: KVRouter,
        dump_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bus = bus
        self.subjects = subjects
        self.router = router
        self.dump_timeout_s = dump_timeout_s
        self.clock = clock
        self._resync_after: dict[StreamKey, float] = {}
        self.num_dumps = {"applied": 0, "failed": 0}  # asked for after a gap, by outcome

    async def start(self) -> None:
        await self.bus.subscribe(self.subjects.load_all, self.on_load)
        await self.bus.subscribe(self.subjects.kv_events, self.on_events)  # the workers' G2
        await self.bus.subscribe(self.subjects.kv_device_events, self.on_events)  # the schedulers' G1

    async def route(
        self,
        prompt: Sequence[int],
        tenant: str,
        owners: Container[str] | None = None,
        spans: Sequence[ImageSpan] = (),
    ) -> Route | None:
        """The router's pick (among the workers of ``owners``, when given); the prompt is hashed
        in a thread (a long one takes a while), so the event loop goes on serving streams."""
        try:
            kinds = self.router.chain_kinds(self.clock(), owners)
            chains = await asyncio.to_thread(hash_chains, prompt, tenant, kinds, spans) if kinds else {}
            return self.router.route(prompt, tenant, self.clock(), chains, owners, spans)
        except Exception:  # a routing bug must not fail the submit: any scheduler places it
            log.exception("routing failed")
            return None

    async def on_load(self, msg: Message) -> None:
        load = decode_or_warn(WorkerLoad, msg.data, log, "load message")
        if load is not None:
            self.router.on_load(load, self.clock())

    async def on_events(self, msg: Message) -> None:
        batch = decode_or_warn(KVEvents, msg.data, log, "kv events")
        if batch is None:
            return
        key = self.router.on_events(batch)
        if key is not None and self.clock() >= self._resync_after.get(key, 0.0):
            await self._dump(key)

    async def _dump(self, key: StreamKey) -> None:
        publisher_id, worker_id = key
        request = encode(KVDumpRequest(publisher_id, worker_id))
        try:
            data = await self.bus.request(self.subjects.kv_dump(publisher_id), request, self.dump_timeout_s)
            self.router.on_dump(decode(KVDump, data))
        except (NoResponders, RequestTimeout, DecodeError, ValueError) as exc:
            log.warning("kv dump of %s failed: %r; its cache counts as empty", key, exc)
            self._resync_after[key] = self.clock() + RESYNC_BACKOFF_S
            self.num_dumps["failed"] += 1
            return
        self.num_dumps["applied"] += 1
        log.info("kv dump of %s applied", key)
