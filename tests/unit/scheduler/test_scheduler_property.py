"""Random arrivals, finishes and cancellations through the scheduler core and a fake worker.

The KV pool is small so preemption happens often; plans run with and without overlap (a second
plan made before the first one's result). After every step the core's integrity holds, and every
sequence that finished on its own produced exactly what it produces running alone.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from libs.protocol.messages import FinishReason, SamplingParams
from services.scheduler.scheduler import Limits, Scheduler
from services.scheduler.sequence import Sequence
from tests.unit.scheduler.fake_worker import EOS, FakeWorker, reference_output

BLOCK_SIZE = 4
NUM_BLOCKS = 40
MAX_MODEL_LEN = 96


def random_request(rng: random.Random, request_id: str) -> Sequence:
    prompt = [rng.randrange(3, 50) for _ in range(rng.randint(1, 40))]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=rng.randint(1, 30),
        min_tokens=rng.choice([0, 0, 3]),
        n=rng.choice([1, 1, 1, 2, 3]),
    )
    return Sequence(request_id, "gw", prompt, params, EOS, priority=rng.choice([0, 0, 1, 2]))


def run(seed: int, overlap: bool, num_requests: int) -> tuple[int, int]:
    rng = random.Random(seed)
    limits = Limits(NUM_BLOCKS, BLOCK_SIZE, 8, MAX_MODEL_LEN, rng.choice([16, 32, 64]), 64, 0.01)
    sched = Scheduler(limits)
    worker = FakeWorker(BLOCK_SIZE)
    in_flight: deque[tuple[tuple[str, ...], list[int]]] = deque()
    prompts: dict[str, Sequence] = {}
    num_added = num_checked = 0
    while num_added < num_requests or sched.has_work() or in_flight:
        for _ in range(rng.choice([0, 0, 1, 2])):
            if num_added < num_requests and sched.num_waiting < 48:
                seq = random_request(rng, f"r{num_added}")
                for choice in sched.add(seq):
                    prompts[choice.seq_id] = choice
                num_added += 1
        if rng.random() < 0.05 and sched.seqs:
            victim = rng.choice(sorted(sched.seqs))
            assert all(s.finish_reason is FinishReason.ABORT for s in sched.abort(victim.split("#")[0]))
            sched.check_integrity()
        sent = False
        if sched.has_work():
            plan = sched.schedule()
            sched.check_integrity()
            if plan.num_scheduled_seqs or plan.finished_seq_ids:
                in_flight.append(worker.execute(plan))  # the worker runs plans in order
                sent = True
        if in_flight and (len(in_flight) == (2 if overlap else 1) or not sent):
            for seq in sched.postprocess(*in_flight.popleft()):
                if seq.is_finished and seq.finish_reason is not FinishReason.ABORT:
                    p = seq.sampling_params
                    want = reference_output(seq.prompt_token_ids, p.max_tokens, MAX_MODEL_LEN, p.min_tokens)
                    assert seq.output_token_ids == want, seq.seq_id
                    num_checked += 1
            sched.check_integrity()
    assert sched.block_manager.num_free_blocks == NUM_BLOCKS
    num_preemptions = sum(s.num_preemptions for s in prompts.values())
    return num_checked, num_preemptions


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_traffic_keeps_integrity_and_outputs(seed: int, overlap: bool) -> None:
    num_checked, num_preemptions = run(seed, overlap, num_requests=1000)
    assert num_checked > 1000  # n > 1 requests add choices; a few are cancelled
    assert num_preemptions > 10  # the small pool forces recompute, so that path is exercised
