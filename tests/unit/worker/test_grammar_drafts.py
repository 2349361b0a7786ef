"""Speculative decoding under grammars (scheduler core + ModelRunner, tiny random model, the
synthetic vocabulary of test_grammar, both real backends): each verified position is masked as a
decode without speculation would be there, and the matcher rolls back what was not kept.

Drafts come from Predicted Outputs: the output a run without speculation wrote, with some tokens
changed, so drafts are accepted, rejected, and refused by the grammar. Outputs must equal that
run's, greedy and seeded, with overlap on and off and under preemption."""

from __future__ import annotations

import json
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from deepinfer.local_engine import LocalEngine
from libs.grammar.backend import CompiledGrammar
from libs.models.llama import LlamaForCausalLM
from libs.protocol.codec import pack_tokens
from libs.protocol.messages import FinishReason, SamplingParams, StructuredOutput, StructuredOutputKind
from services.scheduler.worker_scheduler import Limits
from services.worker.grammar import HORIZON, SequenceGrammar
from services.worker.grammar_compilers import Grammars
from services.worker.model_runner import ModelRunner, ModelShape
from tests.unit.worker.test_grammar import CONFIG, EOS, PROMPTS, SCHEMA, VOCAB, text

MAX_TOKENS = 200  # the way out stays far (HORIZON) for most of a ~60-token answer: drafts run


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(VOCAB)


def make_engine(
    model: LlamaForCausalLM, grammars: Grammars, k: int, overlap: bool, num_blocks: int = 128
) -> LocalEngine:
    limits = Limits(
        num_blocks, 4, 8, CONFIG.max_position_embeddings, 256, 64, 0.0,
        num_speculative_tokens=k, speculative_policy="fixed",
    )  # fmt: skip
    runner = ModelRunner(model, ModelShape.of(CONFIG), num_blocks, 4, torch.float32, grammars=grammars)
    return LocalEngine(runner, limits, EOS, overlap, check=True)


def params(backend: str, temperature: float) -> SamplingParams:
    constraint = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA), backend)
    return SamplingParams(
        max_tokens=MAX_TOKENS, structured_output=constraint, temperature=temperature, seed=11
    )


def edited(token_ids: list[int]) -> list[int]:
    """Every fifth token changed: to a space (often refused by the grammar) or to 'x'."""
    return [
        (VOCAB.index(b" ") if i % 10 == 4 else VOCAB.index(b"x")) if i % 5 == 4 else t
        for i, t in enumerate(token_ids)
    ]


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
@pytest.mark.parametrize(("overlap", "num_blocks"), [(False, 128), (True, 128), (True, 40)])
def test_drafted_outputs_are_those_without_speculation(
    model: LlamaForCausalLM, grammars: Grammars, backend: str, overlap: bool, num_blocks: int
) -> None:
    requests = [
        (f"{kind}-{seq_id}", prompt, params(backend, temperature))
        for seq_id, prompt in PROMPTS.items()
        for kind, temperature in (("greedy", 0.0), ("seeded", 1.0))
    ]
    plain = make_engine(model, grammars, 0, overlap, num_blocks)
    for request_id, prompt, sampling in requests:
        plain.add(request_id, prompt, sampling)
    expected = plain.run()
    engine = make_engine(model, grammars, 4, overlap, num_blocks)
    for request_id, prompt, sampling in requests:
        engine.add(request_id, prompt, sampling, prediction_token_ids=edited(expected[request_id]))
    assert engine.run() == expected
    for request_id, token_ids in expected.items():
        assert engine.finish_reasons[request_id] is FinishReason.STOP
        jsonschema.validate(json.loads(text(token_ids)), SCHEMA)
    stats = engine.core.speculator.stats["prediction"]
    assert 0 < stats.num_accepted < stats.num_drafted, stats
    if num_blocks < 64:
        assert engine.num_preemptions > 0


def compiled_grammar(
    grammars: Grammars, backend: str, start_after: list[int] | None = None
) -> SequenceGrammar:
    constraint = StructuredOutput(
        StructuredOutputKind.JSON_SCHEMA,
        json.dumps(SCHEMA),
        backend,
        start_after=pack_tokens(start_after or []),
    )
    compiled: Future[CompiledGrammar] = grammars.submit(constraint)
    compiled.result()
    return SequenceGrammar(constraint, compiled, [EOS], grammars.alphabet)


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_drafted_masks_are_the_masks_one_token_at_a_time(grammars: Grammars, backend: str) -> None:
    answer = [VOCAB.index(p.encode()) for p in ['{"', "n", "a", "m", "e", '": ', '"', "a", "b", '"', ', "']]
    drafted, stepped = compiled_grammar(grammars, backend), compiled_grammar(grammars, backend)
    num_words = (CONFIG.vocab_size + 31) // 32
    draft = [*answer, VOCAB.index(b"}")]  # the last one is refused here: the draft is cut before it
    assert drafted.num_usable(draft, MAX_TOKENS) == len(answer)
    masks = torch.zeros(len(answer) + 1, num_words, dtype=torch.int32)
    drafted.fill_drafted(masks, 0, MAX_TOKENS, answer)
    for i, token_id in enumerate([*answer, None]):
        one = torch.zeros(1, num_words, dtype=torch.int32)
        stepped.fill(one, 0, MAX_TOKENS - i)
        assert torch.equal(masks[i], one[0]), i
        if token_id is not None:
            stepped.accept(token_id)
    again = torch.zeros(1, num_words, dtype=torch.int32)
    drafted.fill(again, 0, MAX_TOKENS)  # rolled back: where it began
    assert torch.equal(again[0], masks[0])
    # Where steering may act at a verified position, none is verified.
    assert drafted.num_usable(answer, HORIZON) == 0
    assert drafted.num_usable(answer, HORIZON + 4) == 3


def test_a_draft_stops_before_the_reasoning_ends(grammars: Grammars) -> None:
    grammar = compiled_grammar(grammars, "xgrammar", start_after=[7, 8])
    assert grammar.num_usable([3, 7, 8, 9], MAX_TOKENS) == 2  # 8 completes start_after: masks begin
    grammar.accept(7)
    assert grammar.num_usable([8, 9], MAX_TOKENS) == 0
    assert grammar.num_usable([9, 7], MAX_TOKENS) == 2
