"""The P/D handoff area through two real ModelRunners on the tiny random-weight model in fp32: a
prefill runner computes PROMPT (3 full blocks, then 2 tokens), samples its first token and, in the
plan that drops it, saves the full blocks to G3 and the partial last block to the handoff area,
before that plan's forward reuses the page. A decode runner with fresh pages loads all of it and
computes only the first output token: its tokens and top-5 logprobs equal the prompt served cold
on one runner. A partial block that is missing, corrupt or after a failed full block is recomputed
to the same output, and no handoff file outlives its load, its drop or its age."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from libs.models.llama import LlamaForCausalLM
from libs.protocol.codec import pack_tokens, unpack_floats, unpack_tokens
from libs.protocol.kv_messages import KVLoad, KVSave, PartialSave, join_hashes
from libs.protocol.messages import ModelRunnerOutput, NewSequence, SchedulerOutput
from services.kvcache.store_scan import IssueKind, ScannedBlock, scan_store
from services.worker.config import Config
from services.worker.handoff_area import HANDOFF_DIR_NAME, HandoffArea
from services.worker.kv_tiers import KVTiers
from services.worker.main import build_handoff_area
from services.worker.model_runner import ModelRunner, PlanError
from tests.unit.worker.test_kv_tiers import (
    BLOCK_SIZE,
    FP,
    FRESH,
    HASHES,
    NUM_BLOCKS,
    NUM_DECODES,
    PARAMS,
    PROMPT,
    SHAPE,
    STORE_LAYOUT,
    TABLE,
    Run,
    execute,
    make_store,
    serve,
)

KEY = bytes(range(32))
OTHER = [3, 20, 21, 22]  # a sequence the handoff plan admits onto the freed partial page (3)


def make_area(root: Path, **kwargs: object) -> HandoffArea:
    return HandoffArea(root, FP, STORE_LAYOUT, torch.float32, **kwargs)  # type: ignore[arg-type]


def make_runner(model: LlamaForCausalLM, root: Path) -> tuple[ModelRunner, KVTiers, HandoffArea]:
    tiers, area = KVTiers(None, make_store(root / "store")), make_area(root / "handoff")
    runner = ModelRunner(model, SHAPE, NUM_BLOCKS, BLOCK_SIZE, torch.float32, kv_tiers=tiers, handoff=area)
    return runner, tiers, area


@pytest.fixture(scope="module")
def cold(model: LlamaForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Run:
    runner, _, _ = make_runner(model, tmp_path_factory.mktemp("cold"))
    return serve(runner, TABLE)


def prefill_and_hand_off(model: LlamaForCausalLM, root: Path, key: bytes = KEY) -> int:
    """The prefill side; returns the first token. Its handoff plan admits another sequence onto
    the partial block's page, whose forward overwrites it after the save."""
    runner, tiers, area = make_runner(model, root)
    new = NewSequence("s", pack_tokens(PROMPT), b"", PARAMS, (), pack_tokens(TABLE), 0, len(PROMPT))
    first = unpack_tokens(execute(runner, SchedulerOutput(1, (new,))).sampled_token_ids)[0]
    other = NewSequence("o", pack_tokens([9] * 16), b"", PARAMS, (), pack_tokens(OTHER), 0, 16)
    plan = SchedulerOutput(
        2,
        (other,),
        finished_seq_ids=("s",),
        kv_saves=(KVSave(pack_tokens(TABLE[:3]), join_hashes(HASHES)),),
        partial_saves=(PartialSave(TABLE[3], key),),
    )
    execute(runner, plan)
    tiers.flush()
    area.flush()
    assert area.drain_done() == [key] and area.path(key).is_file()
    tiers.close()
    area.close()
    return first


def decode(runner: ModelRunner, first: int, kv_load: KVLoad, num_computed: int = len(PROMPT)) -> Run:
    num_tokens = len(PROMPT) + 1
    new = NewSequence(
        "s", pack_tokens(PROMPT), pack_tokens([first]), PARAMS, (), pack_tokens(FRESH), num_computed,
        num_tokens - num_computed, kv_load,
    )  # fmt: skip
    outputs: list[ModelRunnerOutput] = [execute(runner, SchedulerOutput(1, (new,)))]
    for step in range(NUM_DECODES - 1):
        outputs.append(execute(runner, SchedulerOutput(2 + step, (), ("s",), pack_tokens([1]), (b"",))))
    tokens = [first] + [t for out in outputs for t in unpack_tokens(out.sampled_token_ids)]
    top = [
        x for out in outputs for lp in out.logprobs if lp is not None for x in unpack_floats(lp.top_logprobs)
    ]
    return Run(tokens, top, outputs[0])


def assert_like_cold(run: Run, cold: Run) -> None:
    assert run.tokens == cold.tokens
    top_per_step = len(cold.top_logprobs) // (NUM_DECODES + 1)
    assert run.top_logprobs == pytest.approx(cold.top_logprobs[top_per_step:], abs=1e-5)


def test_the_decode_worker_loads_the_whole_prompt_and_computes_one_token(
    model: LlamaForCausalLM, cold: Run, tmp_path: Path
) -> None:
    first = prefill_and_hand_off(model, tmp_path)
    runner, _, area = make_runner(model, tmp_path)
    run = decode(runner, first, KVLoad(0, join_hashes(HASHES), partial_key=KEY))
    assert_like_cold(run, cold)
    out = run.first
    assert (out.num_loaded_store_blocks, out.num_loaded_partial_blocks, out.num_failed_partial_blocks) == (
        3,
        1,
        0,
    )
    assert not area.path(KEY).exists()  # deleted once read
    assert runner.seqs["s"].num_computed_tokens == len(PROMPT) + NUM_DECODES  # nothing recomputed


def test_the_partial_page_is_really_read(model: LlamaForCausalLM, cold: Run, tmp_path: Path) -> None:
    """A handoff file holding other KV (of another prompt, under this key) changes the output:
    the decode worker attends over the page it loads, not over anything it computed itself."""
    root = tmp_path
    first = prefill_and_hand_off(model, root)
    area = make_area(root / "handoff")
    page = area.read(KEY)
    assert page is not None
    area.write(KEY, torch.zeros_like(page))  # a sound file of the wrong KV
    area.flush()
    runner, _, _ = make_runner(model, root)
    run = decode(runner, first, KVLoad(0, join_hashes(HASHES), partial_key=KEY))
    assert run.top_logprobs != pytest.approx(
        cold.top_logprobs[len(cold.top_logprobs) // (NUM_DECODES + 1) :], abs=1e-3
    )


@pytest.mark.parametrize("fault", ["missing", "corrupt", "full_block_missing"])
def test_a_partial_block_that_cannot_be_loaded_is_recomputed(
    model: LlamaForCausalLM, cold: Run, tmp_path: Path, fault: str
) -> None:
    first = prefill_and_hand_off(model, tmp_path)
    runner, tiers, area = make_runner(model, tmp_path)
    path = area.path(KEY)
    if fault == "missing":
        path.unlink()
    elif fault == "corrupt":
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        assert tiers.store is not None
        tiers.store.path(HASHES[1]).unlink()  # blocks 1.. and the partial one: recomputed
    run = decode(runner, first, KVLoad(0, join_hashes(HASHES), partial_key=KEY))
    assert_like_cold(run, cold)
    assert (run.first.num_loaded_partial_blocks, run.first.num_failed_partial_blocks) == (0, 1)
    area.flush()
    assert not path.exists()  # a corrupt file is deleted, one after a gap dropped


def test_a_whole_prompt_in_g1_with_its_partial_block_loaded(
    model: LlamaForCausalLM, cold: Run, tmp_path: Path
) -> None:
    """A load of only the partial block (the full ones hit G1 there): first_block past them."""
    first = prefill_and_hand_off(model, tmp_path)
    runner, _, _ = make_runner(model, tmp_path)
    warm = serve(runner, FRESH)  # leaves PROMPT's full blocks in pages FRESH[:3]
    assert warm.tokens == cold.tokens
    run = decode(runner, first, KVLoad(3, b"", partial_key=KEY))
    assert_like_cold(run, cold)
    assert (run.first.num_loaded_store_blocks, run.first.num_loaded_partial_blocks) == (0, 1)


@pytest.mark.parametrize(
    ("kv_load", "num_computed"),
    [
        (KVLoad(0, join_hashes(HASHES), partial_key=KEY), 12),  # the partial block holds nothing
        (KVLoad(0, join_hashes(HASHES), partial_key=KEY[:8]), 14),  # a short key
        (KVLoad(0, join_hashes(HASHES[:2]), partial_key=KEY), 14),  # not the last computed block
    ],
)
def test_a_partial_load_that_does_not_end_the_computed_tokens_is_a_plan_error(
    model: LlamaForCausalLM, tmp_path: Path, kv_load: KVLoad, num_computed: int
) -> None:
    runner, _, _ = make_runner(model, tmp_path)
    with pytest.raises(PlanError):
        decode(runner, 7, kv_load, num_computed)


def test_a_partial_save_naming_no_page_is_a_plan_error(model: LlamaForCausalLM, tmp_path: Path) -> None:
    runner, _, _ = make_runner(model, tmp_path)
    for partial in (PartialSave(NUM_BLOCKS, KEY), PartialSave(-1, KEY), PartialSave(0, b"short")):
        with pytest.raises(PlanError):
            runner.execute(SchedulerOutput(1, partial_saves=(partial,)))


def test_a_drop_after_a_write_deletes_the_file_and_notices_every_write(tmp_path: Path) -> None:
    area = make_area(tmp_path)
    page = torch.randn(SHAPE.kv_spec.block_shape(BLOCK_SIZE))
    area.write(KEY, page)
    area.skip(bytes(32))  # a save whose KV was never written: noticed, no file
    area.drop([KEY, bytes(range(1, 33))])  # one file, one never written
    area.flush()
    assert area.drain_done() == [KEY, bytes(32)] and area.drain_done() == []
    assert not any(area.dir.iterdir())
    assert (area.num_written, area.num_dropped) == (1, 1)


def test_a_failed_write_is_noticed_and_nothing_is_left(tmp_path: Path) -> None:
    (tmp_path / "root").write_text("a file where the area's directory should be")
    area = make_area(tmp_path / "root")
    area.write(KEY, torch.zeros(SHAPE.kv_spec.block_shape(BLOCK_SIZE)))
    area.flush()
    assert area.drain_done() == [KEY] and area.num_write_failures == 1
    assert area.read(KEY) is None  # the decode worker recomputes it


def test_the_sweep_collects_only_old_files(tmp_path: Path) -> None:
    area = make_area(tmp_path, max_age_s=100.0)
    for key in (KEY, bytes(32)):
        area.write(key, torch.zeros(SHAPE.kv_spec.block_shape(BLOCK_SIZE)))
    area.flush()
    old = time.time() - 200
    os.utime(area.path(KEY), (old, old))
    assert area.sweep() == 1
    assert not area.path(KEY).exists() and area.path(bytes(32)).exists()
    assert make_area(tmp_path / "none").sweep() == 0  # no directory yet


def test_kvcache_never_indexes_or_collects_the_handoff_area(tmp_path: Path) -> None:
    """Under the store root, the area is a dot directory: a store scan reports it as not its own
    (never deleted) and finds no block in it."""
    area = make_area(tmp_path / HANDOFF_DIR_NAME)
    area.write(KEY, torch.zeros(SHAPE.kv_spec.block_shape(BLOCK_SIZE)))
    area.flush()
    items = list(scan_store(tmp_path))
    assert not [i for i in items if isinstance(i, ScannedBlock)]
    assert [i.kind for i in items if not isinstance(i, ScannedBlock)] == [IssueKind.UNKNOWN]


def test_config_places_the_area_under_the_store_or_where_asked(tmp_path: Path) -> None:
    layout = SHAPE.kv_spec
    area = build_handoff_area(Config(block_size=BLOCK_SIZE), str(tmp_path), FP, layout, torch.float32)
    assert area is not None and area.dir == tmp_path / "kv-store" / HANDOFF_DIR_NAME / FP
    assert area.layout == STORE_LAYOUT
    shm = Config(block_size=BLOCK_SIZE, kv_store_path="none", handoff_dir=str(tmp_path / "shm"))
    built = build_handoff_area(shm, str(tmp_path), FP, layout, torch.float32)
    assert built is not None and built.dir == tmp_path / "shm" / FP
    off = Config(block_size=BLOCK_SIZE, kv_store_path="none")
    assert build_handoff_area(off, str(tmp_path), FP, layout, torch.float32) is None
