"""Stored Responses API objects in a JetStream KV bucket: they outlive a gateway restart.

One entry per response id: the response object and the input items it answered (the whole chain
before it, so a ``previous_response_id`` costs one lookup). Retention is the bucket's TTL. Each
entry belongs to the tenant that created it: to any other, it does not exist.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from libs.bus.base import Bus
from libs.protocol.codec import decode, encode
from libs.protocol.stream_messages import StoredResponse
from services.gateway.sse import dumps

TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})


@dataclass(frozen=True, slots=True)
class Stored:
    response: dict[str, Any]
    input_json: bytes  # the input items, kept encoded: a new version is written with the same bytes
    owner: str  # the gateway running it to the end (background); empty once it ended
    tenant: str  # whose it is

    @property
    def input_items(self) -> list[Any]:
        return list(json.loads(self.input_json))


def encode_items(input_items: list[Any]) -> bytes:
    return dumps(input_items).encode()


class ResponseStore:
    def __init__(self, bus: Bus, bucket: str, ttl_s: float) -> None:
        self.bus = bus
        self.bucket = bucket
        self.ttl_s = ttl_s

    async def start(self) -> None:
        await self.bus.ensure_kv(self.bucket, self.ttl_s)

    async def put(self, response: dict[str, Any], input_json: bytes, tenant: str, owner: str = "") -> None:
        stored = StoredResponse(dumps(response).encode(), input_json, owner, tenant)
        await self.bus.kv_put(self.bucket, response["id"], encode(stored))

    async def get(self, response_id: str, tenant: str) -> Stored | None:
        """The response, if it exists and is ``tenant``'s."""
        raw = await self.bus.kv_get(self.bucket, response_id)
        if raw is None:
            return None
        stored = decode(StoredResponse, raw)
        if stored.tenant != tenant:
            return None
        return Stored(json.loads(stored.response_json), stored.input_json, stored.owner, stored.tenant)

    async def history(self, response_id: str, tenant: str) -> list[Any] | None:
        """The input items a follow-up to ``response_id`` starts from: its input, then its output."""
        found = await self.get(response_id, tenant)
        if found is None:
            return None
        return [*found.input_items, *found.response.get("output", [])]
