"""The lower KV tiers as one worker's scheduler core sees them: admission hits past the G1 prefix
cache, the saves queued at store points, the worker's host-memory (G2) content, and per-tier
counters. Pure: no nats, asyncio or torch.

G2 is a set of block hashes kept from the worker's HOST events (``note_host_blocks``); G3 is per
sequence, ``Sequence.num_stored_blocks``: the leading blocks of its prompt chain that the shared
store held when it was submitted. Both are hints. A block the worker cannot load (G2 evicted it,
the G3 file is gone or corrupt) it recomputes in the same step, so a stale hint costs compute,
never correctness, and the plan's accounting holds either way.

Admission: after the G1 hit of n1 blocks, the consecutive blocks j = n1.. that G2 holds or that
are among the sequence's stored ones (never the block holding its last token) count as computed;
its NewSequence carries them as a ``KVLoad``, G2 preferred over G3.

P/D handoff: a prefilled request leaving its prefill worker saves its partial last prompt block
(no chained hash: never a tier's) to the handoff area under a key of its own; the decode worker's
admission loads it after the prompt's full blocks, or the file is dropped (``drop_partial``).

Store points (DeepSeek's: the end of the user input and the end of the model output, so that the
next turn of a conversation hits): a sequence's full prompt blocks are queued for saving when the
plan that computes its last prompt token is made, and all its full blocks whose KV the plans made
so far compute when it finishes (stop, length, abort; not error, not preemption). A sequence never
saves a block twice (``Sequence.num_saved_blocks``); hashes G2 already holds are skipped (the
worker dedups G3 itself). A save queued while a plan is made, or between plans, rides in the NEXT
plan (``take_saves`` at the start of ``schedule``); the worker runs it before that plan's forward.

NOTE: why saving blocks that are already freed is safe. Every block in a save holds KV that a plan
made before the save was queued computes; the worker runs plans in the order they are made, so
that plan has run when the save (in a later plan) runs. A finished sequence's blocks are freed at
once, and a freed block is handed out again only by allocation in a plan made after the free, that
is the plan carrying the save or a later one. The worker saves before that plan's forward, so the
save reads the block before any forward overwrites it, with two plans in flight as with one (a
plan in flight when the sequence finished was made before the free, and writes into its blocks
only the KV of tokens the save counts as computed). A plan that carries only saves is still sent.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from libs.protocol.codec import pack_tokens, unpack_tokens
from libs.protocol.kv_messages import (
    HASH_NUM_BYTES,
    CacheTier,
    KVEvent,
    KVLoad,
    KVSave,
    PartialSave,
    RemovalReason,
    TierCounter,
    join_hashes,
    split_hashes,
)
from libs.protocol.messages import ImageSpan
from services.scheduler.limits import Limits
from services.scheduler.prefix_cache import BlockHasher, PrefixCache, PrefixCacheStats
from services.scheduler.sequence import Sequence

TIER_LABELS = {CacheTier.DEVICE: "G1", CacheTier.HOST: "G2", CacheTier.STORE: "G3"}


@dataclass(slots=True)
class TierStats:
    """Counters since start. Admission records a query, its G1 hit and its planned loads; the
    worker reports what it actually loaded, which makes the G2 and G3 hits. The hit rate of a
    tier is its hit tokens over the query tokens."""

    num_queries: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: dict[CacheTier, int] = field(default_factory=lambda: dict.fromkeys(CacheTier, 0))
    num_planned_blocks: dict[CacheTier, int] = field(
        default_factory=lambda: {CacheTier.HOST: 0, CacheTier.STORE: 0}
    )
    num_saves: int = 0  # KVSave messages sent
    num_saved_blocks: dict[str, int] = field(default_factory=dict)  # retention class -> blocks
    num_loaded_host_blocks: int = 0  # worker-reported
    num_loaded_store_blocks: int = 0
    num_failed_load_blocks: int = 0  # planned loads the worker recomputed instead
    num_partial_saves: int = 0  # P/D handoffs' partial blocks sent to the handoff area
    num_loaded_partial_blocks: int = 0  # worker-reported: read back from it by a decode worker
    num_failed_partial_blocks: int = 0  # ... or recomputed instead

    def counters(self) -> dict[tuple[str, str], float]:
        """(name, label) -> value."""
        out: dict[tuple[str, str], float] = {
            ("queries", "all"): self.num_queries,
            ("query_tokens", "all"): self.num_query_tokens,
            ("saves", "all"): self.num_saves,
            ("loaded_blocks", "G2"): self.num_loaded_host_blocks,
            ("loaded_blocks", "G3"): self.num_loaded_store_blocks,
            ("failed_load_blocks", "all"): self.num_failed_load_blocks,
            ("partial_saves", "all"): self.num_partial_saves,
            ("loaded_partial_blocks", "all"): self.num_loaded_partial_blocks,
            ("failed_partial_blocks", "all"): self.num_failed_partial_blocks,
        }
        for tier, tokens in self.num_hit_tokens.items():
            out["hit_tokens", TIER_LABELS[tier]] = tokens
        for tier, num_blocks in self.num_planned_blocks.items():
            out["planned_load_blocks", TIER_LABELS[tier]] = num_blocks
        for retention_class, num_blocks in self.num_saved_blocks.items():
            out["saved_blocks", retention_class or "default"] = num_blocks
        return out


def to_counters(values: dict[tuple[str, str], float]) -> tuple[TierCounter, ...]:
    return tuple(TierCounter(name, label, value) for (name, label), value in sorted(values.items()))


class TierPlanner:
    """One worker's G2 view, pending saves and tier counters, next to its BlockManager: it plans
    the loads and saves that the worker's ``KVTiers`` carries out."""

    def __init__(self, limits: Limits, hasher: BlockHasher, prefix_cache: PrefixCache) -> None:
        self.block_size = limits.block_size
        self._hasher = hasher
        self._prefix_cache = prefix_cache
        self._use_prefix_cache = limits.enable_prefix_caching
        # G2/G3 hold the same hashed blocks as G1: without hashes there is nothing to look up
        self.enabled = limits.enable_prefix_caching and limits.enable_kv_tiers
        self._host: set[bytes] = set()  # hashes the worker's G2 holds, as its events last said
        self._pending_saves: list[tuple[str, KVSave]] = []  # (seq id, save) for the next plan
        self._pending_partials: list[PartialSave] = []  # handoffs' partial blocks, for the next plan
        self._pending_drops: list[bytes] = []  # handoff-area keys to delete, for the next plan
        self.stats = TierStats()

    @property
    def model_fingerprint(self) -> str:
        return self._hasher.model_fingerprint

    # --- G2 content ------------------------------------------------------------------------

    @property
    def num_host_blocks(self) -> int:
        return len(self._host)

    def note_host_blocks(
        self, stored: Iterable[bytes] = (), removed: Iterable[bytes] = (), cleared: bool = False
    ) -> None:
        """The worker's G2 changed: ``cleared`` empties it first (a CLEARED event, or a dump that
        replaces it: pass the dump's hashes as ``stored``), then ``removed`` go and ``stored`` come."""
        if not self.enabled:
            return
        if cleared:
            self._host.clear()
        self._host.difference_update(removed)
        self._host.update(stored)

    def note_host_event(self, event: KVEvent) -> None:
        """One event of the worker's, applied to the G2 view (other tiers are not this view's:
        G3 is kvcache's, G1 this core's own). Raises ValueError on malformed hashes."""
        if event.tier is not CacheTier.HOST:
            return
        block_hashes = split_hashes(event.block_hashes)
        if event.stored:
            self.note_host_blocks(stored=block_hashes)
        elif event.reason is RemovalReason.CLEARED and not block_hashes:
            self.note_host_blocks(cleared=True)  # everything this worker held in G2 is gone
        else:
            self.note_host_blocks(removed=block_hashes)

    # --- admission -------------------------------------------------------------------------

    def prompt_chain(self, prompt: Seq[int], tenant: str, spans: Seq[ImageSpan] = ()) -> list[bytes]:
        """The hashes of the prompt blocks admission may reuse (never the last token's block);
        empty with prefix caching off. ``spans``: the prompt's images."""
        if not self._use_prefix_cache:
            return []
        num_blocks = max(0, len(prompt) - 1) // self.block_size
        return self._hasher.chain(prompt[: num_blocks * self.block_size], tenant, spans)

    def num_reusable_blocks(self, block_hashes: Seq[bytes]) -> int:
        """Leading blocks of a chain this worker holds in G1 or G2 (routing; no side effects)."""
        n = len(self._prefix_cache.lookup(block_hashes, len(block_hashes)))
        while self.enabled and n < len(block_hashes) and block_hashes[n] in self._host:
            n += 1
        return n

    def extend_hit(self, seq: Sequence, first_block: int, max_blocks: int) -> KVLoad | None:
        """Blocks ``first_block ..`` (after the G1 hit) that G2 or G3 hold, as a load; None if none.
        ``seq.block_hashes`` holds at least ``max_blocks`` hashes."""
        if not self.enabled:
            return None
        tiers = bytearray()
        for j in range(first_block, max_blocks):
            if seq.block_hashes[j] in self._host:
                tiers.append(CacheTier.HOST)
            elif j < seq.num_stored_blocks:
                tiers.append(CacheTier.STORE)
            else:
                break
        if not tiers:
            return None
        hashes = seq.block_hashes[first_block : first_block + len(tiers)]
        return KVLoad(first_block, join_hashes(hashes), bytes(tiers))

    def record_hit(self, num_tokens: int, num_hit_tokens: int, load: KVLoad | None) -> int:
        """Count an admission that asked the caches; returns the tokens G1 held."""
        num_loaded = {CacheTier.HOST: 0, CacheTier.STORE: 0}
        for tier in load.tiers if load is not None else b"":
            num_loaded[CacheTier(tier)] += 1
        num_device_tokens = num_hit_tokens - sum(num_loaded.values()) * self.block_size
        self.stats.num_queries += 1
        self.stats.num_query_tokens += num_tokens
        self.stats.num_hit_tokens[CacheTier.DEVICE] += num_device_tokens
        for tier, num_blocks in num_loaded.items():
            self.stats.num_planned_blocks[tier] += num_blocks
        return num_device_tokens

    def record_loads(self, num_host_blocks: int, num_store_blocks: int, num_failed_blocks: int) -> None:
        """What the worker loaded (or recomputed instead) for one step's new sequences."""
        self.stats.num_loaded_host_blocks += num_host_blocks
        self.stats.num_loaded_store_blocks += num_store_blocks
        self.stats.num_failed_load_blocks += num_failed_blocks
        self.stats.num_hit_tokens[CacheTier.HOST] += num_host_blocks * self.block_size
        self.stats.num_hit_tokens[CacheTier.STORE] += num_store_blocks * self.block_size

    # --- store points ----------------------------------------------------------------------

    @property
    def has_pending_saves(self) -> bool:
        return bool(self._pending_saves or self._pending_partials or self._pending_drops)

    def queue_save(self, seq: Sequence, block_table: Seq[int], num_blocks: int) -> None:
        """Save ``seq``'s first ``num_blocks`` full blocks (their KV computed by plans made so far)
        in the next plan, less those it saved before and those G2 holds."""
        if not self.enabled or num_blocks <= seq.num_saved_blocks:
            return
        first, end = seq.loaded_blocks
        wanted = [i for i in range(seq.num_saved_blocks, num_blocks) if not first <= i < end]
        self._queue(seq, block_table, num_blocks, wanted)
        seq.num_saved_blocks = num_blocks

    def recomputed(self, seq: Sequence, block_table: Seq[int], num_blocks: int) -> None:
        """The worker failed to load the last ``num_blocks`` blocks of ``seq``'s admission load
        and computed them (in the step that said so): they are no tier's, so they are saved like
        computed ones, now if its saves have passed them already."""
        first, end = seq.loaded_blocks
        restart = max(first, end - num_blocks)
        seq.loaded_blocks = (first, restart)
        if self.enabled and seq.num_saved_blocks > restart:
            # (G2's view said it held some of these, wrongly: the load failed; the worker dedups)
            blocks = list(range(restart, min(end, seq.num_saved_blocks)))
            self._queue(seq, block_table, end, blocks, skip_held=False)

    def _queue(
        self, seq: Sequence, block_table: Seq[int], num_blocks: int, wanted: list[int], skip_held: bool = True
    ) -> None:
        """A save of ``seq``'s blocks ``wanted`` (among its first ``num_blocks``), less those G2
        holds (``skip_held``)."""
        block_hashes = self._hasher.extend(seq, num_blocks)
        if skip_held:
            wanted = [i for i in wanted if block_hashes[i] not in self._host]
        if not wanted:
            return
        save = KVSave(
            block_ids=pack_tokens([block_table[i] for i in wanted]),
            block_hashes=join_hashes([block_hashes[i] for i in wanted]),
            retention_class=seq.retention_class,
        )
        self._pending_saves.append((seq.seq_id, save))

    def take_saves(self) -> tuple[KVSave, ...]:
        """The saves for the plan being made: everything queued before it (counted as sent)."""
        saves, self._pending_saves = tuple(save for _, save in self._pending_saves), []
        saved = self.stats.num_saved_blocks
        for save in saves:
            self.stats.num_saves += 1
            num_blocks = len(unpack_tokens(save.block_ids))
            saved[save.retention_class] = saved.get(save.retention_class, 0) + num_blocks
        return saves

    # --- P/D handoff: the partial last prompt block ------------------------------------------

    def queue_partial_save(self, seq: Sequence, block_table: Seq[int]) -> bool:
        """Save ``seq``'s partial last prompt block to the handoff area in the next plan, under a
        key of its own (``seq.partial_key``); False when there is none (a prompt of whole blocks)
        or its KV is not computed. Queued with the full blocks' saves, before the sequence's
        blocks are freed: see the module's note on why that is safe."""
        num_full, num_left = divmod(seq.num_prompt_tokens, self.block_size)
        if not self.enabled or not num_left or seq.num_computed_tokens < seq.num_prompt_tokens:
            return False
        seq.partial_key = secrets.token_bytes(HASH_NUM_BYTES)  # one handoff's, never reused
        self._pending_partials.append(PartialSave(block_table[num_full], seq.partial_key))
        self.stats.num_partial_saves += 1
        return True

    def extend_with_partial(self, seq: Sequence, num_blocks: int, load: KVLoad | None) -> KVLoad | None:
        """Admission of a handed-off ``seq`` whose first ``num_blocks`` blocks count as computed:
        when they are the prompt's full blocks, its partial block comes from the handoff area
        (the load carries its key, and ``seq.num_computed_tokens`` should cover the prompt); else
        it is recomputed and its file dropped. Returns the load to plan."""
        if not seq.partial_key:
            return load
        at_prompt_end = num_blocks == seq.num_prompt_tokens // self.block_size
        if not (at_prompt_end and seq.num_output_tokens and self.enabled):  # (it samples after it)
            self.drop_partial(seq)
            return load
        if load is None:
            return KVLoad(num_blocks, b"", b"", partial_key=seq.partial_key)
        return dataclasses.replace(load, partial_key=seq.partial_key)

    def drop_partial(self, seq: Sequence) -> None:
        """No plan will load ``seq``'s partial block: its file goes with this worker's next plan."""
        if seq.partial_key:
            self.queue_drops([seq.partial_key])
            seq.partial_key = b""

    def queue_drops(self, keys: Iterable[bytes]) -> None:
        self._pending_drops.extend(keys)

    def take_drops(self) -> list[bytes]:
        """The drops not sent yet: a worker that is lost hands them to another (the area is shared)."""
        drops, self._pending_drops = self._pending_drops, []
        return drops

    def take_handoff(self) -> tuple[tuple[PartialSave, ...], bytes]:
        """The partial saves and the drops for the plan being made."""
        partials, self._pending_partials = tuple(self._pending_partials), []
        return partials, b"".join(self.take_drops())

    def record_partial_loads(self, num_loaded: int, num_failed: int) -> None:
        self.stats.num_loaded_partial_blocks += num_loaded
        self.stats.num_failed_partial_blocks += num_failed

    def discard_saves_of(self, seq: Sequence) -> None:
        """``seq`` failed: the KV of its queued saves may never have been written."""
        self._pending_saves = [(seq_id, s) for seq_id, s in self._pending_saves if seq_id != seq.seq_id]

    def discard_saves(self) -> None:
        """The worker is gone, and its blocks with it (take its drops first: see ``take_drops``)."""
        self._pending_saves = []
        self._pending_partials = []
        self._pending_drops = []

    def counters(self) -> dict[tuple[str, str], float]:
        """This core's counters, (name, label) -> value, for KVCacheStats."""
        counters = self.stats.counters()
        counters["evicted_blocks", "G1"] = self._prefix_cache.stats.num_evicted_blocks
        return counters

    def check_integrity(self, g1_stats: PrefixCacheStats, num_blocks: int) -> None:
        stats = self.stats
        assert stats.num_queries == g1_stats.num_queries, "G1 and tier stats count other queries"
        assert stats.num_hit_tokens[CacheTier.DEVICE] == g1_stats.num_hit_tokens, "G1 hits disagree"
        assert sum(stats.num_hit_tokens.values()) <= stats.num_query_tokens, "more hits than queried"
        assert all(n % self.block_size == 0 for n in stats.num_hit_tokens.values())
        num_done = stats.num_loaded_host_blocks + stats.num_loaded_store_blocks + stats.num_failed_load_blocks
        assert num_done <= sum(stats.num_planned_blocks.values()), "more loads than planned"
        assert self.enabled or not (self._host or self._pending_saves), "tiers off, yet in use"
        assert all(0 <= p.block_id < num_blocks for p in self._pending_partials), (
            "a partial save names no block"
        )
        assert all(len(k) == HASH_NUM_BYTES for k in self._pending_drops), "a drop's key has the wrong size"
        for _, save in self._pending_saves:
            block_ids, block_hashes = unpack_tokens(save.block_ids), split_hashes(save.block_hashes)
            assert len(block_ids) == len(block_hashes) > 0, "a save's ids and hashes differ"
            for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
                assert 0 <= block_id < num_blocks, "a save names no block"
                # Until the plan that carries it is made, a saved block is handed out to nobody
                # else: if it is cached, then under the hash it is saved under.
                assert self._prefix_cache.hash_of(block_id) in (None, block_hash), "a saved block was reused"
