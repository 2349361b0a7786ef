"""In-process Bus for service tests of one process's logic (system tests use NatsBus)."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from libs.bus.base import ConnectionListener, Message, MessageHandler, NoResponders, RequestTimeout


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard match: ``*`` is one token, a trailing ``>`` is one or more."""
    p_tokens, s_tokens = pattern.split("."), subject.split(".")
    for i, p in enumerate(p_tokens):
        if p == ">":
            return len(s_tokens) > i
        if i >= len(s_tokens) or (p != "*" and p != s_tokens[i]):
            return False
    return len(p_tokens) == len(s_tokens)


@dataclass(eq=False)
class _Subscription:
    bus: InMemoryBus
    subject: str
    handler: MessageHandler
    queue: str
    inbox: asyncio.Queue[Message] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        while True:
            msg = await self.inbox.get()
            await self.handler(msg)

    async def unsubscribe(self) -> None:
        self.bus._subs.discard(self)
        if self.task is not None:
            self.task.cancel()


@dataclass
class _Stream:
    subjects: list[str]
    messages: list[tuple[str, bytes]] = field(default_factory=list)


class InMemoryBus:
    def __init__(self) -> None:
        self._subs: set[_Subscription] = set()
        self._streams: dict[str, _Stream] = {}
        self._kv: dict[str, dict[str, tuple[bytes, float]]] = {}
        self._kv_ttl: dict[str, float] = {}
        self._inbox_ids = itertools.count()
        self._pending: dict[str, asyncio.Future[bytes]] = {}
        self._listeners: list[ConnectionListener] = []
        self.connected = True

    def add_connection_listener(self, listener: ConnectionListener) -> None:
        self._listeners.append(listener)

    def set_connected(self, connected: bool) -> None:
        """Tell the listeners the connection was lost or is back (messages still flow: a test
        of what a process does on the news, not of an outage)."""
        self.connected = connected
        for listener in self._listeners:
            listener(connected)

    async def publish(self, subject: str, data: bytes) -> None:
        self._deliver(Message(subject, data))

    def _deliver(self, msg: Message) -> int:
        if msg.subject in self._pending:
            fut = self._pending.pop(msg.subject)
            if not fut.done():
                fut.set_result(msg.data)
            return 1
        delivered = 0
        groups_done: set[str] = set()
        for sub in list(self._subs):
            if not subject_matches(sub.subject, msg.subject) or sub.queue in groups_done:
                continue
            if sub.queue:
                groups_done.add(sub.queue)  # a queue group gets each message once
            sub.inbox.put_nowait(msg)
            delivered += 1
        for stream in self._streams.values():
            if any(subject_matches(s, msg.subject) for s in stream.subjects):
                stream.messages.append((msg.subject, msg.data))
        return delivered

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        inbox = f"_INBOX.{next(self._inbox_ids)}"
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[inbox] = fut
        if self._deliver(Message(subject, data, reply=inbox)) == 0:
            self._pending.pop(inbox, None)
            raise NoResponders(subject)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError as exc:
            raise RequestTimeout(subject) from exc
        finally:
            self._pending.pop(inbox, None)

    async def respond(self, msg: Message, data: bytes) -> None:
        await self.publish(msg.reply, data)

    async def subscribe(self, subject: str, handler: MessageHandler, queue: str = "") -> _Subscription:
        sub = _Subscription(self, subject, handler, queue)
        sub.task = asyncio.create_task(sub.run())
        self._subs.add(sub)
        return sub

    async def ensure_stream(self, name: str, subjects: list[str], max_age_s: float) -> None:
        self._streams.setdefault(name, _Stream(subjects))

    async def publish_durable(self, subject: str, data: bytes) -> int:
        for stream in self._streams.values():
            if any(subject_matches(s, subject) for s in stream.subjects):
                seq = len(stream.messages) + 1
                for sub in list(self._subs):
                    if subject_matches(sub.subject, subject):
                        sub.inbox.put_nowait(Message(subject, data, seq=seq))
                stream.messages.append((subject, data))
                return seq
        raise NoResponders(f"no stream captures {subject}")

    async def subscribe_durable(
        self, subject: str, handler: MessageHandler, start_seq: int = 0
    ) -> _Subscription:
        sub = _Subscription(self, subject, handler, "")
        for stream in self._streams.values():
            for seq, (subj, data) in enumerate(stream.messages, start=1):
                if start_seq and seq >= start_seq and subject_matches(subject, subj):
                    sub.inbox.put_nowait(Message(subj, data, seq=seq))
        sub.task = asyncio.create_task(sub.run())
        self._subs.add(sub)
        return sub

    async def stream_last_seq(self, name: str, subject: str = "") -> int:
        messages = self._streams[name].messages
        if not subject:
            return len(messages)
        return max((seq for seq, (s, _) in enumerate(messages, start=1) if s == subject), default=0)

    async def ensure_kv(self, bucket: str, ttl_s: float) -> None:
        self._kv.setdefault(bucket, {})
        self._kv_ttl[bucket] = ttl_s

    async def kv_put(self, bucket: str, key: str, value: bytes) -> None:
        self._kv[bucket][key] = (value, time.monotonic())

    async def kv_delete(self, bucket: str, key: str) -> None:
        self._kv[bucket].pop(key, None)

    async def kv_get(self, bucket: str, key: str) -> bytes | None:
        value, put_at = self._kv[bucket].get(key, (None, 0.0))
        ttl = self._kv_ttl[bucket]
        return None if value is None or (ttl and put_at < time.monotonic() - ttl) else value

    async def kv_items(self, bucket: str) -> dict[str, bytes]:
        ttl = self._kv_ttl[bucket]
        deadline = time.monotonic() - ttl if ttl else -float("inf")
        return {k: v for k, (v, t) in self._kv[bucket].items() if t >= deadline}

    async def close(self) -> None:
        for sub in list(self._subs):
            await sub.unsubscribe()
