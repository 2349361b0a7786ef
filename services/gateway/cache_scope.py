"""Whose KV cache a request uses and how long its KV is kept: its tenant and its retention class. Pure.

Tenant: the KV block hashes are salted with it, so two tenants never share, or probe, each other's
cached prefixes. It is a hash of the client's API key (``Authorization: Bearer <key>``, OpenAI's
spelling, or ``x-api-key: <key>``, Anthropic's; each API prefers its own), the same at every
gateway and across restarts, since cached KV outlives both. No key: "", the shared tenant. With
``--api-keys-file`` the tenant is the one the key's entry names (services/gateway/auth.py). Behind
an authenticating proxy an operator names a trusted header (``tenant_header``) whose value is the
tenant instead; a request without it falls back to its key.

Retention class: the ``x-deepinfer-cache-class`` header, else the body's retention request
(OpenAI's ``prompt_cache_retention``; Anthropic's top-level ``cache_control.ttl``, "5m" when the
cache_control names none), else the configured default. A value is one of the configured classes
(any case), or one of the vendors' values, read as:

    in_memory (or in-memory), 5m  -> the lowest-priority class (the first evicted: a short cache)
    24h, 1h                       -> the default class (an extended cache; ours keeps days)

A configured class of the same name wins over that reading. Anything else is a 400 naming the
parameter and the classes it accepts (the parsers admit only these values of cache_control.ttl,
so its 400 is the parser's).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from libs.kvstore.retention import RetentionPolicy
from libs.recipe.fields import ApiError, shown

CACHE_CLASS_HEADER: Final = "x-deepinfer-cache-class"
CACHE_RETENTION_PARAM: Final = "prompt_cache_retention"
TENANT_CHARS: Final = 32  # hex digits of sha256 kept: 128 bits, no collision between keys
MAX_TENANT_HEADER_CHARS: Final = 128
# Separates this use of a key's hash from any other (a key's plain sha256 is a common fingerprint).
_TENANT_DOMAIN: Final = b"deepinfer-kv-tenant\x00"
_SHORT: Final = ("in_memory", "in-memory", "5m")  # OpenAI's short cache; Anthropic's default ttl
_EXTENDED: Final = ("24h", "1h")  # OpenAI's extended cache; Anthropic's long ttl
_VENDOR_VALUES: Final = ("in_memory", "24h", "5m", "1h")  # as a 400 lists them (one spelling each)

KeyStyle = Literal["openai", "anthropic"]  # which API's key header a route reads first


@dataclass(frozen=True, slots=True)
class CacheScope:
    tenant: str = ""  # "": the shared tenant
    retention_class: str = ""  # "": the store's default class


UNSCOPED: Final = CacheScope()  # the shared tenant, the default class


def tenant_of_key(api_key: str) -> str:
    """The tenant of an API key: a short, stable hash of it; "" for no key."""
    if not api_key:
        return ""
    return hashlib.sha256(_TENANT_DOMAIN + api_key.encode()).hexdigest()[:TENANT_CHARS]


def api_key(headers: Mapping[str, str], style: KeyStyle) -> str:
    """The client's key: the route's own header first (a client of one API may send both)."""
    authorization = headers.get("authorization", "").strip()
    scheme, _, token = authorization.partition(" ")
    bearer = token.strip() if scheme.lower() == "bearer" else ""
    x_api_key = headers.get("x-api-key", "").strip()
    return (x_api_key or bearer) if style == "anthropic" else (bearer or x_api_key)


class CacheScoping:
    """A request's CacheScope from its headers and the class it asked for (400 on an unknown one)."""

    def __init__(self, policy: RetentionPolicy | None = None, tenant_header: str = "") -> None:
        self.policy = policy or RetentionPolicy()
        self.tenant_header = tenant_header.lower()
        self._names = tuple(self.policy.classes)
        # The class evicted first: the first configured of the lowest priority.
        self._lowest = min(self.policy.classes.values(), key=lambda c: c.priority).name

    def scope(
        self,
        headers: Mapping[str, str],
        style: KeyStyle,
        requested: str | None = None,
        authenticated: str = "",
    ) -> CacheScope:
        """``requested``: the body's retention (prompt_cache_retention, or cache_control's ttl; None: none);
        ``authenticated``: the tenant of the API key the gateway checked ("": keys are off)."""
        tenant = self.tenant(headers, style, authenticated)
        return CacheScope(tenant, self.retention_class(headers, requested))

    def tenant(self, headers: Mapping[str, str], style: KeyStyle, authenticated: str = "") -> str:
        if authenticated:  # the gateway's own key check named it: nothing a client sends overrides it
            return authenticated
        trusted = headers.get(self.tenant_header, "").strip() if self.tenant_header else ""
        if not trusted:
            return tenant_of_key(api_key(headers, style))
        if len(trusted) > MAX_TENANT_HEADER_CHARS or not (trusted.isascii() and trusted.isprintable()):
            limit = f"at most {MAX_TENANT_HEADER_CHARS} printable ASCII characters"
            raise ApiError(
                400, f"the '{self.tenant_header}' header must be {limit}", param=self.tenant_header
            )
        return trusted

    def retention_class(self, headers: Mapping[str, str], requested: str | None) -> str:
        header = headers.get(CACHE_CLASS_HEADER, "")
        if header.strip():
            return self._resolve(header, CACHE_CLASS_HEADER)
        return self._resolve(requested, CACHE_RETENTION_PARAM)

    def _resolve(self, value: str | None, param: str) -> str:
        if value is None or not value.strip():
            return self.policy.default.name
        name = value.strip().lower()
        if name in self._names:
            return name
        if name in _SHORT:
            return self._lowest
        if name in _EXTENDED:
            return self.policy.default.name
        known = ", ".join(map(repr, [*self._names, *_VENDOR_VALUES]))
        message = f"unknown cache retention class {shown(value)} in '{param}': it must be one of {known}"
        raise ApiError(400, message, param=param)
