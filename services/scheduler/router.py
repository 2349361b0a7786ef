"""Pick the worker for a new request. Pure: takes plain numbers per worker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerState:
    worker_id: str
    num_seqs: int  # waiting + running on this worker, as this scheduler sees it
    max_num_seqs: int


def pick_worker(workers: list[WorkerState]) -> str | None:
    """Least loaded by fill ratio; ties go to the lowest id so the choice is deterministic."""
    if not workers:
        return None
    best = min(workers, key=lambda w: (w.num_seqs / max(w.max_num_seqs, 1), w.worker_id))
    return best.worker_id
