"""Grammar backends over the real SmolLM2 vocabulary, built once per session (xgrammar's import
and vocabulary setup take about two seconds; outlines compiles take up to seconds, so compiled
grammars are shared through a GrammarCache per backend)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.grammar import BACKENDS, make_backend
from libs.grammar.cache import GrammarCache
from libs.recipe.tokenizer import Tokenizer
from tests.unit.grammar.walk import WalkVocab

VOCAB_SIZE = 49152  # SmolLM2's logits width


@pytest.fixture(scope="session")
def tokenizer(smollm2_path: Path, model_cache_dir: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path, model_cache_dir)


@pytest.fixture(scope="session")
def vocab(tokenizer: Tokenizer) -> list[bytes]:
    special = tokenizer.special_token_ids
    return [b"" if i in special else tokenizer.token_bytes(i) for i in range(VOCAB_SIZE)]


@pytest.fixture(scope="session")
def walk_vocab(vocab: list[bytes]) -> WalkVocab:
    return WalkVocab.of(vocab)


@pytest.fixture(scope="session")
def stop_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Several stop ids, EOS first: every matcher here must handle more than one."""
    assert tokenizer.eos_token_id is not None
    return (tokenizer.eos_token_id, 0, 1)


@pytest.fixture(scope="session")
def caches(vocab: list[bytes]) -> Iterator[dict[str, GrammarCache]]:
    built = {name: GrammarCache(make_backend(name, vocab), max_entries=1024) for name in BACKENDS}
    yield built
    for cache in built.values():
        cache.close()
