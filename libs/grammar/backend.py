"""The one small interface every grammar backend implements: compile -> matcher -> mask / advance.

A backend is built once per worker from the model's vocabulary (the bytes each token id stands
for). ``compile`` turns a ``StructuredOutput`` into a reusable ``CompiledGrammar`` (the expensive
part, cached by the caller by ``grammar_key``); ``matcher`` makes the cheap per-sequence state.

Bitmask layout (shared by every backend and ``libs.kernels.token_mask``): int32 tensor
[num_rows, ceil(vocab_size / 32)]; token t is allowed in row r iff bit (t % 32) of word
``bitmask[r, t // 32]`` is set.

Vocabulary: token i stands for ``vocab[i]``; b"" is a token no grammar produces (special tokens,
ids past the tokenizer); a markup token (``grammar_vocab``'s ``markup_ids``) stands for
``SPECIAL_BYTES``, a byte no UTF-8 text holds, so no text rule accepts it and only a structure's
token node (by id) does.

Stop tokens: a matcher is made with the sequence's stop token ids; ``fill_mask`` allows them
exactly when the grammar may end at this point, and accepting one terminates the matcher.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Final, Protocol

from libs.protocol.messages import StructuredOutput

SPECIAL_BYTES: Final = b"\xff"

if TYPE_CHECKING:  # importing torch takes a second; the gateway's checks never need it
    import torch


class GrammarError(ValueError):
    """A constraint that cannot be honoured: invalid, or using something the backend cannot enforce.

    ``param`` names the offending part (e.g. ``properties.age.multipleOf``) for the 400 message.
    """

    def __init__(self, message: str, param: str = "") -> None:
        super().__init__(message)
        self.param = param


class GrammarLimitError(GrammarError):
    """Compiling the constraint ran past a bound (time or memory): the constraint's own cost, so
    it is remembered as failed like any other GrammarError."""


class BackendUnavailable(GrammarError):
    """The backend cannot be used here (its library is missing, its compiler would not start).
    Not the constraint's fault: never cached, a later request may find it working."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "backend")


class Matcher(Protocol):
    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (every other bit cleared)."""

    def advance(self, token_id: int) -> bool:
        """Accept one sampled token; False if the grammar rejects it (state unchanged)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding)."""

    def is_terminated(self) -> bool:
        """A stop token was accepted: nothing more may follow."""

    def state_key(self) -> Hashable:
        """Equal for two states of one matcher that accept the same continuations, as far as the
        backend can tell (a hint for searches: equal keys may rarely differ in what follows)."""


class CompiledGrammar(Protocol):
    def matcher(self, stop_token_ids: Sequence[int]) -> Matcher: ...


class GrammarBackend(Protocol):
    name: str
    vocab_size: int

    def compile(self, constraint: StructuredOutput) -> CompiledGrammar:
        """Compile (seconds at worst; call it off the event loop). Raises GrammarError."""


def grammar_key(constraint: StructuredOutput) -> str:
    """Cache key: everything that shapes the compiled grammar (not ``start_after``, which the
    worker handles before the matcher sees a token)."""
    text = "\0".join(
        (constraint.backend, str(int(constraint.kind)), constraint.spec, constraint.prefix, constraint.suffix)
    )
    return hashlib.sha256(text.encode()).hexdigest()
