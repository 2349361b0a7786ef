"""The waiting queue of one worker's scheduler core, fair between tenants. Pure.

Order of admission: priority first (lower first; an API key's), then sequences moved here from a
lost worker or scheduler (their clients are mid-stream), then, between the tenants waiting at that
priority, the one served least per unit of weight, then arrival. Within one tenant it is first
come, first served. With a single tenant this is the plain (priority, arrival, choice) order.

Fairness is start-time fair queuing over admitted prompt tokens: each tenant has a virtual time,
advanced by ``cost / weight`` when one of its sequences is admitted (``charge``). A tenant that
floods the queue advances its own virtual time with every admission, so a tenant with a few
requests is admitted between its floods instead of after them; weights (from the API keys file)
give shares. A tenant that becomes active starts at the queue's virtual clock (the virtual time of
the latest tenant served), never below: idle time banks no credit. Prompt tokens are the cost
known at admission (output lengths are not); decode work evens out as sequences finish.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass

Order = tuple[int, int, int]  # (priority, arrival, choice index): Sequence.order


@dataclass(frozen=True, slots=True)
class Entry:
    order: Order
    seq_id: str
    tenant: str


class FairQueue:
    def __init__(self) -> None:
        self._queues: dict[str, list[tuple[Order, str]]] = {}  # tenant -> heap of its waiting
        self._entries: dict[str, Entry] = {}  # seq_id -> its entry
        self._vtime: dict[str, float] = {}  # tenant -> virtual time (admitted cost / weight)
        self.clock = 0.0  # the virtual time of the tenant served last

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._entries

    def push(self, seq_id: str, order: Order, tenant: str) -> None:
        """Queue a sequence (a tenant with nothing waiting starts at the clock)."""
        assert seq_id not in self._entries, f"{seq_id} is queued already"
        queue = self._queues.get(tenant)
        if not queue:
            self._vtime[tenant] = max(self._vtime.get(tenant, 0.0), self.clock)
            queue = self._queues[tenant] = []
        heapq.heappush(queue, (order, seq_id))
        self._entries[seq_id] = Entry(order, seq_id, tenant)

    def _key(self, tenant: str, head: Order) -> tuple[int, bool, float, Order]:
        """Which tenant's head goes first: priority, a moved sequence (negative arrival), the
        tenant's virtual time, then the head's own order."""
        return (head[0], head[1] >= 0, self._vtime[tenant], head)

    def _best_tenant(self) -> str | None:
        waiting = [t for t, q in self._queues.items() if q]
        return min(waiting, key=lambda t: self._key(t, self._queues[t][0][0])) if waiting else None

    def pop(self) -> Entry:
        """The next sequence to admit (it leaves the queue; ``requeue`` puts it back as it was)."""
        tenant = self._best_tenant()
        assert tenant is not None, "pop from an empty queue"
        _, seq_id = heapq.heappop(self._queues[tenant])
        self.clock = max(self.clock, self._vtime[tenant])
        return self._entries.pop(seq_id)

    def requeue(self, entry: Entry) -> None:
        """Put back a popped sequence that was not admitted, in its old place (no restart)."""
        heapq.heappush(self._queues.setdefault(entry.tenant, []), (entry.order, entry.seq_id))
        self._vtime.setdefault(entry.tenant, self.clock)  # (forgotten if another's charge made it idle)
        self._entries[entry.seq_id] = entry

    def charge(self, tenant: str, cost: float, weight: float) -> None:
        """An admitted sequence of ``tenant`` costs ``cost`` (its prompt tokens) at ``weight``."""
        assert weight > 0, weight
        self._vtime[tenant] = self._vtime.get(tenant, self.clock) + cost / weight
        self._forget_idle()

    def _forget_idle(self) -> None:
        """Tenants with nothing waiting and no lead over the clock start at the clock anyway."""
        idle = [t for t, q in self._queues.items() if not q and self._vtime.get(t, 0.0) <= self.clock]
        for tenant in idle:
            del self._queues[tenant]
            self._vtime.pop(tenant, None)

    def remove(self, seq_id: str) -> None:
        entry = self._entries.pop(seq_id)
        queue = self._queues[entry.tenant]
        queue.remove((entry.order, seq_id))
        heapq.heapify(queue)

    def clear(self) -> None:
        self._queues.clear()
        self._entries.clear()

    def peek(self, num: int) -> list[str]:
        """The next ``num`` sequences in the order ``pop`` would give them, were none charged."""
        heads = {t: sorted(q) for t, q in self._queues.items() if q}
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
            assert all(self._entries[s].tenant == tenant for _, s in queue)
            if queue:
                assert tenant in self._vtime, "a waiting tenant without a virtual time"
