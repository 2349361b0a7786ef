"""How far one publisher's stream of KV events is applied to a consumer's view of a cache.

A publisher numbers its ``KVEvents`` messages from 1 at its start, +1 each. A consumer keeps one
cursor per stream: seq 1 restarts the view (the publisher's cache starts empty), the next seq
applies, an older one is ignored (a dump already covered it), and a gap, or a stream first met
mid-way, asks for a dump (``KVDump``) that replaces the view. Pure: no nats, asyncio or torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EventVerdict(enum.Enum):
    APPLY = enum.auto()  # the next message in order
    RESTART = enum.auto()  # seq 1: the publisher (re)started with an empty cache; clear, then apply
    IGNORE = enum.auto()  # already applied, or older than the dump in use
    RESYNC = enum.auto()  # a gap, or nothing to continue from: replace the view from a KVDump


@dataclass(slots=True)
class EventCursor:
    """How far one stream of KV events is applied to a view of its cache."""

    last_seq: int = 0
    synced: bool = False  # a dump or seq 1 was seen, and no gap since

    def accept(self, seq: int) -> EventVerdict:
        if seq == 1:
            self.last_seq, self.synced = 1, True
            return EventVerdict.RESTART
        if self.synced and seq == self.last_seq + 1:
            self.last_seq = seq
            return EventVerdict.APPLY
        if self.synced and seq <= self.last_seq:
            return EventVerdict.IGNORE
        self.synced = False
        return EventVerdict.RESYNC

    def resynced(self, dump_seq: int) -> None:
        """A dump as of ``dump_seq`` replaced the view: events up to it are ignored from now on."""
        self.last_seq, self.synced = dump_seq, True
