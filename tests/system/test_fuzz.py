"""Seeded fuzzing of the running stack's HTTP input: valid bodies mutated (fields dropped,
duplicated, retyped; random unicode, huge strings, deep nesting) and random ids with NATS
subject characters, each answered without a 5xx in the API's shape on a connection that stays
usable, while canary streams get their solo answers. Reproducible: plain ``random`` with a seed.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any
from urllib.parse import quote

from tests.system.bad_inputs import COMPLETION, COUNT, MESSAGE, POSTS, RESPONSE, RESUMES, Case, raw
from tests.system.stack import Stack
from tests.system.test_bad_inputs import run_cases

NUM_CASES = 300
MAX_TOKENS = 8  # an accepted mutant generates: keep each short
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
RICH: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": POSTS["/v1/chat/completions"][0]["model"],
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        ],
        "tools": [TOOL],
        "tool_choice": "auto",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "o", "schema": {"type": "object"}},
        },
        "stop": ["\n\n"],
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    "/v1/completions": {**COMPLETION, "prompt": [1, 2, 3], "echo": True, "logprobs": 2},
    "/v1/responses": {
        **RESPONSE,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    },
    "/v1/messages": {**MESSAGE, "system": [{"type": "text", "text": "Be kind."}], "stop_sequences": ["x"]},
    "/v1/messages/count_tokens": {**COUNT, "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
}
SUBJECT_CHARS = ".*> \t$\x00\x7f/%?#"


def random_text(rng: random.Random) -> str:
    size = rng.choice((0, 1, 5, 40, 3000, 60_000))
    pick = rng.random()
    if pick < 0.3:  # any code point but lone surrogates (which JSON text cannot carry as UTF-8)
        return "".join(
            chr(rng.choice((rng.randrange(0x20, 0xD800), rng.randrange(0xE000, 0x110000))))
            for _ in range(size)
        )
    if pick < 0.5:
        return "".join(rng.choice(SUBJECT_CHARS) for _ in range(size))
    return rng.choice(("x", "日本", "😀", "\u0000", "\u202e", "<|im_start|>", "{")) * size


def junk(rng: random.Random) -> Any:
    """A JSON value of any type: a scalar at an edge, text, or a small container of junk."""
    pick = rng.randrange(8)
    if pick < 4:
        return rng.choice([None, True, False, -1, 0, 1, 2, 7, 2**31, 2**63, rng.randint(-(2**70), 2**70)])
    if pick == 4:
        return rng.uniform(-1e300, 1e300)
    if pick == 5:
        return random_text(rng)
    if pick == 6:
        return [junk(rng) for _ in range(rng.randrange(4))]
    return {random_text(rng)[:20]: junk(rng) for _ in range(rng.randrange(3))}


def mutate(rng: random.Random, body: dict[str, Any]) -> str:
    """One change somewhere in ``body`` (in place); returns what it did."""
    containers: list[Any] = [body]
    for node in containers:  # grows while walked: every dict and list inside
        children = node.values() if isinstance(node, dict) else node
        containers += [c for c in children if isinstance(c, dict | list)]
    node = rng.choice(containers)
    keys = list(node) if isinstance(node, dict) else list(range(len(node)))
    op = rng.choice(("drop", "retype", "retype", "add", "wrap", "text"))
    if op == "drop" and keys:
        del node[rng.choice(keys)]
        return "drop"
    if op == "add" or not keys:
        if isinstance(node, dict):
            node[rng.choice([*keys, random_text(rng)[:30]])] = junk(rng)
        else:
            node.append(junk(rng))
        return "add"
    key = rng.choice(keys)
    node[key] = junk(rng) if op == "retype" else [node[key]] if op == "wrap" else random_text(rng)
    return f"{op} {str(key)[:20]!r}"


def short(path: str, body: dict[str, Any]) -> None:
    """Cap the generation of a mutant that would otherwise run long (a junk cap is left to be rejected)."""
    for key in TOKEN_FIELDS:
        value = body.get(key)
        if key in body and (value is None or (type(value) is int and value > MAX_TOKENS)):
            body[key] = MAX_TOKENS
    default_is_long = path in ("/v1/chat/completions", "/v1/completions", "/v1/responses")
    if default_is_long and not any(key in body for key in TOKEN_FIELDS):
        body["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = MAX_TOKENS
    if type(body.get("n")) is int and body["n"] > 2:
        body["n"] = 2


def serialized(rng: random.Random, body: Any) -> bytes:
    """The body as bytes, sometimes with a duplicated key, or nested deep by hand."""
    text = raw(body)
    if isinstance(body, dict) and body and rng.random() < 0.1:
        key = rng.choice(list(body))
        return text[:-1] + b", " + json.dumps(key).encode() + b": " + raw(junk(rng)) + b"}"
    if rng.random() < 0.05:
        depth = rng.choice((50, 99, 101, 1000, 20_000))
        return b'{"messages": ' + b"[" * depth + b"]" * depth + b', "model": "m"}'
    return text


def fuzz_cases(rng: random.Random) -> list[Case]:
    cases = []
    for i in range(NUM_CASES):
        if rng.random() < 0.15:
            odd = "".join(
                chr(rng.randrange(1, 0x3000)) if rng.random() < 0.3 else rng.choice(SUBJECT_CHARS + "ab1-_")
                for _ in range(rng.choice((1, 3, 30, 300)))
            )
            template, shape = rng.choice(RESUMES)
            cases.append(
                Case(f"case {i} GET id {odd!r:.60}", "GET", template.format(quote(odd, safe="")), shape)
            )
            continue
        path = rng.choice(list(POSTS))
        body = copy.deepcopy(rng.choice((POSTS[path][0], RICH[path])))
        steps = [mutate(rng, body) for _ in range(rng.choice((1, 1, 2, 4)))]
        short(path, body)
        cases.append(Case(f"case {i} {path} {steps}", "POST", path, POSTS[path][1], serialized(rng, body)))
    return cases


def test_fuzzed_requests_are_4xx_in_the_apis_shape_and_hurt_nobody(stack: Stack) -> None:
    run_cases(stack, fuzz_cases(random.Random("system-fuzz-1")))
