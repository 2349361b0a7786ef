"""The scheduler core's invariants, checked after every step by tests and the local engine:
queues agree with statuses, blocks are held only by running sequences, and cached blocks hold
the prefix they are hashed under. Pure: no nats, asyncio or torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.scheduler.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from services.scheduler.worker_scheduler import WorkerScheduler


def check_integrity(core: WorkerScheduler) -> None:
    core.block_manager.check_integrity()
    core.kv_tiers.check_integrity(core.prefix_cache_stats, core.limits.num_blocks)
    running = {s.seq_id for s in core.seqs.values() if s.status is SequenceStatus.RUNNING}
    assert running == {s.seq_id for s in core._running}, "running list disagrees with statuses"
    assert len(running) <= core.limits.max_num_seqs
    assert [s.order for s in core._running] == sorted(s.order for s in core._running)
    assert set(core.block_manager.block_tables) <= running, "a waiting or paused sequence holds blocks"
    waiting = {s.seq_id for s in core.seqs.values() if s.status is SequenceStatus.WAITING}
    assert waiting == set(core._waiting), "waiting queue disagrees with statuses"
    core._waiting.check_integrity()
    bs = core.limits.block_size
    for seq in core.seqs.values():
        assert 0 <= seq.num_pending_tokens <= 2, "more than two plans in flight"
        assert seq.num_saved_blocks * bs <= seq.num_tokens, "saved a block that is not full"
        table = core.block_manager.block_tables.get(seq.seq_id, [])
        assert len(table) * bs >= seq.num_computed_tokens, "computed tokens outside the table"
        if seq.status is not SequenceStatus.RUNNING:
            assert seq.num_computed_tokens == 0 and seq.prompt_done_step == 0
        _check_cached_blocks(core, seq)
    assert not set(core._finished_since_plan) & running, "a running sequence is to be dropped"
    core.speculator.check_integrity(set(core.seqs))
    for seq in core.seqs.values():
        assert not seq.draft_token_ids or seq.num_pending_tokens == 1, "drafts with no plan in flight"


def _check_cached_blocks(core: WorkerScheduler, seq: Sequence) -> None:
    """Its hash chain is that of its tokens, and a cached block of its table holds its prefix."""
    if seq.status is not SequenceStatus.RUNNING:
        return  # holds no blocks, and its tokens (so its chain) do not change while it waits
    core._hasher.check(seq)
    bm, bs = core.block_manager, core.limits.block_size
    num_known = min(seq.num_computed_tokens, seq.num_tokens)
    assert bm.num_cached_blocks_of(seq.seq_id) * bs <= num_known, "cached a block not computed"
    for i, block_id in enumerate(bm.block_tables[seq.seq_id]):
        block_hash = bm.prefix_cache.hash_of(block_id)
        if block_hash is not None:
            assert (i + 1) * bs <= seq.num_computed_tokens, "a cached block is still to be written"
            if i < len(seq.block_hashes):
                assert block_hash == seq.block_hashes[i], "a block is cached under another prefix"
