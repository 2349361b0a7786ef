"""The bad-input table: client mistakes through every route, each answered without a 5xx, in the
API's own error shape, on a connection that stays usable.

A case is one HTTP request (method, path, headers, raw body bytes) and the API whose error shape
its answer must have. Bodies are written as Python values and serialized with ``allow_nan`` (so
NaN and Infinity reach the server as the bare words some clients send), or given as raw bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol
from urllib.parse import quote

Shape = Literal["openai", "anthropic"]
MODEL = "SmolLM2-135M-Instruct"
VOCAB_SIZE = 49152  # SmolLM2's: token id 49152 is one past the last
HI = [{"role": "user", "content": "hi"}]
CHAT: dict[str, Any] = {"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0}
COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "Once upon", "max_tokens": 2, "temperature": 0}
RESPONSE: dict[str, Any] = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "temperature": 0}
MESSAGE: dict[str, Any] = {"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0}
COUNT: dict[str, Any] = {"model": MODEL, "messages": HI}
# The good request made on the same connection after every bad one: parsed and tokenized, no generation.
GOOD_PATH, GOOD_BODY = "/v1/messages/count_tokens", COUNT
DEEP = 10_000
ODD_IDS = [
    "a.b", "chatcmpl-1.2", "*", "a*b", ">", "a.>", "a b", " ", "\t", "é", "日本語", "😀", "\u202e",
    "x" * 10_000, "..", ".", "$JS.API.INFO", "a%2Fb", "\x7f", "-", "_", "0",
]  # fmt: skip


class Answer(Protocol):
    """An HTTP response: httpx's, or the in-process test client's."""

    @property
    def status_code(self) -> int: ...
    @property
    def text(self) -> str: ...
    def json(self) -> Any: ...


class Client(Protocol):
    def request(
        self,
        method: str,
        url: str,
        *,
        content: bytes | None = None,
        headers: dict[bytes, bytes] | None = None,
    ) -> Answer: ...


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    shape: Shape
    content: bytes | None = None
    headers: tuple[tuple[str, str | bytes], ...] = ()

    def send(self, client: Client) -> Answer:
        headers = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in self.headers}
        if self.content is not None and b"content-type" not in headers:
            headers[b"content-type"] = b"application/json"
        return client.request(self.method, self.path, content=self.content, headers=headers)


def raw(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def check_error_shape(resp: Answer, shape: Shape) -> str | None:
    """Why ``resp`` is not an acceptable answer to a client mistake (None: it is)."""
    if resp.status_code >= 500:
        return f"{resp.status_code}: {resp.text[:300]!r}"
    if resp.status_code < 400:
        return None  # accepted: a lenient reading is no mistake of the server's
    try:
        body = resp.json()
    except ValueError:
        return f"{resp.status_code} not JSON: {resp.text[:300]!r}"
    if shape == "anthropic":
        error = body.get("error") if isinstance(body, dict) and body.get("type") == "error" else None
        if not isinstance(error, dict) or not {"type", "message"} <= set(error):
            return f"{resp.status_code} not Anthropic's error shape: {body!r:.300}"
    else:
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict) or not {"message", "type"} <= set(error):
            return f"{resp.status_code} not OpenAI's error shape: {body!r:.300}"
    if not isinstance(error["message"], str) or not error["message"]:
        return f"{resp.status_code} without a message: {body!r:.300}"
    return None


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def nested_in(body: dict[str, Any], key: str, depth: int) -> bytes:
    """``body`` with ``key`` set to arrays nested ``depth`` deep (written by hand: json cannot)."""
    head = raw({**body, key: None})
    assert head.endswith(b"}")
    return head[:-1] + f', "{key}": '.encode() + nested(depth) + b"}"


POSTS: dict[str, tuple[dict[str, Any], Shape]] = {
    "/v1/chat/completions": (CHAT, "openai"),
    "/v1/completions": (COMPLETION, "openai"),
    "/v1/responses": (RESPONSE, "openai"),
    "/v1/messages": (MESSAGE, "anthropic"),
    "/v1/messages/count_tokens": (COUNT, "anthropic"),
}
WHOLE_BODIES: dict[str, bytes] = {
    "non-utf8": b"\xff\xfe\x00{",
    "latin1 in a string": b'{"model": "caf\xe9"}',
    "array": b"[1, 2]",
    "string": b'"hello"',
    "number": b"1e309",
    "null": b"null",
    "empty": b"",
    "truncated": b'{"model": ',
    "deep array": nested(DEEP),
    "deep object": b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "NaN": b"NaN",
    "lone surrogate key": b'{"\\ud800": 1}',
    "bom": b"\xef\xbb\xbf{}",
}
# Per-field junk, applied to every route's base body (a field the route does not know is ignored
# or rejected; either way no 5xx).
JUNK: list[Any] = [
    None, True, -1, 0, 2**70, -(2**70), 1.5, 1e308, float("nan"), float("inf"), float("-inf"),
    "", "x", "x" * 100_000, "\ud800", "\x00", [], [None], [[]], {}, {"": None}, [1] * 1000,
]  # fmt: skip
FIELDS = {
    "/v1/chat/completions": [
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "n",
        "stream",
        "stop",
        "seed",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "response_format",
        "stream_options",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "parallel_tool_calls",
        "reasoning_effort",
        "chat_template_kwargs",
        "prompt_cache_retention",
        "modalities",
        "user",
        "thinking",
        "prediction",
    ],
    "/v1/completions": [
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "n",
        "stream",
        "stop",
        "seed",
        "echo",
        "logprobs",
        "suffix",
        "best_of",
        "stream_options",
        "logit_bias",
    ],
    "/v1/responses": [
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "background",
        "store",
        "previous_response_id",
        "tools",
        "tool_choice",
        "text",
        "reasoning",
        "parallel_tool_calls",
        "metadata",
        "truncation",
        "include",
    ],
    "/v1/messages": [
        "model",
        "messages",
        "max_tokens",
        "system",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "stop_sequences",
        "tools",
        "tool_choice",
        "thinking",
        "output_config",
        "metadata",
    ],
    "/v1/messages/count_tokens": ["model", "messages", "system", "tools", "tool_choice", "thinking"],
}
SPECIFIC: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": [VOCAB_SIZE]}),
    ("/v1/completions", {"prompt": [2**31]}),
    ("/v1/completions", {"prompt": [-1]}),
    ("/v1/completions", {"prompt": [[1, 2], [VOCAB_SIZE]]}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": ["a", 5]}),
    ("/v1/chat/completions", {"n": 1_000_000}),
    ("/v1/chat/completions", {"n": 10**30}),
    ("/v1/chat/completions", {"max_tokens": -5}),
    ("/v1/chat/completions", {"max_tokens": 10**12}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800 lone"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": 5}}]}),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
    ("/v1/chat/completions", {"tool_choice": "maybe"}),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    ("/v1/chat/completions", {"tool_choice": "required"}),
    ("/v1/chat/completions", {"response_format": {"type": "nope"}}),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}}),
    (
        "/v1/chat/completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "bogus"}},
            }
        },
    ),
    (
        "/v1/chat/completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"minimum": float("nan"), "type": "number"}},
            }
        },
    ),
    (
        "/v1/chat/completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"$ref": "#/nope"}},
            }
        },
    ),
    (
        "/v1/chat/completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"pattern": "(("}},
            }
        },
    ),
    ("/v1/chat/completions", {"stop": ["a"] * 1000}),
    ("/v1/chat/completions", {"logit_bias": {"x": 1}}),
    ("/v1/chat/completions", {"logit_bias": {str(VOCAB_SIZE): 1}}),
    ("/v1/chat/completions", {"top_logprobs": 10**6, "logprobs": True}),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": [{"type": "text", "text": 1}]}}),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "word " * 20_000}}),  # > context
    ("/v1/chat/completions", {"stream_options": {"include_usage": "x"}, "stream": True}),
    ("/v1/responses", {"input": [{"type": "bogus"}]}),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
    ("/v1/responses", {"text": {"format": {"type": "json_schema"}}}),
    ("/v1/responses", {"tool_choice": {"type": "function"}}),
    ("/v1/responses", {"background": True, "store": False}),
    *[("/v1/responses", {"previous_response_id": odd}) for odd in ODD_IDS],
    ("/v1/messages", {"max_tokens": None}),
    ("/v1/messages", {"max_tokens": -1}),
    ("/v1/messages", {"messages": [{"role": "system", "content": "x"}]}),
    ("/v1/messages", {"system": [{"type": "image"}]}),
    ("/v1/messages", {"tool_choice": {"type": "tool"}}),
    ("/v1/messages", {"tools": [{"name": 5}]}),
    ("/v1/messages", {"tools": [{"name": "f", "input_schema": "x"}]}),
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": "x"}}),
    ("/v1/messages", {"output_config": {"format": {"type": "json_schema", "schema": 5}}}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [{"type": "x"}]}]}),
]
LAST_EVENT_IDS: list[str | bytes] = [
    "abc", "-5", "9" * 5000, "1" * 4000, "1e3", "0x10", "-1.0", "", "٣".encode(), b"\xff",
]  # fmt: skip


def body_cases() -> Iterator[Case]:
    for path, (base, shape) in POSTS.items():
        for name, content in WHOLE_BODIES.items():
            yield Case(f"{path} {name}", "POST", path, shape, content)
        for key in FIELDS[path]:
            for i, junk in enumerate(JUNK):
                yield Case(f"{path} {key}=junk{i}", "POST", path, shape, raw({**base, key: junk}))
            yield Case(f"{path} {key} deep", "POST", path, shape, nested_in(base, key, DEEP))
        yield Case(f"{path} extra field", "POST", path, shape, raw({**base, "no_such_field": [1]}))
        yield Case(f"{path} text/plain", "POST", path, shape, raw(base), (("content-type", "text/plain"),))
        yield Case(
            f"{path} form",
            "POST",
            path,
            shape,
            b"a=1&b=2",
            (("content-type", "application/x-www-form-urlencoded"),),
        )
        yield Case(
            f"{path} multipart",
            "POST",
            path,
            shape,
            b"--x\r\n\r\n--x--",
            (("content-type", "multipart/form-data; boundary=x"),),
        )
        yield Case(f"{path} GET", "GET", path, shape)
    for path, fields in SPECIFIC:
        base, shape = POSTS[path]
        yield Case(f"{path} {fields!r:.80}", "POST", path, shape, raw({**base, **fields}))


RESUMES: list[tuple[str, Shape]] = [
    ("/v1/chat/completions/{}?stream=true", "openai"),
    ("/v1/completions/{}?stream=true", "openai"),
    ("/v1/messages/{}?stream=true", "anthropic"),
    ("/v1/responses/{}?stream=true", "openai"),
    ("/v1/responses/{}", "openai"),
]


def id_cases() -> Iterator[Case]:
    for odd in ODD_IDS:
        if odd in (".", ".."):
            continue  # a client resolves dot segments before sending: the server never sees them
        quoted = quote(odd, safe="")
        for template, shape in RESUMES:
            yield Case(f"GET {template} id={odd!r:.40}", "GET", template.format(quoted), shape)
        yield Case(f"cancel id={odd!r:.40}", "POST", f"/v1/responses/{quoted}/cancel", "openai")
    for template, shape in RESUMES:
        path = template.format("chatcmpl-0123")
        for value in LAST_EVENT_IDS:
            yield Case(
                f"GET {path} Last-Event-ID={value!r:.20}",
                "GET",
                path,
                shape,
                None,
                (("last-event-id", value),),
            )
        sep = "&" if "?" in path else "?"
        for key in ("last_event_id", "starting_after"):
            for value in ("abc", "-5", "9" * 5000):
                yield Case(f"GET {path} {key}={value:.20}", "GET", f"{path}{sep}{key}={value}", shape)
    yield Case("resume stream=false", "GET", "/v1/chat/completions/chatcmpl-0123?stream=false", "openai")
    yield Case("cancel GET", "GET", "/v1/responses/resp_0/cancel", "openai")
    yield Case("unknown route", "GET", "/v1/nope", "openai")
    yield Case("unknown messages route", "GET", "/v1/messages/a/b", "anthropic")


def all_cases() -> list[Case]:
    return [*body_cases(), *id_cases()]
