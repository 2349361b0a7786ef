"""One bad sequence fails alone in the real ModelRunner (tiny random fp32 model): a token id past
the vocabulary, a prompt past the model's positions, a row whose logits are NaN and a row whose
forward raises each end that sequence with an error, while the rest of the batch gets the tokens
it gets alone. Only a model that fails every row, or a contradicting plan, fails the step."""

from __future__ import annotations

import pytest
import torch

from deepinfer.local_engine import LocalEngine
from libs.models.attention import AttentionFn
from libs.models.llama import LlamaForCausalLM
from libs.protocol.codec import pack_tokens, unpack_tokens
from libs.protocol.kv_messages import KVSave
from libs.protocol.messages import (
    FinishReason,
    ModelRunnerOutput,
    NewSequence,
    SamplingParams,
    SchedulerOutput,
)
from services.scheduler.worker_scheduler import Limits
from services.worker.host_cache import HostCache
from services.worker.kv_tiers import KVTiers
from services.worker.mask_job import MaskResult
from services.worker.model_runner import MAX_LONE_FAILURES, CausalLM, ModelRunner, ModelShape, PlanError
from services.worker.row_isolation import kept_mask
from tests.reference import reference_greedy
from tests.tiny_models import TINY_LLAMA

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
GOOD = {"a": [5, 9, 3, 7, 1, 2, 8], "b": [4, 4, 6]}
BLOCK_SIZE = 4
NAN_TOKEN = 77  # the NaN model's hidden state is NaN wherever this token is the input
POISON_TOKEN = 99  # the raising model raises for any forward whose input has this token


class NaNAt:
    """The model, with the final hidden state of every ``NAN_TOKEN`` position set to NaN."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions, attention).clone()
        hidden[input_ids == NAN_TOKEN] = float("nan")
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


class RaisesOn:
    """The model, raising (as an out-of-range kernel index would) for a forward that sees ``token``."""

    def __init__(self, model: LlamaForCausalLM, token: int | None = POISON_TOKEN) -> None:
        self.model = model
        self.token = token  # None: every forward raises (a broken model)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        if self.token is None or bool((input_ids == self.token).any()):
            raise RuntimeError("kernel index out of range")
        return self.model(input_ids, positions, attention)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def make_runner(model: CausalLM, num_blocks: int = 64) -> ModelRunner:
    return ModelRunner(model, ModelShape.of(TINY_LLAMA), num_blocks, BLOCK_SIZE, torch.float32)


def new_seqs(prompts: dict[str, list[int]]) -> tuple[NewSequence, ...]:
    """Each prompt whole in one step, on blocks of its own."""
    out, next_block = [], 0
    for seq_id, prompt in prompts.items():
        num_blocks = -(-len(prompt) // BLOCK_SIZE)
        blocks = pack_tokens(list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
        out.append(NewSequence(seq_id, pack_tokens(prompt), b"", GREEDY, (), blocks, 0, len(prompt)))
    return tuple(out)


def sampled(result: ModelRunnerOutput) -> dict[str, int]:
    return dict(zip(result.seq_ids, unpack_tokens(result.sampled_token_ids), strict=True))


def solo_first_tokens(model: CausalLM) -> dict[str, int]:
    return {
        s: sampled(make_runner(model).execute(SchedulerOutput(1, new_seqs({s: p}))))[s]
        for s, p in GOOD.items()
    }


def test_a_sequence_the_model_cannot_take_fails_alone_before_the_step(model: LlamaForCausalLM) -> None:
    runner = make_runner(model)
    bad = {
        "vocab": [5, TINY_LLAMA.vocab_size, 7],  # one id past the embedding table
        "long": [3] * (TINY_LLAMA.max_position_embeddings + 1),  # past the RoPE table
    }
    result = runner.execute(SchedulerOutput(1, new_seqs({"a": GOOD["a"], **bad, "b": GOOD["b"]})))
    assert sampled(result) == solo_first_tokens(model)
    errors = dict(zip(result.failed_seq_ids, result.failed_errors, strict=True))
    assert set(errors) == {"vocab", "long"}
    assert "token id 128" in errors["vocab"] and "positions" in errors["long"]
    assert set(runner.seqs) == {"a", "b"} and result.num_running_seqs == 2
    runner.check_integrity()


def test_a_failed_sequence_is_skipped_by_plans_in_flight_until_finished(model: LlamaForCausalLM) -> None:
    runner = make_runner(model)
    runner.execute(SchedulerOutput(1, new_seqs({"a": GOOD["a"], "bad": [TINY_LLAMA.vocab_size + 5]})))
    # made before the scheduler saw step 1's result: decodes both
    decode = SchedulerOutput(
        2, seq_ids=("a", "bad"), num_scheduled_tokens=pack_tokens([1, 1]), new_block_ids=(b"", b"")
    )
    result = runner.execute(decode)
    assert result.seq_ids == ("a",) and result.failed_seq_ids == ()
    runner.check_integrity()
    runner.execute(SchedulerOutput(3, finished_seq_ids=("bad",)))
    assert runner.failed_seq_ids == set()
    with pytest.raises(PlanError):  # once finished, a plan naming it contradicts the worker again
        runner.execute(
            SchedulerOutput(4, seq_ids=("bad",), num_scheduled_tokens=pack_tokens([1]), new_block_ids=(b"",))
        )


def make_engine(model: CausalLM, overlap: bool) -> tuple[LocalEngine, ModelRunner]:
    runner = make_runner(model, num_blocks=32)
    limits = Limits(32, BLOCK_SIZE, 8, TINY_LLAMA.max_position_embeddings, 256, 64, 0.0)
    return LocalEngine(runner, limits, TINY_LLAMA.eos_token_id, overlap, check=True), runner


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    ("wrap", "bad_prompt", "fragment"),
    [
        (lambda m: m, [5, TINY_LLAMA.vocab_size, 7], "vocabulary"),
        (NaNAt, [3, 4, NAN_TOKEN], "not finite"),
        (RaisesOn, [3, POISON_TOKEN, 4], "kernel index out of range"),
    ],
    ids=["bad-token", "nan-logits", "forward-raises"],
)
def test_one_bad_sequence_fails_alone_and_the_batch_goes_on(
    model: LlamaForCausalLM, wrap: type, bad_prompt: list[int], fragment: str, overlap: bool
) -> None:
    """Admitted together, decoded together (with overlap, plans made before the failure is known
    still schedule the bad one); the good ones end equal to their unbatched reference."""
    engine, runner = make_engine(wrap(model), overlap)
    outputs = engine.run(
        [(0, "a", GOOD["a"], GREEDY), (0, "bad", bad_prompt, GREEDY), (0, "b", GOOD["b"], GREEDY)]
    )
    for seq_id, prompt in GOOD.items():
        want = reference_greedy(model, prompt, GREEDY.max_tokens)
        assert NAN_TOKEN not in want and POISON_TOKEN not in want  # the good rows never meet the fault
        assert outputs[seq_id] == want, seq_id
        assert engine.finish_reasons[seq_id] is FinishReason.LENGTH
    assert engine.finish_reasons["bad"] is FinishReason.ERROR and outputs["bad"] == []
    assert fragment in engine.finished["bad"].error
    assert runner.seqs == {} and runner.failed_seq_ids == set()  # dropped, then forgotten once finished
    assert engine.core.block_manager.num_free_blocks == 32


def test_blocks_of_a_refused_sequence_never_serve_a_later_prefix_hit(model: LlamaForCausalLM) -> None:
    """The worker never computed the refused prompt's valid first block: the scheduler must not
    cache it, or a later prompt sharing that block reads KV nobody wrote. (With overlap, the plan
    made before the failure is known caches it first, and forgets it when the failure comes.)"""
    engine, _ = make_engine(model, overlap=False)
    shared = [5, 6, 7, 8]  # one full block
    engine.run([(0, "bad", [*shared, TINY_LLAMA.vocab_size, 7], GREEDY)])
    assert engine.finish_reasons["bad"] is FinishReason.ERROR
    outputs = engine.run([(0, "later", [*shared, 9, 10], GREEDY)])
    assert outputs["later"] == reference_greedy(model, [*shared, 9, 10], GREEDY.max_tokens)
    assert engine.finished["later"].num_cached_tokens == 0


def test_a_forward_that_raises_for_one_row_fails_that_row_alone(model: LlamaForCausalLM) -> None:
    prompts = {"a": GOOD["a"], "bad": [3, POISON_TOKEN], "b": GOOD["b"]}
    runner = make_runner(RaisesOn(model))
    result = runner.execute(SchedulerOutput(1, new_seqs(prompts)))
    assert sampled(result) == solo_first_tokens(model)
    assert result.failed_seq_ids == ("bad",) and "kernel index out of range" in result.failed_errors[0]
    assert set(runner.seqs) == {"a", "b"}
    assert all(runner.seqs[s].num_computed_tokens == len(p) for s, p in GOOD.items())
    runner.check_integrity()


def test_a_model_that_fails_every_row_fails_the_step(model: LlamaForCausalLM) -> None:
    runner = make_runner(RaisesOn(model, token=None))
    with pytest.raises(RuntimeError, match="kernel index out of range"):
        runner.execute(SchedulerOutput(1, new_seqs(GOOD)))


def test_kept_grammar_results_are_renumbered_to_the_rows_that_sample() -> None:
    bias = torch.tensor([[0.0, float("-inf")], [float("-inf"), 0.0]])
    mask = MaskResult(rows=[0, 2], bias=bias, failed={3: "no grammar"})
    grammar_mask, failed = kept_mask(mask, keep=[1, 2, 3])  # sampling row 0 failed
    assert grammar_mask is not None and grammar_mask.rows == [1]
    assert torch.equal(grammar_mask.bias, bias[1:])
    assert failed == {2: "no grammar"}
    assert kept_mask(mask, keep=[1]) == (None, {})


def test_a_failed_sequences_blocks_are_not_saved_by_plans_made_before_the_failure(
    model: LlamaForCausalLM,
) -> None:
    """Plan 2 was made before plan 1's result said "bad" was refused (overlap), and plan 3, which
    names it finished, still carries a save queued before the failure was known: neither may put
    the never-written KV into G2. After that its blocks are the scheduler's again."""
    layout = ModelShape.of(TINY_LLAMA).kv_spec
    tiers = KVTiers(HostCache(8, layout.block_shape(BLOCK_SIZE), torch.float32), None)
    runner = ModelRunner(model, ModelShape.of(TINY_LLAMA), 64, BLOCK_SIZE, torch.float32, kv_tiers=tiers)
    prompt = pack_tokens([5, 6, 7, 8, TINY_LLAMA.vocab_size])
    bad = NewSequence("bad", prompt, b"", GREEDY, (), pack_tokens([0, 1]), 0, 5)
    first = runner.execute(SchedulerOutput(1, (bad,)))
    assert first.failed_seq_ids == ("bad",)
    block_hash = bytes(range(32))
    save = KVSave(pack_tokens([0]), block_hash)
    runner.execute(SchedulerOutput(2, kv_saves=(save,)))
    runner.check_integrity()
    runner.execute(SchedulerOutput(3, finished_seq_ids=("bad",), kv_saves=(save,)))
    runner.check_integrity()
    assert tiers.dump() == []
    runner.execute(SchedulerOutput(4, kv_saves=(save,)))
    assert tiers.dump() == [block_hash]


def test_a_new_row_whose_cached_prefix_a_failed_sequence_never_wrote_computes_it(
    model: LlamaForCausalLM,
) -> None:
    """Overlap: the plan made before "bad"'s failure was known admitted "hit" with a prefix hit
    on bad's first block, which the worker never wrote (its page still holds what was there
    before: NaN here). "hit" computes it again and gets the token it gets alone."""
    runner = make_runner(model)
    page = runner.kv_cache.block_shape  # what an earlier tenant of the page left: NaN here
    runner.kv_cache.scatter_blocks([0], torch.full((1, *page), float("nan")))
    shared = [5, 6, 7, 8]
    bad = NewSequence(
        "bad", pack_tokens([*shared, TINY_LLAMA.vocab_size]), b"", GREEDY, (), pack_tokens([0, 1]), 0, 5
    )
    assert runner.execute(SchedulerOutput(1, (bad,))).failed_seq_ids == ("bad",)
    prompt = [*shared, 9, 10]
    hit = NewSequence("hit", pack_tokens(prompt), b"", GREEDY, (), pack_tokens([0, 2]), 4, 2)
    result = runner.execute(SchedulerOutput(2, (hit,), finished_seq_ids=("bad",)))
    runner.check_integrity()
    assert result.failed_seq_ids == () and runner.seqs["hit"].num_computed_tokens == len(prompt)
    assert sampled(result)["hit"] == reference_greedy(model, prompt, 1)[0]


def test_lone_rows_that_keep_failing_fail_the_step(model: LlamaForCausalLM) -> None:
    """A step of one row cannot tell its sequence's fault from the model's: it blames the
    sequence, but after MAX_LONE_FAILURES such steps in a row the model is taken as broken."""
    runner = make_runner(RaisesOn(model, token=None))
    for step_id in range(1, MAX_LONE_FAILURES + 1):
        result = runner.execute(SchedulerOutput(step_id, new_seqs({f"s{step_id}": GOOD["a"]})))
        assert result.failed_seq_ids == (f"s{step_id}",)
        runner.check_integrity()
    with pytest.raises(RuntimeError, match="kernel index out of range"):
        runner.execute(SchedulerOutput(99, new_seqs({"next": GOOD["a"]})))
