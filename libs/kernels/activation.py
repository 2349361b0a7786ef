"""SwiGLU activation reference op in plain torch."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up over a fused projection output.

    gate_up: [..., 2 * ffn], the gate half first then the up half (as one fused gate/up linear
    produces it); returns [..., ffn] in gate_up's dtype.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
