"""KV-cache messages: what a plan tells a worker to load and save, the tiers' events, lookups and
stats. KV tensors never travel here: they go through host memory (G2) and the store (G3); these
messages carry block ids, block hashes and notices.

Block hashes travel concatenated, ``BLOCK_HASH_NUM_BYTES`` (32) bytes each
(``libs.kvstore.block_hash``); ``split_hashes`` / ``join_hashes`` convert.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

HASH_NUM_BYTES = 32  # libs.kvstore.block_hash.BLOCK_HASH_NUM_BYTES (protocol imports no kvstore)


def join_hashes(block_hashes: Sequence[bytes]) -> bytes:
    assert all(len(h) == HASH_NUM_BYTES for h in block_hashes), "a block hash has the wrong size"
    return b"".join(block_hashes)


def split_hashes(data: bytes) -> list[bytes]:
    if len(data) % HASH_NUM_BYTES:
        raise ValueError(f"{len(data)} bytes of block hashes is not a multiple of {HASH_NUM_BYTES}")
    return [data[i : i + HASH_NUM_BYTES] for i in range(0, len(data), HASH_NUM_BYTES)]


class CacheTier(enum.IntEnum):
    DEVICE = 1  # G1: the worker's KV pages (the scheduler's prefix cache)
    HOST = 2  # G2: host memory of one worker
    STORE = 3  # G3: the shared store directory, one file per block


class RemovalReason(enum.IntEnum):
    CAPACITY = 1  # evicted to make room
    EXPIRED = 2  # its retention class's time ran out
    CORRUPT = 3  # failed a check on read (checksum, header, foreign model, truncated)
    MISSING = 4  # the index had it, the store did not
    CLEARED = 5  # the tier was emptied (a restart, a disabled store)


# --- scheduler -> worker (inside SchedulerOutput) ---------------------------------------------


@dataclass(frozen=True, slots=True)
class KVLoad:
    """Blocks a new sequence starts with whose KV the worker fills from G2 or G3 before the
    forward: table positions ``first_block ..`` of ``NewSequence.block_ids``, one hash each.

    They count in ``NewSequence.num_computed_tokens``. A block the worker cannot load (gone from
    G2, and missing, corrupt or foreign in G3) is recomputed in the same step, with every block
    after it: a wrong block never reaches attention, and the plan's accounting still holds.
    """

    first_block: int
    block_hashes: bytes  # concatenated, 32 bytes each
    tiers: bytes = b""  # one CacheTier value per block: where the scheduler expects it (a hint)
    # A P/D handoff's partial last prompt block, the page right after these: read from the
    # handoff area under this key (then deleted there) when every block before it loaded; its
    # tokens are those up to NewSequence.num_computed_tokens. Empty: none.
    partial_key: bytes = b""


@dataclass(frozen=True, slots=True)
class KVSave:
    """Full blocks whose KV earlier plans computed, to keep: the worker copies them to G2 and
    queues their G3 writes before this step's forward (which may overwrite a freed block)."""

    block_ids: bytes  # packed uint32
    block_hashes: bytes  # concatenated, 32 bytes each, one per block id
    retention_class: str = ""  # "": the store's default class


@dataclass(frozen=True, slots=True)
class PartialSave:
    """A P/D handoff's partial last prompt block: page ``block_id``, whose KV earlier plans
    computed, copied to the handoff area under ``key`` before this step's forward. It has no
    chained hash, so it never enters G1, G2 or G3: the handoff area is a directory of its own,
    which the decode worker reads it from (deleting it) and which no index knows."""

    block_id: int
    key: bytes  # HASH_NUM_BYTES, unique to this handoff


# --- events: worker -> scheduler, kvcache -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVEvent:
    tier: CacheTier
    stored: bool  # True: these blocks are now in the tier; False: they are gone from it
    block_hashes: bytes  # concatenated, 32 bytes each
    reason: RemovalReason | None = None  # why they are gone (stored=False)
    retention_class: str = ""  # stored G3 blocks: their class
    expires_at: float = 0.0  # stored G3 blocks: unix seconds
    num_bytes: int = 0  # stored blocks: bytes each (G3: the whole file)


@dataclass(frozen=True, slots=True)
class KVEvents:
    """One stream's tier changes since its last message. A stream is (``publisher_id``,
    ``worker_id``): a worker publishes its own G2 (and G3 writes) on ``kv.events``, ``worker_id``
    empty; a scheduler publishes the G1 of each worker it drives on ``kv.device_events``, one
    stream per worker. ``seq`` is +1 per message of
    a stream (from 1 at its start, when its cache is empty); a consumer that sees a gap resyncs:
    G1 / G2 by asking the publisher for a ``KVDump`` (``kv.dump.<publisher_id>``), G3 by scanning
    the store."""

    publisher_id: str
    seq: int
    events: tuple[KVEvent, ...]
    fingerprint: str = ""  # the model whose KV these blocks hold
    worker_id: str = ""  # the worker whose cache changed ("": the publisher itself)
    # Concatenated keys of the partial blocks (``PartialSave``) the worker is done writing to the
    # handoff area, failed writes too: the notices a P/D handoff waits for. Not a tier's change:
    # kvcache and the routers ignore them.
    handoff_keys: bytes = b""


@dataclass(frozen=True, slots=True)
class KVDumpRequest:
    publisher_id: str
    worker_id: str = ""  # to a scheduler: the worker whose G1 stream is wanted


@dataclass(frozen=True, slots=True)
class KVDump:
    """Everything one stream's cache holds, as of its event ``seq`` (a consumer continues from
    there): a worker's G2, or (from a scheduler, ``worker_id`` set) a worker's G1."""

    publisher_id: str
    seq: int
    host_block_hashes: bytes  # concatenated, 32 bytes each
    worker_id: str = ""
    device_block_hashes: bytes = b""


# --- scheduler <-> kvcache --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVLookup:
    block_hashes: bytes  # a prompt's chain, concatenated, 32 bytes each, first block first
    fingerprint: str = ""
    # the asking request's class: every stored block of its prefix is kept at least that long from
    # now (a reuse renews and may raise a block's retention); "": the block keeps its own class
    retention_class: str = ""


@dataclass(frozen=True, slots=True)
class KVLookupReply:
    num_blocks: int  # the longest prefix of the chain stored in G3
    error: str = ""


# --- stats (periodic, for /metrics) -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TierCounter:
    """One counter, labelled by tier, retention class or reason (whichever applies)."""

    name: str  # e.g. "hit_tokens", "evicted_blocks", "stored_bytes"
    label: str  # e.g. "G1", "agent", "capacity"
    value: float


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """A service's cache counters since it started (and gauges as of now), published periodically."""

    publisher_id: str
    kind: str  # "scheduler" | "worker" | "kvcache"
    counters: tuple[TierCounter, ...]
