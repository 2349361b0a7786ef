"""Grammar mask ops: the bias path against the masked_fill reference, bit order, row subsets."""

from __future__ import annotations

import pytest
import torch

from libs.kernels.token_mask import (
    allocate_bitmask,
    apply_bias,
    apply_token_bitmask_ref,
    bitmask_to_bias,
)


def _random_bitmask(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = (vocab_size + 31) // 32
    return torch.randint(-(2**31), 2**31 - 1, (num_rows, words), dtype=torch.int32, generator=g)


@pytest.mark.parametrize("vocab_size", [32, 100, 49152, 49157])
@pytest.mark.parametrize("num_rows", [1, 3, 32])
def test_bias_matches_reference(num_rows: int, vocab_size: int) -> None:
    bitmask = _random_bitmask(num_rows, vocab_size, seed=num_rows * 7 + vocab_size)
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(1))
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask)
    apply_bias(logits, bitmask_to_bias(bitmask, vocab_size))
    assert torch.equal(logits, expected)


def test_bit_order_is_token_order() -> None:
    vocab_size = 70
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    for token_id in (0, 7, 8, 31, 32, 63, 69):
        bitmask[0, token_id // 32] |= torch.tensor(1 << (token_id % 32)).to(torch.int32)
    bias = bitmask_to_bias(bitmask, vocab_size)
    allowed = torch.nonzero(bias[0] == 0).flatten().tolist()
    assert allowed == [0, 7, 8, 31, 32, 63, 69]
    assert bias.shape == (1, vocab_size)


def test_row_subset_leaves_other_rows_alone() -> None:
    vocab_size = 64
    logits = torch.randn(4, vocab_size)
    before = logits.clone()
    bitmask = _random_bitmask(2, vocab_size, seed=3)
    apply_bias(logits, bitmask_to_bias(bitmask, vocab_size), rows=torch.tensor([1, 3]))
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for j, row in enumerate((1, 3)):
        expected = before[row : row + 1].clone()
        apply_token_bitmask_ref(expected, bitmask[j : j + 1])
        assert torch.equal(logits[row], expected[0])


def test_allocate_allows_everything() -> None:
    bias = bitmask_to_bias(allocate_bitmask(2, 100), 100)
    assert torch.count_nonzero(bias) == 0


def test_rejects_wrong_dtype() -> None:
    with pytest.raises(ValueError):
        bitmask_to_bias(torch.zeros(1, 2, dtype=torch.int64), 64)
