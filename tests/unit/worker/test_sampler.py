from __future__ import annotations

import torch

from libs.protocol.messages import SamplingParams
from services.worker.sampler import Sampler, top_p_filter


def test_top_p_keeps_the_smallest_head_reaching_p() -> None:
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25]])
    out = top_p_filter(probs.clone(), torch.tensor([0.7, 0.0]))
    assert torch.equal(out[0] > 0, torch.tensor([False, True, True, False]))
    assert int((out[1] > 0).sum()) == 1  # top_p=0 keeps only the top token


def test_greedy_rows_take_argmax_and_sampling_follows_distribution() -> None:
    logits = torch.log(torch.tensor([[0.05, 0.8, 0.15], [0.6, 0.3, 0.1]]))
    sampler = Sampler(seed=0)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    counts = torch.zeros(3)
    for _ in range(2000):
        greedy, sampled = sampler(logits, params, [None, None])
        assert greedy == 1
        counts[sampled] += 1
    assert torch.allclose(counts / counts.sum(), torch.tensor([0.6, 0.3, 0.1]), atol=0.05)
