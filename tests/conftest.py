"""Session fixtures for the embedded default model (SmolLM2 GGUF) and its conversion cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.modelfiles.registry import resolve_model_path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    # No skip: a missing model is a broken install, and the tests must say so.
    return resolve_model_path("smollm2")


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache dir per test session, so the GGUF is converted (seconds) at most once."""
    return tmp_path_factory.mktemp("model-cache")
