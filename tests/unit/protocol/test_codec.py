from __future__ import annotations

import logging

import msgpack
import pytest

from libs.protocol.codec import (
    DecodeError,
    decode,
    decode_or_warn,
    encode,
    pack_floats,
    pack_tokens,
    unpack_floats,
    unpack_tokens,
)
from libs.protocol.member_messages import StepSample, WorkerLoad
from libs.protocol.messages import (
    FinishReason,
    Logprobs,
    ModelRunnerOutput,
    NewSequence,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
    StepOutputs,
    SubmitRequest,
    TokenBias,
)
from libs.protocol.stream_messages import StoredResponse


def test_tokens_pack_as_uint32_little_endian() -> None:
    ids = [0, 1, 49151, 2**32 - 1]
    packed = pack_tokens(ids)
    assert len(packed) == 4 * len(ids)
    assert packed[:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"
    assert unpack_tokens(packed) == ids


def test_floats_pack_as_float32() -> None:
    values = [0.0, -1.5, -9999.0]
    assert len(pack_floats(values)) == 12
    assert unpack_floats(pack_floats(values)) == values


@pytest.mark.parametrize(
    "msg",
    [
        SubmitRequest(
            "r1",
            "gw",
            pack_tokens([5, 6]),
            SamplingParams(temperature=0.0, top_k=7, stop_token_ids=(3,), seed=42, n=2, logprobs=True),
            2,
            1,
            "t",
        ),
        SchedulerOutput(
            3,
            (NewSequence("a", pack_tokens([1]), b"", SamplingParams(), (2,), pack_tokens([4]), 0, 1),),
            ("b", "c"),
            pack_tokens([1, 5]),
            (b"", pack_tokens([7])),
            ("d",),
            "s1",
        ),
        ModelRunnerOutput(
            3,
            ("a", "b"),
            pack_tokens([9, 8]),
            2,
            (Logprobs(pack_floats([-0.5]), pack_tokens([9]), pack_floats([-0.5]), 1), None),
        ),
        StepOutputs("s", 9, (RequestOutput("r", pack_tokens([1]), 1, 4, FinishReason.LENGTH, index=1),)),
        WorkerLoad("w", 0, 8, 64, 32, 4, step_profile=(StepSample(1, 0, 0, 0.05), StepSample(8, 7, 1, 0.09))),
    ],
)
def test_round_trip(msg: object) -> None:
    assert decode(type(msg), encode(msg)) == msg


def test_wire_is_an_array_without_field_names() -> None:
    wire = msgpack.unpackb(encode(SamplingParams(temperature=0.5)))
    assert wire == [0.5, 1.0, 0, 0.0, 1.0, 0.0, 0.0, 256, 0, [], False, None, False, 0, 1, None, []]
    biased = SamplingParams(logit_bias=(TokenBias(7, -100.0), TokenBias(9, 2.5)))
    assert msgpack.unpackb(encode(biased))[-1] == [[7, -100.0], [9, 2.5]]
    assert decode(SamplingParams, encode(biased)) == biased


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


def test_a_payload_from_before_new_trailing_fields_decodes_with_their_defaults() -> None:
    # A stored response as written before it had a tenant, and before it had an owner.
    assert decode(StoredResponse, msgpack.packb([b"{}", b"[]", "gw1"])) == StoredResponse(b"{}", b"[]", "gw1")
    assert decode(StoredResponse, msgpack.packb([b"{}", b"[]"])).tenant == ""
    with pytest.raises(DecodeError):  # a required field missing
        decode(StoredResponse, msgpack.packb([b"{}"]))
    # A newer peer's payload, with a field this version does not know yet: read without it.
    newer = decode(StoredResponse, msgpack.packb([b"{}", b"[]", "gw1", "t", "extra"]))
    assert newer == StoredResponse(b"{}", b"[]", "gw1", "t")


def test_decode_or_warn_drops_a_bad_message_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.codec")
    good = StoredResponse(b"{}", b"[]")
    assert decode_or_warn(StoredResponse, encode(good), log, "stored response") == good
    with caplog.at_level(logging.WARNING, logger="test.codec"):
        assert decode_or_warn(StoredResponse, b"\xc1", log, "stored response") is None
    assert "bad stored response" in caplog.text
