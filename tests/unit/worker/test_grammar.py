"""Grammar masks in the engine (scheduler core + ModelRunner, tiny random-weight model, a small
synthetic vocabulary, the real grammar backends): constrained outputs validate whatever the
weights want, with overlap and preemption, and end valid inside any ``max_tokens`` that covers
the way out; a model that finishes inside its budget is never steered; a constraint that fails
to compile fails only its own sequence; reasoning before ``start_after`` is free."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from deepinfer.local_engine import LocalEngine
from libs.grammar.backend import CompiledGrammar
from libs.grammar.completion import completion_path, whole_tokens
from libs.models.llama import LlamaForCausalLM
from libs.protocol.codec import pack_tokens
from libs.protocol.messages import FinishReason, SamplingParams, StructuredOutput, StructuredOutputKind
from services.scheduler.worker_scheduler import Limits
from services.worker.grammar import OPEN_SLACK, STEER_SLACK, SequenceGrammar
from services.worker.grammar_compilers import Grammars
from services.worker.model_runner import ModelRunner, ModelShape
from tests.tiny_models import TINY_LLAMA

CONFIG = dataclasses.replace(TINY_LLAMA, max_position_embeddings=256)  # room for a JSON answer
EOS = CONFIG.eos_token_id
# ids 0-2 are special (never text); then printable ASCII; then a few multi-character pieces
PIECES = ['{"', '":', '": ', ', "', '"}', "true", "false", "null", "12", "-3", "ab", "cd"]
VOCAB: list[bytes] = [b"", b"", b""] + [bytes([c]) for c in range(32, 127)] + [p.encode() for p in PIECES]
VOCAB += [b""] * (CONFIG.vocab_size - len(VOCAB))
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"enum": [-3, 12, 40]},  # no numeric bounds: outlines cannot enforce them
        "tags": {"type": "array", "items": {"enum": ["ab", "cd", "x"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "tags", "ok"],
    "additionalProperties": False,
}
PROMPTS = {"a": [5, 9, 3, 7, 1], "b": [4, 4, 6, 8, 10, 12, 14, 16, 18], "c": [30, 31]}


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(VOCAB)


def make_engine(
    model: LlamaForCausalLM, grammars: Grammars, num_blocks: int = 64, overlap: bool = True
) -> LocalEngine:
    limits = Limits(num_blocks, 4, 8, CONFIG.max_position_embeddings, 256, 64, 0.0)
    runner = ModelRunner(model, ModelShape.of(CONFIG), num_blocks, 4, torch.float32, grammars=grammars)
    return LocalEngine(runner, limits, EOS, overlap, check=True)


def text(token_ids: list[int]) -> str:
    return b"".join(VOCAB[t] for t in token_ids if t != EOS).decode()


def constrained(backend: str, **kwargs: object) -> SamplingParams:
    constraint = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA), backend)
    return SamplingParams(max_tokens=160, structured_output=constraint, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
@pytest.mark.parametrize("overlap", [False, True])
def test_outputs_validate_greedy_and_sampled(
    model: LlamaForCausalLM, grammars: Grammars, backend: str, overlap: bool
) -> None:
    engine = make_engine(model, grammars, overlap=overlap)
    for seq_id, prompt in PROMPTS.items():
        engine.add(f"greedy-{seq_id}", prompt, constrained(backend, temperature=0.0))
        engine.add(f"sampled-{seq_id}", prompt, constrained(backend, temperature=1.0, seed=11))
    outputs = engine.run()
    assert len(outputs) == 2 * len(PROMPTS)
    for seq_id, token_ids in outputs.items():
        assert engine.finish_reasons[seq_id] is FinishReason.STOP, seq_id
        assert token_ids[-1] == EOS
        jsonschema.validate(json.loads(text(token_ids)), SCHEMA)


def test_preemption_replays_the_grammar(model: LlamaForCausalLM, grammars: Grammars) -> None:
    free = make_engine(model, grammars)
    tight = make_engine(model, grammars, num_blocks=24)  # 96 slots for ~190 tokens of demand
    params = constrained("xgrammar", temperature=1.0, seed=5)
    for engine in (free, tight):
        for seq_id, prompt in PROMPTS.items():
            engine.add(seq_id, prompt, params)
    expected = free.run()
    assert tight.run() == expected
    assert tight.num_preemptions > 0


def test_a_failed_compile_fails_only_its_sequence(model: LlamaForCausalLM, grammars: Grammars) -> None:
    engine = make_engine(model, grammars)
    bad = StructuredOutput(StructuredOutputKind.REGEX, "(unclosed", "xgrammar")
    engine.add("bad", PROMPTS["a"], SamplingParams(max_tokens=20, structured_output=bad))
    engine.add("good", PROMPTS["b"], constrained("xgrammar", temperature=0.0))
    outputs = engine.run()
    assert engine.finish_reasons["bad"] is FinishReason.ERROR
    assert engine.finish_reasons["good"] is FinishReason.STOP
    jsonschema.validate(json.loads(text(outputs["good"])), SCHEMA)


def test_reasoning_is_free_until_start_after(grammars: Grammars) -> None:
    regex = StructuredOutput(StructuredOutputKind.REGEX, "ab", "xgrammar", start_after=pack_tokens([7, 8]))
    compiled: Future[CompiledGrammar] = grammars.submit(regex)
    grammar = SequenceGrammar(regex, compiled, [EOS])
    bitmask = torch.zeros(1, (CONFIG.vocab_size + 31) // 32, dtype=torch.int32)
    for token_id in (7, 9, 8, 7):  # 7 8 not yet adjacent: still reasoning
        grammar.accept(token_id)
        assert not grammar.active
    grammar.accept(8)
    assert grammar.active
    grammar.fill(bitmask, 0)
    allowed = [t for t in range(CONFIG.vocab_size) if int(bitmask[0, t // 32]) >> (t % 32) & 1]
    assert allowed == sorted({VOCAB.index(b"a"), VOCAB.index(b"ab")})
    grammar.accept(VOCAB.index(b"ab"))
    grammar.fill(bitmask, 0)
    allowed = [t for t in range(CONFIG.vocab_size) if int(bitmask[0, t // 32]) >> (t % 32) & 1]
    assert allowed == [EOS]


OPEN_ENDED = {  # nothing in the schema bounds the output's length
    "free_object": {"type": "object"},
    "long_string": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    "numbers": {"type": "array", "items": {"type": "integer"}, "minItems": 2},
    "linked_list": {  # recursion: outlines refuses recursive $ref, so xgrammar only
        "$defs": {
            "item": {
                "type": "object",
                "properties": {
                    "v": {"type": "string"},
                    "next": {"anyOf": [{"$ref": "#/$defs/item"}, {"type": "null"}]},
                },
                "required": ["v", "next"],
            }
        },
        "$ref": "#/$defs/item",
    },
}


def test_every_way_out_fits_the_smallest_budget(grammars: Grammars) -> None:
    """The premise of the next test: 16 tokens cover each schema's way out at the start."""
    assert grammars.alphabet is not None
    for backend in ("xgrammar", "outlines"):
        for name, schema in OPEN_ENDED.items():
            if backend == "outlines" and name == "linked_list":
                continue
            constraint = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(schema), backend)
            matcher = grammars.submit(constraint).result().matcher([EOS])
            path = completion_path(matcher, grammars.alphabet, EOS)
            assert path is not None and len(path) <= 16, (backend, name, path)


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
@pytest.mark.parametrize("max_tokens", [16, 19, 24, 61])
def test_open_ended_outputs_end_valid_inside_max_tokens(
    model: LlamaForCausalLM, grammars: Grammars, backend: str, max_tokens: int
) -> None:
    """Random weights never choose to close a string or a list; the way out does, in budget."""
    engine = make_engine(model, grammars)
    schemas = {n: s for n, s in OPEN_ENDED.items() if backend == "xgrammar" or n != "linked_list"}
    for name, schema in schemas.items():
        constraint = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(schema), backend)
        for temperature, seed in ((0.0, None), (1.0, 3), (1.0, 4)):
            params = SamplingParams(
                max_tokens=max_tokens, temperature=temperature, seed=seed, structured_output=constraint
            )
            engine.add(f"{name}-{temperature}-{seed}", PROMPTS["b"], params)
    outputs = engine.run()
    for seq_id, token_ids in outputs.items():
        assert engine.finish_reasons[seq_id] is FinishReason.STOP, (seq_id, text(token_ids))
        assert len(token_ids) <= max_tokens
        jsonschema.validate(json.loads(text(token_ids)), schemas[seq_id.split("-")[0]])


OPTIONAL = {
    "type": "object",
    "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
    "required": ["a"],
}


def allowed(bitmask: torch.Tensor) -> set[int]:
    return {t for t in range(CONFIG.vocab_size) if int(bitmask[0, t // 32]) >> (t % 32) & 1}


def spelled(text: str, grammars: Grammars) -> list[int]:
    assert grammars.alphabet is not None
    return whole_tokens(text.encode(), grammars.alphabet.pieces)


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_a_model_with_room_to_spare_is_never_steered(grammars: Grammars, backend: str) -> None:
    """Every token of an answer that leaves more than OPEN_SLACK tokens of its budget unused is
    allowed, its structure too (a third tag), though the way out is close from the first token."""
    answer = spelled('{"name": "abcd", "size": 12, "tags": ["ab", "cd", "x"], "ok": true}', grammars)
    constraint = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA), backend)
    grammar = SequenceGrammar(constraint, grammars.submit(constraint), [EOS], grammars.alphabet)
    bitmask = torch.zeros(1, (CONFIG.vocab_size + 31) // 32, dtype=torch.int32)
    budget = len(answer) + 1 + OPEN_SLACK + 1  # EOS, then the margin
    for i, token_id in enumerate([*answer, EOS]):
        grammar.fill(bitmask, 0, budget - i)
        assert token_id in allowed(bitmask), (i, VOCAB[token_id])
        grammar.accept(token_id)


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_a_close_way_out_guards_then_is_walked(grammars: Grammars, backend: str) -> None:
    """After '{"a": "x"' the way out is '}' then EOS. With a margin above OPEN_SLACK the model may
    open the optional property; at OPEN_SLACK or less it may not (only '}' is left); at a margin
    of one the way out is walked. Inside the string, a guarded model still writes letters."""
    constraint = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(OPTIONAL), backend)
    bitmask = torch.zeros(1, (CONFIG.vocab_size + 31) // 32, dtype=torch.int32)
    close, comma, letter = VOCAB.index(b"}"), VOCAB.index(b', "'), VOCAB.index(b"x")

    def mask(prefix: str, remaining: int) -> set[int]:
        grammar = SequenceGrammar(constraint, grammars.submit(constraint), [EOS], grammars.alphabet)
        for token_id in spelled(prefix, grammars):
            grammar.accept(token_id)
        grammar.fill(bitmask, 0, remaining)
        return allowed(bitmask)

    assert {close, comma} <= mask('{"a": "x"', 2 + OPEN_SLACK + 1)
    for margin in (OPEN_SLACK, STEER_SLACK + 1, STEER_SLACK):  # no new structure, then checked
        guarded = mask('{"a": "x"', 2 + margin)
        assert close in guarded and comma not in guarded, margin
    loose = mask('{"a": "x', 2 + OPEN_SLACK)  # in a string, margin OPEN_SLACK - 1: letters go on
    assert letter in loose and VOCAB.index(b'"}') in loose
    assert mask('{"a": "x"', 3) == {close}
    inside = mask('{"a": "x', 3 + 2)  # way out '"}' EOS, margin 3: guarded
    assert letter in inside and VOCAB.index(b'"}') in inside and VOCAB.index(b"\\") not in inside
    assert mask('{"a": "x', 3) == {VOCAB.index(b'"}'), VOCAB.index(b'"')}  # margin 1: only what begins it
