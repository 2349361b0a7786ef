"""KVSpec: what one token's KV is in each layer, as the model states it (no torch here).

Two kinds:

- ``mha`` (MHA / GQA): a key and a value per KV head, ``head_dim`` wide: two planes.
- ``mla`` (DeepSeek MLA): one entry shared by every head, the normed KV latent then the roped
  shared key, ``kv_lora_rank + rope_dim`` wide (576 for V3): one plane, one "head".

Every holder of KV follows the spec: the worker's pages (a page per plane and layer), G2's host
blocks and G3's block files (a block is ``[num_layers, num_planes, block_size, num_kv_heads,
head_dim]``), the attention backend chosen, and the KV bytes per token the worker reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

MHA: Final = "mha"
MLA: Final = "mla"
_PLANES: Final = {MHA: 2, MLA: 1}


@dataclass(frozen=True, slots=True)
class KVSpec:
    kind: str  # MHA or MLA
    num_layers: int
    num_kv_heads: int  # MLA: 1
    head_dim: int  # MLA: the entry width, kv_lora_rank + rope_dim

    def __post_init__(self) -> None:
        if self.kind not in _PLANES:
            raise ValueError(f"KV kind {self.kind!r}: expected one of {sorted(_PLANES)}")
        if min(self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"KVSpec dimensions must be positive: {self}")
        if self.kind == MLA and self.num_kv_heads != 1:
            raise ValueError("an MLA entry is shared by all heads: num_kv_heads must be 1")

    @classmethod
    def mha(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> KVSpec:
        return cls(MHA, num_layers, num_kv_heads, head_dim)

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int, rope_dim: int) -> KVSpec:
        return cls(MLA, num_layers, 1, kv_lora_rank + rope_dim)

    @property
    def num_planes(self) -> int:
        """Tensors per layer and token: key and value (MHA), or the one latent entry (MLA)."""
        return _PLANES[self.kind]

    def page_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """One plane of one layer in the worker: ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def block_shape(self, block_size: int) -> tuple[int, int, int, int, int]:
        """One block's payload, the unit G2 holds and G3 stores:
        ``[num_layers, num_planes, block_size, num_kv_heads, head_dim]``."""
        return (self.num_layers, self.num_planes, block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_token(self, element_size: int) -> int:
        """KV bytes one token costs across all layers (V3 in bf16: 61 x 576 x 2 = 70,272)."""
        return self.num_layers * self.num_planes * self.num_kv_heads * self.head_dim * element_size

    def bytes_per_block(self, block_size: int, element_size: int) -> int:
        return block_size * self.bytes_per_token(element_size)
