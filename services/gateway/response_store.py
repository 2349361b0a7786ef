"""Stored Responses API objects in a JetStream KV bucket: they outlive a gateway restart.

One entry per response id: the response object and the input items it answered (the whole chain
before it, so a ``previous_response_id`` costs one lookup). Retention is the bucket's TTL.
"""

from __future__ import annotations

import json
from typing import Any

from libs.bus.base import Bus
from libs.protocol.codec import decode, encode
from libs.protocol.messages import StoredResponse

TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})


class ResponseStore:
    def __init__(self, bus: Bus, bucket: str, ttl_s: float) -> None:
        self.bus = bus
        self.bucket = bucket
        self.ttl_s = ttl_s

    async def start(self) -> None:
        await self.bus.ensure_kv(self.bucket, self.ttl_s)

    async def put(self, response: dict[str, Any], input_items: list[Any], request_id: str = "") -> None:
        stored = StoredResponse(_dumps(response), _dumps(input_items), request_id)
        await self.bus.kv_put(self.bucket, response["id"], encode(stored))

    async def get(self, response_id: str) -> tuple[dict[str, Any], list[Any]] | None:
        raw = await self.bus.kv_get(self.bucket, response_id)
        if raw is None:
            return None
        stored = decode(StoredResponse, raw)
        return json.loads(stored.response_json), json.loads(stored.input_json)

    async def history(self, response_id: str) -> list[Any] | None:
        """The input items a follow-up to ``response_id`` starts from: its input, then its output."""
        found = await self.get(response_id)
        if found is None:
            return None
        response, input_items = found
        return [*input_items, *response.get("output", [])]


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
