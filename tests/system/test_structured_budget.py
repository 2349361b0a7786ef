"""Structured outputs end valid inside ``max_tokens`` on the real SmolLM2, in one process.

The gateway's own request parsing and prompt rendering (``parse_chat_request``,
``ServedModel.prompt``), then the scheduler core and a real ModelRunner with the real grammar
backend (``LocalEngine``): a forced tool call, a strict tool under ``auto`` and a nested
``response_format`` schema, each swept over ``max_tokens`` from the length of the way out at
the start up. Every reply stops (its stop token inside the budget), parses and validates. One
engine runs every case together, as a batch, once per module.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from deepinfer.local_engine import LocalEngine
from libs.grammar.completion import byte_path, completion_path
from libs.models.gguf_loader import load_llama
from libs.models.llama import LlamaForCausalLM
from libs.protocol.messages import FinishReason, StructuredOutput
from libs.recipe.api.chat import parse_chat_request
from libs.recipe.output_parser import OutputParser, ParserSpec, merge_segments
from libs.recipe.segments import Content, ToolCallArgs, ToolCallStart
from libs.recipe.template_format import Prompt
from services.gateway.served_model import ServedModel
from services.scheduler.worker_scheduler import Limits
from services.worker.grammar_compilers import Grammars
from services.worker.main import grammar_vocab
from services.worker.model_runner import ModelRunner, ModelShape

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather", "parameters": WEATHER},
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
TRIP = {  # an array of objects inside an object inside an object: ways out close three levels
    "type": "object",
    "properties": {
        "trip": {
            "type": "object",
            "properties": {
                "country": {"type": "string"},
                "stops": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "nights": {"type": "integer"}},
                        "required": ["city", "nights"],
                    },
                },
            },
            "required": ["country", "stops"],
        }
    },
    "required": ["trip"],
}
ASK_TRIP = [{"role": "user", "content": "Plan a trip through five French cities, as JSON."}]
FORCED = range(33, 77)  # the model writes the whole call in 32 tokens (its stop token included)
AUTO = (4, 12, 20, 28, 36, 44)
NESTED = range(24, 97, 6)


def body(max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"model": "smollm2", "temperature": 0, "max_tokens": max_tokens, **fields}


CASES: dict[str, dict[str, Any]] = {
    **{f"forced-{m}": body(m, messages=ASK_WEATHER, tools=[TOOL], tool_choice="required") for m in FORCED},
    **{
        f"auto-{m}": body(
            m,
            messages=ASK_WEATHER,
            tools=[{**TOOL, "function": {**TOOL["function"], "strict": True}}],
            tool_choice="auto",
        )
        for m in AUTO
    },
    **{
        f"nested-{m}": body(
            m,
            messages=ASK_TRIP,
            response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP}},
        )
        for m in NESTED
    },
}


@dataclasses.dataclass(frozen=True)
class Reply:
    text: str
    num_tokens: int
    finish_reason: FinishReason
    content: str
    calls: list[tuple[str, str]]  # (name, arguments) as the output parser reads them


@pytest.fixture(scope="module")
def served(smollm2_path: Path, model_cache_dir: Path) -> ServedModel:
    return ServedModel.load(str(smollm2_path), str(model_cache_dir), "smollm2", 0)


@pytest.fixture(scope="module")
def model(smollm2_path: Path, model_cache_dir: Path) -> LlamaForCausalLM:
    return load_llama(smollm2_path, model_cache_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def grammars(smollm2_path: Path, model_cache_dir: Path, model: LlamaForCausalLM) -> Grammars:
    return Grammars(grammar_vocab(smollm2_path, model_cache_dir, model.config.vocab_size))


@pytest.fixture(scope="module")
def prompts(served: ServedModel) -> dict[str, Prompt]:
    return {name: served.prompt(parse_chat_request(b).conversation) for name, b in CASES.items()}


@pytest.fixture(scope="module")
def replies(
    model: LlamaForCausalLM, served: ServedModel, grammars: Grammars, prompts: dict[str, Prompt]
) -> dict[str, Reply]:
    cfg = model.config
    runner = ModelRunner(model, ModelShape.of(cfg), 512, 16, torch.float32, grammars=grammars)
    limits = Limits(512, 16, len(CASES), cfg.max_position_embeddings, 8192, 64, 0.0)
    engine = LocalEngine(runner, limits, served.eos_token_id, overlap=True)
    for name, b in CASES.items():
        prompt = prompts[name]
        assert prompt.structured_output is not None, name
        params = parse_chat_request(b).sampling.resolve(b["max_tokens"])
        engine.add(
            name, prompt.token_ids, dataclasses.replace(params, structured_output=prompt.structured_output)
        )
    outputs = engine.run()
    replies = {}
    for name, token_ids in outputs.items():
        text = served.tokenizer.decode([t for t in token_ids if t != served.eos_token_id])
        prompt = prompts[name]
        parser = OutputParser(ParserSpec(prompt.syntax, prompt.start, prompt.parse_tool_calls))
        segments = merge_segments([*parser.feed(text), *parser.finish()])
        names = {s.index: s.name for s in segments if isinstance(s, ToolCallStart)}
        args = {s.index: s.text for s in segments if isinstance(s, ToolCallArgs)}
        content = "".join(s.text for s in segments if isinstance(s, Content))
        calls = [(names[i], args.get(i, "")) for i in sorted(names)]
        replies[name] = Reply(text, len(token_ids), engine.finish_reasons[name], content, calls)
    return replies


def way_out_lengths(grammars: Grammars, served: ServedModel, constraint: StructuredOutput) -> tuple[int, int]:
    """(whole tokens, one-byte tokens) of the way out before the first output token."""
    assert grammars.alphabet is not None
    matcher = grammars.submit(constraint).result().matcher([served.eos_token_id])
    whole = completion_path(matcher, grammars.alphabet, served.eos_token_id)
    one_byte = byte_path(matcher, grammars.alphabet, served.eos_token_id)
    assert whole is not None and one_byte is not None
    return len(whole), len(one_byte)


def test_the_sweeps_start_at_the_way_out(
    grammars: Grammars, served: ServedModel, prompts: dict[str, Prompt]
) -> None:
    """Every budget swept covers the way out at the start (the premise of every check here), and
    spelled one byte a token the forced call's would not fit in any of them."""
    for prefix, budgets in (("forced", FORCED), ("nested", NESTED)):
        constraint = prompts[f"{prefix}-{budgets[0]}"].structured_output
        assert constraint is not None
        whole, one_byte = way_out_lengths(grammars, served, constraint)
        assert whole <= budgets[0], (prefix, whole)
        if prefix == "forced":
            assert one_byte > budgets[-1], one_byte


def test_forced_calls_validate_at_every_max_tokens(replies: dict[str, Reply]) -> None:
    failures = []
    for m in FORCED:
        reply = replies[f"forced-{m}"]
        try:
            assert reply.finish_reason is FinishReason.STOP and reply.num_tokens <= m, reply.finish_reason
            assert [name for name, _ in reply.calls] == ["get_weather"], reply.calls
            jsonschema.validate(json.loads(reply.calls[0][1]), WEATHER)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"max_tokens {m}: {exc!s:.200} in {reply.text!r}")
    assert not failures, "\n".join(failures)


def test_the_model_writes_its_own_call_when_it_fits(replies: dict[str, Reply]) -> None:
    """Never cut off needlessly: from a budget one token over its own call up, the model's call
    (the city it was asked about) is what comes back."""
    own = replies[f"forced-{FORCED[-1]}"]
    assert "Paris" in own.calls[0][1], own.text
    for m in FORCED:
        if m > own.num_tokens:
            assert replies[f"forced-{m}"].calls == own.calls, m


def test_a_strict_tool_under_auto_only_makes_valid_calls(replies: dict[str, Reply]) -> None:
    """Greedy SmolLM2 answers in prose here; whatever it writes stops inside the budget, and any
    call it makes is whole and valid."""
    for m in AUTO:
        reply = replies[f"auto-{m}"]
        assert reply.finish_reason is FinishReason.STOP and reply.num_tokens <= m, (m, reply.text)
        assert "<tool_call>" not in reply.content, (m, reply.text)  # no call cut off into text
        for name, arguments in reply.calls:
            assert name == "get_weather"
            jsonschema.validate(json.loads(arguments), WEATHER)


def test_a_nested_schema_validates_at_every_max_tokens(replies: dict[str, Reply]) -> None:
    for m in NESTED:
        reply = replies[f"nested-{m}"]
        assert reply.finish_reason is FinishReason.STOP and reply.num_tokens <= m, (m, reply.text)
        jsonschema.validate(json.loads(reply.content), TRIP)
