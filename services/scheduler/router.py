"""Pick the worker for a new request: by cost (the prompt blocks it would not have to compute,
against its load), or in turn (round robin, the baseline the cost rule is measured against).
Pure: takes plain numbers per worker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerState:
    worker_id: str
    num_seqs: int  # waiting + running on this worker, as this scheduler sees it
    max_num_seqs: int
    num_cached_blocks: int = 0  # leading prompt blocks it holds in G1 or G2
    num_prompt_blocks: int = 0  # prompt blocks a hit could skip (all but the last token's)

    @property
    def has_room(self) -> bool:
        return self.num_seqs < self.max_num_seqs

    @property
    def load_fraction(self) -> float:
        return self.num_seqs / max(self.max_num_seqs, 1)

    @property
    def cached_fraction(self) -> float:
        return self.num_cached_blocks / self.num_prompt_blocks if self.num_prompt_blocks else 0.0

    @property
    def score(self) -> float:
        """Share of the prompt it need not compute, less the share of its slots taken: a full
        prefix hit is worth as much as an idle worker. G3 is left out: every worker reads it."""
        return self.cached_fraction - self.load_fraction


def pick_worker(workers: list[WorkerState]) -> str | None:
    """The best score among the workers with room (all of them when none has room); ties go to
    the less loaded, then to the lowest id, so the choice is deterministic."""
    if not workers:
        return None
    best = min(workers, key=lambda w: (not w.has_room, -w.score, w.load_fraction, w.worker_id))
    return best.worker_id


def pick_in_turn(workers: list[WorkerState], turn: int) -> str | None:
    """Round robin over the workers with room (all of them when none has room), in id order."""
    with_room = [w for w in workers if w.has_room] or workers
    if not with_room:
        return None
    ordered = sorted(w.worker_id for w in with_room)
    return ordered[turn % len(ordered)]


def pick_prefill_worker(
    num_uncached_tokens: int,
    queues: dict[str, int],
    min_uncached_tokens: int,
    max_queue: int,
) -> str | None:
    """Where to prefill a prompt that will decode elsewhere, or None: prefill where it decodes.

    Dynamo's rule: only when what the decode worker would have to compute of the prompt is long
    (``min_uncached_tokens``) and a prefill worker's queue (``queues``: worker id -> sequences
    waiting or running there) is short (below ``max_queue``); the shortest queue wins, then the
    lowest id.
    """
    if num_uncached_tokens < min_uncached_tokens:
        return None
    free = [(n, worker_id) for worker_id, n in queues.items() if n < max_queue]
    return min(free)[1] if free else None
