"""The Bus interface: core pub/sub and request/reply, one durable stream kind, a TTL'd KV bucket.

Services depend on this Protocol only, so one process's logic can be tested on ``InMemoryBus``
while system tests run the same code over ``NatsBus`` and a real nats-server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol


class NoResponders(Exception):
    """A request found nobody subscribed to its subject."""


class RequestTimeout(Exception):
    """A request got no reply in time."""


@dataclass(frozen=True, slots=True)
class Message:
    subject: str
    data: bytes
    reply: str = ""  # set on requests: answer with Bus.respond
    seq: int = 0  # stream sequence, on durable subscriptions only


MessageHandler = Callable[[Message], Awaitable[None]]
# Called with False when the connection to the bus is lost and True when it is back. Step outputs
# and replies in flight across a loss may be gone: listeners fail what depended on them.
ConnectionListener = Callable[[bool], None]


class Subscription(Protocol):
    async def unsubscribe(self) -> None: ...


class Bus(Protocol):
    """Handlers of one subscription run one at a time, in arrival order."""

    async def publish(self, subject: str, data: bytes) -> None: ...

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes: ...

    async def respond(self, msg: Message, data: bytes) -> None: ...

    async def subscribe(self, subject: str, handler: MessageHandler, queue: str = "") -> Subscription: ...

    async def ensure_stream(self, name: str, subjects: list[str], max_age_s: float) -> None: ...

    async def publish_durable(self, subject: str, data: bytes) -> int:
        """Publish into the stream that captures ``subject``; returns the stream sequence."""
        ...

    async def subscribe_durable(
        self, subject: str, handler: MessageHandler, start_seq: int = 0
    ) -> Subscription:
        """Ordered delivery from ``start_seq`` (0: only new messages)."""
        ...

    async def stream_last_seq(self, name: str, subject: str = "") -> int:
        """The sequence of the newest message in stream ``name`` (0: empty), or of the newest on
        ``subject`` (0: none)."""
        ...

    async def ensure_kv(self, bucket: str, ttl_s: float) -> None:
        """Create the bucket if needed; ``ttl_s`` 0 keeps entries until deleted."""
        ...

    async def kv_get(self, bucket: str, key: str) -> bytes | None: ...

    async def kv_put(self, bucket: str, key: str, value: bytes) -> None: ...

    async def kv_delete(self, bucket: str, key: str) -> None: ...

    async def kv_items(self, bucket: str) -> dict[str, bytes]: ...

    @property
    def connected(self) -> bool: ...

    def add_connection_listener(self, listener: ConnectionListener) -> None: ...

    async def close(self) -> None: ...
