"""Sampling ops: penalties, temperature + top-k/top-p/min-p filtering, and inverse-CDF draws.

Each op has a plain-torch reference (``*_ref``, or the torch op itself for ``argmax`` / ``topk``)
beside the variant the sampler uses. On CPU the fast variants avoid what is slow there: full-vocab
sorts (top-k and top-p rank a few candidates), torch's scalar argmax and topk (both first rank
vectorised block maxima), long sequential cumsums (draws search block sums first) and
[rows, vocab] count tensors (penalties touch only the tokens a row has seen). On CUDA the filter
runs flashinfer's kernels. ``sample_ref`` is the whole sampler in plain torch: the oracle of the
tests and the baseline of ``bench/sampling.py``.

A draw is an inverse CDF over the row's filtered distribution in token-id order, driven by one
uniform per row. ``uniform_from_seed`` makes that uniform a pure function of (seed, step), so a
seeded row's token depends on its logits, its seed and its step only: not on its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from libs.kernels import flashinfer_available

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15
_TOPK_MAX = 1024  # beyond this many candidates one full sort of the rows is cheaper than topk
_NUCLEUS_STEPS = (32, 512)  # candidate counts tried before a full sort when only top_p cuts
_SELECT_BLOCK = 32  # argmax and topk rank block maxima first, then the best blocks' values
_CDF_BLOCK = 256  # draws over more columns than this search block sums first


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit ints with full avalanche."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_from_seed(seed: int, step: int) -> float:
    """The uniform in [0, 1) that draws a seeded row's ``step``-th token (0 = first output).

    It is the ``step``-th output of a SplitMix64 stream whose state starts at mix(seed): no
    generator object, about a microsecond. 52 bits keep ``u * total`` strictly below ``total``.
    """
    state = (_mix64(seed & _MASK64) + (step + 1) * _GOLDEN64) & _MASK64
    return (_mix64(state) >> 12) / float(1 << 52)


class RowParams(Protocol):
    """The sampling settings of one row that the sampler reads (the protocol's SamplingParams has
    them; kernels know no wire types)."""

    @property
    def temperature(self) -> float: ...

    @property
    def top_k(self) -> int: ...

    @property
    def top_p(self) -> float: ...

    @property
    def min_p(self) -> float: ...

    @property
    def repetition_penalty(self) -> float: ...

    @property
    def presence_penalty(self) -> float: ...

    @property
    def frequency_penalty(self) -> float: ...

    @property
    def min_tokens(self) -> int: ...

    @property
    def greedy(self) -> bool: ...

    @property
    def logit_bias(self) -> Sequence[TokenBiasEntry]: ...


class TokenBiasEntry(Protocol):
    """One ``logit_bias`` entry: ``bias`` added to the logit of ``token_id``."""

    @property
    def token_id(self) -> int: ...

    @property
    def bias(self) -> float: ...


class SamplingRow(Protocol):
    """What sampling reads of a sequence (the worker's SequenceState is one)."""

    @property
    def token_ids(self) -> list[int]: ...  # prompt + outputs

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def sampling_params(self) -> RowParams: ...

    @property
    def stop_token_ids(self) -> frozenset[int]: ...  # masked while outputs < min_tokens


# --- penalties ------------------------------------------------------------------------------


def apply_penalties_ref(
    logits: Tensor, seen: Tensor, output: Tensor, repetition: Tensor, presence: Tensor, frequency: Tensor
) -> Tensor:
    """vLLM's penalties over dense [rows, vocab] masks and counts; returns a new tensor.

    logits: [rows, vocab]; seen: [2, n] (row, token) pairs of prompt + output tokens; output: [2, m]
    pairs of output tokens (repeats count); repetition / presence / frequency: [rows].
    """
    seen_mask = torch.zeros_like(logits, dtype=torch.bool)
    seen_mask[seen[0], seen[1]] = True
    counts = torch.zeros_like(logits)
    counts.index_put_((output[0], output[1]), torch.ones_like(output[0], dtype=logits.dtype), accumulate=True)
    rep, pres, freq = (v.to(logits.dtype)[:, None] for v in (repetition, presence, frequency))
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    out = torch.where(seen_mask, penalised, logits)
    return out - freq * counts - pres * (counts > 0)


def apply_penalties(
    logits: Tensor, seen: Tensor, output: Tensor, repetition: Tensor, presence: Tensor, frequency: Tensor
) -> Tensor:
    """``apply_penalties_ref`` in place, touching only the listed tokens: O(tokens), not O(vocab).

    Repeated pairs need no dedup: a gather-modify-write of a repeated position writes the same
    value each time, and ``index_add_`` sums the per-occurrence frequency term. logits must be
    contiguous and every token id < vocab; returns logits. Pass seen/output on the host (they are
    moved to logits' device here): the vocab check then reads no device memory.
    """
    flat = logits.view(-1)
    vocab, device, dtype = logits.shape[1], logits.device, logits.dtype
    # A token past the vocab would silently land in the next row's logits. Checked before the
    # pairs move: on the host (as the sampler passes them) the max costs no device sync.
    assert all(int(pairs[1].max()) < vocab for pairs in (seen, output) if pairs.shape[1]), "token id >= vocab"
    seen, output = seen.to(device), output.to(device)
    repetition, presence, frequency = (v.to(device, dtype) for v in (repetition, presence, frequency))
    if seen.shape[1]:
        index = seen[0] * vocab + seen[1]
        values = flat[index]
        rep = repetition[seen[0]]
        flat[index] = torch.where(values > 0, values / rep, values * rep)
    if output.shape[1]:
        index = output[0] * vocab + output[1]
        flat[index] = flat[index] - presence[output[0]]
        flat.index_add_(0, index, -frequency[output[0]])
    return logits


# --- temperature, top-k, top-p, min-p -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Candidates:
    """Some rows' filtered distribution, columns in ascending token id.

    probs: [num, m] unnormalised, zero where filtered out; token_ids: [num, m], or None when column
    j is token j (m = vocab); rows: [num] int64, rows of the filter's input.
    """

    rows: Tensor
    probs: Tensor
    token_ids: Tensor | None


def top_k_top_p_min_p_filter_ref(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor
) -> Tensor:
    """Normalised [rows, vocab] probs of logits / temperature after top-k (0 = off), top-p over the
    top-k renormalised distribution (1 = off; the top token stays) and min-p (0 = off)."""
    vocab = logits.shape[1]
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    sorted_probs = sorted_probs.masked_fill(torch.arange(vocab) >= k, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove = (mass_before >= top_p[:, None]) | (sorted_probs < min_p[:, None] * sorted_probs[:, :1])
    remove[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(remove, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def top_k_top_p_min_p_filter(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor
) -> list[Candidates]:
    """The distributions of ``top_k_top_p_min_p_filter_ref``, as candidate blocks covering every row.

    logits: [rows, vocab], not modified; temperature (> 0), top_k, top_p, min_p: [rows] CPU tensors.
    On CPU, rows are grouped by what cuts them: a top-k row needs only its k best logits; a row cut
    by top-p alone takes the 32, then 512 most likely tokens and sorts the row only if its nucleus
    is wider; a row without either keeps the whole vocab (min-p is a threshold there). A row's
    group depends on its own parameters only.
    """
    if logits.is_cuda and flashinfer_available():
        return [_filter_flashinfer(logits, temperature, top_k, top_p, min_p)]
    vocab = logits.shape[1]
    by_k: list[int] = []
    nucleus: list[int] = []
    dense: list[int] = []
    for i, (k, p) in enumerate(zip(top_k.tolist(), top_p.tolist(), strict=True)):
        (by_k if 0 < k < vocab else nucleus if p < 1.0 else dense).append(i)
    blocks = []
    if by_k:
        blocks.append(_top_k_block(logits, torch.tensor(by_k), temperature, top_k, top_p, min_p))
    if nucleus:
        rows = torch.tensor(nucleus)
        blocks += _nucleus_blocks(rows, _softmax(_take(logits, rows), temperature[rows]), top_p, min_p)
    if dense:
        rows = torch.tensor(dense)
        blocks.append(_dense_block(rows, _softmax(_take(logits, rows), temperature[rows]), min_p[rows]))
    return blocks


def argmax(x: Tensor) -> Tensor:
    """``x.argmax(dim=-1)`` of [rows, n] (ties to the first), via block maxima: the first block that
    holds the row's max holds its first argmax. On CPU amax is vectorised and argmax is not."""
    rows, n = x.shape
    if x.is_cuda or n % _SELECT_BLOCK or not x.is_contiguous():
        return x.argmax(dim=-1)
    blocks = x.view(rows, n // _SELECT_BLOCK, _SELECT_BLOCK)
    best = blocks.amax(dim=-1).argmax(dim=-1)  # [rows]
    return best * _SELECT_BLOCK + blocks[torch.arange(rows), best].argmax(dim=-1)


def topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``x.topk(k, dim=-1)`` of [rows, n] (descending; tied values may come in another order).

    The k largest lie in the k blocks with the largest maxima, so only those k * B values are
    ranked: about a fifth of the work of ``torch.topk`` for the k of sampling and logprobs.
    """
    rows, n = x.shape
    if x.is_cuda or n % _SELECT_BLOCK or k * _SELECT_BLOCK * 8 > n or not x.is_contiguous():
        return x.topk(k, dim=-1)
    blocks = x.view(rows, n // _SELECT_BLOCK, _SELECT_BLOCK)
    top_blocks = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [rows, k]
    candidates = blocks[torch.arange(rows)[:, None], top_blocks].view(rows, k * _SELECT_BLOCK)
    values, pos = candidates.topk(k, dim=-1)
    return values, top_blocks.gather(1, pos // _SELECT_BLOCK) * _SELECT_BLOCK + pos % _SELECT_BLOCK


def _take(x: Tensor, rows: Tensor) -> Tensor:
    """x[rows] without the copy when rows is every row in order (the common, homogeneous batch)."""
    if rows.numel() == x.shape[0] and bool((rows == torch.arange(x.shape[0])).all()):
        return x
    return x.index_select(0, rows)


def _softmax(x: Tensor, temperature: Tensor) -> Tensor:
    """softmax(x / t) of [r, vocab]; the division is skipped when every t is 1."""
    return torch.softmax(x if bool((temperature == 1.0).all()) else x / temperature[:, None], dim=-1)


def _most_likely(x: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """The m largest of each row, descending: values and token ids, each [rows, m]."""
    if m <= _TOPK_MAX:
        return topk(x, m)
    values, ids = x.sort(dim=-1, descending=True)
    return values[:, :m], ids[:, :m]


def _cut(probs: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Descending candidate probs [r, m] (normalised over the row) zeroed past the top-p mass and
    under min_p * the top prob, in place. The first column always stays."""
    mass_before = probs.cumsum(dim=-1) - probs
    remove = (mass_before >= top_p[:, None]) | (probs < min_p[:, None] * probs[:, :1])
    remove[:, 0] = False
    return probs.masked_fill_(remove, 0.0)


def _in_id_order(rows: Tensor, probs: Tensor, ids: Tensor, vocab: int) -> Candidates:
    """Reorder candidates by token id; a block as wide as the vocab becomes dense instead."""
    if ids.shape[1] == vocab:
        return Candidates(rows, torch.zeros_like(probs).scatter_(1, ids, probs), None)
    ids, order = ids.sort(dim=-1)
    return Candidates(rows, probs.gather(1, order), ids)


def _top_k_block(
    logits: Tensor, rows: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor
) -> Candidates:
    k = top_k[rows]
    values, ids = _most_likely(_take(logits, rows), int(k.max()))  # [r, k_max]
    # Temperature is monotone, so the top-k of logits / t are the top-k of logits, scaled.
    scaled = values / temperature[rows, None]
    scaled.masked_fill_(torch.arange(scaled.shape[1]) >= k[:, None], float("-inf"))
    probs = _cut(torch.softmax(scaled, dim=-1), top_p[rows], min_p[rows])  # renormalised over top-k
    return _in_id_order(rows, probs, ids, logits.shape[1])


def _nucleus_blocks(rows: Tensor, probs: Tensor, top_p: Tensor, min_p: Tensor) -> list[Candidates]:
    """Top-p (and min-p) rows; probs: [r, vocab] their full distributions."""
    vocab = probs.shape[1]
    blocks, pending = [], torch.arange(rows.numel())
    for m in (*_NUCLEUS_STEPS, vocab):
        values, ids = _most_likely(_take(probs, pending), min(m, vocab))
        values = _cut(values, top_p[rows[pending]], min_p[rows[pending]])
        # The kept set is a prefix of the descending candidates; once their last one is cut
        # (or underflows to 0), everything past it is cut too and the block is complete.
        done = values[:, -1] == 0 if m < vocab else torch.ones(pending.numel(), dtype=torch.bool)
        if bool(done.any()):
            blocks.append(_in_id_order(rows[pending[done]], values[done], ids[done], vocab))
        pending = pending[~done]
        if not pending.numel():
            break
    return blocks


def _dense_block(rows: Tensor, probs: Tensor, min_p: Tensor) -> Candidates:
    """Rows that keep the whole vocab but for min-p; probs: [r, vocab], thresholded in place."""
    thresholds = min_p * probs.amax(dim=-1)  # [r]
    # threshold_ keeps x > t; t one float32 step down keeps x >= min_p * max, as the reference does.
    below = torch.nextafter(thresholds, torch.zeros_like(thresholds)).tolist()
    for i, (threshold, t) in enumerate(zip(thresholds.tolist(), below, strict=True)):
        if threshold > 0:
            torch.threshold_(probs[i], t, 0.0)  # a row view; masked_fill_ is ~40x slower on CPU
    return Candidates(rows, probs, None)


def _filter_flashinfer(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor
) -> Candidates:
    """CUDA: flashinfer's top-k and top-p renormalisation (no sort), min-p as a threshold."""
    from flashinfer.sampling import top_k_renorm_probs, top_p_renorm_probs

    device, vocab = logits.device, logits.shape[1]
    probs = torch.softmax(logits / temperature.to(device)[:, None], dim=-1)
    if bool((top_k > 0).any()):
        probs = top_k_renorm_probs(probs, torch.where(top_k > 0, top_k, vocab).to(device, torch.int32))
    if bool((top_p < 1.0).any()):
        probs = top_p_renorm_probs(probs, top_p.to(device, torch.float32))
    if bool((min_p > 0).any()):
        threshold = min_p.to(device)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return Candidates(torch.arange(logits.shape[0]), probs, None)


# --- draws ----------------------------------------------------------------------------------


def sample_from_probs_ref(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Per row, the first column whose cumulative prob exceeds u * total (one full cumsum).

    probs: [rows, m] >= 0, unnormalised; uniforms: [rows] float64 in [0, 1). Returns [rows] int64.
    """
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    # held below the total, as rounding of u * total may reach it: never past the last kept column
    target = torch.minimum(uniforms.double().to(probs.device)[:, None] * total, total * (1.0 - 2.0**-40))
    return (cdf <= target).sum(dim=-1)


def sample_from_probs(probs: Tensor, uniforms: Tensor, token_ids: Tensor | None = None) -> Tensor:
    """``sample_from_probs_ref``, mapped through token_ids ([rows, m]) when given.

    Over more than _CDF_BLOCK columns it picks the block from block sums first, then the column
    inside it: one vectorised pass over probs instead of a sequential full-width cumsum.
    """
    m = probs.shape[1]
    uniforms = uniforms.double().to(probs.device)
    if m <= _CDF_BLOCK:
        cdf = probs.double().cumsum(dim=-1)
        cols = _search(cdf, uniforms * cdf[:, -1])
    else:
        full = m - m % _CDF_BLOCK
        # Summed in the input dtype (a float64 accumulator is 20x slower on CPU); a block sum's
        # rounding only moves mass between neighbouring blocks by ~1e-7 of it.
        sums = probs.unfold(1, _CDF_BLOCK, _CDF_BLOCK).sum(dim=-1)  # [rows, m // B]
        if full < m:
            sums = torch.cat([sums, probs[:, full:].sum(dim=-1, keepdim=True)], 1)
        sums = sums.double()
        block_cdf = sums.cumsum(dim=-1)
        target = uniforms * block_cdf[:, -1]
        block = _search(block_cdf, target)[:, None]  # [rows, 1]
        cols = block * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=probs.device)  # [rows, B]
        inside = probs.gather(1, cols.clamp_max(m - 1)).double().masked_fill_(cols >= m, 0.0)
        mass_before = (block_cdf.gather(1, block) - sums.gather(1, block)).squeeze(1)
        cols = block.squeeze(1) * _CDF_BLOCK + _search(inside.cumsum(dim=-1), target - mass_before)
    return cols if token_ids is None else token_ids.gather(1, cols[:, None]).squeeze(1)


def _search(cdf: Tensor, target: Tensor) -> Tensor:
    """First column whose running sum (cdf: [rows, n] float64) exceeds target ([rows]); [rows] int64.

    A zero weight never raises the running sum, so it is never the first to exceed the target.
    """
    # Rounding can push a target to the total; held just below it, the draw stays on the last
    # column with weight rather than running past it onto filtered (zero) columns.
    target = torch.minimum(target, cdf[:, -1] * (1.0 - 2.0**-40))
    return torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp_max(cdf.shape[1] - 1)


# --- the whole sampler, plainly -------------------------------------------------------------


def sample_ref(logits: Tensor, rows: Sequence[SamplingRow], uniforms: Tensor) -> Tensor:
    """The sampler in plain torch at full vocab width: logit bias, penalties, the min_tokens mask,
    then argmax for greedy rows and filter + draw (with uniforms: [rows] float64) for the others.
    Returns [rows] int64; logits ([rows, vocab]) are not modified."""
    params = [r.sampling_params for r in rows]
    logits = logits.clone()
    for i, p in enumerate(params):
        for entry in p.logit_bias:
            logits[i, entry.token_id] += entry.bias
    seen = [(i, t) for i, r in enumerate(rows) for t in r.token_ids]
    output = [(i, t) for i, r in enumerate(rows) for t in r.token_ids[r.num_prompt_tokens :]]
    logits = apply_penalties_ref(
        logits,
        torch.tensor(seen, dtype=torch.long).reshape(-1, 2).T,
        torch.tensor(output, dtype=torch.long).reshape(-1, 2).T,
        torch.tensor([p.repetition_penalty for p in params]),
        torch.tensor([p.presence_penalty for p in params]),
        torch.tensor([p.frequency_penalty for p in params]),
    )
    for i, r in enumerate(rows):
        if r.num_output_tokens < r.sampling_params.min_tokens:
            logits[i, [t for t in r.stop_token_ids if t < logits.shape[1]]] = float("-inf")
    token_ids = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        chosen = [params[i] for i in sampled]
        probs = top_k_top_p_min_p_filter_ref(
            logits[sampled],
            torch.tensor([p.temperature for p in chosen]),
            torch.tensor([p.top_k for p in chosen]),
            torch.tensor([p.top_p for p in chosen]),
            torch.tensor([p.min_p for p in chosen]),
        )
        token_ids[sampled] = sample_from_probs_ref(probs, uniforms[sampled])
    return token_ids
