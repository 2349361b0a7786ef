"""A worker stand-in for scheduler tests: follows plans exactly as the real worker must, with a
"model" whose next token is a hash of the whole sequence so far.

Every KV slot stores the hash of the prefix that produced it. Before sampling, the fake checks
that every position its sequence attends to holds exactly that sequence's prefix: a wrong block
table, an overwritten shared block or a chunk that starts at the wrong position all show up as a
mismatch, not as a flaky output.
"""

from __future__ import annotations

from dataclasses import dataclass

from libs.protocol.codec import pack_tokens, unpack_tokens
from libs.protocol.messages import ModelRunnerOutput, SchedulerOutput

VOCAB = 50
EOS = 2


def next_token(tokens: list[int]) -> int:
    return hash(tuple(tokens)) % VOCAB


def reference_output(
    prompt: list[int], max_tokens: int, context_len: int, min_tokens: int = 0, ignore_eos: bool = False
) -> list[int]:
    """What a sequence generates when it runs alone from start to end."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        token = next_token(tokens)
        if len(out) < min_tokens and token == EOS:
            token = EOS + 1  # the worker masks stop tokens before min_tokens; so does this "model"
        tokens.append(token)
        out.append(token)
        if (
            (token == EOS and not ignore_eos and len(out) > min_tokens)
            or len(out) >= max_tokens
            or len(tokens) >= context_len
        ):
            return out


@dataclass
class _State:
    tokens: list[int]
    table: list[int]
    num_computed: int
    min_tokens: int
    max_tokens: int
    num_prompt: int


class FakeWorker:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.kv: dict[int, int] = {}  # slot -> hash of the prefix whose last token's KV it holds
        self.seqs: dict[str, _State] = {}

    def _slot(self, state: _State, position: int) -> int:
        return state.table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, plan: SchedulerOutput) -> tuple[tuple[str, ...], list[int]]:
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        rows: list[tuple[str, int]] = []
        for new in plan.new_seqs:
            assert new.seq_id not in self.seqs, f"{new.seq_id} sent as new twice"
            prompt = unpack_tokens(new.prompt_token_ids)
            self.seqs[new.seq_id] = _State(
                prompt + unpack_tokens(new.output_token_ids),
                unpack_tokens(new.block_ids),
                new.num_computed_tokens,
                new.sampling_params.min_tokens,
                new.sampling_params.max_tokens,
                len(prompt),
            )
            rows.append((new.seq_id, new.num_scheduled_tokens))
        counts = unpack_tokens(plan.num_scheduled_tokens)
        for seq_id, count, blocks in zip(plan.seq_ids, counts, plan.new_block_ids, strict=True):
            self.seqs[seq_id].table += unpack_tokens(blocks)
            rows.append((seq_id, count))
        # Like every layer of the real model: write all new KV first, then attend.
        for seq_id, count in rows:
            state = self.seqs[seq_id]
            assert state.num_computed + count <= len(state.tokens), f"{seq_id}: computes unknown tokens"
            for p in range(state.num_computed, state.num_computed + count):
                self.kv[self._slot(state, p)] = hash(tuple(state.tokens[: p + 1]))
        seq_ids: list[str] = []
        sampled: list[int] = []
        for seq_id, count in rows:
            state = self.seqs[seq_id]
            state.num_computed += count
            for p in range(state.num_computed):
                assert self.kv.get(self._slot(state, p)) == hash(tuple(state.tokens[: p + 1])), (
                    f"{seq_id}: wrong KV at position {p}"
                )
            if state.num_computed == len(state.tokens):
                assert len(state.tokens) - state.num_prompt < state.max_tokens, f"{seq_id}: past max_tokens"
                token = next_token(state.tokens)
                if len(state.tokens) - state.num_prompt < state.min_tokens and token == EOS:
                    token = EOS + 1
                state.tokens.append(token)
                seq_ids.append(seq_id)
                sampled.append(token)
        return tuple(seq_ids), sampled

    def check_integrity(self) -> None:
        for seq_id, state in self.seqs.items():
            assert state.num_computed <= len(state.tokens), seq_id
            assert len(state.table) * self.block_size >= state.num_computed, seq_id


class FakeRunner:
    """A FakeWorker behind the ModelRunner interface, for deepinfer.local_engine.LocalEngine."""

    def __init__(self, block_size: int) -> None:
        self.worker = FakeWorker(block_size)

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        seq_ids, sampled = self.worker.execute(plan)
        return ModelRunnerOutput(plan.step_id, seq_ids, pack_tokens(sampled), len(self.worker.seqs))

    def check_integrity(self) -> None:
        self.worker.check_integrity()
