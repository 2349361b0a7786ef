"""--deterministic through the real ModelRunner and scheduler core, in bf16 (a small random llama
whose contexts span several attention chunks): 8 prompts give the same tokens alone and cold as
all at once with 24-token prefill chunks and preemption, and as on prefix-cache hits, greedy and
seeded; and the worker refuses the flag, with the reason, where it cannot hold."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.local_engine import LocalEngine
from libs.kvstore.kv_spec import MLA
from libs.models.llama import LlamaForCausalLM
from libs.protocol.messages import SamplingParams
from services.scheduler.worker_scheduler import Limits
from services.worker import determinism
from services.worker.forward_executor import ForwardBatch
from services.worker.model_runner import ModelRunner, ModelShape
from tests.tiny_models import TINY_LLAMA

CONFIG = dataclasses.replace(
    TINY_LLAMA,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
)
BLOCK_SIZE = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, ignore_eos=True, seed=7)


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 128, (72,), generator=g).tolist()  # 9 blocks a later prompt finds cached
    prompts = {f"p{i}": torch.randint(3, 128, (10 + 17 * i,), generator=g).tolist() for i in range(6)}
    prompts["s0"] = [*shared, 5, 6, 7]
    prompts["s1"] = [*shared, 9, 10]
    return prompts


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def bf16_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG, dtype=torch.bfloat16)
    for param in model.parameters():  # random weights large enough to make sharp, varied logits
        param.data.normal_(0.0, 0.2)
    return model.eval()


def _engine(
    model: LlamaForCausalLM, num_blocks: int = 256, max_num_batched_tokens: int = 512
) -> tuple[LocalEngine, list[int]]:
    max_len = CONFIG.max_position_embeddings
    limits = Limits(num_blocks, BLOCK_SIZE, 8, max_len, max_num_batched_tokens, 64, 0.0)
    runner = ModelRunner(
        model, ModelShape.of(CONFIG), num_blocks, BLOCK_SIZE, torch.bfloat16, batch_invariant=True
    )
    rows: list[int] = []  # rows of each step's forward
    forward = runner.executor.forward

    def recorded(batch: ForwardBatch) -> torch.Tensor | None:
        rows.append(len(batch.query_lens))
        return forward(batch)

    runner.executor.forward = recorded  # type: ignore[method-assign]
    return LocalEngine(runner, limits, CONFIG.eos_token_id, check=True), rows


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_tokens_do_not_depend_on_the_batch(bf16_model: LlamaForCausalLM, params: SamplingParams) -> None:
    alone = {}
    for seq_id, prompt in PROMPTS.items():  # each alone, cold, its prompt in one step
        engine, _ = _engine(bf16_model)
        alone |= engine.run([(0, seq_id, prompt, params)])
    assert len({tuple(tokens) for tokens in alone.values()}) == len(PROMPTS)  # not all one token

    # All at once: 24-token prefill chunks, and a pool too small for all eight to finish together.
    engine, rows = _engine(bf16_model, num_blocks=40, max_num_batched_tokens=24)
    together = engine.run((0, seq_id, prompt, params) for seq_id, prompt in PROMPTS.items())
    assert together == alone
    assert max(rows) >= 6, rows  # steps really held several rows
    assert engine.core.num_preemptions > 0

    # One after another in one engine: s1 finds s0's 9 shared blocks cached.
    engine, _ = _engine(bf16_model)
    arrivals = [(20 * i, seq_id, prompt, params) for i, (seq_id, prompt) in enumerate(PROMPTS.items())]
    staggered = engine.run(arrivals)
    assert staggered == alone
    assert engine.core.prefix_cache_stats.num_hit_tokens >= 72


def test_the_probe_passes_bf16_and_names_what_fails(bf16_model: LlamaForCausalLM) -> None:
    assert determinism.probe(bf16_model, torch.bfloat16) is None
    # fp32 products on this CPU sum in another order for one row than for a batch (or, where they
    # do not, the probe passes them and the refusal before it still names fp32).
    fp32 = LlamaForCausalLM(CONFIG, dtype=torch.float32)
    reason = determinism.refusal(torch.device("cpu"), torch.float32, CONFIG.kv_spec(), "none")
    assert reason is not None and "bfloat16" in reason
    probed = determinism.probe(fp32, torch.float32)
    assert probed is None or "alone than in a batch" in probed
    heads = (CONFIG.num_attention_heads, CONFIG.num_key_value_heads, CONFIG.head_dim)
    assert determinism._attention_probe(*heads, torch.bfloat16) is None
    attention_fp32 = determinism._attention_probe(*heads, torch.float32)
    assert attention_fp32 is None or attention_fp32.startswith("attention gives a query other bits")


def test_refusals_name_their_reason() -> None:
    spec = CONFIG.kv_spec()
    assert determinism.refusal(torch.device("cpu"), torch.bfloat16, spec, "ngram") is None
    assert "CPU-only" in str(determinism.refusal(torch.device("cuda"), torch.bfloat16, spec, "none"))
    assert "MTP" in str(determinism.refusal(torch.device("cpu"), torch.bfloat16, spec, "mtp"))
    mla = dataclasses.replace(spec, kind=MLA, num_kv_heads=1)
    assert "MLA" in str(determinism.refusal(torch.device("cpu"), torch.bfloat16, mla, "none"))
