"""A bad or unsupported HF checkpoint is refused before a model is built, with a message that
names the file and the field or tensor; sharded checkpoints load like single-file ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from libs.modelfiles.registry import model_architecture, model_fingerprint, resolve_model_path
from libs.models.deepseek_loader import load_deepseek_v3
from libs.models.hf_checkpoint import INDEX_FILE, CheckpointError
from libs.models.tiny_deepseek import write_tiny_checkpoint
from services.worker.model_loading import load_model


@pytest.fixture
def single(tmp_path: Path) -> Path:
    write_tiny_checkpoint(tmp_path / "one")
    return tmp_path / "one"


def _edit(directory: Path, edit: dict[str, torch.Tensor | None]) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    for name, tensor in edit.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    save_file(tensors, str(path))


def test_sharded_equals_single(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path / "one", seed=4)
    write_tiny_checkpoint(tmp_path / "three", seed=4, num_shards=3)
    assert json.loads((tmp_path / "three" / INDEX_FILE).read_text())["weight_map"]
    one, three = load_deepseek_v3(tmp_path / "one"), load_deepseek_v3(tmp_path / "three")
    for (name, a), (_, b) in zip(one.state_dict().items(), three.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert model_fingerprint(tmp_path / "one") != model_fingerprint(tmp_path / "three")  # other files
    assert model_architecture(resolve_model_path(str(tmp_path / "one"))) == "DeepseekV3ForCausalLM"


def test_a_missing_tensor_is_named(single: Path) -> None:
    _edit(single, {"model.layers.1.mlp.experts.3.up_proj.weight": None})
    with pytest.raises(CheckpointError, match=r"experts: up_proj of experts \[0, 1, 2, 4"):
        load_deepseek_v3(single)


def test_a_misshapen_tensor_is_named(single: Path) -> None:
    _edit(single, {"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 63)})
    with pytest.raises(CheckpointError, match=r"layers.0.self_attn.o_proj.weight: shape \[64, 63\]"):
        load_deepseek_v3(single)


def test_a_misshapen_packed_part_is_named(single: Path) -> None:
    """Experts and gate/up pairs are packed: a part that does not fit is named, not a torch error."""
    _edit(single, {"model.layers.2.mlp.experts.5.down_proj.weight": torch.zeros(64, 31)})
    with pytest.raises(CheckpointError, match=r"layers.2.mlp.experts.\*.down_proj.weight: the parts differ"):
        load_deepseek_v3(single)


def test_the_worker_leaves_the_mtp_module_on_disk(single: Path) -> None:
    assert len(load_deepseek_v3(single).mtp) == 1
    model = load_model(single, single, "float32")
    assert len(model.mtp) == 0 and model.config.num_nextn_predict_layers == 0


def test_fp8_without_its_scale_is_named(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, fp8=True)
    _edit(tmp_path, {"model.layers.0.self_attn.o_proj.weight_scale_inv": None})
    with pytest.raises(CheckpointError, match=r"o_proj\.weight' is float8 without"):
        load_deepseek_v3(tmp_path)


def test_a_missing_shard_and_a_bad_config_are_named(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, num_shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=f"{INDEX_FILE}: names shard model-00002-of-00002"):
        load_deepseek_v3(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "scoring_func": "softmax"}))
    with pytest.raises(CheckpointError, match=r"config.json: .*scoring_func"):
        load_deepseek_v3(tmp_path)


def test_an_unsupported_architecture_is_refused(single: Path) -> None:
    config = json.loads((single / "config.json").read_text())
    (single / "config.json").write_text(json.dumps({**config, "architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(ValueError, match=r"config.json: architectures 'MixtralForCausalLM'"):
        load_model(single, single, "float32")
    with pytest.raises(ValueError, match="int8/int4 is implemented for llama GGUF only"):
        (single / "config.json").write_text(json.dumps(config))
        load_model(single, single, "int8")


def test_a_bad_checkpoint_is_refused_from_its_headers(single: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole checkpoint is checked before a weight is read: reading one would fail here."""
    _edit(single, {"model.layers.0.self_attn.o_proj.weight": None})

    def no_reading(*_: object) -> None:
        raise AssertionError("a weight was read")

    monkeypatch.setattr("safetensors.safe_open.get_tensor", no_reading, raising=False)
    with pytest.raises(CheckpointError, match="missing"):
        load_deepseek_v3(single)
