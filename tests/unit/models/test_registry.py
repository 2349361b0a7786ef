"""resolve_model_path and model_fingerprint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from libs.modelfiles.registry import model_fingerprint, resolve_model_path


def test_default_resolves_to_installed_gguf(smollm2_path: Path) -> None:
    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2_path.is_file()
    assert resolve_model_path() == smollm2_path


def test_existing_gguf_path_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    assert resolve_model_path(str(path)) == path.resolve()


@pytest.mark.parametrize("spec", ["llama-3-70b", "/nonexistent/model.gguf", "weights.safetensors"])
def test_bad_spec_names_itself(spec: str) -> None:
    with pytest.raises(ValueError, match=spec.replace(".", r"\.")):
        resolve_model_path(spec)


def test_fingerprint_follows_content_not_path(tmp_path: Path) -> None:
    a = tmp_path / "a.gguf"
    a.write_bytes(bytes(range(256)) * 20000)  # ~5 MB: head and tail are hashed separately
    b = tmp_path / "b.gguf"
    shutil.copy(a, b)
    assert model_fingerprint(a) == model_fingerprint(b)
    assert len(model_fingerprint(a)) == 16
    for where in (-1, len(data := a.read_bytes()) // 2):  # the end, and the middle of the weights
        changed = bytearray(data)
        changed[where] ^= 0xFF
        c = tmp_path / f"c{where}.gguf"
        c.write_bytes(bytes(changed))
        assert model_fingerprint(a) != model_fingerprint(c)
