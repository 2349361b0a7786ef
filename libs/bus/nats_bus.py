"""Bus over NATS (nats-py): core subjects, JetStream for step outputs and membership."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api

from libs.bus.base import Message, MessageHandler, NoResponders, RequestTimeout

log = logging.getLogger(__name__)

# Ordered consumers notice a lost server within ~2 heartbeats and resume from the last sequence.
IDLE_HEARTBEAT_S = 0.5
# Raised server-side too (see nats_server.py); a 1M-token prompt is 4 MB packed.
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024


class _NatsSubscription:
    def __init__(self, sub: Any) -> None:
        self._sub = sub

    async def unsubscribe(self) -> None:
        # already gone with the connection
        with contextlib.suppress(nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
            await self._sub.unsubscribe()


class NatsBus:
    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._kv: dict[str, Any] = {}

    @classmethod
    async def connect(cls, url: str, name: str) -> NatsBus:
        async def on_error(exc: Exception) -> None:
            log.warning("nats: %s", exc)

        nc = await nats.connect(
            url,
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
            error_cb=on_error,
        )
        return cls(nc)

    async def publish(self, subject: str, data: bytes) -> None:
        await self._nc.publish(subject, data)

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        try:
            msg = await self._nc.request(subject, data, timeout=timeout)
        except nats.errors.NoRespondersError as exc:
            raise NoResponders(subject) from exc
        except nats.errors.TimeoutError as exc:
            raise RequestTimeout(subject) from exc
        return msg.data

    async def respond(self, msg: Message, data: bytes) -> None:
        await self._nc.publish(msg.reply, data)

    async def subscribe(self, subject: str, handler: MessageHandler, queue: str = "") -> _NatsSubscription:
        async def cb(msg: Msg) -> None:
            await handler(Message(msg.subject, msg.data, reply=msg.reply or ""))

        return _NatsSubscription(await self._nc.subscribe(subject, queue=queue, cb=cb))

    async def ensure_stream(self, name: str, subjects: list[str], max_age_s: float) -> None:
        config = api.StreamConfig(
            name=name, subjects=subjects, storage=api.StorageType.FILE, max_age=max_age_s
        )
        try:
            await self._js.add_stream(config)
        except nats.js.errors.BadRequestError:
            await self._js.update_stream(config)  # exists with other limits: ours win

    async def publish_durable(self, subject: str, data: bytes) -> int:
        ack = await self._js.publish(subject, data)
        return int(ack.seq)

    async def subscribe_durable(
        self, subject: str, handler: MessageHandler, start_seq: int = 0
    ) -> _NatsSubscription:
        async def cb(msg: Msg) -> None:
            await handler(Message(msg.subject, msg.data, seq=msg.metadata.sequence.stream))

        config = api.ConsumerConfig()
        if start_seq:
            config.deliver_policy = api.DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = start_seq
        else:
            config.deliver_policy = api.DeliverPolicy.NEW
        sub = await self._js.subscribe(
            subject, cb=cb, ordered_consumer=True, idle_heartbeat=IDLE_HEARTBEAT_S, config=config
        )
        return _NatsSubscription(sub)

    async def stream_last_seq(self, name: str) -> int:
        info = await self._js.stream_info(name)
        return int(info.state.last_seq)

    async def ensure_kv(self, bucket: str, ttl_s: float) -> None:
        try:
            self._kv[bucket] = await self._js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            config = api.KeyValueConfig(bucket=bucket, ttl=ttl_s, storage=api.StorageType.FILE)
            try:
                self._kv[bucket] = await self._js.create_key_value(config)
            except nats.js.errors.BadRequestError:  # another process created it first
                self._kv[bucket] = await self._js.key_value(bucket)

    async def kv_put(self, bucket: str, key: str, value: bytes) -> None:
        await self._kv[bucket].put(key, value)

    async def kv_delete(self, bucket: str, key: str) -> None:
        await self._kv[bucket].purge(key)

    async def kv_get(self, bucket: str, key: str) -> bytes | None:
        try:
            entry = await self._kv[bucket].get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value or None

    async def kv_items(self, bucket: str) -> dict[str, bytes]:
        kv = self._kv[bucket]
        try:
            keys = await kv.keys()
        except nats.js.errors.NoKeysError:
            return {}
        items: dict[str, bytes] = {}
        for key in keys:
            try:
                entry = await kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                continue  # expired or deleted between keys() and get()
            if entry.value:
                items[key] = entry.value
        return items

    async def close(self) -> None:
        if not self._nc.is_closed:
            await self._nc.drain()
