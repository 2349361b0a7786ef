"""LLaVA against transformers on the same tiny random checkpoint: config reading and refusals, the
CLIP image processor to the bit, the vision tower's features, and whole-prompt logits with two
images scattered into placeholder tokens (fp32: 1e-5 on features, 1e-4 on logits)."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from libs.modelfiles.llava_config import ImageProcessing, LlavaConfig, read_llava_config
from libs.modelfiles.registry import resolve_model_path
from libs.models.attention import SingleSequenceCausalAttention
from libs.models.hf_checkpoint import CheckpointError
from libs.models.image_processor import preprocess
from libs.models.llama import LlamaForCausalLM
from libs.models.llava import VisionTower, image_placeholder_rows
from libs.models.llava_loader import (
    interleaved_to_rotate_half,
    load_llava_language,
    load_llava_vision,
    rotate_half_to_interleaved,
)
from libs.models.tiny_llava import IMAGE_TOKEN, write_tiny_llava
from libs.recipe.tokenizer import Tokenizer

FEATURE_ATOL, LOGITS_ATOL = 1e-5, 1e-4
CHECKPOINT_FILES = ("config.json", "preprocessor_config.json", "model.safetensors")
Edit = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]  # of a checkpoint's tensors


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), seed=0)


@pytest.fixture(scope="module")
def config(tiny_dir: Path) -> LlavaConfig:
    return read_llava_config(tiny_dir)


def hf_llava(directory: Path) -> transformers.PreTrainedModel:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(directory, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> transformers.PreTrainedModel:
    return hf_llava(tiny_dir)


def random_images(seed: int, sizes: list[tuple[int, int]], mode: str = "RGB") -> list[PIL.Image.Image]:
    """Noise images of (height, width) ``sizes``, converted to ``mode``."""
    rng = np.random.default_rng(seed)
    return [
        PIL.Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA").convert(mode)
        for h, w in sizes
    ]


def variant(
    tiny_dir: Path,
    directory: Path,
    edit_config: Callable[[dict[str, Any]], None] | None = None,
    edit_tensors: Edit | None = None,
    file: str = "config.json",
) -> Path:
    """A copy of the tiny checkpoint with ``file``'s JSON and/or the tensors edited."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINT_FILES:
        shutil.copy(tiny_dir / name, directory / name)
    if edit_config is not None:
        data = json.loads((directory / file).read_text())
        edit_config(data)
        (directory / file).write_text(json.dumps(data))
    if edit_tensors is not None:
        path = str(directory / "model.safetensors")
        save_file(edit_tensors(load_file(path)), path)
    return directory


# --- (a) config --------------------------------------------------------------------------------


def test_config_reads_the_tiny_checkpoint(config: LlavaConfig) -> None:
    assert (config.text.vocab_size, config.text.hidden_size, config.text.head_dim) == (49153, 64, 16)
    assert (config.text.num_attention_heads, config.text.num_key_value_heads) == (4, 2)
    assert not config.text.tie_word_embeddings
    vision = config.vision
    assert (vision.hidden_size, vision.num_hidden_layers, vision.hidden_act) == (32, 3, "quick_gelu")
    assert config.image_token_id == 49152
    assert (config.num_image_tokens, config.num_vision_layers_used) == (16, 2)
    processing = config.image_processing
    assert (processing.shortest_edge, processing.crop_height, processing.resample) == (32, 32, 3)
    assert dataclasses.replace(config, vision_feature_select_strategy="full").num_image_tokens == 17


def test_config_saved_by_transformers_reads_the_same(
    tiny_dir: Path, config: LlavaConfig, reference: transformers.PreTrainedModel, tmp_path: Path
) -> None:
    # transformers 5 writes rope_parameters, image_token_index and every default spelled out.
    reference.config.save_pretrained(tmp_path)
    shutil.copy(tiny_dir / "preprocessor_config.json", tmp_path)
    ours = read_llava_config(tmp_path)
    assert ours.text.bos_token_id == 1  # transformers' LlamaConfig default, which it writes
    text = dataclasses.replace(ours.text, bos_token_id=None, eos_token_id=None)
    assert dataclasses.replace(ours, text=text) == config


def test_config_fills_transformers_defaults_as_llava_hf_writes_it(tmp_path: Path) -> None:
    sparse = {  # the fields of llava-hf/llava-1.5-7b-hf's config.json that matter
        "architectures": ["LlavaForConditionalGeneration"],
        "image_token_index": 32000,
        "text_config": {"model_type": "llama", "max_position_embeddings": 4096, "vocab_size": 32064},
        "vision_config": {
            "hidden_size": 1024,
            "image_size": 336,
            "intermediate_size": 4096,
            "model_type": "clip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 24,
            "patch_size": 14,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(sparse))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 336}}))
    config = read_llava_config(tmp_path)
    assert (config.text.hidden_size, config.text.num_hidden_layers, config.text.head_dim) == (4096, 32, 128)
    assert config.text.num_key_value_heads == 32 and config.text.rms_norm_eps == 1e-6
    assert (config.vision.hidden_act, config.vision.layer_norm_eps) == ("quick_gelu", 1e-5)
    assert config.num_image_tokens == 576 and config.num_vision_layers_used == 23
    assert config.image_processing == ImageProcessing(shortest_edge=336)  # crop 224: CLIP's default


def test_config_accepts_image_token_id_and_rope_parameters(tiny_dir: Path, tmp_path: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        data["image_token_id"] = data.pop("image_token_index") - 1
        text = data["text_config"]
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
        del text["rope_theta"]

    config = read_llava_config(variant(tiny_dir, tmp_path, edit))
    assert (config.image_token_id, config.text.rope_theta) == (49151, 500000.0)


def test_config_needs_the_preprocessor_config(tiny_dir: Path, tmp_path: Path) -> None:
    directory = variant(tiny_dir, tmp_path)
    (directory / "preprocessor_config.json").unlink()
    with pytest.raises(ValueError, match=r"preprocessor_config\.json: unreadable"):
        read_llava_config(directory)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        for parent in parents:
            data = data[parent]
        data[leaf] = value

    return edit


@pytest.mark.parametrize(
    ("file", "path", "value", "message"),
    [
        ("config.json", "vision_feature_layer", [-2, -1], "vision_feature_layer"),
        ("config.json", "vision_feature_layer", 4, "vision_feature_layer"),
        ("config.json", "vision_feature_select_strategy", "cls_only", "vision_feature_select_strategy"),
        ("config.json", "projector_hidden_act", "relu", "projector_hidden_act"),
        ("config.json", "vision_config.hidden_act", "gelu_new", "vision_config.*hidden_act"),
        ("config.json", "vision_config.model_type", "siglip_vision_model", "vision_config.model_type"),
        ("config.json", "architectures", ["LlavaNextForConditionalGeneration"], "architectures"),
        ("config.json", "text_config.model_type", "mistral", "text_config.model_type"),
        ("config.json", "text_config.rope_scaling", {"rope_type": "llama3"}, "text_config.rope_scaling"),
        ("config.json", "text_config.num_key_value_heads", 3, "text_config.*num_key_value_heads"),
        ("config.json", "image_token_index", 10**6, "image_token_id"),
        ("preprocessor_config.json", "do_pad", True, "do_pad"),
        ("preprocessor_config.json", "size", {"height": 32, "width": 32}, "size"),
        ("preprocessor_config.json", "image_processor_type", "SiglipImageProcessor", "image_processor_type"),
    ],
)
def test_config_refuses_what_is_not_implemented(
    tiny_dir: Path, tmp_path: Path, file: str, path: str, value: Any, message: str
) -> None:
    directory = variant(tiny_dir, tmp_path, _set(path, value), file=file)
    with pytest.raises(ValueError, match=rf"{file}: field '{message}"):
        read_llava_config(directory)
    with pytest.raises(CheckpointError, match=file):
        load_llava_vision(directory)


# --- (b) image processor -----------------------------------------------------------------------

SIZES = [(50, 37), (29, 64), (17, 20), (100, 33)]


@pytest.mark.parametrize(
    "fields",
    [
        {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}},
        {"size": {"shortest_edge": 24}, "crop_size": {"height": 20, "width": 22}, "resample": 2},
        {"size": {"shortest_edge": 16}, "crop_size": {"height": 20, "width": 18}},  # crop pads
        {"size": 40, "crop_size": 36, "do_normalize": False, "resample": 1},
        {"size": {"shortest_edge": 32}, "do_resize": False, "do_center_crop": False},
    ],
)
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_preprocess_matches_clip_image_processor(fields: dict[str, Any], mode: str) -> None:
    # transformers 5's slow (PIL/numpy) CLIPImageProcessor; the default one needs torchvision.
    reference = transformers.CLIPImageProcessorPil(**fields)
    processing = ImageProcessing.from_dict(fields)
    for image in random_images(len(fields), SIZES, mode):
        expected = reference(image, return_tensors="np")["pixel_values"][0]
        ours = preprocess(image, processing)
        assert ours.dtype == np.float32 and ours.shape == expected.shape
        np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-5)


# --- (c) vision tower, (d) whole-prompt logits -------------------------------------------------


def pixel_values(config: LlavaConfig, seed: int = 0) -> torch.Tensor:
    images = random_images(seed, [(48, 40), (30, 70)])
    return torch.from_numpy(np.stack([preprocess(image, config.image_processing) for image in images]))


@torch.no_grad()
def test_vision_features_match_transformers(
    tiny_dir: Path, config: LlavaConfig, reference: transformers.PreTrainedModel
) -> None:
    pixels = pixel_values(config)
    ours = load_llava_vision(tiny_dir).encode(pixels)
    expected = torch.stack(reference.model.get_image_features(pixel_values=pixels).pooler_output)
    assert ours.shape == (2, config.num_image_tokens, config.text.hidden_size)
    assert expected.abs().max() > 0.3 and (expected[0] - expected[1]).abs().max() > 0.1  # not degenerate
    torch.testing.assert_close(ours, expected, atol=FEATURE_ATOL, rtol=0)


def prompt_with_two_images(tiny_dir: Path, config: LlavaConfig) -> list[int]:
    tokenizer = Tokenizer.from_hf_dir(tiny_dir)
    slots = [config.image_token_id] * config.num_image_tokens
    return [
        *tokenizer.encode("<|im_start|>user\nWhat differs between"),
        *slots,
        *tokenizer.encode(" and"),
        *slots,
        *tokenizer.encode("?<|im_end|>\n<|im_start|>assistant\n"),
    ]


@torch.no_grad()
def our_logits(
    model: LlamaForCausalLM, tower: VisionTower, token_ids: list[int], pixels: torch.Tensor | None
) -> torch.Tensor:
    ids = torch.tensor(token_ids)
    rows = embeds = None
    if pixels is not None:
        rows = image_placeholder_rows(ids, tower.config.image_token_id)
        embeds = tower.encode(pixels).flatten(0, 1)  # [images * num_image_tokens, hidden], in order
    hidden = model(ids, torch.arange(len(ids)), SingleSequenceCausalAttention(), rows, embeds)
    return model.compute_logits(hidden)


@torch.no_grad()
def test_logits_with_two_images_match_transformers(
    tiny_dir: Path, config: LlavaConfig, reference: transformers.PreTrainedModel
) -> None:
    token_ids, pixels = prompt_with_two_images(tiny_dir, config), pixel_values(config, seed=1)
    model, tower = load_llava_language(tiny_dir), load_llava_vision(tiny_dir)
    expected = reference(input_ids=torch.tensor([token_ids]), pixel_values=pixels).logits[0]
    assert expected.abs().max() > 1.0
    ours = our_logits(model, tower, token_ids, pixels)
    torch.testing.assert_close(ours, expected, atol=LOGITS_ATOL, rtol=0)
    # The images matter: without them (placeholders embedded as tokens) the logits move.
    assert (our_logits(model, tower, token_ids, None) - expected).abs().max() > 0.1


@torch.no_grad()
def test_tied_embeddings_match_transformers(tiny_dir: Path, config: LlavaConfig, tmp_path: Path) -> None:
    # A tied checkpoint stores no head (transformers 5 would not tie one that stored a different one).
    tie = _set("text_config.tie_word_embeddings", True)
    directory = variant(tiny_dir, tmp_path, tie, _drop("lm_head.weight"))
    token_ids, pixels = prompt_with_two_images(tiny_dir, config), pixel_values(config, seed=2)
    model = load_llava_language(directory)
    assert model.lm_head is None
    expected = hf_llava(directory)(input_ids=torch.tensor([token_ids]), pixel_values=pixels).logits[0]
    ours = our_logits(model, load_llava_vision(directory), token_ids, pixels)
    torch.testing.assert_close(ours, expected, atol=LOGITS_ATOL, rtol=0)


def test_the_writer_writes_what_transformers_holds(
    tiny_dir: Path, reference: transformers.PreTrainedModel
) -> None:
    with safe_open(str(tiny_dir / "model.safetensors"), framework="pt") as f:
        written = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    assert written == {name: tuple(t.shape) for name, t in reference.state_dict().items()}


def test_rotary_permutation_round_trips() -> None:
    weight = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    interleaved = rotate_half_to_interleaved(weight, 8)
    assert torch.equal(interleaved[:2, 0], weight[[0, 8], 0])  # pair (j, j + head_dim/2) now adjacent
    assert torch.equal(interleaved_to_rotate_half(interleaved, 8), weight)


# --- loading: older names, missing and misshapen tensors ---------------------------------------


def _legacy_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    renames = [
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
    ]
    out = {}
    for name, tensor in tensors.items():
        for new, old in renames:
            if name.startswith(new):
                name = old + name.removeprefix(new)
                break
        out[name] = tensor
    return out


def test_llava_hf_legacy_names_load_the_same(tiny_dir: Path, tmp_path: Path) -> None:
    directory = variant(tiny_dir, tmp_path, edit_tensors=_legacy_names)
    for load in (load_llava_vision, load_llava_language):
        ours, legacy = load(tiny_dir).state_dict(), load(directory).state_dict()  # type: ignore[operator]
        assert ours.keys() == legacy.keys()
        assert all(torch.equal(ours[name], legacy[name]) for name in ours)


def _drop(name: str) -> Edit:
    return lambda tensors: {n: t for n, t in tensors.items() if n != name}


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [
        ("model.vision_tower.encoder.layers.1.self_attn.v_proj.bias", None, "v_proj.bias' is missing"),
        ("model.multi_modal_projector.linear_2.weight", None, "missing.*projector.linear_2"),
        ("model.multi_modal_projector.linear_1.weight", (64, 31), "linear_1.weight: shape"),
        ("model.language_model.layers.1.self_attn.k_proj.weight", None, "k_proj.weight' is missing"),
        ("model.language_model.layers.0.mlp.up_proj.weight", (127, 64), "up_proj.weight: shape"),
        ("lm_head.weight", None, r"missing \['lm_head.weight'\]"),
    ],
)
def test_a_bad_tensor_is_named(
    tiny_dir: Path, tmp_path: Path, name: str, shape: tuple[int, ...] | None, message: str
) -> None:
    edit = _drop(name) if shape is None else lambda tensors: {**tensors, name: torch.zeros(shape)}
    directory = variant(tiny_dir, tmp_path, edit_tensors=edit)
    language = name.startswith(("model.language_model.", "lm_head."))
    with pytest.raises(CheckpointError, match=message):
        load_llava_language(directory) if language else load_llava_vision(directory)


def test_unused_vision_tensors_are_not_needed(tiny_dir: Path, tmp_path: Path) -> None:
    # Layer 2 (past hidden state -2) and post_layernorm never run: a checkpoint without them loads.
    def drop(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        unused = ("model.vision_tower.encoder.layers.2.", "model.vision_tower.post_layernorm.")
        return {n: t for n, t in tensors.items() if not n.startswith(unused)}

    tower = load_llava_vision(variant(tiny_dir, tmp_path, edit_tensors=drop))
    assert len(tower.layers) == 2


def test_image_rows_need_image_embeds(tiny_dir: Path) -> None:
    model = load_llava_language(tiny_dir)
    with pytest.raises(ValueError, match="go together"):
        model(torch.tensor([1, 2]), torch.arange(2), SingleSequenceCausalAttention(), torch.tensor([0]))


# --- (e) tokenizer -----------------------------------------------------------------------------


def test_tokenizer_round_trip(tiny_dir: Path, config: LlavaConfig) -> None:
    tokenizer = Tokenizer.from_hf_dir(tiny_dir)
    smollm2 = Tokenizer.from_gguf(resolve_model_path("smollm2"), None)
    assert tokenizer.encode(IMAGE_TOKEN) == [config.image_token_id]
    assert tokenizer.vocab_size == config.text.vocab_size == smollm2.vocab_size + 1
    assert config.image_token_id in tokenizer.special_token_ids
    text = "Describe <image> and <image>, please."
    ids = tokenizer.encode(text)
    assert ids.count(config.image_token_id) == 2
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == "Describe  and , please."
    assert config.image_token_id not in tokenizer.encode_plain(text)  # user text cannot inject one
    assert tokenizer.encode("Hello world") == smollm2.encode("Hello world")
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.add_bos) == (
        smollm2.bos_token,
        smollm2.eos_token,
        smollm2.add_bos,
    )
    assert tokenizer.chat_template == smollm2.chat_template
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == ids
