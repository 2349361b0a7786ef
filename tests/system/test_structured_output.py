"""Structured output through the running stack (real NATS, real SmolLM2, default grammar backend).

Every corpus schema at temperature 0 and 1 validates with jsonschema; forced tool calls parse and
validate against the tool's schema in Chat, Responses and Messages, streamed and not; regex and
json_object outputs hold; schemas the backend cannot honour are a 400 naming the keyword, and
the service goes on serving.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.grammar_corpus import SCHEMAS, UNSUPPORTED
from tests.system.stack import Stack

MODEL = "SmolLM2-135M-Instruct"
# Greedy SmolLM2-135M loops in recursive or unbounded structures (a list counting 1, 2, 3, ...;
# "next": {"next": ...}) and at temperature 1 writes e-mail addresses that never end: the worker
# walks a way out of the grammar before max_tokens runs out, so those end valid too.
MAX_TOKENS = 256
SEED = 7

WEATHER = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "minLength": 2, "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["location", "unit", "days"],
    "additionalProperties": False,
}
FLIGHT = {
    "type": "object",
    "properties": {
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["origin", "destination", "passengers"],
    "additionalProperties": False,
}
SCHEMA_OF = {"get_weather": WEATHER, "book_flight": FLIGHT}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
    for name, schema in SCHEMA_OF.items()
]
ASK_TOOL = [{"role": "user", "content": "I fly from Paris to Berlin tomorrow. What will the weather be?"}]


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300)


def _schema_format(schema: dict[str, Any], name: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": re.sub(r"\W", "_", name)[:64], "schema": schema}}


def _ask(name: str) -> list[dict[str, str]]:
    ask = f"Write one small example {name.replace('_', ' ')} as JSON: few items, short values, shallow."
    return [{"role": "user", "content": ask}]


def test_every_corpus_schema_validates_at_temperature_0_and_1(stack: Stack) -> None:
    """Every output ends with ``stop`` inside max_tokens and validates, open-ended schemas
    (recursion, unbounded strings, numbers, arrays or property sets) included."""
    sdk = client(stack)
    cases = [(c.name, c.schema, t) for c in SCHEMAS for t in (0.0, 1.0)]

    def run(case: tuple[str, dict[str, Any], float]) -> tuple[str, float, str, str | None]:
        name, schema, temperature = case
        resp = sdk.chat.completions.create(
            model=MODEL,
            messages=_ask(name),  # type: ignore[arg-type]
            response_format=_schema_format(schema, name),  # type: ignore[arg-type]
            temperature=temperature,
            seed=SEED,
            max_tokens=MAX_TOKENS,
        )
        choice = resp.choices[0]
        return name, temperature, choice.message.content or "", choice.finish_reason

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, cases))
    failures = []
    for (name, temperature, text, finish), (_, schema, _) in zip(results, cases, strict=True):
        try:
            assert finish == "stop", f"finish_reason {finish}"
            checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
            jsonschema.validate(json.loads(text), schema, format_checker=checker)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{name} @ t={temperature}: {exc!s:.200} in {text[:200]!r}")
    assert not failures, "\n".join(failures)
    assert len(results) >= 60


def test_a_streamed_schema_output_validates(stack: Stack) -> None:
    name, schema = SCHEMAS[0].name, SCHEMAS[0].schema
    stream = client(stack).chat.completions.create(
        model=MODEL,
        messages=_ask(name),  # type: ignore[arg-type]
        response_format=_schema_format(schema, name),  # type: ignore[arg-type]
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_tool_calls_parse_and_validate_in_chat(stack: Stack, stream: bool, temperature: float) -> None:
    sdk = client(stack)
    for choice in ("required", {"type": "function", "function": {"name": "book_flight"}}):
        kwargs: dict[str, Any] = dict(
            model=MODEL,
            messages=ASK_TOOL,
            tools=CHAT_TOOLS,
            tool_choice=choice,
            temperature=temperature,
            max_tokens=MAX_TOKENS,
        )
        if stream:
            names: dict[int, str] = {}
            args: dict[int, str] = {}
            finish = None
            for chunk in sdk.chat.completions.create(**kwargs, stream=True):
                if not chunk.choices:
                    continue
                finish = chunk.choices[0].finish_reason or finish
                for call in chunk.choices[0].delta.tool_calls or ():
                    if call.function and call.function.name:
                        names[call.index] = call.function.name
                    if call.function and call.function.arguments:
                        args[call.index] = args.get(call.index, "") + call.function.arguments
            calls = [(names[i], args.get(i, "")) for i in sorted(names)]
        else:
            resp = sdk.chat.completions.create(**kwargs)
            finish = resp.choices[0].finish_reason
            calls = [
                (c.function.name, c.function.arguments) for c in resp.choices[0].message.tool_calls or ()
            ]
        assert finish == "tool_calls" and len(calls) == 1, (finish, calls)
        name, arguments = calls[0]
        if isinstance(choice, dict):
            assert name == "book_flight"
        jsonschema.validate(json.loads(arguments), SCHEMA_OF[name])


CITY_WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
}


def test_a_forced_call_ends_valid_at_small_max_tokens(stack: Stack) -> None:
    """SmolLM2 writes this call in about 32 tokens; a way out spelled one byte a token would need
    77. From 33 up the call ends inside max_tokens and validates (the whole sweep, 33 to 76, runs
    in one process in test_structured_budget.py)."""
    sdk = client(stack)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY_WEATHER}}]

    def run(max_tokens: int) -> tuple[int, str | None, list[tuple[str, str]]]:
        resp = sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=tools,  # type: ignore[arg-type]
            tool_choice="required",
            temperature=0.0,
            max_tokens=max_tokens,
        )
        calls = [(c.function.name, c.function.arguments) for c in resp.choices[0].message.tool_calls or ()]
        return max_tokens, resp.choices[0].finish_reason, calls

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(run, (33, 50, 76)))
    for max_tokens, finish, calls in results:
        names = [name for name, _ in calls]
        assert finish == "tool_calls" and names == ["get_weather"], (max_tokens, finish, calls)
        jsonschema.validate(json.loads(calls[0][1]), CITY_WEATHER)


def test_forced_tool_use_in_messages_and_responses(stack: Stack) -> None:
    tools = [{"name": n, "description": f"{n} tool", "input_schema": s} for n, s in SCHEMA_OF.items()]
    messages = anthropic.Anthropic(base_url=stack.root_url, api_key="unused", max_retries=0, timeout=300)
    for tool_choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        msg = messages.messages.create(
            model=MODEL,
            max_tokens=MAX_TOKENS,
            messages=ASK_TOOL,  # type: ignore[arg-type]
            tools=tools,
            tool_choice=tool_choice,  # type: ignore[arg-type]
        )
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and len(uses) == 1
        jsonschema.validate(uses[0].input, SCHEMA_OF[uses[0].name])
        if tool_choice["type"] == "tool":
            assert uses[0].name == "get_weather"
    resp = client(stack).responses.create(
        model=MODEL,
        input=ASK_TOOL[0]["content"],
        tools=[
            {"type": "function", "name": n, "parameters": s, "strict": True} for n, s in SCHEMA_OF.items()
        ],
        tool_choice="required",
    )
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA_OF[calls[0].name])


def test_strict_tools_under_auto_only_make_valid_calls(stack: Stack) -> None:
    tools = [{**t, "function": {**t["function"], "strict": True}} for t in CHAT_TOOLS]
    resp = client(stack).chat.completions.create(
        model=MODEL,
        messages=ASK_TOOL,
        tools=tools,
        tool_choice="auto",  # type: ignore[arg-type]
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        n=4,
        seed=3,
    )
    for choice in resp.choices:
        for call in choice.message.tool_calls or ():
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_a_format_beside_auto_tools_gives_a_call_or_the_format(stack: Stack) -> None:
    answer = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{**t, "function": {**t["function"], "strict": True}} for t in CHAT_TOOLS]
    resp = client(stack).chat.completions.create(
        model=MODEL,
        messages=ASK_TOOL,
        tools=tools,
        tool_choice="auto",  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": answer}},
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        n=4,
        seed=5,
    )
    for choice in resp.choices:
        calls = choice.message.tool_calls or ()
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
        if not calls:
            jsonschema.validate(json.loads(choice.message.content or ""), answer)


def test_regex_json_object_and_the_other_apis_formats(stack: Stack) -> None:
    sdk = client(stack)
    pattern = r"(yes|no), because [a-z ]{5,40}\."
    resp = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sea salty?"}],
        response_format={"type": "regex", "regex": pattern},  # type: ignore[typeddict-item]
        temperature=1.0,
        max_tokens=MAX_TOKENS,
    )
    assert re.fullmatch(pattern, resp.choices[0].message.content or ""), resp.choices[0].message.content
    resp = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a cat in json."}],
        response_format={"type": "json_object"},
        temperature=1.0,
        max_tokens=MAX_TOKENS,
    )
    assert isinstance(json.loads(resp.choices[0].message.content or ""), dict)
    name, schema = SCHEMAS[1].name, SCHEMAS[1].schema
    out = sdk.responses.create(
        model=MODEL,
        input=_ask(name)[0]["content"],
        max_output_tokens=MAX_TOKENS,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    )
    jsonschema.validate(json.loads(out.output_text), schema)
    messages = anthropic.Anthropic(base_url=stack.root_url, api_key="unused", max_retries=0, timeout=300)
    msg = messages.messages.create(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        messages=_ask(name),  # type: ignore[arg-type]
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    text = "".join(b.text for b in msg.content if b.type == "text")
    jsonschema.validate(json.loads(text), schema)


def test_unsupported_schemas_are_a_400_naming_the_problem(stack: Stack) -> None:
    http = httpx.Client(base_url=stack.base_url, timeout=60)
    for schema, expected in UNSUPPORTED:
        body = {
            "model": MODEL,
            "messages": _ask("thing"),
            "max_tokens": 8,
            "response_format": _schema_format(schema, "thing"),
        }
        resp = http.post("/chat/completions", json=body)
        assert resp.status_code == 400, (schema, resp.text)
        if isinstance(schema, dict):  # anything else is refused by the request parser, in its words
            assert expected in resp.json()["error"]["message"], (expected, resp.text)
    bad_regex = {"type": "regex", "regex": "(unclosed"}
    resp = http.post(
        "/chat/completions", json={"model": MODEL, "messages": _ask("x"), "response_format": bad_regex}
    )
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    unenforceable = {"type": "object", "properties": {"x": {"not": {"type": "string"}}}}
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": unenforceable}}]
    resp = http.post(
        "/chat/completions",
        json={"model": MODEL, "messages": ASK_TOOL, "tools": bad_tool, "tool_choice": "required"},
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"].startswith("tools")
    for name, value in (("ignore_eos", True), ("min_tokens", 3)):
        ask_json = [{"role": "user", "content": "Reply in json."}]
        body = {"model": MODEL, "messages": ask_json, "response_format": {"type": "json_object"}, name: value}
        resp = http.post("/chat/completions", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == name, resp.text
    ok = http.post("/chat/completions", json={"model": MODEL, "messages": _ask("x"), "max_tokens": 4})
    assert ok.status_code == 200  # still serving
