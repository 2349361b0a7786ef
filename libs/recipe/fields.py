"""Reading JSON request fields: typed readers that raise ``ApiError`` naming the field. Pure.

``ApiError`` carries the HTTP status and OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``. Every reader treats an absent field and an
explicit ``null`` alike (the default), as OpenAI does, and rejects booleans where numbers are
expected (``True`` is an ``int`` to Python, never to a client).

A body is any JSON value: where a field should be a name, it may be an object or an array (which
Python cannot hash, so cannot look up in a table) or a value nested thousands deep (which recursion
cannot walk, nor ``repr`` print). ``lookup``, ``shown`` and ``check_depth`` read such values safely.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_DEPTH = 100  # nesting levels of a JSON value the adapters copy or walk (schemas, tool inputs)
_SHOWN_CHARS = 40
_T = TypeVar("_T")


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


def optional_bool(
    obj: dict[str, Any], key: str, param: str | None = None, message: str | None = None
) -> bool | None:
    """``obj[key]`` as a boolean, or None when absent; ``param`` names the field (``key`` by default)
    and ``message`` words the 400 where an API has its own words for it."""
    value = obj.get(key)
    if value is not None and not isinstance(value, bool):
        where = param or key
        raise ApiError(400, message or f"'{where}' must be a boolean", param=where)
    return value


def boolean(body: dict[str, Any], key: str) -> bool:
    """An optional boolean that defaults to false."""
    return optional_bool(body, key) or False


def optional_str(obj: dict[str, Any], key: str, param: str | None = None) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"'{param or key}' must be a string", param=param or key)
    return value


def optional_dict(obj: dict[str, Any], key: str, param: str | None = None) -> dict[str, Any] | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, dict):
        raise ApiError(400, f"'{param or key}' must be an object", param=param or key)
    return value


def is_token_ids(value: Any) -> bool:
    """A list of token ids: ints in [0, 2**32) (an empty list is one too)."""
    return isinstance(value, list) and all(type(i) is int and 0 <= i < 2**32 for i in value)


def token_ids(body: dict[str, Any], key: str) -> tuple[int, ...]:
    ids = body.get(key)
    if ids is None:
        return ()
    if not is_token_ids(ids):
        raise ApiError(400, f"'{key}' must be a list of token ids", param=key)
    return tuple(ids)


def check_vocabulary(ids: Sequence[int], vocab_size: int, param: str) -> None:
    """400 when an id in ``ids`` is not below ``vocab_size``: the model has no such token."""
    if ids and (max(ids) >= vocab_size or min(ids) < 0):  # C-speed scans: prompts may be long
        bad = next(i for i in ids if not 0 <= i < vocab_size)
        raise ApiError(
            400,
            f"'{param}' has token id {bad}, outside this model's vocabulary (ids 0 to {vocab_size - 1})",
            param=param,
        )


def lookup(table: Mapping[str, _T], value: Any) -> _T | None:
    """``table[value]`` when ``value`` is one of its names; None for anything else (any JSON type)."""
    return table.get(value) if isinstance(value, str) else None


def shown(value: Any) -> str:
    """A client's value as an error message quotes it: a string in quotes and a number cut short,
    true/false/null as JSON spells them, an object or array by its kind alone (it may be huge, or
    nested too deep to print)."""
    if isinstance(value, dict | list):
        return "an object" if isinstance(value, dict) else "an array"
    if isinstance(value, str):
        return repr(value) if len(value) <= _SHOWN_CHARS else f"{value[:_SHOWN_CHARS]!r}..."
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = str(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}..."


def check_depth(value: Any, param: str, limit: int = MAX_DEPTH) -> None:
    """400 when objects and arrays nest more than ``limit`` deep in ``value`` (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            raise ApiError(400, f"'{param}' is nested too deeply (at most {limit} levels)", param=param)
        stack.extend((child, depth + 1) for child in children)
