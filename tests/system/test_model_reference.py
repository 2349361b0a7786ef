"""The real SmolLM2 GGUF: our torch model and tokenizer against transformers, and a greedy answer.

transformers loading the same GGUF is the independent reference (llama.cpp is not: it quantizes
activations and differs by up to ~1.8 in logits on this file).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from libs.models.attention import SingleSequenceCausalAttention
from libs.models.gguf_loader import load_llama
from libs.models.llama import LlamaForCausalLM
from libs.recipe.chat_template import render_chat
from libs.recipe.tokenizer import Tokenizer
from tests.reference import greedy_text

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOKENIZER_SAMPLES = [
    "Hello world! 12345 and 3.14159",
    "  leading   spaces\n\n\ttabs\r\n",
    "emoji 😀👍🏽 🇫🇷 and 中文字符测试，你好！",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x**2  # comment",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path, model_cache_dir: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path, model_cache_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Tokenizer) -> list[int]:
    assert tokenizer.chat_template is not None
    return tokenizer.encode(render_chat(tokenizer.chat_template, QUESTION))


@pytest.fixture(scope="module")
def model_fp32(smollm2_path: Path, model_cache_dir: Path) -> LlamaForCausalLM:
    return load_llama(smollm2_path, model_cache_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def offline() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def hf_model(smollm2_path: Path, offline: None) -> Any:
    import accelerate  # noqa: F401  (transformers needs it to load a GGUF)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()


def logits_of(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), SingleSequenceCausalAttention())
        return model.compute_logits(hidden)


def test_logits_match_transformers(
    model_fp32: LlamaForCausalLM, hf_model: Any, prompt_ids: list[int]
) -> None:
    ours = logits_of(model_fp32, prompt_ids)
    with torch.inference_mode():
        theirs = hf_model(torch.tensor([prompt_ids])).logits[0].float()
    assert ours.shape == theirs.shape == (len(prompt_ids), 49152)
    max_delta = (ours - theirs).abs().max().item()
    assert max_delta < 1e-3, max_delta
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_token_ids_match_transformers(tokenizer: Tokenizer, smollm2_path: Path, offline: None) -> None:
    import transformers

    reference = transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    for text in TOKENIZER_SAMPLES:
        assert tokenizer.encode(text) == reference(text)["input_ids"], text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_answer_names_paris(
    smollm2_path: Path, model_cache_dir: Path, tokenizer: Tokenizer, prompt_ids: list[int], dtype: torch.dtype
) -> None:
    model = load_llama(smollm2_path, model_cache_dir, dtype=dtype)
    text = greedy_text(model, tokenizer, prompt_ids)
    assert "Paris" in text, text
