"""Drafts for speculative decoding, proposed by the scheduler core from a sequence's own tokens.
Pure: no nats, asyncio or torch.

n-gram (prompt lookup): the longest of the sequence's last ``max_ngram`` .. ``min_ngram`` tokens
that occurred before, most recent occurrence first; the draft is what followed it. Code edits,
quoting and summaries repeat their prompt, and then a draft is often right whole.

A draft must follow the sequence's last token, so it is made when no plan is in flight for the
sequence. With overlap scheduling (plan N+1 made before result N) a sequence therefore waits for
its result instead of overlapping, unless its last draft attempt found nothing: then it overlaps
for up to ``RETRY_AFTER`` plans before it waits to try again (``may_overlap``).

Each sequence keeps its tokens packed (4 bytes a token) so a lookup is one ``bytes.rfind`` over
them: no per-sequence index to grow or evict. The worker verifies a draft against its own samples
(services/worker/verify.py), so a wrong draft costs compute, never output.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from services.scheduler.sequence import Sequence

METHODS: Final = ("none", "ngram")
RETRY_AFTER: Final = 4  # plans a sequence whose draft attempt found nothing overlaps before retrying


@dataclass(slots=True)
class DraftStats:
    """Drafted and accepted tokens since start, and verification steps (for /metrics)."""

    num_drafted: int = 0
    num_accepted: int = 0
    num_verified: int = 0  # drafted sequence-steps whose result came back

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_verified += 1


@dataclass(slots=True)
class Speculator:
    """Proposes drafts per sequence (``draft``) and counts how they fare (``stats``)."""

    method: str = "ngram"
    max_ngram: int = 4
    min_ngram: int = 2
    stats: DraftStats = field(default_factory=DraftStats)
    _tokens: dict[str, array[int]] = field(default_factory=dict)  # seq_id -> prompt + outputs
    # seq_id -> plans overlapped since its last draft attempt found nothing (absent: it found one)
    _overlapped: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}: one of {', '.join(METHODS)}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")

    def draft_for(self, seq: Sequence, max_tokens: int, context_len: int) -> list[int]:
        """A draft for a decode of ``seq`` with no plan in flight: at most ``max_tokens``, and never
        past its ``max_tokens`` or the context (so even a draft accepted whole stays inside them).
        Constrained sequences get none (their grammar masks are per sampled position)."""
        params = seq.sampling_params
        if params.structured_output is not None or seq.num_pending_tokens:
            return []
        room = min(params.max_tokens - seq.num_output_tokens, context_len - seq.num_tokens) - 1
        draft = self.draft(seq.seq_id, seq.prompt_token_ids, seq.output_token_ids, min(max_tokens, room))
        if draft:
            self._overlapped.pop(seq.seq_id, None)
        else:
            self._overlapped[seq.seq_id] = 0
        return draft

    def may_overlap(self, seq: Sequence) -> bool:
        """Whether a decode of a sequence with a plan in flight goes in this plan (it cannot draft)
        rather than waiting for that result (then the next plan can): see the module docstring.
        A constrained sequence never drafts, so it never waits."""
        if seq.sampling_params.structured_output is not None:
            return True
        num_overlapped = self._overlapped.get(seq.seq_id)
        return num_overlapped is not None and num_overlapped < RETRY_AFTER

    def overlapped(self, seq_id: str) -> None:
        """A sequence went in a plan while its previous one was in flight (it could not draft)."""
        if seq_id in self._overlapped:
            self._overlapped[seq_id] = min(self._overlapped[seq_id] + 1, RETRY_AFTER)

    def draft(self, seq_id: str, prompt: list[int], output: list[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens to follow ``prompt + output`` (none when nothing matches)."""
        if self.method == "none" or max_tokens <= 0:
            return []
        tokens = self._synced(seq_id, prompt, output)
        return ngram_draft(tokens, max_tokens, self.max_ngram, self.min_ngram)

    def forget(self, seq_id: str) -> None:
        self._tokens.pop(seq_id, None)
        self._overlapped.pop(seq_id, None)

    def _synced(self, seq_id: str, prompt: list[int], output: list[int]) -> array[int]:
        """The sequence's packed tokens, extended by the outputs it gained since the last draft."""
        tokens = self._tokens.get(seq_id)
        num_tokens = len(prompt) + len(output)
        if tokens is None or len(tokens) > num_tokens or len(tokens) < len(prompt):
            tokens = self._tokens[seq_id] = array("I", prompt)
        tokens.extend(output[len(tokens) - len(prompt) :])
        return tokens

    def check_integrity(self, live_seq_ids: set[str]) -> None:
        assert self._tokens.keys() <= live_seq_ids, "tokens kept for a finished sequence"
        assert self._overlapped.keys() <= live_seq_ids, "a finished sequence's overlap count"
        assert all(0 <= n <= RETRY_AFTER for n in self._overlapped.values())


def ngram_draft(tokens: array[int], max_tokens: int, max_ngram: int = 4, min_ngram: int = 2) -> list[int]:
    """What followed the most recent earlier occurrence of the longest matching suffix n-gram."""
    num_tokens = len(tokens)
    data = tokens.tobytes()
    width = tokens.itemsize
    for n in range(min(max_ngram, num_tokens - 1), min_ngram - 1, -1):
        suffix = data[(num_tokens - n) * width :]
        # An earlier occurrence ends before the last token; only token-aligned hits count.
        end = (num_tokens - 1) * width
        while True:
            hit = data.rfind(suffix, 0, end)
            if hit < 0:
                break
            if hit % width == 0:
                start = hit // width + n
                return tokens[start : start + max_tokens].tolist()
            end = hit + len(suffix) - 1
    return []
