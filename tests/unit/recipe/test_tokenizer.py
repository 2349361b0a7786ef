"""Tokenizer and IncrementalDetokenizer on the real SmolLM2 GGUF vocabulary."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from libs.recipe import tokenizer as tokenizer_module
from libs.recipe.tokenizer import IncrementalDetokenizer, Tokenizer

MULTILINGUAL = (
    "Hello, world! Ça va? naïve café — 中文字符测试，你好！こんにちは 안녕하세요 Здравствуйте مرحبا "
    "emoji 😀👍🏽🇫🇷👨‍👩‍👧 math ∑∫√ and 12345 + 3.14159\n\n\tindented   spaces  "
)
ROUND_TRIPS = [
    "",
    " ",
    "   leading and trailing   ",
    "\n\n\t\r\n",
    "emoji 😀👍🏽 🇫🇷 👨‍👩‍👧",
    "中文字符测试，你好！",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name><file_sep>",
    "x" * 300 + " 2024-11-29 99.5%",
    MULTILINGUAL,
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path, model_cache_dir: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path, model_cache_dir)


def test_metadata(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert not tokenizer.add_bos
    assert len(tokenizer.special_token_ids) == 17
    assert tokenizer.chat_template is not None and "<|im_start|>" in tokenizer.chat_template


@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_round_trip(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_control_tokens_are_single_ids_and_no_bos(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [2]
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.encode("hi")[0] != tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_digits_are_split_one_by_one(tokenizer: Tokenizer) -> None:
    assert len(tokenizer.encode("12345")) == 5


def stream(tokenizer: Tokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas, start = [], 0
    for size in chunk_sizes:
        deltas.append(detok.add(ids[start : start + size]))
        start += size
    assert start == len(ids)
    deltas.append(detok.flush())
    return deltas


def test_one_token_at_a_time_equals_full_decode(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MULTILINGUAL)
    deltas = stream(tokenizer, ids, [1] * len(ids))
    assert "".join(deltas) == tokenizer.decode(ids) == MULTILINGUAL
    assert not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas[:-1]  # some multibyte character really was split across tokens and held back


def test_random_chunks_equal_full_decode(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MULTILINGUAL * 3)
    rng = random.Random(0)
    sizes: list[int] = []
    while sum(sizes) < len(ids):
        sizes.append(min(rng.randint(0, 5), len(ids) - sum(sizes)))
    assert "".join(stream(tokenizer, ids, sizes)) == tokenizer.decode(ids)


def test_special_tokens_are_skipped_in_stream(tokenizer: Tokenizer) -> None:
    ids = [*tokenizer.encode("The answer is 42."), tokenizer.eos_token_id or 0]
    assert "".join(stream(tokenizer, ids, [1] * len(ids))) == "The answer is 42."
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert detok.add([1]) + detok.add(tokenizer.encode("hi")) + detok.flush() == "<|im_start|>hi"


def test_incomplete_character_at_end_flushes_as_replacement(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("😀")
    assert len(ids) > 1  # byte-level BPE spells this emoji with several tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:1]) == ""
    assert detok.flush() == "\ufffd"


def test_cached_tokenizer_skips_the_gguf(
    tokenizer: Tokenizer, smollm2_path: Path, model_cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_build(path: Path) -> None:
        raise AssertionError("rebuilt despite a cache")

    monkeypatch.setattr(tokenizer_module, "_build_record", no_build)
    again = Tokenizer.from_gguf(smollm2_path, model_cache_dir)
    assert again.encode(MULTILINGUAL) == tokenizer.encode(MULTILINGUAL)
    assert again.chat_template == tokenizer.chat_template


def test_ids_past_the_vocabulary_decode_to_nothing(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add([tokenizer.vocab_size + 10, *tokenizer.encode("ok")]) + detok.flush() == "ok"
