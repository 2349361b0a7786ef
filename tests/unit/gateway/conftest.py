"""The real SmolLM2 tokenizer for the gateway's unit tests (byte-level BPE: split UTF-8 happens)."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.recipe.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer(smollm2_path: Path, model_cache_dir: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path, model_cache_dir)
