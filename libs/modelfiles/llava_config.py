"""LlavaConfig: the shape of a LLaVA-style model (CLIP vision tower, projector, llama decoder) and
its image preprocessing, read from an HF checkpoint's config.json and preprocessor_config.json.

Fields a file leaves out take transformers' defaults (LlamaConfig, CLIPVisionConfig,
CLIPImageProcessor): llava-hf's own config.json lists only what differs from them. What we do not
implement (several feature layers, other vision towers, rotary scaling, other activations) is a
ValueError naming the file and the field, before anything is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

from libs.modelfiles import require_positive
from libs.modelfiles.llama_config import LlamaConfig

ARCHITECTURE: Final = "LlavaForConditionalGeneration"
ACTIVATIONS: Final = ("gelu", "quick_gelu")
SELECT_STRATEGIES: Final = ("default", "full")  # default: drop the CLS position; full: keep it
OPENAI_CLIP_MEAN: Final = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD: Final = (0.26862954, 0.26130258, 0.27577711)
PIL_BICUBIC: Final = 3
CLIP_IMAGE_SIZE: Final = 224  # CLIPImageProcessor's default shortest edge and square crop
# transformers' LlamaConfig and CLIPVisionConfig defaults, for the fields a config.json omits.
_TEXT_DEFAULTS: Final[Mapping[str, Any]] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
}
_VISION_DEFAULTS: Final[Mapping[str, Any]] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 224,
    "patch_size": 32,
    "num_channels": 3,
    "layer_norm_eps": 1e-5,
    "hidden_act": "quick_gelu",
}


@dataclasses.dataclass(frozen=True, slots=True)
class ClipVisionConfig:
    """A CLIP ViT: patch conv, CLS, learned positions, pre-LN, pre-norm encoder layers."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    def __post_init__(self) -> None:
        require_positive(
            self,
            (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "image_size",
                "patch_size",
                "num_channels",
            ),
        )
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported {ACTIVATIONS}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches(self) -> int:
        # The patch conv has stride patch_size and no padding: a partial last row/column is dropped.
        return (self.image_size // self.patch_size) ** 2


@dataclasses.dataclass(frozen=True, slots=True)
class ImageProcessing:
    """What transformers' CLIPImageProcessor does to an image, in its order: convert to RGB,
    resize the shortest edge, center crop, rescale, normalize. Defaults are that class's."""

    shortest_edge: int = CLIP_IMAGE_SIZE
    crop_height: int = CLIP_IMAGE_SIZE
    crop_width: int = CLIP_IMAGE_SIZE
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    resample: int = PIL_BICUBIC  # a PIL.Image.Resampling code
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        require_positive(self, ("shortest_edge", "crop_height", "crop_width"))
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std must have one value per RGB channel")
        if not 0 <= self.resample <= 5:
            raise ValueError(f"resample {self.resample} is not a PIL resampling filter (0-5)")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ImageProcessing:
        """From preprocessor_config.json's fields (an int size is the shortest edge, an int crop
        size a square, as transformers reads them)."""
        kind = data.get("image_processor_type", "CLIPImageProcessor")
        if kind not in ("CLIPImageProcessor", "CLIPImageProcessorFast"):
            raise ValueError(f"field 'image_processor_type': {kind!r} is not supported (CLIPImageProcessor)")
        if data.get("do_pad"):
            raise ValueError("field 'do_pad': padding to a square is not supported")
        size = data.get("size", CLIP_IMAGE_SIZE)
        size = {"shortest_edge": size} if isinstance(size, int) else size
        if not (isinstance(size, dict) and isinstance(size.get("shortest_edge"), int)):
            raise ValueError(f"field 'size': {size!r} has no shortest_edge (only that resize is supported)")
        crop = data.get("crop_size", CLIP_IMAGE_SIZE)
        crop = {"height": crop, "width": crop} if isinstance(crop, int) else crop
        if not (isinstance(crop, dict) and {"height", "width"} <= crop.keys()):
            raise ValueError(f"field 'crop_size': {crop!r} is not a height and width")
        flags = ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb")
        return cls(
            shortest_edge=int(size["shortest_edge"]),
            crop_height=int(crop["height"]),
            crop_width=int(crop["width"]),
            rescale_factor=float(data.get("rescale_factor", 1 / 255)),
            image_mean=tuple(float(v) for v in data.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(float(v) for v in data.get("image_std", OPENAI_CLIP_STD)),
            resample=int(data.get("resample", PIL_BICUBIC)),
            **{flag: bool(data.get(flag, True)) for flag in flags},
        )


@dataclasses.dataclass(frozen=True, slots=True)
class LlavaConfig:
    """The whole model: the decoder, the vision tower, how features are picked and projected, the
    placeholder token the features replace, and the image preprocessing."""

    text: LlamaConfig
    vision: ClipVisionConfig
    image_processing: ImageProcessing
    image_token_id: int
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True
    # Index into transformers' vision hidden_states: 0 is the embeddings after pre-LN, i the
    # output of encoder layer i-1; negative counts from the end (-1: the last layer's output).
    vision_feature_layer: int = -2
    vision_feature_select_strategy: str = "default"

    def __post_init__(self) -> None:
        layers = self.vision.num_hidden_layers
        if not -(layers + 1) <= self.vision_feature_layer <= layers:
            raise ValueError(
                f"field 'vision_feature_layer': {self.vision_feature_layer} is outside the "
                f"{layers + 1} hidden states of a {layers}-layer vision tower"
            )
        if self.vision_feature_select_strategy not in SELECT_STRATEGIES:
            raise ValueError(
                f"field 'vision_feature_select_strategy': {self.vision_feature_select_strategy!r} "
                f"is not supported {SELECT_STRATEGIES}"
            )
        if self.projector_hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"field 'projector_hidden_act': {self.projector_hidden_act!r} is not supported {ACTIVATIONS}"
            )
        if not 0 <= self.image_token_id < self.text.vocab_size:
            raise ValueError(
                f"field 'image_token_id': {self.image_token_id} is outside the vocabulary "
                f"({self.text.vocab_size})"
            )

    @property
    def num_vision_layers_used(self) -> int:
        """How many encoder layers run: those after the selected hidden state are never needed."""
        layer = self.vision_feature_layer
        return layer if layer >= 0 else self.vision.num_hidden_layers + 1 + layer

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens (and projected features) per image."""
        cls_token = 1 if self.vision_feature_select_strategy == "full" else 0
        return self.vision.num_patches + cls_token

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], image_processing: ImageProcessing) -> LlavaConfig:
        """From config.json's fields (messages name the field; the caller adds the file)."""
        _check_architecture(config)
        feature_layer = config.get("vision_feature_layer", -2)
        if isinstance(feature_layer, list) and len(feature_layer) == 1:
            feature_layer = feature_layer[0]  # one layer listed is that layer (nothing concatenated)
        if not isinstance(feature_layer, int):
            raise ValueError(
                f"field 'vision_feature_layer': {feature_layer!r}: features concatenated from several "
                "layers are not supported (one int)"
            )
        token_id = config.get("image_token_id", config.get("image_token_index", 32000))
        return cls(
            text=_text_config(_section(config, "text_config"), config),
            vision=_vision_config(_section(config, "vision_config")),
            image_processing=image_processing,
            image_token_id=int(token_id),
            projector_hidden_act=str(config.get("projector_hidden_act", "gelu")),
            projector_bias=bool(config.get("multimodal_projector_bias", True)),
            vision_feature_layer=feature_layer,
            vision_feature_select_strategy=str(config.get("vision_feature_select_strategy", "default")),
        )


def read_llava_config(directory: Path) -> LlavaConfig:
    """The config of an HF LLaVA checkpoint directory; ValueError naming the file and the field.
    config.json's architecture is checked first: another model's directory has no preprocessor."""
    config_path = Path(directory) / "config.json"
    processing_path = Path(directory) / "preprocessor_config.json"
    with _naming(config_path):
        config = _read_json(config_path)
        _check_architecture(config)
    with _naming(processing_path):
        processing = ImageProcessing.from_dict(_read_json(processing_path))
    with _naming(config_path):
        return LlavaConfig.from_hf_config(config, processing)


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Re-raise a bad field's error (ValueError, or a TypeError/KeyError of a mistyped one) as a
    ValueError that starts with the file."""
    try:
        yield
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{path}: {e}") from None


def _check_architecture(config: Mapping[str, Any]) -> None:
    architectures = config.get("architectures") or [config.get("model_type")]
    if architectures[0] not in (ARCHITECTURE, "llava"):
        raise ValueError(f"field 'architectures': {architectures!r} is not [{ARCHITECTURE!r}]")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"unreadable ({e})") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def _section(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    section = config.get(name)
    if not isinstance(section, dict):
        raise ValueError(f"field {name!r}: expected an object, got {section!r}")
    return section


def _text_config(text: Mapping[str, Any], top: Mapping[str, Any]) -> LlamaConfig:
    """Our LlamaConfig from text_config (tie_word_embeddings may sit at the top, as transformers
    reads it: tied if either level says so)."""
    rope = text.get("rope_parameters") or {}
    refusals = {
        "model_type": text.get("model_type", "llama") != "llama",
        "hidden_act": text.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(text.get("attention_bias")),
        "mlp_bias": bool(text.get("mlp_bias")),
        "rope_scaling": text.get("rope_scaling") is not None,
        "rope_parameters": rope.get("rope_type", "default") != "default",
    }
    for field, refused in refusals.items():
        if refused:
            value = text.get(field)
            raise ValueError(f"field 'text_config.{field}': {value!r} is not supported (a plain llama)")
    values = {field: text.get(field, default) for field, default in _TEXT_DEFAULTS.items()}
    heads = int(values["num_attention_heads"])
    try:
        return LlamaConfig(
            **{field: int(value) for field, value in values.items() if field != "rms_norm_eps"},
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or int(values["hidden_size"]) // heads),
            rope_theta=float(text.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rms_norm_eps=float(values["rms_norm_eps"]),
            tie_word_embeddings=bool(top.get("tie_word_embeddings")) or bool(text.get("tie_word_embeddings")),
            bos_token_id=_optional_int(text.get("bos_token_id")),
            eos_token_id=_optional_int(text.get("eos_token_id")),
        )
    except ValueError as e:
        raise ValueError(f"field 'text_config': {e}") from None


def _vision_config(vision: Mapping[str, Any]) -> ClipVisionConfig:
    kind = vision.get("model_type", "clip_vision_model")
    if kind != "clip_vision_model":
        raise ValueError(f"field 'vision_config.model_type': {kind!r} is not supported (clip_vision_model)")
    values = {field: vision.get(field, default) for field, default in _VISION_DEFAULTS.items()}
    try:
        return ClipVisionConfig(**values)
    except ValueError as e:
        raise ValueError(f"field 'vision_config': {e}") from None


def _optional_int(value: Any) -> int | None:
    # A list of EOS ids (llama 3) keeps the first: LlamaConfig holds one.
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if value is not None else None
