"""DeepSeek-V3 family against transformers' DeepseekV3ForCausalLM on the same tiny random weights.

fp32 exactness (1e-4 on logits of up to ~3): a whole prefill through each writer's checkpoint
(ours, with MTP weights, FP8 and shards; and transformers' own save_pretrained), routing, and the
MTP module against a composite of transformers' own layers. bf16: argmax agreement is reported.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_modeling

from libs.kernels.moe import grouped_topk
from libs.modelfiles.deepseek_config import DeepseekV3Config
from libs.models.attention import SingleSequenceMLAAttention
from libs.models.deepseek_loader import load_deepseek_v3
from libs.models.deepseek_v3 import DeepseekV3ForCausalLM
from libs.models.fp8 import dequantize_fp8_block_reference
from libs.models.tiny_deepseek import tiny_config_json, write_tiny_checkpoint
from tests.deepseek_reference import hf_from_dir, hf_logits, write_hf_random

TOKENS = [int(t) for t in torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1))]
ATOL = 1e-4


def our_logits(model: DeepseekV3ForCausalLM, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor(token_ids)
        hidden = model(ids, torch.arange(len(ids)), SingleSequenceMLAAttention())
        return model.compute_logits(hidden)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-deepseek")
    write_tiny_checkpoint(directory, num_shards=3)
    return directory


def test_prefill_matches_transformers_on_our_checkpoint(tiny_dir: Path) -> None:
    ours, reference = load_deepseek_v3(tiny_dir), hf_from_dir(tiny_dir)
    expected = hf_logits(reference, TOKENS)
    assert expected.abs().max() > 1.0  # peaky enough that a wrong scale or rope would show
    torch.testing.assert_close(our_logits(ours, TOKENS), expected, atol=ATOL, rtol=0)


def test_prefill_matches_transformers_on_its_own_checkpoint(tmp_path: Path) -> None:
    reference = write_hf_random(tmp_path, tiny_config_json(num_mtp_layers=0), seed=3)
    ours = load_deepseek_v3(tmp_path)
    torch.testing.assert_close(our_logits(ours, TOKENS), hf_logits(reference, TOKENS), atol=ATOL, rtol=0)


def test_routing_matches_transformers_router(tiny_dir: Path) -> None:
    reference = hf_from_dir(tiny_dir)
    ours = load_deepseek_v3(tiny_dir)
    config = ours.config
    hidden = torch.randn(256, config.hidden_size, generator=torch.Generator().manual_seed(2))
    for layer in range(config.first_k_dense_replace, config.num_hidden_layers):
        _, hf_weights, hf_ids = reference.model.layers[layer].mlp.gate(hidden)
        gate = ours.layers[layer].mlp.gate
        weights, ids = grouped_topk(
            hidden @ gate.weight.T,
            gate.e_score_correction_bias,
            n_group=config.n_group,
            topk_group=config.topk_group,
            top_k=config.num_experts_per_tok,
            norm_topk_prob=config.norm_topk_prob,
            routed_scaling_factor=config.routed_scaling_factor,
        )
        # the same experts per token with the same weights, in whatever order topk left them
        ours_sorted, hf_sorted = ids.sort(dim=-1), hf_ids.sort(dim=-1)
        assert torch.equal(ours_sorted.values, hf_sorted.values)
        torch.testing.assert_close(
            weights.gather(1, ours_sorted.indices), hf_weights.gather(1, hf_sorted.indices), atol=1e-6, rtol=0
        )
        assert gate.weight.dtype == torch.float32  # the gate stays fp32 in every model dtype


def test_fp8_checkpoint_loads_dequantized(tmp_path: Path) -> None:
    """Block-scaled FP8 projections (16x16 blocks here: kv_a_proj_with_mqa has 24 rows, so an edge
    block) load as the plain per-block dequantization of what is on disk; transformers' CPU FP8
    path is not a reference for this (it mis-scales edge blocks)."""
    original = write_tiny_checkpoint(tmp_path, fp8=True)
    loaded = load_deepseek_v3(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
        weight, scale = f.get_tensor(name), f.get_tensor(name + "_scale_inv")
        names = f.keys()  # a safe_open handle is not iterable
        quantized = [k for k in names if f.get_tensor(k).dtype == torch.float8_e4m3fn]
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == (24, 64) and scale.shape == (2, 4)
    expected = dequantize_fp8_block_reference(weight, scale, (16, 16))
    got = loaded.layers[0].self_attn.kv_a_proj_with_mqa.weight
    assert torch.equal(got, expected)
    want = original.layers[0].self_attn.kv_a_proj_with_mqa.weight
    assert (got - want).abs().max() <= want.abs().max() / 8  # e4m3: 3 mantissa bits
    assert len(quantized) > 30  # every projection, the experts' included
    assert loaded.layers[1].mlp.gate.weight.dtype == torch.float32


def test_mtp_module_matches_a_composite_of_transformers_layers(tiny_dir: Path) -> None:
    """MTP k=0: h' = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]), one MoE block, its own norm,
    the main head. transformers has no MTP forward, so the reference is its own decoder layer,
    norms and rotary embedding loaded with layer L's weights."""
    ours = load_deepseek_v3(tiny_dir)
    config = ours.config
    hf_config = transformers.AutoConfig.from_pretrained(tiny_dir)
    hf_config._experts_implementation = "eager"
    hf_config._attn_implementation = "eager"
    block = hf_modeling.DeepseekV3DecoderLayer(hf_config, layer_idx=config.num_hidden_layers).eval()
    norms = {
        name: hf_modeling.DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)
        for name in ("e", "h", "s")
    }
    eh_proj = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    mtp = ours.mtp[0]
    block_state = {k.removeprefix("block."): v for k, v in mtp.state_dict().items() if k.startswith("block.")}
    hf_block_state = _hf_names(block_state)
    block.load_state_dict(hf_block_state, strict=True)
    norms["e"].weight.data.copy_(mtp.enorm.weight)
    norms["h"].weight.data.copy_(mtp.hnorm.weight)
    norms["s"].weight.data.copy_(mtp.shared_head_norm.weight)
    eh_proj.weight.data.copy_(mtp.eh_proj.weight)
    rotary = hf_modeling.DeepseekV3RotaryEmbedding(hf_config)

    ids = torch.tensor(TOKENS)
    positions = torch.arange(len(TOKENS) - 1)
    with torch.no_grad():
        main_hidden = ours(ids, torch.arange(len(TOKENS)), SingleSequenceMLAAttention())
        draft_hidden = ours.forward_mtp(0, ids[1:], main_hidden[:-1], positions, SingleSequenceMLAAttention())
        got = ours.compute_logits(draft_hidden)

        fused = eh_proj(
            torch.cat([norms["e"](ours.embed_tokens(ids[1:])), norms["h"](main_hidden[:-1])], -1)
        )[None]
        n = fused.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = block(
            fused,
            attention_mask=mask,
            position_ids=positions[None],
            position_embeddings=rotary(fused, positions[None]),
        )
        out = out[0] if isinstance(out, tuple) else out
        expected = ours.compute_logits(norms["s"](out)[0])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def _hf_names(block_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our decoder-layer names -> transformers' (gate/up split for the shared expert; the routed
    experts are packed the same way in both)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in block_state.items():
        if name.endswith("shared_experts.gate_up_proj.weight"):
            gate, up = tensor.chunk(2)
            prefix = name.removesuffix("gate_up_proj.weight")
            out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = gate, up
        else:
            out[name] = tensor
    return out


def test_bf16_argmax_agreement_with_fp32(tiny_dir: Path) -> None:
    """bf16 is checked by argmax agreement, not by max error (a near-tie routing flip moves one
    position a lot): at least 90% of positions keep their fp32 argmax."""
    fp32, bf16 = load_deepseek_v3(tiny_dir), load_deepseek_v3(tiny_dir, torch.bfloat16)
    agree = (our_logits(fp32, TOKENS).argmax(-1) == our_logits(bf16, TOKENS).argmax(-1)).float().mean()
    print(f"bf16 argmax agreement with fp32: {agree:.3f}")
    assert agree >= 0.9


def test_config_refuses_what_it_cannot_run() -> None:
    base = tiny_config_json()
    for field, value, named in (
        ("scoring_func", "softmax", "scoring_func"),
        ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}, "rope_scaling"),
        ("n_group", 3, "n_group"),
        ("attention_bias", True, "attention_bias"),
        ("rope_interleave", False, "rope_interleave"),
        ("rope_scaling", {**base["rope_scaling"], "attention_factor": 0.5}, "attention_factor"),
    ):
        with pytest.raises(ValueError, match=named):
            DeepseekV3Config.from_hf_config({**base, field: value})
    with pytest.raises(ValueError, match="kv_lora_rank"):
        DeepseekV3Config.from_hf_config({k: v for k, v in base.items() if k != "kv_lora_rank"})
