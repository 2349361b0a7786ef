"""ModelRunner over paged KV vs the plain whole-sequence forward, on a tiny random-weight model."""

from __future__ import annotations

import torch

from libs.models.attention import SingleSequenceCausalAttention
from libs.models.llama import LlamaForCausalLM
from libs.protocol.codec import pack_tokens, unpack_tokens
from libs.protocol.messages import NewSequence, SamplingParams, SchedulerOutput
from services.worker.model_runner import KVLayout, ModelRunner
from tests.tiny_models import TINY_LLAMA

CONFIG = TINY_LLAMA
GREEDY = SamplingParams(temperature=0.0, max_tokens=100)


def make_runner(num_blocks: int = 32, block_size: int = 4) -> tuple[LlamaForCausalLM, ModelRunner]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG, dtype=torch.float32).eval()
    layout = KVLayout(CONFIG.num_hidden_layers, CONFIG.num_key_value_heads, CONFIG.head_dim)
    return model, ModelRunner(model, layout, num_blocks, block_size, torch.float32)


@torch.inference_mode()
def reference_greedy(model: LlamaForCausalLM, prompt: list[int], num_tokens: int) -> list[int]:
    """Re-run the whole sequence for every token: no cache at all."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        ids = torch.tensor(tokens)
        hidden = model(ids, torch.arange(len(tokens)), SingleSequenceCausalAttention())
        tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return tokens[len(prompt) :]


def test_staggered_batch_matches_reference() -> None:
    """Sequences join at different steps, so prefills mix with decodes of different lengths."""
    model, runner = make_runner()
    prompts = {"a": [5, 9, 3, 7, 1, 2, 8], "b": [4, 4, 6], "c": [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]}
    joins = {"a": 1, "b": 3, "c": 4}
    got: dict[str, list[int]] = {s: [] for s in prompts}
    for step in range(1, 12):
        new = tuple(NewSequence(s, pack_tokens(p), GREEDY) for s, p in prompts.items() if joins[s] == step)
        decode = tuple(s for s in prompts if joins[s] < step)
        out = runner.execute(SchedulerOutput(step, new, decode))
        runner.check_integrity()
        for seq_id, token in zip(out.seq_ids, unpack_tokens(out.sampled_token_ids), strict=True):
            got[seq_id].append(token)
    for seq_id, prompt in prompts.items():
        assert got[seq_id] == reference_greedy(model, prompt, len(got[seq_id])), seq_id


def test_finished_sequences_free_their_blocks_and_full_cache_fails_loudly() -> None:
    _, runner = make_runner(num_blocks=4, block_size=4)
    out = runner.execute(SchedulerOutput(1, (NewSequence("a", pack_tokens([1] * 10), GREEDY),)))
    assert out.seq_ids == ("a",) and runner.block_manager.num_free_blocks == 1
    out = runner.execute(SchedulerOutput(2, (NewSequence("b", pack_tokens([2] * 8), GREEDY),), ("a",)))
    assert out.failed_seq_ids == ("b",) and out.seq_ids == ("a",)
    runner.check_integrity()
    out = runner.execute(SchedulerOutput(3, (), (), ("a",)))
    assert out.num_running_seqs == 0 and runner.block_manager.num_free_blocks == 4
    runner.check_integrity()
    runner.execute(SchedulerOutput(4, (NewSequence("c", pack_tokens([3] * 5), GREEDY),)))
    runner.reset()
    assert runner.num_running_seqs == 0 and runner.block_manager.num_free_blocks == 4
    runner.check_integrity()


def test_seeded_sampling_is_reproducible() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123)

    def sample() -> list[int]:
        _, runner = make_runner()
        tokens = []
        out = runner.execute(SchedulerOutput(1, (NewSequence("s", pack_tokens([3, 1, 4]), params),)))
        tokens += unpack_tokens(out.sampled_token_ids)
        for step in range(2, 8):
            tokens += unpack_tokens(runner.execute(SchedulerOutput(step, (), ("s",))).sampled_token_ids)
        return tokens

    assert sample() == sample()
