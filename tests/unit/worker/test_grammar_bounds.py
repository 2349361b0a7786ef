"""The worker's compile bound in the engine (scheduler core + ModelRunner, tiny model, the real
outlines backend in its compiler process): a regex whose index explodes fails its own sequence,
naming the bound, while the sequence beside it decodes to a valid answer; a repeat fails at once
from the cache, without another compile (the timeouts counter counts one)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest
import torch
from prometheus_client import generate_latest

from libs.grammar.sandbox import CompileLimits
from libs.models.llama import LlamaForCausalLM
from libs.protocol.messages import FinishReason, SamplingParams, StructuredOutput, StructuredOutputKind
from services.worker import metrics
from services.worker.grammar_compilers import Grammars
from services.worker.model_runner import ModelRunner, ModelShape
from tests.unit.worker.test_grammar import CONFIG, PROMPTS, SCHEMA, VOCAB, constrained, make_engine, text

HOSTILE = StructuredOutput(StructuredOutputKind.REGEX, "[ab]*a[ab]{22}", "outlines")  # 2**22 DFA states


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def grammars() -> Iterator[Grammars]:
    grammars = Grammars(VOCAB, limits=CompileLimits(timeout_s=2, num_procs=1))
    yield grammars
    grammars.close()


def test_a_compile_past_its_bound_fails_only_its_sequence(
    model: LlamaForCausalLM, grammars: Grammars
) -> None:
    timeouts_before = metrics.GRAMMAR_COMPILE_TIMEOUTS._value.get()
    engine = make_engine(model, grammars)
    engine.add("hostile", PROMPTS["a"], SamplingParams(max_tokens=20, structured_output=HOSTILE))
    engine.add("good", PROMPTS["b"], constrained("outlines", temperature=0.0))
    outputs = engine.run()
    assert engine.finish_reasons["hostile"] is FinishReason.ERROR
    assert "grammar compilation exceeded 2 s" in engine.finished["hostile"].error
    assert engine.finish_reasons["good"] is FinishReason.STOP
    jsonschema.validate(json.loads(text(outputs["good"])), SCHEMA)
    # the repeat is answered by the cache: already failed when the sequence arrives
    assert grammars.submit(HOSTILE).done()
    engine.add("again", PROMPTS["c"], SamplingParams(max_tokens=20, structured_output=HOSTILE))
    engine.run()
    assert engine.finish_reasons["again"] is FinishReason.ERROR
    assert metrics.GRAMMAR_COMPILE_TIMEOUTS._value.get() == timeouts_before + 1  # one compile burned


def test_wait_warm_returns_once_every_compiler_process_is_ready(model: LlamaForCausalLM) -> None:
    # A worker waits for this before it announces itself: processes still importing their backend
    # would take the cores from its first requests.
    grammars = Grammars(VOCAB, limits=CompileLimits(num_procs=2))
    try:
        grammars.wait_warm()  # nothing warming: at once
        assert grammars.compilers_ready() == {}
        grammars.warm("xgrammar")
        grammars.wait_warm()
        assert grammars.compilers_ready() == {"xgrammar": 2}
        runner = ModelRunner(model, ModelShape.of(CONFIG), 16, 4, torch.float32, grammars=grammars)
        scraped = generate_latest(metrics.registry(runner)).decode()
        assert 'deepinfer_grammar_compilers_ready{backend="xgrammar"} 2.0' in scraped
        json_any = StructuredOutput(StructuredOutputKind.JSON, backend="xgrammar")
        compiles = metrics.GRAMMAR_COMPILE_SECONDS._sum.get(), _count(metrics.GRAMMAR_COMPILE_SECONDS)
        assert grammars.submit(json_any).done()  # warm's compile, cached: no compile time counted
        schema = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, '{"type": "integer"}', backend="xgrammar")
        grammars.submit(schema).result(timeout=30)
        assert _count(metrics.GRAMMAR_COMPILE_SECONDS) == compiles[1] + 1  # one compile timed
        assert metrics.GRAMMAR_COMPILE_SECONDS._sum.get() > compiles[0]
    finally:
        grammars.close()


def _count(histogram: object) -> float:
    """Observations so far (the +Inf bucket of a prometheus_client Histogram)."""
    return sum(bucket.get() for bucket in histogram._buckets)  # type: ignore[attr-defined]
