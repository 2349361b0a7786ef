"""Drafts for speculative decoding, proposed by the scheduler core. Pure: no nats, asyncio or torch.

Four sources; a request's prediction first, then the method's:

- a **prediction** (OpenAI Predicted Outputs): the text the client expects most of the output to
  be, e.g. the file an edit rewrites. The draft is what follows, in the prediction, the place the
  output is aligned with: its start while the output is empty, later where the output's last
  ``max_ngram`` .. 1 tokens occur in it (longest first; the first occurrence ending after where
  the last draft was taken, so a repeated line does not throw the alignment back), which re-aligns the
  draft after the output departs from the prediction and comes back to it.
- **n-gram** (prompt lookup, ``--speculative-method ngram``): the longest of the sequence's last
  ``max_ngram`` .. ``min_ngram`` tokens that occurred before, at the occurrence whose match runs
  back furthest (``ngram_match``); the draft is what followed it (``follow``: a match one period
  back in a repeating run drafts the run on). Code edits, quoting and summaries repeat their
  prompt, and then a draft is often right whole.
- **suffix** (``--speculative-method suffix``: n-gram first, then this): what followed the
  sequence's last tokens in the same tenant's other outputs (``SuffixIndex``, fed as sequences
  finish).
- **mtp** (``--speculative-method mtp``, on the worker too): the token the worker's MTP module
  proposed with the sequence's last result (``proposed``), while it still follows the sequence's
  last token. Its probability, bucketed, stands in for the match length in acceptance counts.

A draft must follow the sequence's last token, so it is made when no plan is in flight for the
sequence. With overlap scheduling (plan N+1 made before result N) a sequence therefore waits for
its result instead of overlapping, unless its last draft attempt found nothing: then it overlaps
for up to ``RETRY_AFTER`` plans before it waits to try again (``may_overlap``).

Each sequence keeps its tokens packed (4 bytes a token) so a lookup is a few ``bytes.rfind`` over
them (one per n-gram length tried, and up to ``MAX_CANDIDATES`` for the longest): no per-sequence
index to grow or evict. The worker verifies a draft against its own samples
(services/worker/verify.py), so a wrong draft costs compute, never output; and a draft the
policy cuts whole is scored against the tokens decoded instead (``Shadow``), which are those
samples, so the policy learns from it as from a verification.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from libs.protocol.messages import SPECULATIVE_METHODS
from services.scheduler.spec_policy import MAX_MATCH_BUCKET, VerifyPolicy
from services.scheduler.suffix_index import SuffixIndex

if TYPE_CHECKING:
    from services.scheduler.plan import Plan
    from services.scheduler.sequence import Sequence

METHODS: Final = SPECULATIVE_METHODS  # automatic sources; a request's prediction is its own
SOURCES: Final = ("ngram", "suffix", "mtp", "prediction")  # where a draft came from (a /metrics label)
RETRY_AFTER: Final = 4  # plans a sequence whose draft attempt found nothing overlaps before retrying
MAX_MATCH_LEN: Final = 32  # a draft's match is measured back this far at most (the policy's feature)
MAX_CANDIDATES: Final = 16  # earlier occurrences of an n-gram compared by how far back they match


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


@dataclass(frozen=True, slots=True)
class Shadow:
    """A draft the policy cut whole, kept to be scored against the tokens that come instead."""

    start: int  # the sequence's num_tokens when it was drafted: the draft's first position
    draft_token_ids: list[int]
    source: str
    match_len: int


@dataclass(slots=True)
class Speculator:
    """Proposes drafts per sequence (``draft_for``), lets ``policy`` cut each plan's drafts to what
    pays (``trim``, ``planned``), and counts how they fare (``stats``, the policy's record)."""

    method: str = "ngram"
    max_ngram: int = 4
    min_ngram: int = 2
    policy: VerifyPolicy = field(default_factory=VerifyPolicy)
    suffix: SuffixIndex = field(default_factory=SuffixIndex)  # other requests' outputs (method suffix)
    stats: dict[str, DraftStats] = field(default_factory=lambda: {s: DraftStats() for s in SOURCES})
    _tokens: dict[str, array[int]] = field(default_factory=dict)  # seq_id -> prompt + outputs
    _predictions: dict[str, bytes] = field(default_factory=dict)  # seq_id -> its packed prediction
    # seq_id -> where in its prediction its last prediction draft started (the alignment hint)
    _aligned: dict[str, int] = field(default_factory=dict)
    # seq_id -> plans overlapped since its last draft attempt found nothing (absent: it found one)
    _overlapped: dict[str, int] = field(default_factory=dict)
    # seq_id -> (its num_tokens then, token, probability): the worker's last draft for it (mtp)
    _proposed: dict[str, tuple[int, int, float]] = field(default_factory=dict)
    _shadows: dict[str, Shadow] = field(default_factory=dict)  # seq_id -> its cut draft, unscored

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}: one of {', '.join(METHODS)}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")

    def draft_for(self, seq: Sequence, max_tokens: int, context_len: int) -> list[int]:
        """A draft for a decode of ``seq`` with no plan in flight: at most ``max_tokens``, and never
        past its ``max_tokens`` or the context (so even a draft accepted whole stays inside them).
        Sets ``seq.draft_source`` and ``seq.draft_match_len``. A constrained sequence's draft is
        cut by the worker to what its grammar accepts (services/worker/grammar.py)."""
        if not self.drafts(seq) or seq.num_pending_tokens:
            return []
        self._score_shadow(seq)
        params = seq.sampling_params
        room = min(params.max_tokens - seq.num_output_tokens, context_len - seq.num_tokens) - 1
        max_tokens = min(max_tokens, room)
        draft: list[int] = []
        if max_tokens > 0:
            tokens = self._synced(seq.seq_id, seq.prompt_token_ids, seq.output_token_ids)
            if seq.prediction_token_ids:
                draft, seq.draft_match_len = self._from_prediction(seq, tokens, max_tokens)
                seq.draft_source = "prediction"
            if not draft and self.method in ("ngram", "suffix"):
                start, seq.draft_match_len = ngram_match(tokens, self.max_ngram, self.min_ngram)
                draft = follow(tokens, start, max_tokens) if start >= 0 else []
                seq.draft_source = "ngram"
            if not draft and self.method == "suffix":
                draft, seq.draft_match_len = self.suffix.draft(tokens, max_tokens, seq.tenant)
                seq.draft_source = "suffix"
            if not draft and self.method == "mtp":
                draft, seq.draft_match_len = self._from_drafter(seq)
                seq.draft_source = "mtp"
        if draft:
            self._overlapped.pop(seq.seq_id, None)
        else:
            self._overlapped[seq.seq_id] = 0
        return draft

    def drafts(self, seq: Sequence) -> bool:
        """Whether ``seq`` has a draft source at all (otherwise it is planned as without one)."""
        return self.method != "none" or bool(seq.prediction_token_ids)

    def may_overlap(self, seq: Sequence) -> bool:
        """Whether a decode of a sequence with a plan in flight goes in this plan (it cannot draft)
        rather than waiting for that result (then the next plan can): see the module docstring.
        A sequence that never drafts never waits."""
        if not self.drafts(seq):
            return True
        num_overlapped = self._overlapped.get(seq.seq_id)
        return num_overlapped is not None and num_overlapped < RETRY_AFTER

    def overlapped(self, seq_id: str) -> None:
        """A sequence went in a plan while its previous one was in flight (it could not draft)."""
        if seq_id in self._overlapped:
            self._overlapped[seq_id] = min(self._overlapped[seq_id] + 1, RETRY_AFTER)

    def verified(self, seq: Sequence, num_drafted: int, num_accepted: int, num_kept: int) -> None:
        """A draft's result came back: ``num_accepted`` drafts held, and the sequence kept
        ``num_kept`` tokens of the result (fewer at a stop). A prediction's tokens count for the
        request's usage as they end up in the output: accepted, or rejected (never output)."""
        self.stats[seq.draft_source].record(num_drafted, num_accepted)
        source, match_len = seq.draft_source, seq.draft_match_len
        predictor = self.policy.predictor
        predictor.record(seq.seq_id, source, match_len, num_drafted, num_accepted, not seq.is_finished)
        if seq.draft_source == "prediction":
            num_output = min(num_accepted, num_kept)
            seq.num_unsent_accepted_prediction_tokens += num_output
            seq.num_unsent_rejected_prediction_tokens += num_drafted - num_output

    def trim(self, plan: Plan, seqs: Mapping[str, Sequence], num_more_tokens: int = 0) -> None:
        """Cut the plan's drafts to the prefixes the policy verifies, before the plan's prefill
        chunks and admissions take the budget the cut gives back (``num_more_tokens``: what
        they are expected to take). The cut tokens' blocks stay with their sequences (later
        tokens fill them); a sequence left with no draft overlaps as one whose attempt found
        nothing (it may go in the next plan)."""
        if not plan.drafts or self.policy.name == "fixed":
            return
        drafted = [(seqs[s], d) for s, d in plan.drafts.items()]
        shapes = [(seq.seq_id, seq.draft_source, seq.draft_match_len, len(d)) for seq, d in drafted]
        num_tokens = sum(plan.scheduled.values()) + num_more_tokens
        lengths = self.policy.lengths(shapes, plan.num_sampling, num_tokens)
        for (seq, draft), num_verified in zip(drafted, lengths, strict=True):
            plan.budget += len(draft) - num_verified
            if num_verified:
                plan.drafts[seq.seq_id] = seq.draft_token_ids = draft[:num_verified]
            else:
                del plan.drafts[seq.seq_id]
                shadow = Shadow(seq.num_tokens, draft, seq.draft_source, seq.draft_match_len)
                self._shadows.setdefault(seq.seq_id, shadow)  # one at a time: no position twice
                seq.draft_token_ids = []
                self._overlapped[seq.seq_id] = 0

    def _score_shadow(self, seq: Sequence) -> None:
        """Score ``seq``'s cut draft once the tokens that came instead settle it: a drafted token
        would have been accepted exactly when it equals the sample at its position, which is the
        token that came (the worker draws it from (seed, position), verifying or not)."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            return
        offset = shadow.start - len(seq.prompt_token_ids)
        came = seq.output_token_ids[offset : offset + len(shadow.draft_token_ids)]
        num_accepted = 0
        while num_accepted < len(came) and came[num_accepted] == shadow.draft_token_ids[num_accepted]:
            num_accepted += 1
        if num_accepted == len(came) < len(shadow.draft_token_ids):
            return  # every token so far held: the next ones decide
        del self._shadows[seq.seq_id]
        num_drafted = len(shadow.draft_token_ids)
        self.policy.predictor.record(seq.seq_id, shadow.source, shadow.match_len, num_drafted, num_accepted)

    def planned(self, plan: Plan) -> None:
        """The plan is complete: the policy learns its size, to match with its measured time."""
        num_drafted = sum(len(d) for d in plan.drafts.values())
        num_tokens = sum(plan.scheduled.values()) + num_drafted
        self.policy.planned(plan.step_id, num_tokens, num_drafted)

    def proposed(self, seq: Sequence, token_id: int, probability: float) -> None:
        """The worker's drafter proposes ``token_id`` to follow ``seq``'s tokens as they are now."""
        if self.method == "mtp":
            self._proposed[seq.seq_id] = (seq.num_tokens, token_id, probability)

    def _from_drafter(self, seq: Sequence) -> tuple[list[int], int]:
        """The worker's draft for ``seq`` if it still follows its last token, and its probability
        as a bucket 1..MAX_MATCH_BUCKET (it stands for a match length in the predictor's counts)."""
        proposal = self._proposed.pop(seq.seq_id, None)
        if proposal is None or proposal[0] != seq.num_tokens:
            return [], 0
        _, token_id, probability = proposal
        return [token_id], 1 + min(int(probability * MAX_MATCH_BUCKET), MAX_MATCH_BUCKET - 1)

    def _from_prediction(self, seq: Sequence, tokens: array[int], max_tokens: int) -> tuple[list[int], int]:
        """The prediction's draft, and how many output tokens its alignment matched."""
        prediction = self._predictions.get(seq.seq_id)
        if prediction is None:
            prediction = self._predictions[seq.seq_id] = array("I", seq.prediction_token_ids).tobytes()
        num_output = seq.num_output_tokens
        output_tail = tokens[len(tokens) - min(num_output, self.max_ngram) :].tobytes() if num_output else b""
        hint = self._aligned.get(seq.seq_id, 0)
        start, match_len = prediction_match(prediction, output_tail, hint, tokens.itemsize)
        if start < 0:
            return [], 0
        self._aligned[seq.seq_id] = start
        if num_output and match_len == len(output_tail) // tokens.itemsize:  # (it may match further)
            limit = min(num_output, MAX_MATCH_LEN) - match_len
            view = memoryview(prediction).cast("I")
            match_len += matched_before(view, start - match_len, tokens, len(tokens) - match_len, limit)
        width = tokens.itemsize
        return array("I", prediction[start * width : (start + max_tokens) * width]).tolist(), match_len

    def finished(self, seq: Sequence, completed: bool) -> None:
        """``seq`` is done here; a ``completed`` output (a stop, or its length) feeds the suffix
        source, led in by its prompt's last tokens."""
        if completed and self.method == "suffix" and seq.output_token_ids:
            lead = seq.prompt_token_ids[-self.suffix.max_context :]
            self.suffix.add(array("I", lead + seq.output_token_ids), len(lead), seq.tenant)
        self.forget(seq.seq_id)

    def forget(self, seq_id: str) -> None:
        for table in (self._tokens, self._predictions, self._aligned, self._overlapped, self._proposed):
            table.pop(seq_id, None)
        self._shadows.pop(seq_id, None)
        self.policy.predictor.forget(seq_id)

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
        assert self._proposed.keys() <= live_seq_ids, "a finished sequence's proposed draft"
        assert self._shadows.keys() <= live_seq_ids, "a finished sequence's cut draft"
        assert all(s.draft_token_ids for s in self._shadows.values()), "an empty cut draft"
        assert self._predictions.keys() <= live_seq_ids and self._aligned.keys() <= live_seq_ids
        assert all(0 <= start <= len(self._predictions[s]) // 4 for s, start in self._aligned.items())
        assert all(0 <= n <= RETRY_AFTER for n in self._overlapped.values())
        self.policy.predictor.check_integrity(live_seq_ids)
        self.suffix.check_integrity()


def ngram_draft(tokens: array[int], max_tokens: int, max_ngram: int = 4, min_ngram: int = 2) -> list[int]:
    """What followed the earlier occurrence of the longest matching suffix n-gram that ``ngram_match``
    picks."""
    start, _ = ngram_match(tokens, max_ngram, min_ngram)
    return follow(tokens, start, max_tokens) if start >= 0 else []


def follow(tokens: array[int], start: int, max_tokens: int) -> list[int]:
    """What follows ``tokens[start:]``'s match at the end: the tokens from ``start`` on, and where
    they run out before ``max_tokens``, the draft itself again (the match was one period of a
    repeating run back, so the run goes on: a model that loops keeps looping)."""
    draft = tokens[start : start + max_tokens].tolist()
    period = len(tokens) - start
    while period > 0 and len(draft) < max_tokens:
        draft.append(draft[len(draft) - period])
    return draft


def ngram_match(tokens: array[int], max_ngram: int = 4, min_ngram: int = 2) -> tuple[int, int]:
    """Where the draft starts and how many tokens before there match the sequence's last ones (at
    most ``MAX_MATCH_LEN``); (-1, 0) for none. The match is an earlier occurrence of the longest
    suffix n-gram that occurred before: of its ``MAX_CANDIDATES`` most recent occurrences, the
    one whose match runs back furthest, the most recent of those. A copy of repeating structure
    (list items, fields, rows) thus follows its own line of the prompt, not the line it copied
    last."""
    num_tokens = len(tokens)
    data = tokens.tobytes()
    width = tokens.itemsize
    longest = min(max_ngram, num_tokens - 1)
    for n in range(longest, min_ngram - 1, -1):
        suffix = data[(num_tokens - n) * width :]
        # Below the longest n every occurrence matches exactly n (one that matched further would
        # have been an occurrence of the n + 1 tokens, found before): the most recent one serves.
        max_candidates = MAX_CANDIDATES if n == longest else 1
        best_start, best_len = -1, 0
        # An earlier occurrence ends before the last token; only token-aligned hits count.
        end, num_candidates = (num_tokens - 1) * width, 0
        while num_candidates < max_candidates and best_len < MAX_MATCH_LEN:
            hit = data.rfind(suffix, 0, end)
            if hit < 0:
                break
            end = hit + len(suffix) - 1
            if hit % width:
                continue
            num_candidates += 1
            start = hit // width + n
            length = n + matched_before(tokens, start - n, tokens, num_tokens - n, MAX_MATCH_LEN - n)
            if length > best_len:
                best_start, best_len = start, length
        if best_start >= 0:
            return best_start, best_len
    return -1, 0


def matched_before(a: array[int] | memoryview, a_end: int, b: array[int], b_end: int, limit: int) -> int:
    """How many tokens before ``a[a_end]`` equal those before ``b[b_end]``, counting back, at most
    ``limit``."""
    num = 0
    while num < limit and num < a_end and num < b_end and a[a_end - num - 1] == b[b_end - num - 1]:
        num += 1
    return num


def prediction_start(prediction: bytes, output_tail: bytes, hint: int, width: int = 4) -> int:
    """``prediction_match``'s start alone."""
    return prediction_match(prediction, output_tail, hint, width)[0]


def prediction_match(prediction: bytes, output_tail: bytes, hint: int, width: int = 4) -> tuple[int, int]:
    """Where in ``prediction`` (packed tokens) the tokens after the output start: 0 for no output
    yet; else right after the longest suffix of ``output_tail`` (packed, its last tokens) found
    in it, the first occurrence ending after ``hint`` (where the last draft started: the output
    has grown since) if there is one. A one-token suffix is only looked for from ``hint`` on:
    anywhere else, one common token is a poor alignment.
    Also returns how many tail tokens matched (0 at the start). -1: none, or the match ends the
    prediction."""
    if not output_tail:
        return (0 if prediction else -1), 0
    num_tail = len(output_tail) // width
    for n in range(num_tail, 0, -1):
        suffix = output_tail[(num_tail - n) * width :]
        for lo in (max(hint - n + 1, 0), 0) if n > 1 else (hint,):
            hit = _find_aligned(prediction, suffix, lo * width, width)
            if hit >= 0:
                end = hit + n
                return (end, n) if end * width < len(prediction) else (-1, 0)
    return -1, 0


def _find_aligned(data: bytes, needle: bytes, start: int, width: int) -> int:
    """The first token-aligned occurrence of ``needle`` in ``data`` from byte ``start`` (a token
    index), or -1."""
    while True:
        hit = data.find(needle, start)
        if hit < 0:
            return -1
        if hit % width == 0:
            return hit // width
        start = hit + 1
