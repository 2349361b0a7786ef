"""Who is calling: the API-key check in front of every ``/v1`` route (ASGI middleware), and the
caller it names for the routes (tenant, priority).

With ``--api-keys-file`` every request under ``/v1/`` presents a key from the file (OpenAI's
``Authorization: Bearer <key>`` or Anthropic's ``x-api-key: <key>``; each API reads its own header
first) or is answered 401 in its API's error shape; a key past its rate limit is answered 429
with ``Retry-After``. Answers to admitted requests carry the key's ``x-ratelimit-*`` headers
(OpenAI's names; the Messages routes also Anthropic's ``anthropic-ratelimit-requests-*``).
``/health``, ``/readyz``, ``/livez`` and ``/metrics`` stay open: probes and scrapers hold no key
(bind the gateway where only they can reach those, or filter them at the proxy).
Without the file nothing is checked and the caller is anonymous: the KV tenant is then a hash of
whatever key is sent (services/gateway/cache_scope.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Final

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from libs.recipe.fields import ApiError
from services.gateway.api_keys import Allowed, Decision, KeyTable, Limited, read_keys_file
from services.gateway.cache_scope import api_key
from services.gateway.caller import CALLER_KEY, Caller
from services.gateway.metrics import observer_of
from services.gateway.serving import error_response, shape_of

log = logging.getLogger(__name__)

PROTECTED_PREFIX: Final = "/v1/"


class KeyFile:
    """The keys file and the table in force; ``reload`` (on SIGHUP) reads the file again and keeps
    the table in force when the new text is malformed."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        self.table = KeyTable.of(read_keys_file(path), clock())  # a bad file at start: ValueError, exit 2

    def reload(self) -> bool:
        try:
            keys = read_keys_file(self.path)
        except ValueError as exc:
            log.error("%s; the keys in force stay", exc)
            return False
        self.table.replace(keys, self.clock())
        log.info("api keys reloaded from %s: %d keys", self.path, len(keys))
        return True

    def check(self, presented: str) -> Decision:
        return self.table.check(presented, self.clock())


def _duration(seconds: float) -> str:
    """OpenAI's spelling of a reset time: 120ms, 6s, 1m30s."""
    if seconds < 1.0:
        return f"{math.ceil(seconds * 1000)}ms"
    whole = math.ceil(seconds)
    minutes, rest = divmod(whole, 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


def limit_headers(decision: Allowed | Limited, anthropic: bool) -> dict[str, str]:
    """The key's rate-limit headers ({} for a key without a limit)."""
    if not decision.limit:
        return {}
    remaining = decision.remaining if isinstance(decision, Allowed) else 0
    headers = {
        "x-ratelimit-limit-requests": str(decision.limit),
        "x-ratelimit-remaining-requests": str(remaining),
        "x-ratelimit-reset-requests": _duration(decision.reset_s),
    }
    if anthropic:
        reset = (datetime.now(UTC) + timedelta(seconds=decision.reset_s)).isoformat(timespec="seconds")
        headers["anthropic-ratelimit-requests-limit"] = str(decision.limit)
        headers["anthropic-ratelimit-requests-remaining"] = str(remaining)
        headers["anthropic-ratelimit-requests-reset"] = reset.replace("+00:00", "Z")
    return headers


def _refusal(decision: Decision, shape: str, presented: bool) -> tuple[ApiError, dict[str, str]]:
    """The 401 or 429 for a request the table did not admit."""
    if decision is None:
        if presented:
            message, code = "Incorrect API key provided.", "invalid_api_key"
        else:
            where = "an x-api-key header" if shape == "anthropic" else "an Authorization header (Bearer)"
            message, code = f"No API key provided: send one in {where}.", "missing_api_key"
        return ApiError(401, message, code=code), {"WWW-Authenticate": "Bearer"}
    assert isinstance(decision, Limited)
    wait = max(1, math.ceil(decision.retry_after_s))
    message = (
        f"Rate limit reached for key {decision.key.label}: {decision.limit} requests per minute. "
        f"Please try again in {wait}s."
    )
    headers = limit_headers(decision, shape == "anthropic") | {"Retry-After": str(wait)}
    return ApiError(429, message, code="rate_limit_exceeded", type_="requests"), headers


class KeyCheck:
    """ASGI middleware: the key check of every ``/v1/`` request (nothing when ``keys`` is None)."""

    def __init__(self, app: ASGIApp, keys: KeyFile | None) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self.keys
        if keys is None or scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        shape = shape_of(scope["path"])
        presented = api_key(Headers(scope=scope), shape)
        decision = keys.check(presented)
        observer = observer_of(scope)
        if not isinstance(decision, Allowed):
            err, headers = _refusal(decision, shape, bool(presented))
            if observer is not None and isinstance(decision, Limited):
                observer.rate_limited(decision.key.tenant)
            response = error_response(err, shape)
            response.headers.update(headers)
            await response(scope, receive, send)
            return
        key = decision.key
        scope.setdefault("state", {})[CALLER_KEY] = Caller(key.tenant, key.priority, key.label, key.weight)
        headers = limit_headers(decision, shape == "anthropic")

        async def sending(message: Message) -> None:
            if headers and message["type"] == "http.response.start":
                MutableHeaders(scope=message).update(headers)
            await send(message)

        await self.app(scope, receive, sending)
