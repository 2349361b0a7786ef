"""Which scheduler replica and worker a new request goes to: the gateway's KV-aware router.
Pure: no nats, asyncio or torch.

One view of every worker's cache, fed by KV events (``KVEvents``), one stream per (publisher,
worker): a worker's own stream says what its G2 (host memory) holds, and the scheduler that
drives a worker publishes its G1 (device pages: the scheduler's prefix cache). Each stream is
applied in order (``EventCursor``); a gap, or a stream met mid-way, empties that part of the view
and asks for a dump (the caller sends it, and hands the answer to ``on_dump``). A worker's load
reports (``WorkerLoad``, after each step and every half second while idle) say who owns it, its
role, whether it drains, and its slots taken; a worker silent for ``silence_s`` is not routed to.
Only the G1 stream of a worker's current owner counts for it.

Cost of a worker for a prompt, lower is better (G3 is left out: every worker reads it):

    cache_weight * (share of the prompt's blocks it would compute)
      + load_weight * (share of its slots taken)

where the slots taken are its last report's running sequences plus the requests this router sent
it since (a scheduler's waiting queue is not seen). Workers with a free slot come before any
without: a full one is chosen only when every one is full. ``temperature`` 0 takes the cheapest
(ties: the less loaded, then the lowest id); above 0 it samples softmax(-cost / temperature),
spreading load over workers of near-equal cost, as Dynamo's router does.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from libs.kvstore.block_hash import BLOCK_HASH_NUM_BYTES, hash_blocks
from libs.kvstore.event_cursor import EventCursor, EventVerdict
from libs.protocol.kv_messages import CacheTier, KVDump, KVEvents, RemovalReason, split_hashes
from libs.protocol.member_messages import WorkerLoad
from libs.protocol.messages import ImageSpan

StreamKey = tuple[str, str]  # (publisher id, worker id; "" for a worker's own stream)
ChainKind = tuple[int, str]  # (block size, model fingerprint): what a worker's block hashes depend on
FORGET_AFTER_S = 120.0  # a worker silent this long leaves the view, with its streams


@dataclass(frozen=True, slots=True)
class Route:
    scheduler_id: str  # the worker's owner: the replica to submit to
    worker_id: str
    num_cached_blocks: int  # leading prompt blocks it holds in G1 or G2
    num_prompt_blocks: int  # prompt blocks a hit could skip (all but the last token's)


@dataclass(slots=True)
class StreamView:
    cursor: EventCursor = field(default_factory=EventCursor)
    block_hashes: set[bytes] = field(default_factory=set)


@dataclass(slots=True)
class WorkerView:
    load: WorkerLoad
    seen_at: float  # the caller's clock, at its last load report
    num_routed: int = 0  # requests this router sent it since that report


@dataclass(slots=True)
class RouterStats:
    num_routes: Counter[str] = field(default_factory=Counter)  # worker id -> requests routed there
    num_cached_blocks: int = 0  # over the routed requests: prompt blocks their worker held
    num_prompt_blocks: int = 0
    num_unrouted: int = 0  # no worker to route to: the submit went to any scheduler


class KVRouter:
    def __init__(
        self,
        cache_weight: float = 1.0,
        load_weight: float = 1.0,
        temperature: float = 0.0,
        silence_s: float = 3.0,
        rng: random.Random | None = None,
    ) -> None:
        self.cache_weight = cache_weight
        self.load_weight = load_weight
        self.temperature = temperature
        self.silence_s = silence_s
        self.rng = rng or random.Random()
        self.workers: dict[str, WorkerView] = {}
        self.streams: dict[StreamKey, StreamView] = {}
        self.stats = RouterStats()

    # --- feeds -----------------------------------------------------------------------------

    def on_load(self, load: WorkerLoad, now: float) -> None:
        if load.block_size <= 0 or load.max_num_seqs <= 0:
            return  # nothing to route by (a report no worker sends)
        view = self.workers.get(load.worker_id)
        if view is not None and view.load.owner != load.owner:
            self.streams.pop((view.load.owner, load.worker_id), None)  # the old owner's G1
        self.workers[load.worker_id] = WorkerView(load, now)
        for gone in [v for v in self.workers.values() if now - v.seen_at > FORGET_AFTER_S]:
            self._forget(gone)

    def _forget(self, view: WorkerView) -> None:
        """A worker silent this long is gone (restarted under a new id, or scaled down)."""
        worker_id = view.load.worker_id
        del self.workers[worker_id]
        self.streams.pop((view.load.owner, worker_id), None)
        self.streams.pop((worker_id, ""), None)

    def on_events(self, batch: KVEvents) -> StreamKey | None:
        """Apply one message of a stream; returns the stream's key when it needs a dump."""
        if not batch.worker_id and batch.publisher_id not in self.workers:
            return None  # not a worker's own stream (kvcache's G3 removals), or one not heard yet
        key = (batch.publisher_id, batch.worker_id)
        stream = self.streams.setdefault(key, StreamView())
        verdict = stream.cursor.accept(batch.seq)
        if verdict is EventVerdict.IGNORE:
            return None
        if verdict is EventVerdict.RESYNC:
            stream.block_hashes.clear()  # unknown until the dump: counts as empty, never as held
            return key
        if verdict is EventVerdict.RESTART:
            stream.block_hashes.clear()
        tier = CacheTier.DEVICE if batch.worker_id else CacheTier.HOST
        try:
            for event in batch.events:
                if event.tier is not tier:
                    continue  # (a worker's G3 writes are kvcache's)
                block_hashes = split_hashes(event.block_hashes)
                if event.stored:
                    stream.block_hashes.update(block_hashes)
                elif event.reason is RemovalReason.CLEARED and not block_hashes:
                    stream.block_hashes.clear()
                else:
                    stream.block_hashes.difference_update(block_hashes)
        except ValueError:  # malformed: what it holds is unknown from here on
            stream.block_hashes.clear()
            stream.cursor.synced = False
            return key
        return None

    def on_dump(self, dump: KVDump) -> None:
        """A stream's whole content as of ``dump.seq`` (raises ValueError on malformed hashes)."""
        stream = self.streams.setdefault((dump.publisher_id, dump.worker_id), StreamView())
        packed = dump.device_block_hashes if dump.worker_id else dump.host_block_hashes
        stream.block_hashes = set(split_hashes(packed))
        stream.cursor.resynced(dump.seq)

    # --- routing ---------------------------------------------------------------------------

    def chain_kinds(self, now: float, owners: Container[str] | None = None) -> set[ChainKind]:
        """How the routable workers hash a prompt (workers that hash alike share one chain)."""
        return {_kind(v.load) for v in self.workers.values() if self._routable(v, now, owners)}

    def route(
        self,
        prompt: Sequence[int],
        tenant: str,
        now: float,
        chains: Mapping[ChainKind, list[bytes]] = {},
        owners: Container[str] | None = None,
        spans: Sequence[ImageSpan] = (),
    ) -> Route | None:
        """The worker (and its owner) for a new request, or None when no worker can be named
        (none known, silent, unowned, draining or prefill-only; or, with ``owners``, owned by a
        scheduler not in it): then any scheduler places it. ``chains``: the prompt's chain per
        kind, hashed already (``hash_chains``, off the event loop); a kind missing is hashed here."""
        candidates = [v for v in self.workers.values() if self._routable(v, now, owners)]
        if not candidates:
            self.stats.num_unrouted += 1
            return None
        missing = {_kind(v.load) for v in candidates} - set(chains)
        chains = {**chains, **hash_chains(prompt, tenant, missing, spans)}
        scored: list[tuple[float, WorkerView, int, int]] = []
        for view in candidates:
            chain = chains[_kind(view.load)]
            num_cached = self._num_cached(view, chain)
            uncached = 1.0 - num_cached / len(chain) if chain else 0.0
            cost = self.cache_weight * uncached + self.load_weight * _load_fraction(view)
            scored.append((cost, view, num_cached, len(chain)))
        with_room = [s for s in scored if _has_room(s[1])] or scored
        _, view, num_cached, num_blocks = self._pick(with_room)
        view.num_routed += 1
        worker_id = view.load.worker_id
        self.stats.num_routes[worker_id] += 1
        self.stats.num_cached_blocks += num_cached
        self.stats.num_prompt_blocks += num_blocks
        return Route(view.load.owner, worker_id, num_cached, num_blocks)

    def _routable(self, view: WorkerView, now: float, owners: Container[str] | None = None) -> bool:
        load = view.load
        fresh = now - view.seen_at <= self.silence_s
        owned = bool(load.owner) and (owners is None or load.owner in owners)
        return fresh and owned and not load.draining and load.role != "prefill"

    def _num_cached(self, view: WorkerView, chain: list[bytes]) -> int:
        """Leading blocks of ``chain`` in the worker's G1 (its owner's stream) or G2."""
        device = self.streams.get((view.load.owner, view.load.worker_id))
        host = self.streams.get((view.load.worker_id, ""))
        held = [s.block_hashes for s in (device, host) if s is not None]
        num = 0
        for block_hash in chain:
            if not any(block_hash in hashes for hashes in held):
                break
            num += 1
        return num

    def _pick(self, scored: list[tuple[float, WorkerView, int, int]]) -> tuple[float, WorkerView, int, int]:
        if self.temperature <= 0:
            return min(scored, key=lambda s: (s[0], _load_fraction(s[1]), s[1].load.worker_id))
        best = min(s[0] for s in scored)
        weights = [math.exp(-(s[0] - best) / self.temperature) for s in scored]
        return self.rng.choices(scored, weights)[0]

    def check_integrity(self) -> None:
        for key, stream in self.streams.items():
            assert all(len(h) == BLOCK_HASH_NUM_BYTES for h in stream.block_hashes), f"{key}: bad hash"
            assert stream.cursor.last_seq >= 0, f"{key}: negative seq"
        for worker_id, view in self.workers.items():
            assert view.load.worker_id == worker_id and view.num_routed >= 0, worker_id
        stats = self.stats
        assert 0 <= stats.num_cached_blocks <= stats.num_prompt_blocks, "cached blocks past the prompts'"


def hash_chains(
    prompt: Sequence[int], tenant: str, kinds: Iterable[ChainKind], spans: Sequence[ImageSpan] = ()
) -> dict[ChainKind, list[bytes]]:
    """The chain of the prompt blocks a hit could skip (all but the last token's), per kind;
    ``spans``: the prompt's images, in the hashes of the blocks they touch."""
    chains = {}
    for block_size, fingerprint in kinds:
        num_blocks = max(0, len(prompt) - 1) // block_size
        chains[block_size, fingerprint] = hash_blocks(
            prompt[: num_blocks * block_size], block_size, fingerprint, tenant, spans=spans
        )
    return chains


def _kind(load: WorkerLoad) -> ChainKind:
    return (load.block_size, load.model_fingerprint or load.model)


def _load_fraction(view: WorkerView) -> float:
    return (view.load.num_running_seqs + view.num_routed) / max(view.load.max_num_seqs, 1)


def _has_room(view: WorkerView) -> bool:
    return view.load.num_running_seqs + view.num_routed < view.load.max_num_seqs
