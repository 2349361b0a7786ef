"""A worker stand-in for scheduler tests: follows plans exactly as the real worker must, with a
"model" whose next token is a hash of the whole sequence so far.

Every KV slot stores the hash of the prefix that produced it. Before sampling, the fake checks
that every position its sequence attends to holds exactly that sequence's prefix: a wrong block
table, an overwritten shared block or a chunk that starts at the wrong position all show up as a
mismatch, not as a flaky output.

Lower tiers: a plan's saves copy blocks (their slots' values) into a host memory (G2, LRU, of
``host_capacity`` blocks) and a store (G3) keyed by block hash, before the forward; a new
sequence's load copies them back, and a block found in neither is recomputed (written with the
right values) with every block after it, as the real worker must. So a save of a block whose KV
is not (or no longer) what its hash says shows up as wrong KV when a later sequence loads it.

Handoff area: a plan's partial saves copy a page under its key (``handoff``, shared like the
store); a load's partial block is copied back after its full blocks, and popped (the file is
deleted once read), or recomputed when it is not there; a plan's drops pop their keys.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from libs.protocol.codec import pack_tokens, unpack_tokens
from libs.protocol.kv_messages import KVLoad, KVSave, PartialSave, split_hashes
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


BlockKV = tuple[int | None, ...]  # the slots of one block
HostEvent = tuple[bool, list[bytes]]  # (stored, block hashes); (False, []) = G2 cleared


class FakeWorker:
    def __init__(self, block_size: int, host_capacity: int = 1 << 30) -> None:
        self.block_size = block_size
        self.kv: dict[int, int] = {}  # slot -> hash of the prefix whose last token's KV it holds
        self.seqs: dict[str, _State] = {}
        self.host: OrderedDict[bytes, BlockKV] = OrderedDict()  # G2, least recently used first
        self.host_capacity = host_capacity
        self.store: dict[bytes, BlockKV] = {}  # G3
        self.handoff: dict[bytes, BlockKV] = {}  # the handoff area: key -> page
        self.num_partial_loads = [0, 0]  # partial blocks loaded, recomputed instead
        self.host_events: list[HostEvent] = []  # not yet taken by the scheduler
        self.saves: list[KVSave] = []  # every save run, in order
        self.last_loads = (0, 0, 0)  # the last step's blocks loaded from G2, from G3, recomputed
        self.last_failed_loads: dict[str, int] = {}  # the last step's seq id -> blocks recomputed
        # seq id -> prompt tokens its first admission took from a cache (G1 or a load), not recomputed
        self.first_reused: dict[str, int] = {}

    def take_host_events(self) -> list[HostEvent]:
        events, self.host_events = self.host_events, []
        return events

    def clear_host(self) -> None:
        self.host.clear()
        self.host_events.append((False, []))

    def _save(self, save: KVSave) -> None:
        for block_id, block_hash in zip(
            unpack_tokens(save.block_ids), split_hashes(save.block_hashes), strict=True
        ):
            slots = range(block_id * self.block_size, (block_id + 1) * self.block_size)
            content = tuple(self.kv.get(slot) for slot in slots)
            assert None not in content, f"saving block {block_id}, never written"
            self.store[block_hash] = content
            if block_hash in self.host:
                self.host.move_to_end(block_hash)
                continue
            self.host[block_hash] = content
            self.host_events.append((True, [block_hash]))
            if len(self.host) > self.host_capacity:
                evicted, _ = self.host.popitem(last=False)
                self.host_events.append((False, [evicted]))
        self.saves.append(save)

    def _save_partial(self, partial: PartialSave) -> None:
        slots = range(partial.block_id * self.block_size, (partial.block_id + 1) * self.block_size)
        content = tuple(self.kv.get(slot) for slot in slots)
        assert content[0] is not None, f"saving partial block {partial.block_id}, never written"
        self.handoff[partial.key] = content

    def _load_partial(self, state: _State, load: KVLoad) -> None:
        """The page after the loaded full blocks, from the handoff area, or recomputed."""
        page = load.first_block + len(split_hashes(load.block_hashes))
        start = page * self.block_size
        assert start < state.num_computed < start + self.block_size, "a partial block that ends nothing"
        content = self.handoff.pop(load.partial_key, None)
        self.num_partial_loads[content is None] += 1
        for p in range(start, state.num_computed):
            value = content[p - start] if content is not None else hash(tuple(state.tokens[: p + 1]))
            self.kv[self._slot(state, p)] = value  # type: ignore[assignment]

    def _load(self, state: _State, load: KVLoad) -> tuple[int, int, int]:
        """Fill the loaded blocks from G2 or G3; from the first one in neither, recompute."""
        block_hashes = split_hashes(load.block_hashes)
        assert len(load.tiers) == len(block_hashes) and (block_hashes or load.partial_key)
        end = (load.first_block + len(block_hashes)) * self.block_size
        assert end <= state.num_computed, "loading blocks past the computed tokens"
        if load.partial_key:
            end = state.num_computed  # a failed block recomputes the partial one too
        num_host = num_store = 0
        for i, block_hash in enumerate(block_hashes):
            content = self.host.get(block_hash) or self.store.get(block_hash)
            if content is None:
                start = (load.first_block + i) * self.block_size
                for p in range(start, end):  # recompute: this block and every one after it
                    self.kv[self._slot(state, p)] = hash(tuple(state.tokens[: p + 1]))
                if load.partial_key:
                    self.handoff.pop(load.partial_key, None)  # after a gap: dropped
                    self.num_partial_loads[1] += 1
                return num_host, num_store, len(block_hashes) - i
            if block_hash in self.host:
                self.host.move_to_end(block_hash)
                num_host += 1
            else:
                num_store += 1
            block_id = state.table[load.first_block + i]
            for k, value in enumerate(content):
                assert value is not None
                self.kv[block_id * self.block_size + k] = value
        if load.partial_key:
            self._load_partial(state, load)
        return num_host, num_store, 0

    def _slot(self, state: _State, position: int) -> int:
        return state.table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, plan: SchedulerOutput) -> tuple[tuple[str, ...], list[int]]:
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for save in plan.kv_saves:  # before the forward, which may overwrite a freed block
            self._save(save)
        for partial in plan.partial_saves:
            self._save_partial(partial)
        for key in split_hashes(plan.handoff_drops):
            self.handoff.pop(key, None)
        loads = [0, 0, 0]
        failed: dict[str, int] = {}
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
            if new.kv_load is not None:
                counts = self._load(self.seqs[new.seq_id], new.kv_load)
                for k, n in enumerate(counts):
                    loads[k] += n
                if counts[2]:
                    failed[new.seq_id] = counts[2]
            num_reused = new.num_computed_tokens - failed.get(new.seq_id, 0) * self.block_size
            self.first_reused.setdefault(new.seq_id, min(num_reused, len(prompt)))
            rows.append((new.seq_id, new.num_scheduled_tokens))
        self.last_loads, self.last_failed_loads = (loads[0], loads[1], loads[2]), failed
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

    def __init__(self, block_size: int, host_capacity: int = 1 << 30) -> None:
        self.worker = FakeWorker(block_size, host_capacity)

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        seq_ids, sampled = self.worker.execute(plan)
        host, store, failed = self.worker.last_loads
        return ModelRunnerOutput(
            plan.step_id,
            seq_ids,
            pack_tokens(sampled),
            len(self.worker.seqs),
            num_loaded_host_blocks=host,
            num_loaded_store_blocks=store,
            num_failed_load_blocks=failed,
            failed_load_seq_ids=tuple(self.worker.last_failed_loads),
            failed_load_num_blocks=tuple(self.worker.last_failed_loads.values()),
        )

    def check_integrity(self) -> None:
        self.worker.check_integrity()
