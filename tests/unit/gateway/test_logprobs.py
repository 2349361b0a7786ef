from __future__ import annotations

import math

import pytest

from libs.protocol.codec import pack_floats, pack_tokens
from libs.protocol.messages import Logprobs
from libs.recipe.tokenizer import Tokenizer
from services.gateway.logprobs import FLOOR_LOGPROB, LogprobRenderer, TokenLogprob, unpack_logprobs


def test_unpack_row_major_top() -> None:
    wire = Logprobs(
        pack_floats([-0.5, -1.5]), pack_tokens([7, 8, 9, 10]), pack_floats([-0.5, -2, -1, -1.5]), 2
    )
    assert unpack_logprobs([7, 10], wire) == (
        TokenLogprob(7, -0.5, ((7, -0.5), (8, -2.0))),
        TokenLogprob(10, -1.5, ((9, -1.0), (10, -1.5))),
    )
    assert unpack_logprobs([3], Logprobs(pack_floats([-0.25]))) == (TokenLogprob(3, -0.25),)


@pytest.mark.parametrize(
    "wire",
    [
        Logprobs(pack_floats([-0.5])),  # one value for two tokens
        Logprobs(pack_floats([-0.5, -1.0]), pack_tokens([1, 2, 3]), pack_floats([-1, -2, -3]), 2),
        Logprobs(pack_floats([-0.5, -1.0]), pack_tokens([1, 2]), pack_floats([-1]), 1),
        Logprobs(pack_floats([-0.5, -1.0]), b"", b"", -1),
    ],
)
def test_unpack_rejects_arrays_that_do_not_cover_the_tokens(wire: Logprobs) -> None:
    with pytest.raises(ValueError):
        unpack_logprobs([5, 6], wire)


def test_render_partial_utf8_special_tokens_and_trimmed_top(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" 日")  # byte-level BPE splits the character: b" \xe6", b"\x97", b"\xa5"
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == " 日".encode()
    first = tokenizer.token_bytes(ids[0])
    assert first.decode("utf-8", errors="replace") != first.decode("utf-8", errors="backslashreplace")
    eos = tokenizer.eos_token_id
    assert eos is not None
    top = ((eos, -math.inf), (ids[0], -1.0), (ids[1], -2.0))
    [entry, end] = LogprobRenderer(tokenizer, 2).entries(
        [TokenLogprob(ids[0], -0.125, top), TokenLogprob(eos, math.nan)]
    )
    assert entry["token"] == first.decode("utf-8", errors="backslashreplace")
    assert bytes(entry["bytes"]) == first and entry["logprob"] == -0.125
    assert entry["top_logprobs"] == [
        {"token": "<|im_end|>", "logprob": FLOOR_LOGPROB, "bytes": list(b"<|im_end|>")},
        {"token": entry["token"], "logprob": -1.0, "bytes": entry["bytes"]},
    ]
    assert end == {
        "token": "<|im_end|>",
        "logprob": FLOOR_LOGPROB,
        "bytes": list(b"<|im_end|>"),
        "top_logprobs": [],
    }
