"""Turn a step's logits into tokens, with vLLM/OpenAI sampling semantics and raw-logit logprobs.

Order per row: logit bias (OpenAI's ``logit_bias``, added before the penalties, as vLLM does) ->
repetition penalty (prompt + output tokens) -> presence / frequency penalties (output tokens) ->
stop tokens masked while outputs < min_tokens -> the grammar mask, if any -> argmax for greedy
rows, or temperature -> top-k -> top-p -> min-p -> one draw. Rows that need a
step share one vectorised op from libs/kernels/sampling.py; an all-greedy batch with nothing else
to do is a single argmax (after the grammar mask).

A seeded row draws its k-th output with ``uniform_from_seed(seed, k)``, so what it samples does not
depend on its batch neighbours, its row, preemption and recompute, or overlap scheduling. Unseeded
rows share the sampler's generator.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from libs.kernels.sampling import (
    apply_penalties,
    argmax,
    sample_from_probs,
    top_k_top_p_min_p_filter,
    topk,
    uniform_from_seed,
)
from libs.kernels.token_mask import apply_bias
from libs.protocol.codec import pack_floats, pack_tokens
from libs.protocol.messages import Logprobs, SamplingParams


class SamplingState(Protocol):
    """What the sampler reads of a row's sequence (a SequenceState, or one verified position)."""

    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def stop_token_ids(self) -> frozenset[int]: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def num_output_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class GrammarMask:
    """Additive grammar biases for some rows: ``bias[j]`` (0 / -inf, [vocab]) goes to row ``rows[j]``."""

    rows: list[int]
    bias: torch.Tensor  # [len(rows), vocab] float32


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[Logprobs | None]  # one per row; None where the row did not ask


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._generator = torch.Generator()  # unseeded rows only
        if seed is not None:
            self._generator.manual_seed(seed)
        else:
            self._generator.seed()

    def __call__(
        self, logits: torch.Tensor, seqs: Sequence[SamplingState], grammar_mask: GrammarMask | None = None
    ) -> SamplerOutput:
        # logits: [num_rows, vocab] float32, may be modified in place; seqs: one per row
        params = [s.sampling_params for s in seqs]
        # rows whose stop tokens stay masked: fewer than min_tokens outputs so far
        masked = [
            i for i, s in enumerate(seqs) if s.num_output_tokens < params[i].min_tokens and s.stop_token_ids
        ]
        plain = all(p.greedy and not p.has_penalties and not p.logprobs and not p.logit_bias for p in params)
        if not masked and plain:
            if grammar_mask is not None:
                apply_bias(logits, grammar_mask.bias, _index(grammar_mask.rows, logits))
            token_ids: list[int] = argmax(logits).tolist()
            return SamplerOutput(token_ids, [None] * len(seqs))
        logits = logits.float().contiguous()  # no copy for the float32 logits of a model
        raw = _raw_logprobs(logits, params)  # before anything below changes logits
        _add_logit_bias(logits, params)
        _penalise(logits, seqs, params)
        _mask_stop_tokens(logits, seqs, masked)
        if grammar_mask is not None:
            apply_bias(logits, grammar_mask.bias, _index(grammar_mask.rows, logits))
        token_ids = self._sample(logits, seqs, params)
        return SamplerOutput(token_ids, _pack_logprobs(raw, token_ids, params))

    def _sample(
        self, logits: torch.Tensor, seqs: Sequence[SamplingState], params: list[SamplingParams]
    ) -> list[int]:
        num_rows = len(params)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        token_ids = [0] * num_rows
        if greedy:
            # Past half the batch, one argmax over every row is cheaper than gathering the rows first.
            if 2 * len(greedy) >= num_rows:
                best = argmax(logits).tolist()
                greedy_ids = [best[i] for i in greedy]
            else:
                greedy_ids = argmax(logits.index_select(0, _index(greedy, logits))).tolist()
            for i, token_id in zip(greedy, greedy_ids, strict=True):
                token_ids[i] = token_id
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            return token_ids
        x = logits if len(sampled) == num_rows else logits.index_select(0, _index(sampled, logits))
        chosen = [params[i] for i in sampled]
        blocks = top_k_top_p_min_p_filter(
            x,
            torch.tensor([p.temperature for p in chosen]),
            torch.tensor([p.top_k for p in chosen]),
            torch.tensor([p.top_p for p in chosen]),
            torch.tensor([p.min_p for p in chosen]),
        )
        uniforms = self._uniforms([seqs[i] for i in sampled])  # [num_sampled] float64
        for block in blocks:
            picked = sample_from_probs(block.probs, uniforms[block.rows], block.token_ids).tolist()
            for row, token_id in zip(block.rows.tolist(), picked, strict=True):
                token_ids[sampled[row]] = token_id
        return token_ids

    def _uniforms(self, seqs: Sequence[SamplingState]) -> torch.Tensor:
        """One uniform in [0, 1) per row: (seed, outputs so far) for a seeded row, else the generator's."""
        draws = torch.randint(0, 1 << 52, (len(seqs),), generator=self._generator, dtype=torch.float64)
        values: list[float] = (draws / float(1 << 52)).tolist()
        for j, s in enumerate(seqs):
            seed = s.sampling_params.seed
            if seed is not None:
                values[j] = uniform_from_seed(seed, s.num_output_tokens)
        return torch.tensor(values, dtype=torch.float64)


def _raw_logprobs(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[list[int], torch.Tensor] | None:
    """The rows that asked for logprobs and the log_softmax of their raw logits: [num_asked, vocab]."""
    rows = [i for i, p in enumerate(params) if p.logprobs]
    if not rows:
        return None
    x = logits if len(rows) == len(params) else logits.index_select(0, _index(rows, logits))
    return rows, torch.log_softmax(x, dim=-1)


def _pack_logprobs(
    raw: tuple[list[int], torch.Tensor] | None, token_ids: list[int], params: list[SamplingParams]
) -> list[Logprobs | None]:
    out: list[Logprobs | None] = [None] * len(params)
    if raw is None:
        return out
    rows, logprobs = raw
    vocab = logprobs.shape[1]
    chosen = _index([token_ids[i] for i in rows], logprobs)[:, None]
    chosen_logprobs: list[float] = logprobs.gather(1, chosen).squeeze(1).tolist()
    num_top = min(max(params[i].top_logprobs for i in rows), vocab)
    top_logprobs: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if num_top:
        values, ids = topk(logprobs, num_top)  # [num_asked, num_top], most likely first
        top_logprobs, top_ids = values.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        n = min(params[i].top_logprobs, vocab)
        out[i] = Logprobs(
            token_logprobs=pack_floats([chosen_logprobs[j]]),
            top_token_ids=pack_tokens(top_ids[j][:n]),
            top_logprobs=pack_floats(top_logprobs[j][:n]),
            num_top=n,
        )
    return out


def _add_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Each row's ``logit_bias`` added to its logits (ids past the logits' width are none of the
    model's: the gateway refuses them, and here they change nothing)."""
    entries = [(i, b) for i, p in enumerate(params) for b in p.logit_bias if b.token_id < logits.shape[1]]
    if entries:
        rows = torch.tensor([i for i, _ in entries])
        cols = torch.tensor([b.token_id for _, b in entries])
        values = torch.tensor([b.bias for _, b in entries], dtype=logits.dtype)
        logits.index_put_((rows, cols), values, accumulate=True)


def _penalise(logits: torch.Tensor, seqs: Sequence[SamplingState], params: list[SamplingParams]) -> None:
    repeat = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    counted = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if not repeat and not counted:
        return
    apply_penalties(
        logits,
        _token_pairs([(i, seqs[i].token_ids) for i in repeat]),
        _token_pairs([(i, seqs[i].output_token_ids) for i in counted]),
        torch.tensor([p.repetition_penalty for p in params]),
        torch.tensor([p.presence_penalty for p in params]),
        torch.tensor([p.frequency_penalty for p in params]),
    )


def _token_pairs(rows: list[tuple[int, list[int]]]) -> torch.Tensor:
    """[2, n] (row, token) pairs of every listed row's tokens, in one tensor build."""
    rows = [(i, token_ids) for i, token_ids in rows if token_ids]
    if not rows:
        return torch.empty(2, 0, dtype=torch.long)
    # array -> frombuffer is ~10x faster than torch.tensor over a long Python list
    tokens = torch.cat([torch.frombuffer(array("q", token_ids), dtype=torch.long) for _, token_ids in rows])
    row_ids = torch.repeat_interleave(
        torch.tensor([i for i, _ in rows]), torch.tensor([len(t) for _, t in rows])
    )
    return torch.stack([row_ids, tokens])


def _mask_stop_tokens(logits: torch.Tensor, seqs: Sequence[SamplingState], masked: list[int]) -> None:
    """Stop tokens to -inf in the rows still short of min_tokens outputs."""
    vocab = logits.shape[1]
    index = [i * vocab + t for i in masked for t in seqs[i].stop_token_ids if t < vocab]
    if index:
        logits.view(-1).index_fill_(0, _index(index, logits), float("-inf"))


def _index(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)
