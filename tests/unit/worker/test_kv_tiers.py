"""KV tiers through the real ModelRunner on the tiny random-weight model in fp32: a prompt whose
first blocks are loaded from G2, or from G3 (after a restart), gives the greedy tokens and top-5
logprobs (within 1e-5) of the same prompt computed cold. A block G3 cannot give soundly (corrupt,
truncated, of another model or another hash, missing) is reported, deleted and recomputed with
every block after it, to the same output; so is everything when the store cannot be written
(its writes stop, its reads go on).

Greedy tokens of the random model say little (it mostly repeats its last token), so the logprobs
of the runner-up tokens carry the check: ``test_the_check_sees_wrong_kv`` shows they move when a
sequence starts on blocks whose KV is not its own."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from libs.kvstore.block_file import BlockLayout, BlockMeta, block_path, write_block_file
from libs.kvstore.block_hash import hash_blocks
from libs.kvstore.retention import RetentionPolicy
from libs.models.llama import LlamaForCausalLM
from libs.protocol.codec import pack_tokens, unpack_floats, unpack_tokens
from libs.protocol.kv_messages import CacheTier, KVEvent, KVLoad, KVSave, RemovalReason, join_hashes
from libs.protocol.messages import ModelRunnerOutput, NewSequence, SamplingParams, SchedulerOutput
from services.worker import kv_tiers
from services.worker.config import Config
from services.worker.host_cache import HostCache
from services.worker.kv_cache import KVCache
from services.worker.kv_store import KVStore
from services.worker.kv_tiers import EventOutbox, KVTiers
from services.worker.main import build_kv_tiers, kv_store_root
from services.worker.model_runner import ModelRunner, ModelShape, PlanError
from tests.tiny_models import TINY_LLAMA

CONFIG = TINY_LLAMA
SHAPE = ModelShape.of(CONFIG)
BLOCK_SIZE = 4
NUM_BLOCKS = 32
FP = "tiny-0123456789abcdef"
STORE_LAYOUT = BlockLayout(CONFIG.kv_spec(), BLOCK_SIZE)
PROMPT = [5, 9, 3, 7, 1, 2, 8, 11, 12, 13, 14, 15, 16, 17]  # 3 full blocks, then 2 tokens
HASHES = hash_blocks(PROMPT, BLOCK_SIZE, FP)
NUM_DECODES = 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=5)
TABLE = [0, 1, 2, 3, 4, 5]  # the first run's pages
FRESH = [10, 11, 12, 13, 14, 15]  # a later run's pages: nothing of the first run is in them
NOW = 1_000_000.0
BLOCK_NUM_BYTES = SHAPE.kv_spec.bytes_per_block(BLOCK_SIZE, 4)


@dataclass
class Run:
    tokens: list[int]
    top_logprobs: list[float]
    first: ModelRunnerOutput  # the prefill step's output: load counters


def make_runner(model: LlamaForCausalLM, tiers: KVTiers | None = None) -> ModelRunner:
    return ModelRunner(model, SHAPE, NUM_BLOCKS, BLOCK_SIZE, torch.float32, kv_tiers=tiers)


def make_store(root: Path, **kwargs: Any) -> KVStore:
    return KVStore(root, FP, STORE_LAYOUT, torch.float32, RetentionPolicy(), clock=lambda: NOW, **kwargs)


def make_host(num_blocks: int = 16) -> HostCache:
    return HostCache(num_blocks, SHAPE.kv_spec.block_shape(BLOCK_SIZE), torch.float32)


def execute(runner: ModelRunner, plan: SchedulerOutput) -> ModelRunnerOutput:
    runner.prefetch(plan)  # as the service does, before the step's turn
    out = runner.execute(plan)
    runner.check_integrity()
    if runner.kv_tiers is not None:
        runner.kv_tiers.check_integrity()
    return out


def serve(
    runner: ModelRunner,
    table: list[int],
    num_loaded: int = 0,
    first_block: int = 0,
    save: bool = False,
    seq_id: str = "s",
) -> Run:
    """PROMPT on ``table``: its first ``num_loaded`` blocks loaded (from ``first_block`` on; those
    before are G1 hits), then decodes; the last plan finishes it and, with ``save``, saves its
    full prompt blocks."""
    num_computed = (first_block + num_loaded) * BLOCK_SIZE
    kv_load = None
    if num_loaded:
        kv_load = KVLoad(first_block, join_hashes(HASHES[first_block : first_block + num_loaded]))
    new = NewSequence(
        seq_id,
        pack_tokens(PROMPT),
        b"",
        PARAMS,
        (),
        pack_tokens(table),
        num_computed,
        len(PROMPT) - num_computed,
        kv_load,
    )
    outputs = [execute(runner, SchedulerOutput(1, (new,)))]
    for step in range(NUM_DECODES):
        plan = SchedulerOutput(2 + step, (), (seq_id,), pack_tokens([1]), (b"",))
        outputs.append(execute(runner, plan))
    saves = (KVSave(pack_tokens(table[:3]), join_hashes(HASHES), "chat"),) if save else ()
    execute(runner, SchedulerOutput(99, finished_seq_ids=(seq_id,), kv_saves=saves))
    tokens = [t for out in outputs for t in unpack_tokens(out.sampled_token_ids)]
    top = [
        x for out in outputs for lp in out.logprobs if lp is not None for x in unpack_floats(lp.top_logprobs)
    ]
    return Run(tokens, top, outputs[0])


@pytest.fixture(scope="module")
def cold(model: LlamaForCausalLM) -> Run:
    return serve(make_runner(model), TABLE)


def assert_same(run: Run, cold: Run) -> None:
    assert run.tokens == cold.tokens
    assert run.top_logprobs == pytest.approx(cold.top_logprobs, abs=1e-5)


@pytest.fixture(scope="module")
def stored(model: LlamaForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A G3 store holding PROMPT's 3 full blocks, written by a worker that has since exited."""
    root = tmp_path_factory.mktemp("store")
    tiers = KVTiers(None, make_store(root))
    serve(make_runner(model, tiers), TABLE, save=True)
    tiers.close()
    return root


def test_the_check_sees_wrong_kv(model: LlamaForCausalLM, cold: Run) -> None:
    """Starting on 3 zeroed blocks (claimed computed, never loaded) changes the logprobs."""
    runner = make_runner(model)
    new = NewSequence("s", pack_tokens(PROMPT), b"", PARAMS, (), pack_tokens(FRESH), 12, 2)
    out = runner.execute(SchedulerOutput(1, (new,)))
    assert out.logprobs[0] is not None
    got = unpack_floats(out.logprobs[0].top_logprobs)
    assert got != pytest.approx(cold.top_logprobs[: len(got)], abs=1e-3)


def test_blocks_saved_to_g2_load_into_fresh_pages_and_match_cold(model: LlamaForCausalLM, cold: Run) -> None:
    tiers = KVTiers(make_host(), None)
    runner = make_runner(model, tiers)
    assert_same(serve(runner, TABLE, save=True), cold)
    assert tiers.dump() == HASHES
    events = tiers.drain_events()
    assert events == [
        KVEvent(
            CacheTier.HOST,
            True,
            join_hashes(HASHES),
            num_bytes=SHAPE.kv_spec.bytes_per_block(4, 4),
        )
    ]
    warm = serve(make_runner(model, tiers), FRESH, num_loaded=3)  # another runner: empty pages
    assert_same(warm, cold)
    assert (warm.first.num_loaded_host_blocks, warm.first.num_loaded_store_blocks) == (3, 0)
    # G1 hit on the first block (the finished sequence's page still holds it), G2 for the others
    table = [TABLE[0], *FRESH[1:]]
    assert_same(serve(runner, table, num_loaded=2, first_block=1, seq_id="t"), cold)
    assert tiers.num_loaded_host_blocks == 5 and not tiers.failed_load_blocks


@pytest.mark.parametrize("with_host", [False, True])
def test_blocks_load_from_g3_after_a_restart(
    model: LlamaForCausalLM, cold: Run, stored: Path, tmp_path: Path, with_host: bool
) -> None:
    root = tmp_path / "store"
    shutil.copytree(stored, root)
    tiers = KVTiers(make_host() if with_host else None, make_store(root))
    warm = serve(make_runner(model, tiers), FRESH, num_loaded=3)
    assert_same(warm, cold)
    assert (warm.first.num_loaded_store_blocks, warm.first.num_failed_load_blocks) == (3, 0)
    assert warm.first.failed_load_seq_ids == warm.first.failed_load_num_blocks == ()
    if with_host:  # a G3 hit is kept in G2, and the next load comes from there
        assert tiers.dump() == HASHES
        assert tiers.drain_events()[0] == KVEvent(
            CacheTier.HOST, True, join_hashes(HASHES), num_bytes=BLOCK_NUM_BYTES
        )
        again = serve(make_runner(model, tiers), FRESH, num_loaded=3)
        assert (again.first.num_loaded_host_blocks, again.first.num_loaded_store_blocks) == (3, 0)
        assert_same(again, cold)
    tiers.close()


def corrupt_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def foreign_model(path: Path) -> None:
    """A sound file of another model at this model's path for the block."""
    meta = BlockMeta(HASHES[1], "other-model", STORE_LAYOUT, "float32", "agent", NOW, NOW + 1)
    write_block_file(path, meta, bytes(BLOCK_NUM_BYTES))


def wrong_hash(path: Path) -> None:
    """Block 0's sound file where block 1's should be."""
    shutil.copyfile(block_path(path.parents[3], FP, HASHES[0]), path)


SPOILERS: dict[str, tuple[Callable[[Path], None], RemovalReason]] = {
    "corrupt payload": (corrupt_payload, RemovalReason.CORRUPT),
    "truncated": (truncate, RemovalReason.CORRUPT),
    "foreign model": (foreign_model, RemovalReason.CORRUPT),
    "wrong hash": (wrong_hash, RemovalReason.CORRUPT),
    "missing": (Path.unlink, RemovalReason.MISSING),
}


@pytest.mark.parametrize("spoiler", list(SPOILERS))
def test_a_bad_g3_block_is_reported_deleted_and_recomputed_with_the_rest(
    model: LlamaForCausalLM, cold: Run, stored: Path, tmp_path: Path, spoiler: str
) -> None:
    root = tmp_path / "store"
    shutil.copytree(stored, root)
    spoil, reason = SPOILERS[spoiler]
    bad = block_path(root, FP, HASHES[1])
    spoil(bad)
    tiers = KVTiers(make_host(), make_store(root))
    warm = serve(make_runner(model, tiers), FRESH, num_loaded=3)
    assert_same(warm, cold)
    first = warm.first
    assert (first.num_loaded_store_blocks, first.num_failed_load_blocks) == (1, 2)
    assert (first.failed_load_seq_ids, first.failed_load_num_blocks) == (("s",), (2,))
    assert not bad.exists() and block_path(root, FP, HASHES[2]).exists()
    events = tiers.drain_events()
    assert KVEvent(CacheTier.STORE, False, HASHES[1], reason) in events
    assert tiers.dump() == HASHES[:1]  # only the sound block reached G2
    assert sum(tiers.failed_load_blocks.values()) == 2
    tiers.close()


def test_a_long_g3_load_goes_through_the_staging_buffer_whole_and_g2_keeps_its_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More blocks than one staging chunk, G2 smaller than the load: every page gets its own
    block exactly, and G2 keeps the chain's first blocks (a later chunk never evicts them)."""
    monkeypatch.setattr(kv_tiers, "STAGING_MAX_BYTES", 4 * BLOCK_NUM_BYTES)  # 4 blocks a chunk
    chunk = KVTiers.staging_blocks(torch.empty(SHAPE.kv_spec.block_shape(BLOCK_SIZE)))
    assert chunk == 4
    num_blocks = chunk + 6
    source = KVCache(SHAPE.kv_spec, num_blocks, BLOCK_SIZE, torch.float32)
    for pages in (page for plane in source.planes for page in plane):
        pages.normal_()
    hashes = hash_blocks(list(range(num_blocks * BLOCK_SIZE)), BLOCK_SIZE, FP)
    writer = KVTiers(None, make_store(tmp_path))
    writer.save(source, KVSave(pack_tokens(list(range(num_blocks))), join_hashes(hashes)))
    writer.flush()
    num_host_blocks = chunk + 2
    reader = KVTiers(make_host(num_host_blocks), make_store(tmp_path))
    target = KVCache(SHAPE.kv_spec, 2 * num_blocks, BLOCK_SIZE, torch.float32)
    pages = list(range(2 * num_blocks - 1, num_blocks - 1, -1))  # other pages, in another order
    result = reader.load(target, pages, hashes)
    assert (result.num_store_blocks, result.num_failed_blocks) == (num_blocks, 0)
    assert torch.equal(target.gather_blocks(pages), source.gather_blocks(range(num_blocks)))
    assert reader.host is not None
    assert [h in reader.host for h in hashes] == [True] * num_host_blocks + [False] * 4
    kept = reader.host.gather(hashes[:num_host_blocks])  # G2 holds each block's own KV
    assert torch.equal(kept, source.gather_blocks(range(num_host_blocks)))
    reader.check_integrity()
    writer.close()
    reader.close()


def test_without_tiers_every_load_is_recomputed(model: LlamaForCausalLM, cold: Run) -> None:
    run = serve(make_runner(model), FRESH, num_loaded=3)
    assert_same(run, cold)
    assert run.first.num_failed_load_blocks == 3


def test_a_load_beyond_the_computed_tokens_is_a_plan_error(model: LlamaForCausalLM) -> None:
    runner = make_runner(model)
    kv_load = KVLoad(0, join_hashes(HASHES))
    new = NewSequence("s", pack_tokens(PROMPT), b"", PARAMS, (), pack_tokens(FRESH), 8, 6, kv_load)
    with pytest.raises(PlanError, match="kv_load"):
        runner.execute(SchedulerOutput(1, (new,)))


def enospc(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("failure", ["root is a file", "disk full"])
def test_an_unwritable_store_warns_once_and_serving_goes_on(
    model: LlamaForCausalLM, cold: Run, tmp_path: Path, caplog: pytest.LogCaptureFixture, failure: str
) -> None:
    if failure == "root is a file":
        root = tmp_path / "file"
        root.write_bytes(b"x")
        store = make_store(root)
    else:
        store = make_store(tmp_path / "store", write_file=enospc)
    tiers = KVTiers(make_host(), store)
    with caplog.at_level(logging.WARNING):
        assert_same(serve(make_runner(model, tiers), TABLE, save=True), cold)
        tiers.flush()
        assert_same(serve(make_runner(model, tiers), FRESH, num_loaded=3, save=True), cold)  # G2 serves
        tiers.flush()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "serving on without G3 writes" in warnings[0]
    assert not store.writable and tiers.num_loaded_host_blocks == 3
    assert ("writable", "G3", 0.0) in [(c.name, c.label, c.value) for c in tiers.stats()]
    restarted = KVTiers(None, store)  # G2 gone, nothing ever reached G3: everything is recomputed
    run = serve(make_runner(model, restarted), FRESH, num_loaded=3)
    assert_same(run, cold)
    assert run.first.num_failed_load_blocks == 3
    tiers.close()


def test_events_come_in_the_order_the_tiers_changed(model: LlamaForCausalLM, tmp_path: Path) -> None:
    tiers = KVTiers(make_host(num_blocks=2), make_store(tmp_path))
    runner = make_runner(model, tiers)
    serve(runner, TABLE)  # fills pages 0..2
    num_bytes = BLOCK_NUM_BYTES
    execute(
        runner, SchedulerOutput(10, kv_saves=(KVSave(pack_tokens([0, 1]), join_hashes(HASHES[:2]), "chat"),))
    )
    tiers.flush()
    execute(runner, SchedulerOutput(11, kv_saves=(KVSave(pack_tokens([2]), HASHES[2]),)))
    tiers.flush()
    events = tiers.drain_events()
    stored = [e for e in events if e.tier is CacheTier.STORE]
    file_sizes = [block_path(tmp_path, FP, h).stat().st_size for h in HASHES]
    assert events == [
        KVEvent(CacheTier.HOST, True, join_hashes(HASHES[:2]), num_bytes=num_bytes),
        *stored[:2],
        KVEvent(CacheTier.HOST, False, HASHES[0], RemovalReason.CAPACITY),
        KVEvent(CacheTier.HOST, True, HASHES[2], num_bytes=num_bytes),
        stored[2],
    ]
    assert [e.block_hashes for e in stored] == HASHES
    week, three_days = 7 * 86_400.0, 3 * 86_400.0
    assert [(e.retention_class, e.expires_at) for e in stored] == [
        ("chat", NOW + week),
        ("chat", NOW + week),
        ("agent", NOW + three_days),
    ]
    assert [e.num_bytes for e in stored] == file_sizes and all(e.stored for e in stored)
    assert tiers.dump() == HASHES[1:] and tiers.drain_events() == []
    counters = {(c.name, c.label): c.value for c in tiers.stats()}
    assert counters[("stored_blocks", "G2")] == 3 and counters[("evicted_blocks", "G2")] == 1
    assert counters[("stored_blocks", "G3")] == 3 and counters[("stored_bytes", "G3")] == sum(file_sizes)
    # Saved again as "chat": the file keeps its header, the event claims the stronger class.
    execute(runner, SchedulerOutput(12, kv_saves=(KVSave(pack_tokens([2]), HASHES[2], "chat"),)))
    tiers.flush()
    assert tiers.drain_events() == [
        KVEvent(CacheTier.STORE, True, HASHES[2], None, "chat", NOW + week, file_sizes[2])
    ]
    assert [c.value for c in tiers.stats() if (c.name, c.label) == ("present_blocks", "G3")] == [1]
    tiers.close()


def test_the_outbox_keeps_each_thread_s_order() -> None:
    outbox = EventOutbox()

    def add(thread: int) -> None:
        for i in range(200):
            outbox.add(KVEvent(CacheTier.STORE, True, bytes([thread, i % 256]) * 16, num_bytes=i))

    threads = [threading.Thread(target=add, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    drained: list[KVEvent] = []
    while any(t.is_alive() for t in threads):
        drained += outbox.drain()
    for t in threads:
        t.join()
    drained += outbox.drain()
    assert len(drained) == 800
    for thread in range(4):
        mine = [e.num_bytes for e in drained if e.block_hashes[0] == thread]
        assert mine == list(range(200))


def test_config_sizes_g2_and_places_g3(tmp_path: Path) -> None:
    layout = SHAPE.kv_spec
    fraction = 10 * BLOCK_NUM_BYTES / 2**30  # room for 10 blocks
    config = Config(block_size=BLOCK_SIZE, host_cache_gb=fraction, default_retention_class="chat")
    tiers = build_kv_tiers(config, str(tmp_path), FP, layout, torch.float32)
    assert tiers is not None and tiers.host is not None and tiers.store is not None
    assert tiers.host.num_blocks == 10 and tiers.store.root == tmp_path / "kv-store"
    assert tiers.store.layout == STORE_LAYOUT and tiers.store.policy.default.name == "chat"
    tiers.close()
    assert kv_store_root("none", str(tmp_path)) is None
    assert kv_store_root("~/kv", str(tmp_path)) == Path.home() / "kv"
    off = Config(block_size=BLOCK_SIZE, host_cache_gb=0, kv_store_path="none")
    assert build_kv_tiers(off, str(tmp_path), FP, layout, torch.float32) is None
