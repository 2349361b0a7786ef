"""--device: cpu, cuda[:N], npu[:N]; a device this torch cannot use is refused at start, by name."""

from __future__ import annotations

import pytest
import torch

from libs.kernels import cpu_ext
from services.worker.config import Config
from services.worker.model_loading import resolve_device, resolve_dtype, resolve_format


def test_the_flag_takes_three_kinds_of_device() -> None:
    for device in ("cpu", "cuda", "cuda:1", "npu:0"):
        assert Config(device=device).device == device
    for device in ("tpu", "cuda:x", "CPU", ""):
        with pytest.raises(ValueError, match="expected cpu, cuda"):
            Config(device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA device is")
def test_a_missing_accelerator_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--device cuda: this torch sees no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="--device npu: needs torch_npu"):
        resolve_device("npu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_dtype_per_device() -> None:
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("float32", cuda) == torch.float32
    with pytest.raises(ValueError, match="int8/int4 are CPU kernels"):
        resolve_dtype("int4", cuda)


def test_weight_format_auto_is_int8_on_a_cpu_with_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_format("float32", cpu) == "float32" and resolve_format("int4", cpu) == "int4"
    assert resolve_format("auto", cuda) == "bfloat16"
    assert cpu_ext.ops() is not None  # the extension builds wherever the tests run
    for bf16_math in (False, True):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda bf16_math=bf16_math: bf16_math)
        assert resolve_format("auto", cpu) == "int8" and resolve_dtype("int8", cpu) == torch.float32
        dense = "bfloat16" if bf16_math else "float32"
        assert resolve_format("auto", cpu, dense_only=True) == dense  # DeepSeek, MTP drafting
    assert resolve_format("auto", cpu, deterministic=True) == "bfloat16"  # invariance holds in bf16
    assert resolve_format("float32", cpu, deterministic=True) == "float32"  # refused later, with why
    monkeypatch.setattr(cpu_ext, "ops", lambda: None)
    assert resolve_format("auto", cpu) == "bfloat16" and resolve_dtype("int8", cpu) == torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert resolve_format("auto", cpu) == "float32"  # no compiler: the dense weights
