from __future__ import annotations

import msgpack
import pytest

from libs.protocol.codec import DecodeError, decode, encode, pack_tokens, unpack_tokens
from libs.protocol.messages import (
    FinishReason,
    ModelRunnerOutput,
    NewSequence,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
    StepOutputs,
    SubmitRequest,
)


def test_tokens_pack_as_uint32_little_endian() -> None:
    ids = [0, 1, 49151, 2**32 - 1]
    packed = pack_tokens(ids)
    assert len(packed) == 4 * len(ids)
    assert packed[:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"
    assert unpack_tokens(packed) == ids


@pytest.mark.parametrize(
    "msg",
    [
        SubmitRequest(
            "r1", "gw", pack_tokens([5, 6]), SamplingParams(0.0, 0.9, 7, (3,), True, 42), 2, 1, "t"
        ),
        SchedulerOutput(3, (NewSequence("a", pack_tokens([1]), SamplingParams()),), ("b", "c"), ("d",)),
        ModelRunnerOutput(3, ("a", "b"), pack_tokens([9, 8]), 2, ("x",), ""),
        StepOutputs("s", 9, (RequestOutput("r", pack_tokens([1]), 1, 4, FinishReason.LENGTH),)),
    ],
)
def test_round_trip(msg: object) -> None:
    assert decode(type(msg), encode(msg)) == msg


def test_wire_is_an_array_without_field_names() -> None:
    wire = msgpack.unpackb(encode(SamplingParams(temperature=0.5)))
    assert wire == [0.5, 1.0, 256, [], False, None]


def test_enum_and_optional_fields_decode_to_their_types() -> None:
    out = decode(RequestOutput, encode(RequestOutput("r", b"", 0, 1, FinishReason.STOP)))
    assert out.finish_reason is FinishReason.STOP
    assert decode(RequestOutput, encode(RequestOutput("r", b"", 0, 1))).finish_reason is None


@pytest.mark.parametrize(
    "data", [b"\xc1", msgpack.packb([1, 2]), msgpack.packb(["r", b"", "x", 1, None, 0, ""])]
)
def test_bad_payload_raises_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        decode(RequestOutput, data)
