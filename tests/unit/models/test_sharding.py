"""How weights split over ranks, in one process: the splits, the rank layout (and what the KV
fingerprint takes from it), and an expert-parallel rank's share of the routed experts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from libs.kernels.moe import routed_experts
from libs.modelfiles.deepseek_config import DeepseekV3Config
from libs.models.parallel import split_evenly
from libs.models.sharding import RankLayout
from libs.models.tiny_deepseek import tiny_config_json
from tests.tiny_models import TINY_LLAMA

SMOLLM2_LIKE = dataclasses.replace(TINY_LLAMA, num_attention_heads=9, num_key_value_heads=3)


def test_split_evenly() -> None:
    assert split_evenly(3, 2) == [range(0, 2), range(2, 3)]
    assert split_evenly(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    assert split_evenly(1536, 2) == [range(0, 768), range(768, 1536)]
    with pytest.raises(ValueError):
        split_evenly(2, 3)


def test_gqa_layout_splits_kv_head_groups_unevenly() -> None:
    layout = RankLayout.of(SMOLLM2_LIKE, 2, expert_parallel=False)
    assert layout.kv_heads == (range(0, 2), range(2, 3))
    assert [layout.num_heads(SMOLLM2_LIKE, r) for r in (0, 1)] == [6, 3]  # 3 query heads per KV head
    full = SMOLLM2_LIKE.kv_spec()
    assert [layout.kv_spec(full, r).num_kv_heads for r in (0, 1)] == [2, 1]
    assert layout.describe() == "tp2:kv0-2,2-3"
    assert RankLayout.of(SMOLLM2_LIKE, 1, False).describe() == ""  # one rank: fingerprints as before
    with pytest.raises(ValueError, match="3 KV heads"):
        RankLayout.of(SMOLLM2_LIKE, 4, False)
    with pytest.raises(ValueError, match="no routed experts"):
        RankLayout.of(SMOLLM2_LIKE, 2, True)


def test_mla_layout_replicates_the_latent() -> None:
    config = DeepseekV3Config.from_hf_config(tiny_config_json())
    layout = RankLayout.of(config, 3, expert_parallel=True)
    assert [layout.num_heads(config, r) for r in range(3)] == [2, 1, 1]
    assert all(layout.kv_spec(config.kv_spec(), r) == config.kv_spec() for r in range(3))
    assert layout.describe().endswith(":ep")
    with pytest.raises(ValueError, match="4 attention heads"):
        RankLayout.of(config, 5, False)


def test_expert_shares_add_up_to_all_experts() -> None:
    gen = torch.Generator().manual_seed(0)
    num_experts, hidden, inner = 8, 16, 8
    gate_up = torch.randn(num_experts, 2 * inner, hidden, generator=gen)
    down = torch.randn(num_experts, hidden, inner, generator=gen)
    x = torch.randn(10, hidden, generator=gen)
    ids = torch.randint(0, num_experts, (10, 2), generator=gen)
    weights = torch.rand(10, 2, generator=gen)
    whole = routed_experts(x, weights, ids, gate_up, down)
    parts = [
        routed_experts(
            x, weights, ids, gate_up[r.start : r.stop], down[r.start : r.stop], first_expert=r.start
        )
        for r in split_evenly(num_experts, 3)
    ]
    assert not torch.allclose(parts[0], whole)  # a share alone is not the whole
    torch.testing.assert_close(sum(parts), whole, atol=1e-5, rtol=1e-5)
