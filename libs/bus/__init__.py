"""The message bus every service talks through: a small interface, a NATS and an in-memory one."""

from libs.bus.base import (
    Bus,
    ConnectionListener,
    Message,
    MessageHandler,
    NoResponders,
    RequestTimeout,
    Subscription,
)

__all__ = [
    "Bus",
    "ConnectionListener",
    "Message",
    "MessageHandler",
    "NoResponders",
    "RequestTimeout",
    "Subscription",
]
