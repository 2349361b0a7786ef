"""The shared-memory all-reduce between real processes: sums over 3 ranks, bit-identical on
every rank, for fp32 and bf16 and sizes up to a slot; calls back to back reuse the two slots
safely; a rank that never arrives fails the call within its timeout."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from libs.models.shm_all_reduce import SHM_DIR, ShmAllReduce, create_segment, supported

pytestmark = pytest.mark.skipif(
    not supported(), reason="the shared-memory all-reduce needs x86-64 and /dev/shm"
)

ROOT = Path(__file__).resolve().parents[3]
SIZE = 3
MAX_BYTES = 1 << 16

# Each rank: 200 calls of varying size and dtype, values from (rank, call); its results saved.
RANK = """
import sys, torch
from pathlib import Path
from libs.models.shm_all_reduce import ShmAllReduce
path, out = sys.argv[1], sys.argv[5]
rank, size, max_bytes = (int(a) for a in sys.argv[2:5])
torch.set_num_threads(1)
ar = ShmAllReduce(Path(path), rank, size, timeout_s=60, max_bytes=max_bytes)
results = []
for call in range(200):
    dtype = torch.bfloat16 if call % 3 == 0 else torch.float32
    numel = [1, 576, 4000, max_bytes // (2 if dtype == torch.bfloat16 else 4)][call % 4]
    gen = torch.Generator().manual_seed(1000 * call + rank)
    x = torch.randn(numel, generator=gen).to(dtype)
    results.append(ar(x).clone())
torch.save(results, out)
"""


def _expected(call: int) -> torch.Tensor:
    dtype = torch.bfloat16 if call % 3 == 0 else torch.float32
    numel = [1, 576, 4000, MAX_BYTES // (2 if dtype == torch.bfloat16 else 4)][call % 4]
    parts = [
        torch.randn(numel, generator=torch.Generator().manual_seed(1000 * call + r)).to(dtype)
        for r in range(SIZE)
    ]
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)  # rank order, as every rank sums
    return total


def test_three_ranks_sum_the_same(tmp_path: Path) -> None:
    name = f"deepinfer-test-{uuid.uuid4().hex[:8]}"
    path = create_segment(name, SIZE, MAX_BYTES)
    try:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    RANK,
                    str(path),
                    str(rank),
                    str(SIZE),
                    str(MAX_BYTES),
                    str(tmp_path / f"{rank}.pt"),
                ],
                cwd=ROOT,
            )
            for rank in range(SIZE)
        ]
        assert [p.wait(120) for p in procs] == [0] * SIZE
    finally:
        path.unlink()
    results = [torch.load(tmp_path / f"{rank}.pt") for rank in range(SIZE)]
    for call in range(200):
        want = _expected(call)
        for rank in range(SIZE):
            assert torch.equal(results[rank][call], want), (call, rank)


def test_a_missing_rank_fails_the_call() -> None:
    path = create_segment(f"deepinfer-test-{uuid.uuid4().hex[:8]}", 2, MAX_BYTES)
    try:
        alone = ShmAllReduce(path, 0, 2, timeout_s=0.3, max_bytes=MAX_BYTES)
        assert alone.fits(torch.ones(4)) and not alone.fits(torch.ones(MAX_BYTES))
        with pytest.raises(RuntimeError, match=r"ranks \[1\] did not arrive"):
            alone(torch.ones(4))
    finally:
        path.unlink()
    assert not list(SHM_DIR.glob("deepinfer-test-*"))
