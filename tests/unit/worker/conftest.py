"""The worker tests' tiny random-weight model (fp32), built once per session: tests only read it."""

from __future__ import annotations

import pytest
import torch

from libs.models.llama import LlamaForCausalLM
from tests.tiny_models import TINY_LLAMA


@pytest.fixture(scope="session")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(TINY_LLAMA, dtype=torch.float32).eval()
