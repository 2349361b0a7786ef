"""read_gguf_header agrees with gguf.GGUFReader, skips arrays unless asked, and rejects bad files."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from libs.modelfiles.gguf_metadata import read_gguf_config, read_gguf_header


def reference_metadata(path: Path) -> dict[str, object]:
    reader = gguf.GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def write_sample(path: Path) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("sample.text", "héllo 中文")
    writer.add_uint32("sample.u32", 7)
    writer.add_int64("sample.i64", -5)
    writer.add_float32("sample.f32", 0.5)
    writer.add_float64("sample.f64", 1e-300)
    writer.add_bool("sample.flag", True)
    writer.add_array("sample.words", ["a", "b c", ""])
    writer.add_array("sample.ints", [1, -2, 3])
    writer.add_tensor("t.one", np.zeros((2, 3), dtype=np.float32))
    writer.add_tensor("t.two", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_matches_gguf_reader(tmp_path: Path) -> None:
    path = write_sample(tmp_path / "s.gguf")
    full = read_gguf_header(path, full_arrays=("sample.words", "sample.ints"))
    assert full.metadata == reference_metadata(path)
    assert full.tensor_names == ("t.one", "t.two")


def test_arrays_are_counted_unless_asked_for(tmp_path: Path) -> None:
    header = read_gguf_header(write_sample(tmp_path / "s.gguf"), full_arrays=("sample.ints",))
    assert header.metadata["sample.words"] == 3
    assert header.metadata["sample.ints"] == [1, -2, 3]
    assert header.metadata["sample.text"] == "héllo 中文"


def test_real_model_header(smollm2_path: Path) -> None:
    arrays = (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
        "general.languages",
    )
    assert read_gguf_header(smollm2_path, full_arrays=arrays).metadata == reference_metadata(smollm2_path)
    config = read_gguf_config(smollm2_path)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert (config.hidden_size, config.head_dim, config.vocab_size) == (576, 64, 49152)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0 and config.rms_norm_eps == 1e-5


def test_not_gguf_and_truncated(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_header(junk)
    data = write_sample(tmp_path / "s.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:60])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf_header(cut)
