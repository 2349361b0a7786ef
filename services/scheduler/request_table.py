"""The scheduler service's one table of requests: request -> its sequences -> the worker that holds
them, and what moving them has cost so far. Pure: no nats, asyncio or torch.

A request's choices are always on one worker (they share its prompt blocks there), so the table
places requests, and a move takes a whole request. Cancel, pause and resume find a request here
instead of asking every worker's core.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestEntry:
    request_id: str
    worker_id: str
    seq_ids: set[str]  # its unfinished sequences
    num_migrations: int = 0  # moves after the worker holding it was lost (bounded by a limit)
    num_crashes: int = 0  # worker crashes that found it in the batch: a suspect from the first


class RequestTable:
    def __init__(self) -> None:
        self._requests: dict[str, RequestEntry] = {}
        self._request_of: dict[str, str] = {}  # seq id -> request id
        self._on_worker: dict[str, set[str]] = {}  # worker id -> request ids

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def num_seqs(self) -> int:
        return len(self._request_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def get(self, request_or_seq_id: str) -> RequestEntry | None:
        """The entry of a request, found by its id or by one of its sequences' ids."""
        request_id = self._request_of.get(request_or_seq_id, request_or_seq_id)
        return self._requests.get(request_id)

    def add(
        self,
        request_id: str,
        seq_ids: list[str],
        worker_id: str,
        num_migrations: int = 0,
        num_crashes: int = 0,
    ) -> None:
        assert request_id not in self._requests, f"request {request_id} is in the table already"
        self._requests[request_id] = RequestEntry(
            request_id, worker_id, set(seq_ids), num_migrations, num_crashes
        )
        self._request_of.update((s, request_id) for s in seq_ids)
        self._on_worker.setdefault(worker_id, set()).add(request_id)

    def finish(self, seq_id: str) -> None:
        """A sequence ended; its request leaves the table with its last sequence. Idempotent."""
        request_id = self._request_of.pop(seq_id, None)
        if request_id is None:
            return
        entry = self._requests[request_id]
        entry.seq_ids.discard(seq_id)
        if not entry.seq_ids:
            del self._requests[request_id]
            self._leave(entry.worker_id, request_id)

    def move(self, request_id: str, worker_id: str) -> None:
        entry = self._requests[request_id]
        self._leave(entry.worker_id, request_id)
        entry.worker_id = worker_id
        self._on_worker.setdefault(worker_id, set()).add(request_id)

    def requests_on(self, worker_id: str) -> list[str]:
        """The requests placed on a worker, in id order (deterministic)."""
        return sorted(self._on_worker.get(worker_id, ()))

    def num_requests_on(self, worker_id: str) -> int:
        return len(self._on_worker.get(worker_id, ()))

    def _leave(self, worker_id: str, request_id: str) -> None:
        on_worker = self._on_worker[worker_id]
        on_worker.discard(request_id)
        if not on_worker:
            del self._on_worker[worker_id]

    def check_integrity(self) -> None:
        """Every sequence maps to its request, every request to one worker, both ways."""
        for request_id, entry in self._requests.items():
            assert entry.request_id == request_id
            assert entry.seq_ids, f"request {request_id} has no sequence left"
            assert request_id in self._on_worker.get(entry.worker_id, ()), "request not on its worker"
            for seq_id in entry.seq_ids:
                assert self._request_of.get(seq_id) == request_id, f"sequence {seq_id} maps elsewhere"
        assert len(self._request_of) == sum(len(e.seq_ids) for e in self._requests.values())
        for worker_id, request_ids in self._on_worker.items():
            assert request_ids, f"worker {worker_id} listed with no request"
            for request_id in request_ids:
                assert self._requests[request_id].worker_id == worker_id
