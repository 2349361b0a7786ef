"""An all-reduce through shared memory for the ranks of one CPU node: gloo's takes ~1.9 ms per
call over loopback TCP on the 2-core machine measured here (two per layer per step: 61 calls,
~110 ms, for one SmolLM2 decode token), this one tens of microseconds.

The segment (a file in /dev/shm, mapped by every rank) holds, per rank, an ``arrived`` and a
``read`` sequence number and two data slots used alternately. Call s on every rank:

1. wait until every rank has read call s-2's data (the slot this call overwrites);
2. copy x into this rank's slot s % 2, then publish ``arrived[rank] = s``;
3. wait until every rank has arrived at s; sum the slots in rank order (so every rank gets the
   same bits), then publish ``read[rank] = s``.

Correct where stores become visible in program order (x86-64's total store order): the data's
stores before the flag's, the flag's loads before the data's. A copy may use non-temporal stores,
which that order does not cover, so a locked instruction (a lock's acquire) fences the data
before the flag is set; a copy torch splits over OpenMP threads ends at the team's barrier, where
each thread's own locked instruction fences its stores. ``supported()`` says where this holds;
elsewhere the group keeps gloo. A rank that does not arrive within ``timeout_s`` fails the call
(RuntimeError), as a collective's timeout does.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from pathlib import Path

import torch
from torch import Tensor

SHM_DIR = Path("/dev/shm")
MAX_BYTES = 8 << 20  # per slot: a step's hidden up to 2048 tokens x 1024 fp32 (larger ones take gloo)
_FLAG_BYTES = 8
SPIN_YIELDS = 2000  # checks before sleeping, each ~2 us: most waits end within them
SLEEP_S = 50e-6


def supported() -> bool:
    """Where this all-reduce is sound: x86-64 (total store order) with a /dev/shm."""
    return platform.machine().lower() in ("x86_64", "amd64") and SHM_DIR.is_dir()


def segment_bytes(size: int, max_bytes: int = MAX_BYTES) -> int:
    return 2 * size * _FLAG_BYTES + 2 * size * max_bytes


def create_segment(name: str, size: int, max_bytes: int = MAX_BYTES) -> Path:
    """The zeroed file of a ``size``-rank segment (rank 0 makes it before the others open it),
    its pages reserved now: a /dev/shm too small for it (a container's default 64 MB) is an
    OSError here, not a SIGBUS in the middle of a forward."""
    path = SHM_DIR / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, segment_bytes(size, max_bytes))
    except OSError:
        path.unlink()
        raise
    finally:
        os.close(fd)
    return path


class ShmAllReduce:
    """One rank's end of a segment made by ``create_segment``."""

    def __init__(
        self, path: Path, rank: int, size: int, timeout_s: float, max_bytes: int = MAX_BYTES
    ) -> None:
        nbytes = segment_bytes(size, max_bytes)
        if os.path.getsize(path) != nbytes:
            raise ValueError(f"{path}: {os.path.getsize(path)} bytes, expected {nbytes}")
        buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        flags = buffer[: 2 * size * _FLAG_BYTES].view(torch.int64).view(2, size)
        self.arrived, self.read = flags[0], flags[1]
        self.slots = buffer[2 * size * _FLAG_BYTES :].view(2, size, max_bytes)
        self.rank = rank
        self.size = size
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.seq = 0
        self._fence = threading.Lock()

    def fits(self, x: Tensor) -> bool:
        return x.is_cpu and x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: Tensor) -> Tensor:
        """Sum ``x`` (contiguous, CPU, ``fits``) over the ranks, in place; every rank the same bits."""
        self.seq += 1
        seq, slot, nbytes = self.seq, self.seq % 2, x.numel() * x.element_size()
        self._wait(self.read, seq - 2, "read the previous call")
        flat = x.view(-1)
        self.slots[slot, self.rank, :nbytes].view(x.dtype).copy_(flat)
        with self._fence:  # a locked instruction: the copy's stores are visible before the flag's
            pass
        self.arrived[self.rank] = seq
        self._wait(self.arrived, seq, "arrive")
        parts = self.slots[slot, :, :nbytes].view(x.dtype)  # [size, numel]
        flat.copy_(parts[0])
        for part in parts[1:]:
            flat.add_(part)
        self.read[self.rank] = seq
        return x

    def _wait(self, flags: Tensor, seq: int, what: str) -> None:
        """Until every rank's ``flags`` reach ``seq``: yields first (the others are usually a few
        microseconds behind), then short sleeps, so a rank waiting out another's layer does not
        spin beside it."""
        for _ in range(SPIN_YIELDS):
            if int(flags.min()) >= seq:
                return
            os.sched_yield()
        deadline = time.monotonic() + self.timeout_s
        while int(flags.min()) < seq:
            if time.monotonic() > deadline:
                late = [r for r in range(self.size) if int(flags[r]) < seq]
                raise RuntimeError(
                    f"shared-memory all-reduce: ranks {late} did not {what} in {self.timeout_s:.0f} s"
                )
            time.sleep(SLEEP_S)
