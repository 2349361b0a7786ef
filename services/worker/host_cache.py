"""G2: KV blocks kept in the worker's host memory, by block hash, in one preallocated tensor pool.

A slot holds one block's payload ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` (see
``KVLayout.block_shape``). The pool is allocated once (pinned when the pages live on a GPU, so the
copies to and from the device can run at full bandwidth) and slots are reused: full, it evicts the
least recently used block. It takes no lock of its own: ``KVTiers`` holds one around its changes
(only ever on the step thread) and around the ``hashes()`` of a dump (any time).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor


class HostCache:
    def __init__(
        self,
        num_blocks: int,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        pin_memory: bool = False,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.pool = torch.empty((num_blocks, *self.block_shape), dtype=dtype, pin_memory=pin_memory)
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: slot 0 first
        self.num_stored_blocks = 0
        self.num_evicted_blocks = 0
        self.num_hit_blocks = 0

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def hashes(self) -> list[bytes]:
        """Every block held, least recently used first."""
        return list(self._slots)

    def get(self, block_hash: bytes) -> Tensor | None:
        """A view of the block's slot (valid until the next ``put``), now the most recently used."""
        slot = self._slots.get(block_hash)
        if slot is None:
            return None
        self._slots.move_to_end(block_hash)
        self.num_hit_blocks += 1
        return self.pool[slot]

    def touch(self, block_hashes: Sequence[bytes]) -> None:
        """Mark the blocks held among ``block_hashes`` as the most recently used."""
        for block_hash in block_hashes:
            if block_hash in self._slots:
                self._slots.move_to_end(block_hash)

    def gather(self, block_hashes: Sequence[bytes]) -> Tensor:
        """A copy of the blocks ``block_hashes`` (all held), ``[n, *block_shape]``, in that order."""
        slots = []
        for block_hash in block_hashes:
            slots.append(self._slots[block_hash])
            self._slots.move_to_end(block_hash)
        self.num_hit_blocks += len(slots)
        return self.pool.index_select(0, torch.tensor(slots, dtype=torch.long))

    def put(self, block_hash: bytes, payload: Tensor) -> tuple[list[bytes], list[bytes]]:
        return self.put_many([block_hash], payload.unsqueeze(0))

    def put_many(self, block_hashes: Sequence[bytes], payloads: Tensor) -> tuple[list[bytes], list[bytes]]:
        """Keep ``payloads[i]`` (``[n, *block_shape]``, any device) under ``block_hashes[i]``.

        Blocks already held are only marked used. Returns (stored, evicted): the hashes this call
        added and the ones it evicted to make room. Never evicts a block of this call: when more
        new blocks come than there is room for, the first ones are kept (a prefix chain is useless
        without its head) and the rest are not stored.
        """
        if payloads.shape[1:] != self.block_shape or len(payloads) != len(block_hashes):
            raise ValueError(f"payloads {tuple(payloads.shape)} do not fit {len(block_hashes)} blocks")
        held = [h for h in dict.fromkeys(block_hashes) if h in self._slots]
        self.touch(held)
        room = self.num_blocks - len(held)
        rows: list[int] = []
        slots: list[int] = []
        stored: list[bytes] = []
        evicted: list[bytes] = []
        for row, block_hash in enumerate(block_hashes):
            if block_hash in self._slots or len(stored) == room:
                continue
            if not self._free:
                victim, slot = self._slots.popitem(last=False)
                self._free.append(slot)
                evicted.append(victim)
            slot = self._free.pop()
            self._slots[block_hash] = slot
            rows.append(row)
            slots.append(slot)
            stored.append(block_hash)
        if rows:
            source = payloads  # every row: a fresh copy of them would cost page faults, for nothing
            if len(rows) < len(payloads):
                index = torch.tensor(rows, dtype=torch.long, device=payloads.device)
                source = payloads.index_select(0, index)
            self.pool.index_copy_(0, torch.tensor(slots, dtype=torch.long), source.to("cpu"))
        self.num_stored_blocks += len(stored)
        self.num_evicted_blocks += len(evicted)
        return stored, evicted

    def clear(self) -> list[bytes]:
        """Drop every block; returns their hashes."""
        dropped = list(self._slots)
        self._free.extend(self._slots.values())
        self._slots.clear()
        return dropped

    def check_integrity(self) -> None:
        used = list(self._slots.values())
        assert len(set(used)) == len(used), "two blocks share a slot"
        assert not set(used) & set(self._free), "a slot is both used and free"
        assert len(used) + len(self._free) == self.num_blocks, "slots lost or duplicated"
        assert all(0 <= s < self.num_blocks for s in used + self._free)
        assert all(len(h) == 32 for h in self._slots)
