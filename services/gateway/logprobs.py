"""Token logprobs: the wire form (packed arrays) -> per-token records -> OpenAI's entries. Pure.

An entry is ``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}``.
``bytes`` is the token's raw bytes. ``token`` is those bytes as text; a byte-level BPE token that
holds part of a UTF-8 character is not valid text on its own, so its stray bytes are spelled as
``\\xNN`` escapes (as OpenAI does) and the exact bytes are in ``bytes``. Special tokens (EOS)
appear under their own spelling, although the content text leaves them out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from libs.protocol.codec import unpack_floats, unpack_tokens
from libs.protocol.messages import Logprobs
from libs.recipe.tokenizer import Tokenizer

# JSON has no -inf (and starlette refuses NaN): an impossible token is reported with this, as vLLM does.
FLOOR_LOGPROB = -9999.0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


def unpack_logprobs(token_ids: list[int], wire: Logprobs) -> tuple[TokenLogprob, ...]:
    """One record per token; ValueError when the arrays do not cover exactly these tokens."""
    values = unpack_floats(wire.token_logprobs)
    top_ids = unpack_tokens(wire.top_token_ids)
    top_values = unpack_floats(wire.top_logprobs)
    k = wire.num_top
    if len(values) != len(token_ids):
        raise ValueError(f"{len(values)} logprobs for {len(token_ids)} tokens")
    if k < 0 or len(top_ids) != k * len(token_ids) or len(top_values) != len(top_ids):
        raise ValueError(f"top logprobs arrays of {len(top_ids)}/{len(top_values)} for {len(token_ids)}x{k}")
    top = list(zip(top_ids, top_values, strict=True))
    return tuple(
        TokenLogprob(token_id, value, tuple(top[i * k : (i + 1) * k]))
        for i, (token_id, value) in enumerate(zip(token_ids, values, strict=True))
    )


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR_LOGPROB


class LogprobRenderer:
    """Renders records as OpenAI entries with at most ``num_top`` alternatives each."""

    def __init__(self, tokenizer: Tokenizer, num_top: int) -> None:
        self._tokenizer = tokenizer
        self._num_top = num_top

    def entries(self, records: Iterable[TokenLogprob]) -> list[dict[str, Any]]:
        return [
            {
                **self._token(r.token_id, r.logprob),
                # The worker may send more alternatives than asked (one width per batch): trim.
                "top_logprobs": [self._token(t, lp) for t, lp in r.top[: self._num_top]],
            }
            for r in records
        ]

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self._tokenizer.token_bytes(token_id)
        return {
            "token": raw.decode("utf-8", errors="backslashreplace"),
            "logprob": _finite(logprob),
            "bytes": list(raw),
        }
