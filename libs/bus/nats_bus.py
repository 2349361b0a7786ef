"""Bus over NATS (nats-py): core subjects, JetStream for step outputs and membership."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api

from libs.bus.base import ConnectionListener, Message, MessageHandler, NoResponders, RequestTimeout
from libs.bus.nats_auth import NatsAuth

log = logging.getLogger(__name__)

# Ordered consumers notice a lost server within ~2 heartbeats and resume from the last sequence.
IDLE_HEARTBEAT_S = 0.5
# Raised server-side too (see nats_server.py); a 1M-token prompt is 4 MB packed.
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
RECONNECT_WAIT_S = 0.5  # between attempts to reach a server that is down
PING_INTERVAL_S = 5.0
ERROR_LOG_PERIOD_S = 30.0  # while the server is down, one line per kind of error this often


class _NatsSubscription:
    def __init__(self, sub: Any) -> None:
        self._sub = sub

    async def unsubscribe(self) -> None:
        # already gone with the connection
        with contextlib.suppress(nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
            await self._sub.unsubscribe()


class _RateLimitedLog:
    """At most one line per ``period_s`` for each kind of message; the rest are counted."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, text: str) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self.period_s) < self.period_s:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        suppressed = self._suppressed.pop(kind, 0)
        log.warning("%s%s", text, f" ({suppressed} more like it suppressed)" if suppressed else "")


class NatsBus:
    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._kv: dict[str, Any] = {}
        self._listeners: list[ConnectionListener] = []
        self._closing = False

    @classmethod
    async def connect(cls, url: str, name: str, auth: NatsAuth | None = None) -> NatsBus:
        """Reconnects forever (same URL): subscriptions are re-made by nats-py, ordered consumers
        resume from their last sequence, and listeners hear of every loss and return. ``auth``:
        the credentials and TLS settings of the connection (libs/bus/nats_auth.py)."""
        errors = _RateLimitedLog(ERROR_LOG_PERIOD_S)
        bus: NatsBus | None = None

        async def on_error(exc: Exception) -> None:
            # Every failed reconnect attempt lands here: one line per period, not one per attempt.
            errors.warning(type(exc).__name__, f"nats: {exc!r}")

        async def on_disconnect() -> None:
            if bus is None or bus._closing:
                return  # a clean close is no outage
            log.warning("nats: disconnected from %s; reconnecting", url)
            bus._notify(False)

        async def on_reconnect() -> None:
            log.warning("nats: reconnected to %s", url)
            if bus is not None:
                bus._notify(True)

        nc = await nats.connect(
            url,
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=RECONNECT_WAIT_S,
            # A peer that vanished without closing its socket is noticed after two missed pings.
            ping_interval=PING_INTERVAL_S,
            max_outstanding_pings=2,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            **(auth.connect_options() if auth is not None else {}),
        )
        bus = cls(nc)
        return bus

    @property
    def connected(self) -> bool:
        return bool(self._nc.is_connected)

    def add_connection_listener(self, listener: ConnectionListener) -> None:
        self._listeners.append(listener)

    def _notify(self, connected: bool) -> None:
        for listener in self._listeners:
            try:
                listener(connected)
            except Exception:  # one listener's bug must not stop the others or the client
                log.exception("connection listener failed")

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

    async def stream_last_seq(self, name: str, subject: str = "") -> int:
        if subject:
            try:
                return int((await self._js.get_last_msg(name, subject)).seq or 0)
            except nats.js.errors.NotFoundError:
                return 0
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
        """Every key's current value. The keys come from the stream's own subject state (one
        request the server answers from its index), not from ``kv.keys()``: that one builds a
        consumer and ends on a pending count that races with concurrent puts, and under load it
        returned listings missing live keys (a health check saw no worker while one heartbeated)."""
        kv = self._kv[bucket]
        prefix = f"$KV.{bucket}."
        info = await self._js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
        items: dict[str, bytes] = {}
        for subject in info.state.subjects or {}:
            key = subject[len(prefix) :]
            try:
                entry = await kv.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                continue  # expired, deleted or purged (a purge leaves a marker under the key)
            if entry.value:
                items[key] = entry.value
        return items

    async def close(self) -> None:
        self._closing = True  # a clean close is no outage to react to, nor to log
        if not self._nc.is_closed:
            await self._nc.drain()
