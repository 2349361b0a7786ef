"""The waiting queue of one worker's scheduler core, fair between tenants. Pure.

Order of admission: priority first (lower first; an API key's), then sequences moved here from a
lost worker or scheduler (their clients are mid-stream), then, between the tenants waiting at that
priority, the one served least per unit of weight, then arrival. Within one tenant it is first
come, first served. With a single tenant this is the plain (priority, arrival, choice) order.

Fairness is start-time fair queuing over the tokens each admission brings to compute: each tenant
has a virtual time, advanced by ``cost / weight`` when one of its sequences is admitted
(``charge``). A tenant that floods the queue advances its own virtual time with every admission,
so a tenant with a few requests is admitted between its floods instead of after them; weights
(from the API keys file) give shares. A tenant that starts waiting starts at the virtual time of
the least-served tenant already waiting (or the queue's clock when none waits), never below its
own: idle time banks no credit, and a stream of new tenants cannot starve one that waits.

Memory: tenants with nothing waiting keep their virtual time only while it is ahead of where they
would start anyway, and at most ``MAX_IDLE_TENANTS`` of them (least recently charged forgotten
first): without API keys a tenant is a hash of whatever key a client sends.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

Order = tuple[int, int, int]  # (priority, arrival, choice index): Sequence.order
MAX_IDLE_TENANTS: Final = 4096


@dataclass(frozen=True, slots=True)
class Entry:
    order: Order
    seq_id: str
    tenant: str


class FairQueue:
    def __init__(self, max_idle_tenants: int = MAX_IDLE_TENANTS) -> None:
        self.max_idle_tenants = max_idle_tenants
        self._queues: dict[str, list[tuple[Order, str]]] = {}  # tenant -> heap (waiting tenants only)
        self._entries: dict[str, Entry] = {}  # seq_id -> its entry
        # tenant -> virtual time (admitted cost / weight), least recently charged first
        self._vtime: OrderedDict[str, float] = OrderedDict()
        self.clock = 0.0  # the virtual time of the tenant served last

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._entries

    def _start_time(self) -> float:
        """Where a tenant that starts waiting starts: the least-served waiting tenant, else the clock."""
        return min((self._vtime[t] for t in self._queues), default=self.clock)

    def push(self, seq_id: str, order: Order, tenant: str) -> None:
        """Queue a sequence (a tenant with nothing waiting starts at ``_start_time``)."""
        assert seq_id not in self._entries, f"{seq_id} is queued already"
        if tenant not in self._queues:
            self._vtime[tenant] = max(self._vtime.get(tenant, 0.0), self._start_time(), self.clock)
            self._queues[tenant] = []
        heapq.heappush(self._queues[tenant], (order, seq_id))
        self._entries[seq_id] = Entry(order, seq_id, tenant)

    def _key(self, tenant: str, head: Order) -> tuple[int, bool, float, Order]:
        """Which tenant's head goes first: priority, a moved sequence (negative arrival), the
        tenant's virtual time, then the head's own order."""
        return (head[0], head[1] >= 0, self._vtime[tenant], head)

    def pop(self) -> Entry:
        """The next sequence to admit (it leaves the queue; ``requeue`` puts it back as it was)."""
        assert self._queues, "pop from an empty queue"
        tenant = min(self._queues, key=lambda t: self._key(t, self._queues[t][0][0]))
        queue = self._queues[tenant]
        _, seq_id = heapq.heappop(queue)
        if not queue:
            del self._queues[tenant]
        self.clock = max(self.clock, self._vtime[tenant])
        return self._entries.pop(seq_id)

    def requeue(self, entry: Entry) -> None:
        """Put back a popped sequence that was not admitted, in its old place (no restart)."""
        self._vtime.setdefault(entry.tenant, self.clock)  # (forgotten meanwhile: starts at the clock)
        heapq.heappush(self._queues.setdefault(entry.tenant, []), (entry.order, entry.seq_id))
        self._entries[entry.seq_id] = entry

    def charge(self, tenant: str, cost: float, weight: float) -> None:
        """An admitted sequence of ``tenant`` costs ``cost`` (tokens to compute) at ``weight`` (> 0)."""
        assert weight > 0, weight
        self._vtime[tenant] = self._vtime.get(tenant, self.clock) + cost / weight
        self._vtime.move_to_end(tenant)
        self._forget_idle()

    def _forget_idle(self) -> None:
        """Idle tenants not ahead of the clock would start there anyway; past the cap, the least
        recently charged idle ones go."""
        num_idle = len(self._vtime) - len(self._queues)
        for tenant in list(self._vtime):
            if num_idle <= 0:
                break
            if tenant in self._queues:
                continue
            if self._vtime[tenant] <= self.clock or num_idle > self.max_idle_tenants:
                del self._vtime[tenant]
                num_idle -= 1
            else:
                break  # the rest were charged later: keep them while under the cap

    def remove(self, seq_id: str) -> None:
        entry = self._entries.pop(seq_id)
        queue = self._queues[entry.tenant]
        queue.remove((entry.order, seq_id))
        heapq.heapify(queue)
        if not queue:
            del self._queues[entry.tenant]

    def clear(self) -> None:
        self._queues.clear()
        self._entries.clear()

    def peek(self, num: int) -> list[str]:
        """The next ``num`` sequences in the order ``pop`` would give them, were none charged."""
        heads = {t: sorted(q) for t, q in self._queues.items()}
        out: list[str] = []
        while heads and len(out) < num:
            tenant = min(heads, key=lambda t: self._key(t, heads[t][0][0]))
            out.append(heads[tenant].pop(0)[1])
            if not heads[tenant]:
                del heads[tenant]
        return out

    def check_integrity(self) -> None:
        queued = {seq_id for q in self._queues.values() for _, seq_id in q}
        assert queued == set(self._entries), "entries and tenant queues disagree"
        assert sum(len(q) for q in self._queues.values()) == len(self._entries), "queued twice"
        for tenant, queue in self._queues.items():
            assert queue, "an empty tenant queue is kept"
            assert all(self._entries[s].tenant == tenant for _, s in queue)
            assert tenant in self._vtime, "a waiting tenant without a virtual time"
        assert len(self._vtime) - len(self._queues) <= self.max_idle_tenants, "too many idle tenants kept"
