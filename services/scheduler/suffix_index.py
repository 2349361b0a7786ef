"""Drafts from other requests' outputs (the global half of suffix decoding, after ArcticInference):
what followed the same context when earlier sequences wrote it. Pure: no nats, asyncio or torch.

Agents, tools and templated traffic make outputs repeat across requests (the same tool call, the
same JSON skeleton, the same boilerplate reply), which a single request's own tokens cannot
predict. ``SuffixIndex`` counts, for every context of ``min_context`` .. ``max_context`` tokens in
a finished sequence's output (its prompt's last tokens lead in), which token came next. A draft
matches the longest context the index holds at the end of the sequence, then follows the most
frequent continuation token by token while it is frequent enough (``min_share`` of the times the
context was seen), each step on the longest context known.

Contexts are keyed by a scope (the tenant: one tenant's outputs never draft for another, whose
latency would otherwise tell it what the first one was sent) and the packed tokens (4 bytes a
token): no tree to balance. The table is bounded (``max_contexts``), forgetting the contexts
least recently written first.
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class SuffixIndex:
    max_context: int = 4
    min_context: int = 2
    min_share: float = 0.3  # a continuation drafts only if it followed at least this share of the time
    max_contexts: int = 100_000
    _next: OrderedDict[tuple[str, bytes], Counter[int]] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if not 1 <= self.min_context <= self.max_context:
            raise ValueError("need 1 <= min_context <= max_context")

    def __len__(self) -> int:
        return len(self._next)

    def add(self, tokens: array[int], num_prompt_tokens: int, scope: str = "") -> None:
        """Index a finished sequence's output (``tokens``: its prompt then its output, packed)."""
        first = max(num_prompt_tokens, self.min_context)
        for end in range(first, len(tokens)):
            token_id = tokens[end]
            for n in range(self.min_context, min(self.max_context, end) + 1):
                key = (scope, tokens[end - n : end].tobytes())
                counts = self._next.get(key)
                if counts is None:
                    counts = self._next[key] = Counter()
                else:
                    self._next.move_to_end(key)
                counts[token_id] += 1
        while len(self._next) > self.max_contexts:
            self._next.popitem(last=False)

    def draft(self, tokens: array[int], max_tokens: int, scope: str = "") -> tuple[list[int], int]:
        """Up to ``max_tokens`` tokens to follow ``tokens`` (packed), and the length of the context
        the first one matched (0: none matched, and the draft is empty)."""
        context = tokens[max(len(tokens) - self.max_context, 0) :]
        draft: list[int] = []
        first_match = 0
        while len(draft) < max_tokens:
            token_id, match_len = self._follow(context, scope)
            if token_id < 0:
                break
            first_match = first_match or match_len
            draft.append(token_id)
            context.append(token_id)
            del context[: max(len(context) - self.max_context, 0)]
        return draft, first_match

    def _follow(self, context: array[int], scope: str) -> tuple[int, int]:
        """The most frequent next token after the longest known suffix of ``context``, and that
        suffix's length; (-1, 0) if none is known or no continuation is frequent enough."""
        for n in range(min(self.max_context, len(context)), self.min_context - 1, -1):
            counts = self._next.get((scope, context[len(context) - n :].tobytes()))
            if counts:
                token_id, count = counts.most_common(1)[0]
                if count >= self.min_share * counts.total():
                    return token_id, n
                return -1, 0
        return -1, 0

    def check_integrity(self) -> None:
        assert len(self._next) <= self.max_contexts, "the index outgrew its bound"
        for (_, key), counts in self._next.items():
            assert self.min_context * 4 <= len(key) <= self.max_context * 4 and len(key) % 4 == 0
            assert counts and all(n > 0 for n in counts.values()), "an empty continuation count"
