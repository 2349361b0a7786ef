"""A request's cache scope: the tenant from its API key (or a trusted header), the retention class
from its header or body, OpenAI's retention values and Anthropic's cache_control TTLs read as
classes, and the 400 for an unknown one."""

from __future__ import annotations

import pytest

from libs.kvstore.retention import RetentionPolicy, parse_retention_classes
from libs.recipe.api import parse_count_tokens_request, parse_messages_request
from libs.recipe.fields import ApiError
from services.gateway.cache_scope import (
    CACHE_CLASS_HEADER,
    CACHE_RETENTION_PARAM,
    CacheScope,
    CacheScoping,
    api_key,
    tenant_of_key,
)

# scratch is evicted first (priority 0), chat last; the default is agent.
POLICY = RetentionPolicy(parse_retention_classes("agent=3d:1,scratch=1h:0,chat=7d:2"), "agent")


def test_each_key_is_its_own_tenant_and_no_key_is_the_shared_one() -> None:
    a, b = tenant_of_key("sk-alpha"), tenant_of_key("sk-beta")
    assert a != b and len(a) == len(b) == 32 and int(a, 16) >= 0
    assert tenant_of_key("sk-alpha") == a  # stable: cached KV outlives gateways and restarts
    assert tenant_of_key("") == ""


@pytest.mark.parametrize(
    ("headers", "openai", "anthropic"),
    [
        ({"authorization": "Bearer k1"}, "k1", "k1"),
        ({"authorization": "bearer  k1 "}, "k1", "k1"),
        ({"x-api-key": "k2"}, "k2", "k2"),
        ({"authorization": "Bearer k1", "x-api-key": "k2"}, "k1", "k2"),  # each API's own header first
        ({"authorization": "Basic dXNlcg=="}, "", ""),  # not a key
        ({}, "", ""),
    ],
)
def test_the_key_comes_from_the_apis_own_header_first(
    headers: dict[str, str], openai: str, anthropic: str
) -> None:
    assert (api_key(headers, "openai"), api_key(headers, "anthropic")) == (openai, anthropic)


def test_a_trusted_header_names_the_tenant_and_without_it_the_key_does() -> None:
    scoping = CacheScoping(POLICY, tenant_header="X-Tenant")
    assert scoping.tenant({"x-tenant": " acme ", "authorization": "Bearer k1"}, "openai") == "acme"
    assert scoping.tenant({"authorization": "Bearer k1"}, "openai") == tenant_of_key("k1")
    assert scoping.tenant({"x-tenant": "acme"}, "anthropic") == "acme"
    for bad in ("x" * 129, "caf\u00e9"):
        with pytest.raises(ApiError) as err:
            scoping.tenant({"x-tenant": bad}, "openai")
        assert err.value.status == 400 and err.value.param == "x-tenant"
    # Off by default: such a header is just a header.
    assert CacheScoping(POLICY).tenant({"x-tenant": "acme"}, "openai") == ""


@pytest.mark.parametrize(
    ("header", "body", "expected"),
    [
        (None, None, "agent"),  # the default
        (None, "", "agent"),
        (None, "chat", "chat"),
        (None, " Scratch ", "scratch"),  # case and spaces are ignored
        (None, "in_memory", "scratch"),  # OpenAI's short cache: the class evicted first
        (None, "in-memory", "scratch"),
        (None, "24h", "agent"),  # OpenAI's extended cache: the default class
        (None, "5m", "scratch"),  # Anthropic's cache_control ttl (and its default): a short cache
        (None, "1h", "agent"),  # Anthropic's long ttl: the default class
        ("chat", "5m", "chat"),  # the header wins over cache_control too
        ("chat", "in_memory", "chat"),  # the header wins
        ("chat", "nonsense", "chat"),  # ... and the body is not consulted
        ("  ", "chat", "chat"),  # a blank header is no header
    ],
)
def test_the_retention_class_from_header_or_body(header: str | None, body: str | None, expected: str) -> None:
    headers = {} if header is None else {CACHE_CLASS_HEADER: header}
    assert CacheScoping(POLICY).retention_class(headers, body) == expected


def test_a_configured_class_wins_over_openais_reading_of_its_name() -> None:
    policy = RetentionPolicy(parse_retention_classes("in_memory=10m:5,agent=3d:0"), "agent")
    assert CacheScoping(policy).retention_class({}, "in_memory") == "in_memory"


@pytest.mark.parametrize(
    ("headers", "body", "param"),
    [
        ({}, "forever", CACHE_RETENTION_PARAM),
        ({CACHE_CLASS_HEADER: "forever"}, "chat", CACHE_CLASS_HEADER),
    ],
)
def test_an_unknown_class_is_a_400_naming_the_parameter_and_the_classes(
    headers: dict[str, str], body: str, param: str
) -> None:
    with pytest.raises(ApiError) as err:
        CacheScoping(POLICY).retention_class(headers, body)
    assert err.value.status == 400 and err.value.param == param
    assert param in err.value.message and "'forever'" in err.value.message
    known = ("agent", "scratch", "chat", "in_memory", "24h", "5m", "1h")
    assert all(f"'{name}'" in err.value.message for name in known)


def test_the_default_policy_and_a_whole_scope() -> None:
    scoping = CacheScoping()  # agent=3d:0, chat=7d:1
    assert scoping.retention_class({}, "in_memory") == "agent"
    headers = {"x-api-key": "k", CACHE_CLASS_HEADER: "CHAT"}
    assert scoping.scope(headers, "anthropic") == CacheScope(tenant_of_key("k"), "chat")


@pytest.mark.parametrize(
    ("cache_control", "expected"),
    [
        (None, "agent"),  # no cache_control: the default class
        ({"type": "ephemeral"}, "scratch"),  # Anthropic's default ttl, 5m: the class evicted first
        ({"type": "ephemeral", "ttl": "5m"}, "scratch"),
        ({"type": "ephemeral", "ttl": "1h"}, "agent"),
    ],
)
def test_messages_top_level_cache_control_picks_the_retention_class(
    cache_control: dict[str, str] | None, expected: str
) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    if cache_control is not None:
        body["cache_control"] = cache_control
    requested = parse_messages_request(body).cache_retention
    assert CacheScoping(POLICY).scope({}, "anthropic", requested).retention_class == expected
    # Counting tokens stores nothing: its cache_control asks for no class.
    assert parse_count_tokens_request(body).cache_retention is None
