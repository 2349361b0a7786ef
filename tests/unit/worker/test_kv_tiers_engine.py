"""The three tiers end to end in one process (scheduler core + real ModelRunner with G2 and G3,
tiny random-weight model, fp32): requests whose prefix comes back from G1, from G2 (evicted from
the device pages), from G3 (host memory off) and from G3 after a restart (a new engine, runner
and tiers on the same store directory) produce the greedy tokens and top-5 logprobs of the plain
unpaged reference, and the tier that served them is the one the counters name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.local_engine import LocalEngine
from libs.kvstore.block_hash import block_hash_from_hex
from libs.kvstore.retention import RetentionPolicy
from libs.models.llama import LlamaForCausalLM
from services.scheduler.worker_scheduler import Limits
from services.worker.host_cache import HostCache
from services.worker.kv_store import KVStore
from services.worker.kv_tiers import KVTiers
from services.worker.model_runner import ModelRunner, ModelShape
from tests.reference import reference_greedy
from tests.unit.worker.test_kv_tiers import STORE_LAYOUT
from tests.unit.worker.test_prefix_cache_exact import (
    BLOCK_SIZE,
    CONFIG,
    GREEDY,
    PROMPTS,
    WARM,
    check_logprobs,
)

NUM_BLOCKS = 16  # small: the fillers below push every earlier block out of the device pages
FILLERS = {f"f{i}": [60 + 7 * i + j for j in range(17)] for i in range(3)}  # 5 full blocks each
FP = "tiny-engine-fp"


@pytest.fixture(scope="module")
def reference(model: LlamaForCausalLM) -> dict[str, list[int]]:
    return {s: reference_greedy(model, p, GREEDY.max_tokens) for s, p in PROMPTS.items()}


def make_engine(model: LlamaForCausalLM, store_root: Path, host: bool) -> LocalEngine:
    shape = ModelShape.of(CONFIG)
    host_cache = HostCache(64, shape.kv_spec.block_shape(BLOCK_SIZE), torch.float32) if host else None
    store = KVStore(store_root, FP, STORE_LAYOUT, torch.float32, RetentionPolicy())
    runner = ModelRunner(
        model, shape, NUM_BLOCKS, BLOCK_SIZE, torch.float32, kv_tiers=KVTiers(host_cache, store)
    )
    limits = Limits(NUM_BLOCKS, BLOCK_SIZE, 8, CONFIG.max_position_embeddings, 256, 64, 0.0)
    return LocalEngine(runner, limits, CONFIG.eos_token_id, overlap=True, check=True)


def warm_then_evict(engine: LocalEngine) -> None:
    """WARM alone (its blocks saved at the end of its input and its output), then fillers that
    take every device page, so what WARM left in G1 is gone; the store writes are waited for."""
    engine.run((0, s, p, GREEDY) for s, p in WARM.items())
    for seq_id, prompt in FILLERS.items():
        engine.run([(0, seq_id, prompt, GREEDY)])
    engine.runner.kv_tiers.flush()  # type: ignore[attr-defined]
    engine.apply_tier_events()


def serve_prompts(engine: LocalEngine) -> dict[str, list[int]]:
    outputs = {}
    for seq_id, prompt in PROMPTS.items():  # one at a time: each may hit what WARM stored
        outputs |= {seq_id: engine.run([(0, seq_id, prompt, GREEDY)])[seq_id]}
    return outputs


def hit_tokens(engine: LocalEngine) -> dict[str, float]:
    counters = engine.core.kv_tiers.counters()
    return {tier: counters.get(("hit_tokens", tier), 0.0) for tier in ("G1", "G2", "G3")}


@pytest.mark.parametrize("host", [True, False], ids=["G2", "G3"])
def test_a_prefix_from_a_lower_tier_matches_the_reference(
    model: LlamaForCausalLM,
    reference: dict[str, list[int]],
    tmp_path: Path,
    host: bool,
) -> None:
    engine = make_engine(model, tmp_path / "store", host=host)
    warm_then_evict(engine)
    before = hit_tokens(engine)
    outputs = serve_prompts(engine)
    assert outputs == {s: reference[s] for s in PROMPTS}
    check_logprobs(model, engine, PROMPTS | WARM | FILLERS)
    hits = {tier: hit_tokens(engine)[tier] - before[tier] for tier in before}
    lower = "G2" if host else "G3"
    assert hits[lower] > 0, hits
    assert hits["G3" if host else "G2"] == 0, hits
    assert engine.core.kv_tiers.stats.num_failed_load_blocks == 0


def test_after_a_restart_the_store_serves_the_same_tokens(
    model: LlamaForCausalLM,
    reference: dict[str, list[int]],
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    warm_then_evict(make_engine(model, store, host=True))
    engine = make_engine(model, store, host=True)  # nothing in its device pages or host memory
    # What the kvcache service finds when it scans the store at its start.
    engine.stored_hashes = {block_hash_from_hex(p.stem) for p in store.rglob("*.kvb")}
    assert engine.stored_hashes
    outputs = serve_prompts(engine)
    assert outputs == {s: reference[s] for s in PROMPTS}
    check_logprobs(model, engine, PROMPTS)
    assert hit_tokens(engine)["G3"] > 0
