"""The fused decoder blocks (one CPU op per step) against the op-by-op forward they replace: the
same logits and the same KV pages, bit for bit, on decode steps and short rows with context,
while steps with a prefill row keep the op-by-op path."""

from __future__ import annotations

import pytest
import torch

from libs.kernels import cpu_ext
from libs.models.llama import LlamaForCausalLM
from libs.models.quant import quantize_model
from services.worker.forward_executor import ForwardBatch, ForwardExecutor, ModelShape
from tests.tiny_models import TINY_LLAMA

BLOCK_SIZE = 4
TABLES = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9, 10, 11]}


def int8_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY_LLAMA, torch.float32)
    quantize_model(model, "int8")
    return model.eval()


def executor(model: LlamaForCausalLM, fuse: bool) -> ForwardExecutor:
    return ForwardExecutor(model, ModelShape.of(TINY_LLAMA), 16, BLOCK_SIZE, torch.float32, fuse_blocks=fuse)


def step(rows: list[tuple[str, int, int]], g: torch.Generator) -> ForwardBatch:
    """rows: (row, tokens already in its pages, new tokens); prefill rows first. Every token samples."""
    input_ids = torch.randint(0, TINY_LLAMA.vocab_size, (sum(n for _, _, n in rows),), generator=g).tolist()
    positions = [p for _, context, n in rows for p in range(context, context + n)]
    return ForwardBatch(
        input_ids,
        positions,
        query_lens=[n for _, _, n in rows],
        context_lens=[context for _, context, _ in rows],
        block_tables=[TABLES[r] for r, _, _ in rows],
        logits_index=list(range(len(input_ids))),
    )


STEPS: list[tuple[list[tuple[str, int, int]], bool]] = [  # (rows, whether the fused op takes it)
    ([("a", 0, 7), ("b", 0, 3)], False),  # prefills: SDPA's
    ([("a", 7, 1), ("b", 3, 1)], True),  # decodes
    ([("a", 8, 5), ("b", 4, 1)], True),  # a row verifying drafts, beside a decode
    ([("c", 0, 6), ("a", 13, 1)], False),  # a prefill beside a decode
    ([("c", 6, 1), ("a", 14, 1), ("b", 5, 1)], True),
]


@pytest.mark.parametrize("num_threads", [1, 2])
def test_fused_blocks_equal_the_op_by_op_forward(num_threads: int) -> None:
    model = int8_model()
    g = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)  # an executor keeps the count it was made with
    try:
        fused, plain = executor(model, True), executor(model, False)
        assert fused.blocks is not None and plain.blocks is None
        with torch.inference_mode():
            for num_fused, (rows, takes) in enumerate(STEPS):
                batch = step(rows, g)
                expected = plain.forward(batch)
                assert torch.get_num_threads() == num_threads
                got = fused.forward(batch)
                # A fused step runs its torch ops on one thread (the kernels on num_threads).
                assert torch.get_num_threads() == (1 if takes else num_threads)
                assert expected is not None and got is not None
                assert torch.equal(got, expected), f"step {num_fused}: logits differ"
                for plane, other in zip(fused.kv_cache.planes, plain.kv_cache.planes, strict=True):
                    assert all(torch.equal(a, b) for a, b in zip(plane, other, strict=True))
                assert fused.num_fused_steps - (num_fused and sum(t for _, t in STEPS[:num_fused])) == takes
    finally:
        torch.set_num_threads(before)
        cpu_ext.set_num_threads(0)
    assert fused.num_fused_steps == sum(t for _, t in STEPS) and plain.num_fused_steps == 0


def test_only_int8_fp32_llama_blocks_are_fused(extension_off: None) -> None:
    dense = LlamaForCausalLM(TINY_LLAMA, torch.float32)
    assert executor(dense, True).blocks is None  # fp32 weights: op by op
    bf16 = LlamaForCausalLM(TINY_LLAMA, torch.bfloat16)
    quantize_model(bf16, "int8")
    exec_bf16 = ForwardExecutor(bf16, ModelShape.of(TINY_LLAMA), 16, BLOCK_SIZE, torch.bfloat16)
    assert exec_bf16.blocks is None  # bf16 activations: torch's int8 kernel, op by op
    model = int8_model()
    without_kernels = executor(model, True)  # the blocks are there, the extension is not
    with torch.inference_mode():
        out = without_kernels.forward(step([("a", 0, 3)], torch.Generator().manual_seed(2)))
        assert out is not None
        out = without_kernels.forward(step([("a", 3, 1)], torch.Generator().manual_seed(3)))
    assert out is not None and without_kernels.num_fused_steps == 0
