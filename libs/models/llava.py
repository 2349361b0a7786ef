"""LLaVA's vision side in plain torch: a CLIP ViT and the projector that maps its patch features
into the language model's embedding space.

The language side is our LlamaForCausalLM: the placeholder tokens of a prompt (one per image
feature, ``image_token_id``) are embedded as usual and then overwritten by the features
(``LlamaForCausalLM.forward``'s image_rows / image_embeds), as transformers' masked_scatter does.

Only the encoder layers up to the selected hidden state are built (the default -2 skips the last
one), and post_layernorm is never applied: LLaVA reads hidden states, not the pooled output.
Attention inside the tower is bidirectional over one image's tokens (SDPA, no mask).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from libs.modelfiles.llava_config import ClipVisionConfig, LlavaConfig

Activation = Callable[[Tensor], Tensor]


def quick_gelu(x: Tensor) -> Tensor:
    """CLIP's sigmoid approximation of GELU (what OpenAI trained CLIP with)."""
    return x * torch.sigmoid(1.702 * x)


def _gelu(x: Tensor) -> Tensor:
    return F.gelu(x)  # the exact (erf) form: transformers' "gelu"


ACTIVATIONS: dict[str, Activation] = {"quick_gelu": quick_gelu, "gelu": _gelu}


class ClipVisionEmbeddings(nn.Module):
    """Pixels -> [CLS | patch embeddings] + learned positions."""

    def __init__(self, config: ClipVisionConfig, dtype: torch.dtype, device: torch.device | None) -> None:
        super().__init__()
        size = config.hidden_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels,
            size,
            kernel_size=config.patch_size,
            stride=config.patch_size,
            bias=False,
            dtype=dtype,
            device=device,
        )
        self.class_embedding = nn.Parameter(torch.zeros(size, dtype=dtype, device=device))
        self.position_embedding = nn.Embedding(config.num_patches + 1, size, dtype=dtype, device=device)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """pixel_values [B, C, S, S] -> [B, 1 + num_patches, hidden]."""
        patches = self.patch_embedding(pixel_values)  # [B, hidden, S/p, S/p]
        patches = patches.flatten(2).transpose(1, 2)  # [B, num_patches, hidden], row-major patch order
        cls_token = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls_token, patches], dim=1) + self.position_embedding.weight


class ClipAttention(nn.Module):
    def __init__(self, config: ClipVisionConfig, dtype: torch.dtype, device: torch.device | None) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        size = config.hidden_size
        # One fused projection; rows (and bias) are [q | k | v].
        self.qkv_proj = nn.Linear(size, 3 * size, bias=True, dtype=dtype, device=device)
        self.out_proj = nn.Linear(size, size, bias=True, dtype=dtype, device=device)

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [B, T, hidden] -> [B, T, hidden]; every token sees every token of its image."""
        batch, tokens, size = hidden.shape
        qkv = self.qkv_proj(hidden).view(batch, tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, heads, T, head_dim]
        out = F.scaled_dot_product_attention(q, k, v)  # scale head_dim^-0.5, as CLIP's
        result: Tensor = self.out_proj(out.transpose(1, 2).reshape(batch, tokens, size))
        return result


class ClipMLP(nn.Module):
    def __init__(self, config: ClipVisionConfig, dtype: torch.dtype, device: torch.device | None) -> None:
        super().__init__()
        self.act = ACTIVATIONS[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, dtype=dtype, device=device)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, dtype=dtype, device=device)

    def forward(self, hidden: Tensor) -> Tensor:
        out: Tensor = self.fc2(self.act(self.fc1(hidden)))
        return out


class ClipEncoderLayer(nn.Module):
    """Pre-norm block: x + attn(ln1 x), then + mlp(ln2 x)."""

    def __init__(self, config: ClipVisionConfig, dtype: torch.dtype, device: torch.device | None) -> None:
        super().__init__()
        eps, size = config.layer_norm_eps, config.hidden_size
        self.layer_norm1 = nn.LayerNorm(size, eps=eps, dtype=dtype, device=device)
        self.self_attn = ClipAttention(config, dtype, device)
        self.layer_norm2 = nn.LayerNorm(size, eps=eps, dtype=dtype, device=device)
        self.mlp = ClipMLP(config, dtype, device)

    def forward(self, hidden: Tensor) -> Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        out: Tensor = hidden + self.mlp(self.layer_norm2(hidden))
        return out


class LlavaProjector(nn.Module):
    """Vision features -> the language model's hidden size: linear_2(act(linear_1 x))."""

    def __init__(self, config: LlavaConfig, dtype: torch.dtype, device: torch.device | None) -> None:
        super().__init__()
        vision, text, bias = config.vision.hidden_size, config.text.hidden_size, config.projector_bias
        self.linear_1 = nn.Linear(vision, text, bias=bias, dtype=dtype, device=device)
        self.act = ACTIVATIONS[config.projector_hidden_act]
        self.linear_2 = nn.Linear(text, text, bias=bias, dtype=dtype, device=device)

    def forward(self, features: Tensor) -> Tensor:
        out: Tensor = self.linear_2(self.act(self.linear_1(features)))
        return out


class VisionTower(nn.Module):
    """CLIP vision transformer (up to the selected layer) and the projector.

    Built with random weights from a LlavaConfig, or on the meta device and then filled by
    ``load_llava_vision`` (llava_loader.py) via ``load_state_dict(..., assign=True)``.
    """

    def __init__(
        self,
        config: LlavaConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        dev = torch.device(device) if device is not None else None
        self.config = config
        vision = config.vision
        self.embeddings = ClipVisionEmbeddings(vision, dtype, dev)
        self.pre_layrnorm = nn.LayerNorm(
            vision.hidden_size, eps=vision.layer_norm_eps, dtype=dtype, device=dev
        )
        self.layers = nn.ModuleList(
            ClipEncoderLayer(vision, dtype, dev) for _ in range(config.num_vision_layers_used)
        )
        self.projector = LlavaProjector(config, dtype, dev)

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.class_embedding.dtype

    @property
    def device(self) -> torch.device:
        return self.embeddings.class_embedding.device

    def encode(self, pixel_values: Tensor) -> Tensor:
        """pixel_values [B, C, S, S] (S = image_size) -> [B, num_image_tokens, text hidden] in the
        tower's dtype: per image, the features that replace its placeholder tokens, in order."""
        vision = self.config.vision
        expected = (vision.num_channels, vision.image_size, vision.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values of shape {list(pixel_values.shape)}, expected [B, {expected}]")
        # transformers' hidden_states[0]: the embeddings after pre-LN; hidden_states[i]: layer i-1's output.
        hidden = self.pre_layrnorm(self.embeddings(pixel_values.to(self.device, self.dtype)))
        for layer in self.layers:
            hidden = layer(hidden)  # [B, 1 + num_patches, vision hidden]
        if self.config.vision_feature_select_strategy == "default":
            hidden = hidden[:, 1:]  # drop CLS
        out: Tensor = self.projector(hidden)
        return out


def image_placeholder_rows(input_ids: Tensor, image_token_id: int) -> Tensor:
    """[num_tokens] ids -> [M] int64 indices of the image placeholder tokens, in order: the
    ``image_rows`` LlamaForCausalLM.forward overwrites with M image features."""
    return (input_ids == image_token_id).nonzero().squeeze(1)
