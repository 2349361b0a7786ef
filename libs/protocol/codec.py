"""MessagePack encoding of the frozen message dataclasses.

A message travels as a msgpack array of its field values in declaration order (nested messages
likewise), so field names never ride on the wire. Each subject carries one message type, so the
receiver names the type: ``decode(StepOutputs, data)``. Converters are derived once per class from
its type hints.

A payload written before its message gained trailing fields with defaults decodes with those
defaults: entries kept in buckets (stored responses, stream records) outlive an upgrade, and
during a rolling one older peers still send the shorter form. A payload from a newer peer, with
trailing fields this version does not know yet, decodes without them (the same rolling upgrade,
the other way round: a member entry or a step message from an upgraded process). One with too few
fields for its required ones is refused.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import sys
import types
import typing
from array import array
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")
Converter = Callable[[Any], Any]


class DecodeError(ValueError):
    """A payload that does not match the message type it was received as."""


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as uint32 little-endian bytes (4 bytes per token, never a list of ints)."""
    return _pack("I", token_ids)


def unpack_tokens(data: bytes) -> list[int]:
    return _unpack("I", data)


def pack_floats(values: Sequence[float]) -> bytes:
    """Floats as float32 little-endian bytes (logprobs)."""
    return _pack("f", values)


def unpack_floats(data: bytes) -> list[float]:
    return _unpack("f", data)


def _pack(typecode: str, values: Sequence[float]) -> bytes:
    packed: array[Any] = array(typecode, values)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _unpack(typecode: str, data: bytes) -> list[Any]:
    packed: array[Any] = array(typecode)
    packed.frombytes(data)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


def encode(msg: object) -> bytes:
    return msgpack.packb(_to_wire(msg), use_bin_type=True)  # type: ignore[no-any-return]


def decode(cls: type[T], data: bytes) -> T:
    try:
        obj = msgpack.unpackb(data, raw=False)
        return _converter(cls)(obj)  # type: ignore[arg-type,no-any-return]
    except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
        raise DecodeError(f"cannot decode {cls.__name__}: {exc}") from exc


def decode_or_warn(cls: type[T], data: bytes, log: logging.Logger, what: str) -> T | None:
    """``decode``, or None after a warning naming ``what``: a subscriber drops a message it cannot
    read, and says so, rather than let one bad publisher take its handler down."""
    try:
        return decode(cls, data)
    except DecodeError as exc:
        log.warning("bad %s: %s", what, exc)
        return None


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [_to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list | tuple):
        return [_to_wire(v) for v in value]
    return value


@functools.cache
def _converter(tp: Any) -> Converter:
    """Build the function that turns a decoded msgpack object back into ``tp``."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass_converter(tp)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported union {tp}")
        conv = _converter(inner[0])
        return lambda v: None if v is None else conv(v)
    if origin is tuple:
        item = _converter(args[0])
        return lambda v: tuple(item(x) for x in v)
    if origin is list:
        item = _converter(args[0])
        return lambda v: [item(x) for x in v]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp
    if tp is float:
        return float
    if tp in (int, str, bytes, bool):
        return lambda v: _expect(tp, v)
    raise TypeError(f"unsupported field type {tp}")


def _expect(tp: type, value: Any) -> Any:
    if not isinstance(value, tp):
        raise TypeError(f"expected {tp.__name__}, got {type(value).__name__}")
    return value


def _dataclass_converter(cls: type) -> Converter:
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    convs = [_converter(hints[f.name]) for f in fields]
    no_default = dataclasses.MISSING
    num_required = sum(f.default is no_default and f.default_factory is no_default for f in fields)

    def convert(values: Any) -> Any:
        if not isinstance(values, list) or len(values) < num_required:
            raise TypeError(f"expected at least {num_required} fields")
        return cls(*(conv(v) for conv, v in zip(convs, values, strict=False)))

    return convert
