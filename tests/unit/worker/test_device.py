"""--device: cpu, cuda[:N], npu[:N]; a device this torch cannot use is refused at start, by name."""

from __future__ import annotations

import pytest
import torch

from services.worker.config import Config
from services.worker.main import resolve_device, resolve_dtype


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
