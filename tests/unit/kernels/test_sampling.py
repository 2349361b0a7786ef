"""Sampling ops: each fast variant against its plain-torch reference, plus the seeded uniforms."""

from __future__ import annotations

import pytest
import torch

from libs.kernels.sampling import (
    Candidates,
    apply_penalties,
    apply_penalties_ref,
    argmax,
    sample_from_probs,
    sample_from_probs_ref,
    top_k_top_p_min_p_filter,
    top_k_top_p_min_p_filter_ref,
    topk,
    uniform_from_seed,
)


def _pairs(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2).T


def _dense(blocks: list[Candidates], num_rows: int, vocab: int) -> torch.Tensor:
    """Candidate blocks as normalised [rows, vocab] probs; every row must be in exactly one block."""
    out = torch.full((num_rows, vocab), float("nan"), dtype=torch.float64)
    for block in blocks:
        probs = block.probs.double()
        dense = probs if block.token_ids is None else torch.zeros(len(block.rows), vocab, dtype=torch.float64)
        if block.token_ids is not None:
            assert bool((block.token_ids.diff(dim=-1) > 0).all()), "candidates must be in token-id order"
            dense.scatter_(1, block.token_ids, probs)
        assert bool(out[block.rows].isnan().all()), "a row in two blocks"
        out[block.rows] = dense / dense.sum(dim=-1, keepdim=True)
    assert not bool(out.isnan().any()), "a row in no block"
    return out


# --- argmax and topk -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (5, 3000), (7, 4096), (64, 49152)])
def test_argmax_matches_torch_including_ties(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape, generator=g).to(dtype)
    x[0, -1] = x[0, 3] = 100.0  # a tie: the first index wins
    if shape[0] > 1:
        x[1] = 0.0  # all equal: index 0
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    assert int(argmax(x)[0]) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("shape", "k"), [((3, 100), 5), ((8, 4096), 1), ((8, 4096), 16), ((64, 49152), 64)])
def test_topk_matches_torch(dtype: torch.dtype, shape: tuple[int, int], k: int) -> None:
    g = torch.Generator().manual_seed(shape[1] + k)
    x = torch.randn(shape, generator=g).to(dtype)
    values, ids = topk(x, k)
    expected, _ = x.topk(k, dim=-1)
    assert torch.equal(values, expected)  # sorted, descending
    # ids may order tied values differently, but must point at those values, once each
    assert torch.equal(x.gather(1, ids), values)
    assert bool((ids.sort(dim=-1).values.diff(dim=-1) > 0).all())


# --- penalties ------------------------------------------------------------------------------


def test_penalties_exact_values_on_a_small_vocab() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    # row 0: prompt {0, 1}, outputs [3, 3, 1]; row 1: only counted penalties, outputs [2]
    seen = _pairs([(0, 0), (0, 1), (0, 3), (0, 3), (0, 1)])
    output = _pairs([(0, 3), (0, 3), (0, 1), (1, 2)])
    repetition = torch.tensor([2.0, 1.0])
    presence = torch.tensor([0.5, 0.25])
    frequency = torch.tensor([0.125, 1.0])
    expected = torch.tensor(
        [
            # 2/2; -1*2 - 0.5 - 0.125; untouched; 3/2 - 0.5 - 2*0.125; untouched
            [1.0, -2.625, 0.5, 0.75, -2.0],
            [1.0, 1.0, 1.0 - 0.25 - 1.0, 1.0, 1.0],
        ]
    )
    ref = apply_penalties_ref(logits, seen, output, repetition, presence, frequency)
    assert torch.equal(ref, expected)
    fast = logits.clone()
    assert apply_penalties(fast, seen, output, repetition, presence, frequency) is fast  # in place
    assert torch.equal(fast, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("num_rows", "vocab", "num_tokens"), [(1, 7, 3), (5, 100, 40), (17, 1000, 300)])
def test_penalties_fast_matches_reference(
    dtype: torch.dtype, num_rows: int, vocab: int, num_tokens: int
) -> None:
    g = torch.Generator().manual_seed(num_rows * vocab)
    logits = (torch.randn(num_rows, vocab, generator=g) * 4).to(dtype)
    # few distinct tokens per row, so positions repeat many times
    seen = torch.stack(
        [
            torch.randint(0, num_rows, (num_tokens,), generator=g),
            torch.randint(0, 9, (num_tokens,), generator=g),
        ]
    )
    output = seen[:, : num_tokens // 2]
    repetition = 1.0 + torch.rand(num_rows, generator=g)
    presence = torch.rand(num_rows, generator=g) * 2 - 1
    frequency = torch.rand(num_rows, generator=g) * 2 - 1
    ref = apply_penalties_ref(logits, seen, output, repetition, presence, frequency)
    fast = apply_penalties(logits.clone(), seen, output, repetition, presence, frequency)
    assert fast.dtype == dtype
    # bf16: the two order their roundings differently (one bf16 step is up to 0.06 here)
    atol, rtol = (0.1, 0.02) if dtype == torch.bfloat16 else (1e-5, 1.3e-6)
    torch.testing.assert_close(fast, ref, atol=atol, rtol=rtol)
    assert not torch.equal(fast, logits)  # the penalties did something


def test_penalties_with_no_tokens_change_nothing() -> None:
    logits = torch.randn(3, 10)
    none = torch.empty(2, 0, dtype=torch.long)
    penalties = torch.full((3,), 2.0)
    assert torch.equal(apply_penalties(logits.clone(), none, none, penalties, penalties, penalties), logits)


# --- filter ---------------------------------------------------------------------------------


FILTER_CASES = [
    # (temperature, top_k, top_p, min_p, logit scale): each row of a batch takes one case
    (1.0, 0, 1.0, 0.0, 3.0),  # nothing cut
    (0.7, 0, 1.0, 0.1, 3.0),  # min-p only: dense
    (1.0, 1, 1.0, 0.0, 3.0),  # top-1
    (1.3, 5, 1.0, 0.0, 3.0),
    (0.9, 40, 0.8, 0.0, 3.0),  # top-k then top-p on the top-k distribution
    (1.0, 40, 1.0, 0.05, 3.0),
    (1.0, 1500, 0.95, 0.0, 0.5),  # top-k beyond the topk limit: sorted
    (0.8, 0, 0.3, 0.0, 3.0),  # top-p alone, narrow nucleus: first candidate step
    (1.0, 0, 0.2, 0.0, 0.3),  # flat: nucleus of hundreds, second step
    (1.0, 0, 0.95, 0.0, 0.3),  # flat and wide: needs a full sort
    (1.0, 0, 0.99, 0.2, 3.0),  # min-p ends a wide nucleus in the first step
    (0.5, 0, 0.0, 0.0, 3.0),  # top_p 0 keeps the top token only
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("vocab", [50, 3000])
def test_filter_fast_matches_reference(dtype: torch.dtype, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    cases = FILTER_CASES * 2
    scale = torch.tensor([c[4] for c in cases])[:, None]
    logits = (torch.randn(len(cases), vocab, generator=g) * scale).to(dtype)
    params = [torch.tensor([c[i] for c in cases]) for i in range(4)]
    ref = top_k_top_p_min_p_filter_ref(logits, *params)
    blocks = top_k_top_p_min_p_filter(logits.clone(), *params)
    fast = _dense(blocks, len(cases), vocab)
    torch.testing.assert_close(fast, ref.double(), atol=1e-5, rtol=1e-4)
    kept = (ref > 0).sum(dim=-1)
    assert int(kept[2]) == 1 and int(kept[3]) == min(5, vocab) and int(kept[11]) == 1
    if vocab == 3000:
        assert len(blocks) == 5  # every path ran: top-k, three nucleus steps, dense
        assert int(kept[7]) <= 32 < int(kept[8]) <= 512 < int(kept[9])
        assert int(kept[10]) <= 32


def test_filter_keeps_the_input_and_puts_every_row_once() -> None:
    logits = torch.randn(6, 200)
    before = logits.clone()
    blocks = top_k_top_p_min_p_filter(
        logits,
        torch.ones(6),
        torch.tensor([0, 3, 0, 3, 0, 0]),
        torch.tensor([1.0, 1, 0.5, 0.5, 1, 1]),
        torch.zeros(6),
    )
    assert torch.equal(logits, before)
    assert sorted(r for b in blocks for r in b.rows.tolist()) == list(range(6))


# --- draws ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [1, 7, 256, 257, 1000, 5000])
def test_sample_fast_matches_reference(dtype: torch.dtype, width: int) -> None:
    g = torch.Generator().manual_seed(width)
    num_rows = 64
    probs = torch.rand(num_rows, width, generator=g, dtype=torch.float64).pow(8).to(dtype)
    probs[probs < 0.05] = 0.0  # filtered-out columns
    probs[:, torch.randint(0, width, (num_rows,), generator=g)] = 0.5  # at least one kept column per row
    uniforms = torch.rand(num_rows, generator=g, dtype=torch.float64)
    uniforms[:2] = torch.tensor([0.0, 1.0 - 2.0**-52])  # both ends of the range
    fast = sample_from_probs(probs, uniforms)
    assert torch.equal(fast, sample_from_probs_ref(probs, uniforms))
    assert bool((probs.gather(1, fast[:, None]) > 0).all()), "drew a filtered-out column"


def test_sample_maps_columns_through_token_ids() -> None:
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    token_ids = torch.tensor([[3, 8, 9], [1, 2, 7]])
    uniforms = torch.tensor([0.3, 0.9], dtype=torch.float64)
    assert sample_from_probs(probs, uniforms, token_ids).tolist() == [8, 7]


def test_draws_follow_the_probs() -> None:
    probs = torch.tensor([0.0, 0.5, 0.2, 0.0, 0.3]).repeat(20000, 1)
    uniforms = torch.rand(20000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    counts = torch.bincount(sample_from_probs(probs, uniforms), minlength=5).double()
    expected = probs[0].double() * 20000
    assert counts[0] == 0 and counts[3] == 0
    chi2 = float((((counts - expected) ** 2)[expected > 0] / expected[expected > 0]).sum())
    assert chi2 < 16.0  # 2 dof: p ~ 3e-4


# --- seeded uniforms ------------------------------------------------------------------------


def test_uniform_from_seed_is_a_function_of_seed_and_step() -> None:
    assert uniform_from_seed(7, 3) == uniform_from_seed(7, 3)
    assert uniform_from_seed(7, 3) != uniform_from_seed(7, 4) != uniform_from_seed(8, 4)
    assert uniform_from_seed(-1, 0) == uniform_from_seed(2**64 - 1, 0)  # seeds are taken mod 2**64


def test_uniform_from_seed_is_uniform_over_steps_and_seeds() -> None:
    for values in (
        [uniform_from_seed(123, k) for k in range(20000)],
        [uniform_from_seed(s, 0) for s in range(20000)],
    ):
        u = torch.tensor(values, dtype=torch.float64)
        assert bool(((u >= 0) & (u < 1)).all())
        counts = torch.histc(u, bins=20, min=0.0, max=1.0)
        chi2 = float(((counts - 1000) ** 2 / 1000).sum())
        assert chi2 < 50.0  # 19 dof: p ~ 1e-4
        # consecutive draws are uncorrelated
        assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.03


# --- CUDA -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flashinfer_filter_matches_reference() -> None:
    pytest.importorskip("flashinfer")
    g = torch.Generator().manual_seed(0)
    cases = [c for c in FILTER_CASES if c[2] > 0]  # flashinfer takes top_p in (0, 1]
    logits = torch.randn(len(cases), 3000, generator=g) * torch.tensor([c[4] for c in cases])[:, None]
    params = [torch.tensor([c[i] for c in cases]) for i in range(4)]
    ref = top_k_top_p_min_p_filter_ref(logits, *params)
    blocks = top_k_top_p_min_p_filter(logits.cuda(), *params)
    fast = _dense([Candidates(b.rows, b.probs.cpu(), None) for b in blocks], len(cases), 3000)
    torch.testing.assert_close(fast, ref.double(), atol=1e-4, rtol=1e-3)
    uniforms = torch.rand(len(cases), generator=g, dtype=torch.float64)
    drawn = sample_from_probs(blocks[0].probs, uniforms).cpu()
    assert torch.equal(drawn, sample_from_probs_ref(blocks[0].probs.cpu(), uniforms))
