"""Reading JSON request fields: typed readers that raise ``ApiError`` naming the field. Pure.

``ApiError`` carries the HTTP status and OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``. Every reader treats an absent field and an
explicit ``null`` alike (the default), as OpenAI does, and rejects booleans where numbers are
expected (``True`` is an ``int`` to Python, never to a client).
"""

from __future__ import annotations

from typing import Any

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def number(
    body: dict[str, Any], key: str, default: float, lo: float, hi: float, lo_open: bool = False
) -> float:
    """A number in [lo, hi], or (lo, hi] when ``lo_open``."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, f"'{key}' must be a number", param=key)
    if not (lo < value if lo_open else lo <= value) or not value <= hi:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise ApiError(400, f"'{key}' must be in {interval}, got {value}", param=key)
    return float(value)


def optional_int(body: dict[str, Any], key: str, lo: int, hi: int = INT64_MAX) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{key}' must be an integer", param=key)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{key}' must be between {lo} and {hi}, got {value}", param=key)
    return value


def boolean(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be a boolean", param=key)
    return value


def token_ids(body: dict[str, Any], key: str) -> tuple[int, ...]:
    ids = body.get(key)
    if ids is None:
        return ()
    valid = isinstance(ids, list) and all(type(i) is int and 0 <= i < 2**32 for i in ids)
    if not valid:
        raise ApiError(400, f"'{key}' must be a list of token ids", param=key)
    return tuple(ids)
