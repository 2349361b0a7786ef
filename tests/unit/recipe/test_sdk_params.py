"""Every parameter the pinned openai and anthropic SDKs' create methods take, on each route we
serve, is classified in sdk_tables.py, and the route's parser keeps that classification for the
body the SDK itself sends: honoured ones change the parsed request, inert ones leave it as it was
(bar the Response repeating them back), refused ones are a 400 naming the parameter and saying why.

The parameter lists come from the SDKs' own signatures, so an SDK release with a new parameter (or
one dropped) fails the first test until the tables, the parsers and docs/sdk-compat.md say what it
means: a deliberate bump. The SDKs build their requests through an in-process transport that
records them; nothing here is sent anywhere.
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from anthropic.resources.messages import Messages
from openai.resources.chat.completions import Completions as ChatCompletions
from openai.resources.completions import Completions
from openai.resources.responses import Responses

from libs.recipe.api import (
    parse_chat_request,
    parse_completion_request,
    parse_count_tokens_request,
    parse_messages_request,
    parse_responses_request,
)
from libs.recipe.fields import ApiError
from tests.unit.recipe import sdk_tables as tables
from tests.unit.recipe.api_helpers import MODEL, USER

# How a call travels, not what it asks: never a request field.
TRANSPORT = frozenset({"self", "extra_headers", "extra_query", "extra_body", "timeout"})


@dataclass(frozen=True)
class Route:
    method: Callable[..., Any]  # the SDK method, unbound: its signature is the parameter list
    path: str  # the SDK resource under a client, e.g. "chat.completions.create"
    vendor: str  # "openai" or "anthropic"
    parse: Callable[[Any], Any]
    required: dict[str, Any]
    table: dict[str, tables.Kind]
    echoes: bool = False  # a Response repeats settings back: an inert field may show up there


ROUTES = {
    "chat": Route(
        ChatCompletions.create,
        "chat.completions.create",
        "openai",
        parse_chat_request,
        {"model": MODEL, "messages": USER},
        tables.CHAT,
    ),
    "completions": Route(
        Completions.create,
        "completions.create",
        "openai",
        parse_completion_request,
        {"model": MODEL, "prompt": "Hi"},
        tables.COMPLETIONS,
    ),
    "responses": Route(
        Responses.create,
        "responses.create",
        "openai",
        parse_responses_request,
        {"model": MODEL, "input": "Hi"},
        tables.RESPONSES,
        echoes=True,
    ),
    "messages": Route(
        Messages.create,
        "messages.create",
        "anthropic",
        parse_messages_request,
        {"model": MODEL, "messages": USER, "max_tokens": 16},
        tables.MESSAGES,
    ),
    "count_tokens": Route(
        Messages.count_tokens,
        "messages.count_tokens",
        "anthropic",
        parse_count_tokens_request,
        {"model": MODEL, "messages": USER},
        tables.COUNT_TOKENS,
    ),
}
CASES = [(route, param) for route, spec in ROUTES.items() for param in spec.table]


def sdk_parameters(method: Callable[..., Any]) -> set[str]:
    """The method's parameters across its overloads (the stream variants), less the transport's."""
    names: set[str] = set()
    for signature in [method, *typing.get_overloads(method)]:
        names |= set(inspect.signature(signature).parameters)
    return names - TRANSPORT


@dataclass(frozen=True)
class Sent:
    headers: httpx2.Headers
    body: dict[str, Any]


def send(route: Route, arguments: dict[str, Any]) -> Sent:
    """The request the SDK builds for ``arguments``: recorded, and answered with an error."""
    seen: list[httpx2.Request] = []

    def record(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return httpx2.Response(418, json={"error": {"type": "recorded", "message": "recorded"}})

    http = httpx2.Client(transport=httpx2.MockTransport(record))
    client: Any
    if route.vendor == "openai":
        client = openai.OpenAI(api_key="k", base_url="http://sdk.test/v1", max_retries=0, http_client=http)
        failure: type[Exception] = openai.APIStatusError
    else:
        client = anthropic.Anthropic(api_key="k", base_url="http://sdk.test", max_retries=0, http_client=http)
        failure = anthropic.APIStatusError
    call = client
    for attribute in route.path.split("."):
        call = getattr(call, attribute)
    with pytest.raises(failure):
        call(**{**route.required, **arguments})
    [request] = seen
    return Sent(request.headers, json.loads(request.content))


def parsed_view(route: Route, request: Any, param: str) -> Any:
    """What an inert field must leave alone: the whole request, bar its own echo in a Response."""
    if not route.echoes:
        return request
    return replace(request, echoed={k: v for k, v in request.echoed.items() if k != param})


def test_every_sdk_parameter_is_classified() -> None:
    """A parameter a new SDK adds (or drops) fails here until the tables say what it means."""
    for name, route in ROUTES.items():
        assert sdk_parameters(route.method) == set(route.table), name


@pytest.mark.parametrize(("route_name", "param"), CASES, ids=[f"{r}-{p}" for r, p in CASES])
def test_each_parameter_behaves_as_classified(route_name: str, param: str) -> None:
    route, kind = ROUTES[route_name], ROUTES[route_name].table[param]
    without = send(route, {} if isinstance(kind, tables.Refused) else kind.also)
    sent = send(route, {param: kind.value, **({} if isinstance(kind, tables.Refused) else kind.also)})
    if isinstance(kind, tables.Refused):
        assert sent.body[param] == kind.value
        with pytest.raises(ApiError) as refused:
            route.parse(sent.body)
        err = refused.value
        assert (err.status, err.param, err.code) == (400, param, "unsupported_parameter")
        assert f"'{param}' is not supported" in err.message and kind.why in err.message
        return
    before = route.parse(without.body)
    if isinstance(kind, tables.Inert) and kind.header is not None:
        assert sent.headers[kind.header] == kind.value and sent.body == without.body
        return
    assert (kind.wire if isinstance(kind, tables.Honoured) and kind.wire else param) in sent.body
    after = route.parse(sent.body)
    if isinstance(kind, tables.Inert):
        assert parsed_view(route, after, param) == parsed_view(route, before, param)
        return
    assert after != before, f"{param} changed nothing"
    assert kind.effect is None or kind.effect(after)


# Valid to the SDK's types, yet refused: the value promises what this server cannot keep.
BLOCK = {"mode": "block"}
REFUSED_VALUES = [
    ("chat", "moderation", {"model": "m", "policy": {"input": BLOCK}}, "moderation.policy.input.mode"),
    ("responses", "moderation", {"model": "m", "policy": {"output": BLOCK}}, "moderation.policy.output.mode"),
    ("responses", "prompt_cache_options", {"prewarm": True}, "prompt_cache_options.prewarm"),
]


@pytest.mark.parametrize(("route_name", "param", "value", "where"), REFUSED_VALUES)
def test_values_that_promise_too_much_are_refused(
    route_name: str, param: str, value: Any, where: str
) -> None:
    route = ROUTES[route_name]
    with pytest.raises(ApiError) as refused:
        route.parse(send(route, {param: value}).body)
    err = refused.value
    assert (err.status, err.param, err.code) == (400, where, "unsupported_parameter")
    assert f"'{where}' is not supported: " in err.message


# Values of honoured or inert fields past what is served: a 400 naming the field and saying why.
BEYOND: list[tuple[str, dict[str, Any], str, str]] = [
    ("chat", {"modalities": ["text", "audio"]}, "modalities", "only the 'text' output modality"),
    ("completions", {"best_of": 3}, "best_of", "ranking extra samples"),
]


@pytest.mark.parametrize(("route_name", "arguments", "param", "why"), BEYOND)
def test_values_past_what_is_served_are_refused_saying_why(
    route_name: str, arguments: dict[str, Any], param: str, why: str
) -> None:
    route = ROUTES[route_name]
    with pytest.raises(ApiError) as refused:
        route.parse(send(route, arguments).body)
    assert (refused.value.status, refused.value.param) == (400, param) and why in refused.value.message


# Inert fields sent malformed (past the SDKs' types): each is still a 400 naming the field.
MALFORMED = [
    ("chat", {"verbosity": "loud"}, "verbosity"),
    ("chat", {"moderation": {}}, "moderation.model"),
    ("chat", {"prompt_cache_options": {"ttl": "1d"}}, "prompt_cache_options.ttl"),
    ("chat", {"prompt_cache_options": {"prewarm": True}}, "prompt_cache_options.prewarm"),  # Responses' only
    ("responses", {"context_management": [{"type": "summary"}]}, "context_management[0].type"),
    ("responses", {"access_programs": {"cyber": "x"}}, "access_programs.cyber"),
    ("responses", {"image": {"context_compression": 1}}, "image.context_compression"),
    ("responses", {"stream_options": {"include_usage": True}}, "stream_options.include_usage"),
    ("messages", {"speed": "turbo"}, "speed"),
    ("messages", {"inference_geo": 1}, "inference_geo"),
    ("messages", {"diagnostics": {"previous_message_id": 1}}, "diagnostics.previous_message_id"),
    ("messages", {"cache_control": {"type": "persistent"}}, "cache_control.type"),
    ("messages", {"cache_control": {"type": "ephemeral", "ttl": "1d"}}, "cache_control.ttl"),
    ("messages", {"cache_control": {"type": "ephemeral", "scope": "x"}}, "cache_control.scope"),
    ("count_tokens", {"cache_control": {"ttl": "5m"}}, "cache_control.type"),
    ("count_tokens", {"speed": 1}, "speed"),
]


@pytest.mark.parametrize(("route_name", "fields", "param"), MALFORMED)
def test_malformed_values_are_a_400_naming_the_field(
    route_name: str, fields: dict[str, Any], param: str
) -> None:
    route = ROUTES[route_name]
    with pytest.raises(ApiError) as bad:
        route.parse({**route.required, **fields})
    assert (bad.value.status, bad.value.param) == (400, param)
    assert param in bad.value.message
