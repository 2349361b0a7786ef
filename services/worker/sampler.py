"""Turn a step's logits into tokens: greedy, or temperature + top-p with per-request seeds.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) draws from p, so seeded and
unseeded rows share one code path and a seeded row only needs its own noise generator.
"""

from __future__ import annotations

import torch

from libs.protocol.messages import SamplingParams


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._generator = torch.Generator()
        if seed is not None:
            self._generator.manual_seed(seed)
        else:
            self._generator.seed()

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        # logits: [num_seqs, vocab] float32; one SamplingParams and optional generator per row
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows)
            temps = torch.tensor([params[i].temperature for i in sampled_rows]).unsqueeze(1)
            probs = torch.softmax(logits[rows] / temps, dim=-1)
            top_ps = torch.tensor([params[i].top_p for i in sampled_rows])
            probs = top_p_filter(probs, top_ps)
            noise = torch.empty_like(probs)
            for j, i in enumerate(sampled_rows):
                noise[j].exponential_(generator=generators[i] or self._generator)
            tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens.tolist()  # type: ignore[no-any-return]


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail outside the smallest set whose mass reaches top_p (the top token always stays)."""
    if bool((top_p >= 1.0).all()):
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [num_seqs, vocab]
    remove = mass_before >= top_p.unsqueeze(1)
    remove[:, 0] = False
    sorted_probs[remove] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
