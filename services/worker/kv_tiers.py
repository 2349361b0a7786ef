"""The worker's KV tiers below the device pages: G2 (host memory) and G3 (the store), one key.

A plan's ``kv_saves`` copy full device blocks to G2 and queue their G3 writes; its new sequences'
``kv_load`` fill device blocks from G2, else from G3 (a G3 hit is kept in G2 too). A load stops at
the first block it cannot fill: the runner recomputes that block and every one after it, so a
missing or unsound block never reaches attention. Every change of what G2 or G3 holds becomes a
``KVEvent`` in a thread-safe outbox (the G3 writer thread adds to it too), which the service
drains into ``KVEvents`` messages.

Threads: ``save`` and ``load`` run on the step thread, the only one that changes G2; ``dump``
runs whenever a dump is asked for, steps or not, so G2's changes (each with its event) and the
dump's read of it hold one lock, ``_host_lock``. ``prefetch`` runs on the event loop and only reads
G2's membership, a hint (a wrong answer costs one useless read or one read later), so it takes no
lock: a step's G2 copy must not stall the event loop. The store's writer and reader threads touch
only the store and the outbox.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from libs.kvstore.block_file import BlockFileError, BlockFileFault
from libs.protocol.codec import unpack_tokens
from libs.protocol.kv_messages import (
    CacheTier,
    KVEvent,
    KVSave,
    RemovalReason,
    TierCounter,
    join_hashes,
    split_hashes,
)
from libs.protocol.messages import SchedulerOutput
from services.worker.host_cache import HostCache
from services.worker.kv_cache import KVBlocks
from services.worker.kv_store import KVStore, StoredBlock

_STORE_OFF = "store off"  # failed-load label: not in G2, and no G3 to ask
# G3 hits reach the device pages (and G2) at most this many bytes at a time (and at least one
# block), through one staging buffer kept across loads: a fresh buffer per load costs more in page
# faults than the copy itself (a 4k-token load of SmolLM2 in fp32, 180 MB: 0.12 s stacked fresh,
# 0.02 s into a kept buffer).
STAGING_MAX_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class LoadResult:
    num_host_blocks: int  # the first blocks, filled from G2 or G3 in table order
    num_store_blocks: int
    num_failed_blocks: int  # the rest, from the first block that could not be filled: recomputed
    num_partial_blocks: int = 0  # a P/D handoff's partial block, from the handoff area (kv_transfer)
    num_failed_partial_blocks: int = 0  # ... or recomputed instead

    @property
    def num_loaded_blocks(self) -> int:
        return self.num_host_blocks + self.num_store_blocks


class EventOutbox:
    """KVEvents in the order the tiers changed, from any thread, until the service drains them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[KVEvent] = []

    def add(self, event: KVEvent) -> None:
        with self._lock:
            self._events.append(event)

    def drain(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events


class KVTiers:
    def __init__(self, host: HostCache | None, store: KVStore | None) -> None:
        self.host = host
        self.store = store
        self.outbox = EventOutbox()
        self._host_lock = threading.Lock()  # G2's changes and the dump's read of it; see the module doc
        if store is not None:
            store.on_stored = self._on_stored  # called on the store's writer thread
        # Called (on the writer thread) once a G3 write's event is in the outbox: the worker
        # then sends it at once, the completion notice a P/D handoff waits for.
        self.on_written: Callable[[], None] | None = None
        self.num_loaded_host_blocks = 0
        self.num_loaded_store_blocks = 0
        self.failed_load_blocks: Counter[str] = Counter()  # by the first failure's reason
        self.read_faults: Counter[str] = Counter()  # by BlockFileFault value
        self._staging: Tensor | None = None  # [staging_blocks, *block_shape], step thread only

    @property
    def store_writable(self) -> bool:
        return self.store is not None and self.store.writable

    # --- saves ------------------------------------------------------------------------------

    def save(self, kv_cache: KVBlocks, save: KVSave) -> None:
        """Copy the blocks to G2 (those not there yet) and queue their G3 writes (the store skips
        what is queued or on disk already). Runs before the step's forward: a block freed by this
        plan may be overwritten by it."""
        block_ids = unpack_tokens(save.block_ids)
        block_hashes = split_hashes(save.block_hashes)
        if len(block_ids) != len(block_hashes):
            raise ValueError(f"KVSave of {len(block_ids)} blocks carries {len(block_hashes)} hashes")
        host, store_on = self.host, self.store_writable
        if host is not None:
            with self._host_lock:
                host.touch(block_hashes)  # wanted again: the last to evict
        rows = [i for i, h in enumerate(block_hashes) if store_on or (host is not None and h not in host)]
        if not rows:
            return
        # A private copy, on the host: later device writes cannot reach it, nor the G3 writes.
        payloads = kv_cache.gather_blocks([block_ids[i] for i in rows]).cpu()
        hashes = [block_hashes[i] for i in rows]
        if host is not None:
            self._put_host(hashes, payloads)
        if self.store is not None and store_on:
            raw = payloads.view(torch.uint8).reshape(len(rows), -1).numpy()  # [n, block bytes], no copy
            for j, block_hash in enumerate(hashes):
                self.store.write(block_hash, memoryview(raw[j]), save.retention_class)

    def _put_host(self, block_hashes: list[bytes], payloads: Tensor) -> None:
        assert self.host is not None
        # Each event enters the outbox with its change, under the lock, so a dump never falls
        # between the two: see WorkerService.on_dump for why that makes the dump consistent.
        with self._host_lock:
            stored, evicted = self.host.put_many(block_hashes, payloads)
            if evicted:
                self.outbox.add(KVEvent(CacheTier.HOST, False, join_hashes(evicted), RemovalReason.CAPACITY))
            if stored:
                num_bytes = payloads[0].numel() * payloads.element_size()
                self.outbox.add(KVEvent(CacheTier.HOST, True, join_hashes(stored), num_bytes=num_bytes))

    def _on_stored(self, block_hash: bytes, stored: StoredBlock) -> None:
        self.outbox.add(
            KVEvent(
                CacheTier.STORE,
                True,
                block_hash,
                retention_class=stored.retention_class,
                expires_at=stored.expires_at,
                num_bytes=stored.header.file_size,
            )
        )
        if self.on_written is not None:
            self.on_written()

    # --- loads ------------------------------------------------------------------------------

    def prefetch(self, plan: SchedulerOutput) -> None:
        """Start the G3 reads of the plan's loads (the blocks not in G2): called as soon as a plan
        arrives, so they overlap the step in progress."""
        if self.store is None:
            return
        for new in plan.new_seqs:
            if new.kv_load is None:
                continue
            try:
                block_hashes = split_hashes(new.kv_load.block_hashes)
            except ValueError:
                continue  # the step itself reports the bad plan
            host = self.host
            self.store.prefetch(h for h in block_hashes if host is None or h not in host)

    def load(self, kv_cache: KVBlocks, block_ids: Sequence[int], block_hashes: Sequence[bytes]) -> LoadResult:
        """Fill pages ``block_ids[i]`` with block ``block_hashes[i]``, in order, up to the first one
        neither G2 nor G3 can give soundly; the caller recomputes from there."""
        host_rows: list[int] = []
        store_rows: list[int] = []
        store_payloads: list[Tensor] = []
        for i, block_hash in enumerate(block_hashes):
            if self.host is not None and block_hash in self.host:
                host_rows.append(i)
                if self.store is not None:
                    self.store.discard_prefetch(block_hash)
                continue
            payload = self._read(block_hash, len(block_hashes) - i)
            if payload is None:
                break
            store_rows.append(i)
            store_payloads.append(payload)
        num_loaded = len(host_rows) + len(store_rows)
        if self.store is not None:
            for block_hash in block_hashes[num_loaded + 1 :]:
                self.store.discard_prefetch(block_hash)
        # G2 first: putting the G3 hits into G2 below may evict a slot these rows read.
        if host_rows:
            assert self.host is not None
            with self._host_lock:  # gather marks the blocks used: a change of G2's order
                payloads = self.host.gather([block_hashes[i] for i in host_rows])
            kv_cache.scatter_blocks([block_ids[i] for i in host_rows], payloads)
        # G3 hits into G2 too, as many as G2 holds from the head: chunk by chunk, so a later chunk
        # never evicts an earlier one (a chain is useless without its head).
        num_to_host = self.host.num_blocks - len(host_rows) if self.host is not None else 0
        chunk = self.staging_blocks(store_payloads[0]) if store_payloads else 1
        for start in range(0, len(store_rows), chunk):
            rows = store_rows[start : start + chunk]
            payloads = self._stage(store_payloads[start : start + len(rows)])
            kv_cache.scatter_blocks([block_ids[i] for i in rows], payloads)
            num_put = min(len(rows), num_to_host - start)
            if num_put > 0:
                self._put_host([block_hashes[i] for i in rows[:num_put]], payloads[:num_put])
        self.num_loaded_host_blocks += len(host_rows)
        self.num_loaded_store_blocks += len(store_rows)
        return LoadResult(len(host_rows), len(store_rows), len(block_hashes) - num_loaded)

    @staticmethod
    def staging_blocks(payload: Tensor) -> int:
        """Blocks like ``payload`` that one staging chunk holds."""
        return max(1, STAGING_MAX_BYTES // (payload.numel() * payload.element_size()))

    def _stage(self, payloads: list[Tensor]) -> Tensor:
        """``payloads`` (``[*block_shape]`` each, at most ``staging_blocks``) stacked in the
        staging buffer: ``[n, *block_shape]``, valid until the next call."""
        first = payloads[0]
        staging = self._staging
        if staging is None or len(staging) < len(payloads) or staging.shape[1:] != first.shape:
            staging = torch.empty((len(payloads), *first.shape), dtype=first.dtype)
            if len(payloads) == self.staging_blocks(first):  # kept at full size only: loads fit it
                self._staging = staging
        return torch.stack(payloads, out=staging[: len(payloads)])

    def _read(self, block_hash: bytes, num_recomputed: int) -> Tensor | None:
        """One block from G3 as ``[*block_shape]``, or None (counted, and evented when G3 said why)."""
        if self.store is None:
            self.failed_load_blocks[_STORE_OFF] += num_recomputed
            return None
        try:
            payload = self.store.read(block_hash)
        except BlockFileError as e:
            # MISSING: the index was behind the store; anything else (UNREADABLE included, whose
            # file is kept) means this block cannot be served from G3 now.
            missing = e.reason is BlockFileFault.MISSING
            reason = RemovalReason.MISSING if missing else RemovalReason.CORRUPT
            self.outbox.add(KVEvent(CacheTier.STORE, False, block_hash, reason))
            self.read_faults[e.reason.value] += 1
            self.failed_load_blocks[e.reason.value] += num_recomputed
            return None
        return (
            torch.frombuffer(payload, dtype=torch.uint8).view(self.store.dtype).view(self.store.block_shape)
        )

    # --- what the service publishes ---------------------------------------------------------

    def drain_events(self) -> list[KVEvent]:
        return self.outbox.drain()

    def dump(self) -> list[bytes]:
        """Every block in G2 (least recently used first), as of now: safe while a step runs."""
        if self.host is None:
            return []
        with self._host_lock:
            return self.host.hashes()

    def stats(self) -> tuple[TierCounter, ...]:
        counters = [
            TierCounter("loaded_blocks", "G2", self.num_loaded_host_blocks),
            TierCounter("loaded_blocks", "G3", self.num_loaded_store_blocks),
            *(TierCounter("failed_load_blocks", k, n) for k, n in sorted(self.failed_load_blocks.items())),
            *(TierCounter("read_faults", why, n) for why, n in sorted(self.read_faults.items())),
        ]
        if self.host is not None:
            host = self.host
            counters += [
                TierCounter("stored_blocks", "G2", host.num_stored_blocks),
                TierCounter("evicted_blocks", "G2", host.num_evicted_blocks),
                TierCounter("used_blocks", "G2", len(host)),
                TierCounter("capacity_blocks", "G2", host.num_blocks),
            ]
        if self.store is not None:
            store = self.store
            counters += [
                TierCounter("stored_blocks", "G3", store.num_written_blocks),
                TierCounter("stored_bytes", "G3", store.num_written_bytes),
                TierCounter("present_blocks", "G3", store.num_present_blocks),
                TierCounter("write_failures", "G3", store.num_write_failures),
                TierCounter("dropped_writes", "G3", store.num_dropped_writes),
                TierCounter("writable", "G3", float(store.writable)),
            ]
        return tuple(counters)

    def flush(self) -> None:
        """Wait for the queued G3 writes (tests, shutdown)."""
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def check_integrity(self) -> None:
        if self.host is not None:
            with self._host_lock:
                self.host.check_integrity()
