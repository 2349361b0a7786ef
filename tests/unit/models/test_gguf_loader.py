"""GGUF -> LlamaForCausalLM on a tiny synthetic GGUF: name mapping, config, and the weight cache."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from libs.modelfiles.llama_config import LlamaConfig
from libs.models import gguf_loader
from libs.models.attention import SingleSequenceCausalAttention
from libs.models.gguf_loader import cached_weights_path, load_llama, read_gguf_config
from libs.models.gguf_writer import write_llama_gguf
from libs.models.llama import LlamaForCausalLM
from tests.tiny_models import TINY_LLAMA

TINY = TINY_LLAMA


def gguf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's names: the inverse of the loader's mapping."""
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["embed_tokens.weight"], "output_norm.weight": sd["norm.weight"]}
    if "lm_head.weight" in sd:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        q, k, v = np.split(
            sd[f"layers.{i}.self_attn.qkv_proj.weight"], [cfg.q_size, cfg.q_size + cfg.kv_size]
        )
        gate, up = np.split(sd[f"layers.{i}.mlp.gate_up_proj.weight"], 2)
        out |= {
            f"blk.{i}.attn_q.weight": q,
            f"blk.{i}.attn_k.weight": k,
            f"blk.{i}.attn_v.weight": v,
            f"blk.{i}.attn_output.weight": sd[f"layers.{i}.self_attn.o_proj.weight"],
            f"blk.{i}.ffn_gate.weight": gate,
            f"blk.{i}.ffn_up.weight": up,
            f"blk.{i}.ffn_down.weight": sd[f"layers.{i}.mlp.down_proj.weight"],
            f"blk.{i}.attn_norm.weight": sd[f"layers.{i}.input_layernorm.weight"],
            f"blk.{i}.ffn_norm.weight": sd[f"layers.{i}.post_attention_layernorm.weight"],
        }
    return out


def write_gguf(
    path: Path, model: LlamaForCausalLM, extra: dict[str, np.ndarray] | None = None, arch: str = "llama"
) -> Path:
    def token_ids(writer: gguf.GGUFWriter) -> None:
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)

    tensors = {**gguf_tensors(model), **(extra or {})}
    as_f32 = ((name, np.asarray(array, dtype=np.float32)) for name, array in tensors.items())
    return write_llama_gguf(path, model.config, as_f32, arch=arch, add_metadata=token_ids)


def make_model(config: LlamaConfig = TINY) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at ones; make them distinct so a swap would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def logits(model: LlamaForCausalLM) -> torch.Tensor:
    ids = torch.tensor([5, 17, 3, 90, 42, 7])
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(6), SingleSequenceCausalAttention()))


def test_config_from_metadata(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", make_model())
    assert read_gguf_config(path) == TINY


@pytest.mark.parametrize("tied", [True, False])
def test_load_reproduces_the_model_and_caches(tmp_path: Path, tied: bool) -> None:
    model = make_model(dataclasses.replace(TINY, tie_word_embeddings=tied))
    path = write_gguf(tmp_path / "tiny.gguf", model)
    cache_dir = tmp_path / "cache"

    loaded = load_llama(path, cache_dir)
    assert loaded.config == model.config and not loaded.training
    assert all(not p.requires_grad for p in loaded.parameters())
    assert torch.equal(logits(loaded), logits(model))
    assert cached_weights_path(path, cache_dir).is_file()
    assert [p.name for p in cache_dir.iterdir()] == [
        cached_weights_path(path, cache_dir).name
    ]  # no temp left


def test_second_load_uses_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    path = write_gguf(tmp_path / "tiny.gguf", model)
    load_llama(path, tmp_path)

    def no_conversion(path: Path) -> None:
        raise AssertionError("converted again despite a cache")

    monkeypatch.setattr(gguf_loader, "convert_gguf", no_conversion)
    again = load_llama(path, tmp_path, dtype=torch.bfloat16)
    assert again.dtype == torch.bfloat16 and again.cos_sin_cache.dtype == torch.float32
    expected = logits(model)
    assert (logits(again) - expected).abs().max().item() < 0.02 * expected.abs().max().item()


def test_corrupt_cache_is_rebuilt(tmp_path: Path) -> None:
    model = make_model()
    path = write_gguf(tmp_path / "tiny.gguf", model)
    cached_weights_path(path, tmp_path).write_bytes(b"not a safetensors file")
    assert torch.equal(logits(load_llama(path, tmp_path)), logits(model))


def test_changed_file_gets_a_new_cache_entry(tmp_path: Path) -> None:
    first = write_gguf(tmp_path / "m.gguf", make_model())
    before = cached_weights_path(first, tmp_path)
    other = make_model()
    with torch.no_grad():
        other.norm.weight.fill_(2.0)
    write_gguf(tmp_path / "m.gguf", other)
    assert cached_weights_path(first, tmp_path) != before


def test_unknown_tensor_is_an_error(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "x.gguf", make_model(), extra={"rope_freqs.weight": np.ones(4)})
    with pytest.raises(ValueError, match="rope_freqs"):
        load_llama(path, tmp_path)


def test_other_architecture_is_an_error(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "q.gguf", make_model(), arch="qwen2")
    with pytest.raises(ValueError, match="qwen2"):
        read_gguf_config(path)


def test_concurrent_loaders_share_one_cache_file(tmp_path: Path) -> None:
    model = make_model()
    path = write_gguf(tmp_path / "tiny.gguf", model)
    cache_dir = tmp_path / "cache"
    with ThreadPoolExecutor(4) as pool:
        loaded = list(pool.map(lambda _: load_llama(path, cache_dir), range(4)))
    expected = logits(model)
    assert all(torch.equal(logits(m), expected) for m in loaded)
    assert [p.name for p in cache_dir.iterdir()] == [cached_weights_path(path, cache_dir).name]
