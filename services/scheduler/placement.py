"""Where a new request goes: the scheduler service's admission of a submit. Pure policy lives in
the router; this part reads the workers' cores and the shared store's index.

submit -> the prompt's block chain per kind of worker (in a thread: hashing is slow) -> a G3 lookup
(kvcache) -> a decode-capable worker: the one the gateway's KV router named, if it has room, else
by the router's rule (the most of the prompt cached in its G1 / G2 against its load, or round
robin) -> a prefill worker instead when the prompt is long and
uncached there (P/D) -> ``Fleet.submit``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import NamedTuple

from libs.kvstore.media_store import MM_HASH_NUM_BYTES
from libs.protocol.codec import unpack_tokens
from libs.protocol.errors import QueueFull
from libs.protocol.messages import ImageSpan, SubmitReply, SubmitRequest, SubmitStatus
from services.scheduler.config import Config
from services.scheduler.fleet import Fleet
from services.scheduler.kv_sync import KVSync
from services.scheduler.kv_tiers import TierPlanner
from services.scheduler.outputs import OutputPublisher
from services.scheduler.router import WorkerState, pick_in_turn, pick_prefill_worker, pick_worker
from services.scheduler.sequence import Sequence
from services.scheduler.step_loop import WorkerHandle


class ChainKind(NamedTuple):
    """What a worker's hashes of a prompt depend on: workers alike share one chain."""

    block_size: int
    fingerprint: str  # the model's
    prefix_caching: bool  # off: no chain


class Placement:
    def __init__(
        self,
        config: Config,
        workers: dict[str, WorkerHandle],
        fleet: Fleet,
        kv: KVSync,
        outputs: OutputPublisher,
    ) -> None:
        self.config = config
        self.workers = workers
        self.fleet = fleet
        self.kv = kv
        self.outputs = outputs
        self._turns = itertools.count()  # round-robin routing

    async def admit(self, req: SubmitRequest) -> SubmitReply:
        prompt = unpack_tokens(req.prompt_token_ids)
        try:
            outputs = resumed_outputs(req)
        except ValueError as exc:
            return SubmitReply(SubmitStatus.INVALID, f"bad resubmit: {exc}")
        why = malformed(req, len(prompt))
        if why:
            return SubmitReply(SubmitStatus.INVALID, why)
        # Hashing a long prompt takes a while: in a thread, so heartbeats and steps keep going.
        chains = await asyncio.to_thread(self._hash_chains, req, prompt, self._worker_tiers())
        kinds = self._chain_kinds(req, prompt, chains)
        stored = await self._lookup_stored(kinds, chains, req.retention_class)
        # NOTE: no await from here to core.add. Submits run as concurrent tasks: a worker picked
        # before the lookup would be picked by every submit arriving during it, on the same load.
        kinds = self._chain_kinds(req, prompt, chains)  # workers may have come or gone since
        states = [
            WorkerState(
                wid,
                len(h.core.seqs),
                h.load.max_num_seqs,
                h.core.kv_tiers.num_reusable_blocks(chains[kinds[wid]]),
                len(chains[kinds[wid]]),
            )
            for wid, h in self.workers.items()
            if wid not in self.fleet.draining and self.fleet.decodes(wid)
        ]
        worker_id = self._pick(req, states)
        if worker_id is None:
            return SubmitReply(
                SubmitStatus.NO_WORKERS,
                self._why_no_worker(),
                self.config.scheduler_id,
                incarnation=self.outputs.incarnation,
            )
        state = next(s for s in states if s.worker_id == worker_id)
        # A resubmitted request goes on decoding: no remote prefill for it.
        prefill_id = None if outputs else self._remote_prefill(req, prompt, worker_id, kinds, stored, state)
        decode_id, worker_id = worker_id, prefill_id or worker_id
        handle = self.workers[worker_id]
        context_len = handle.core.limits.context_len
        num_tokens = len(prompt) + max((len(o) for o in outputs or () if o is not None), default=0)
        if num_tokens + 1 > context_len:
            return SubmitReply(
                SubmitStatus.INVALID, f"prompt of {num_tokens} tokens exceeds the context of {context_len}"
            )
        kind = kinds[worker_id]
        seq = Sequence(
            req.request_id,
            req.gateway_id,
            prompt,
            req.sampling_params,
            req.eos_token_id,
            priority=req.priority,
            tenant=req.tenant,
            tenant_weight=req.tenant_weight,
            retention_class=req.retention_class,
            # absent: G3 off, or a kind new since the lookup; a worker without the store loads none
            num_stored_blocks=stored.get(kind, 0) if handle.load.has_kv_store else 0,
            block_hashes=list(chains[kind]),  # hashed with this worker's fingerprint and block size
            handoff=worker_id != decode_id,
            prediction_token_ids=unpack_tokens(req.prediction_token_ids),
            queued_at=time.monotonic(),  # its queue time ends at its first admission (metrics)
            traceparent=req.traceparent,
            image_spans=req.image_spans,
        )
        if req.request_id in self.fleet.table:
            return self._again(req)
        try:
            self.fleet.submit(seq, worker_id, outputs, req.num_moves, req.num_crashes)
        except QueueFull as exc:
            return SubmitReply(SubmitStatus.QUEUE_FULL, str(exc))
        handle.wake.set()
        return self._accepted(req)

    def _pick(self, req: SubmitRequest, states: list[WorkerState]) -> str | None:
        # The gateway's router saw every replica's caches: its pick stands while it has room.
        if any(s.worker_id == req.worker_id and s.has_room for s in states):
            return req.worker_id
        if self.config.routing == "round_robin":
            return pick_in_turn(states, next(self._turns))
        return pick_worker(states)

    def _again(self, req: SubmitRequest) -> SubmitReply:
        """A submit of a request this scheduler holds: the retry of a resubmit whose reply timed
        out is the same request (accepted again); a new request reusing a live id is a 400."""
        if req.num_moves:
            return self._accepted(req)
        return SubmitReply(SubmitStatus.INVALID, f"request id {req.request_id} is in use")

    def _accepted(self, req: SubmitRequest) -> SubmitReply:
        return SubmitReply(
            SubmitStatus.ACCEPTED,
            scheduler_id=self.config.scheduler_id,
            out_seq=self.outputs.sent_to(req.gateway_id),
            incarnation=self.outputs.incarnation,
        )

    def _why_no_worker(self) -> str:
        why = "no worker is available"
        if any(not self.fleet.decodes(w) for w in self.workers):
            why = "no worker of the decode role is available (a prefill worker takes only handoffs)"
        if self.fleet.draining:
            why += f"; {len(self.fleet.draining)} draining"
        return why

    def _remote_prefill(
        self,
        req: SubmitRequest,
        prompt: list[int],
        decode_id: str,
        kinds: dict[str, ChainKind],
        stored: dict[ChainKind, int],
        state: WorkerState,
    ) -> str | None:
        """The prefill worker to compute this prompt before ``decode_id`` decodes it, if any.

        Only for one choice, and where both read the shared store and hash alike (the decode
        worker loads the prefill worker's blocks from it)."""
        decode = self.workers[decode_id]
        if req.sampling_params.n != 1 or not _reads_store(decode):
            return None
        kind = kinds[decode_id]
        queues = {
            wid: len(h.core.seqs)
            for wid, h in self.workers.items()
            if not self.fleet.decodes(wid)
            and wid not in self.fleet.draining
            and kinds[wid] == kind
            and _reads_store(h)
        }
        if not queues:
            return None
        num_cached_blocks = max(state.num_cached_blocks, stored.get(kind, 0))
        num_uncached = len(prompt) - num_cached_blocks * decode.core.limits.block_size
        return pick_prefill_worker(
            num_uncached, queues, self.config.pd_min_uncached_tokens, self.config.pd_max_prefill_queue
        )

    def _worker_tiers(self) -> dict[ChainKind, TierPlanner]:
        """One worker's tiers per kind of chain (they hash alike), read on the loop."""
        tiers: dict[ChainKind, TierPlanner] = {}
        for handle in self.workers.values():
            limits = handle.core.limits
            kind = ChainKind(
                limits.block_size, handle.core.kv_tiers.model_fingerprint, limits.enable_prefix_caching
            )
            tiers.setdefault(kind, handle.core.kv_tiers)
        return tiers

    @staticmethod
    def _hash_chains(
        req: SubmitRequest, prompt: list[int], tiers: dict[ChainKind, TierPlanner]
    ) -> dict[ChainKind, list[bytes]]:
        """Each kind's chain of the prompt; pure, so it may run off the loop."""
        return {kind: t.prompt_chain(prompt, req.tenant, req.image_spans) for kind, t in tiers.items()}

    def _chain_kinds(
        self, req: SubmitRequest, prompt: list[int], chains: dict[ChainKind, list[bytes]]
    ) -> dict[str, ChainKind]:
        """Worker id -> how it hashes the prompt; ``chains`` gets, for each kind it lacks, the
        hashes of the prompt blocks a hit could skip (workers that hash alike share one list)."""
        kinds: dict[str, ChainKind] = {}
        for worker_id, handle in self.workers.items():
            tiers, limits = handle.core.kv_tiers, handle.core.limits
            kind = ChainKind(limits.block_size, tiers.model_fingerprint, limits.enable_prefix_caching)
            if kind not in chains:
                chains[kind] = tiers.prompt_chain(prompt, req.tenant, req.image_spans)
            kinds[worker_id] = kind
        return kinds

    async def _lookup_stored(
        self, kinds: dict[str, ChainKind], chains: dict[ChainKind, list[bytes]], retention_class: str
    ) -> dict[ChainKind, int]:
        """The leading blocks of each chain that G3 holds, for the kinds of workers with the lower
        tiers on: usually one chain (workers of one model hash alike); several are looked up at
        once, so a submit waits at most one kv_lookup_timeout_s."""
        wanted = list(dict.fromkeys(k for wid, k in kinds.items() if _reads_store(self.workers[wid])))
        lookups = (self.kv.lookup(chains[k], k.fingerprint, retention_class) for k in wanted)
        counts = await asyncio.gather(*lookups)
        return dict(zip(wanted, counts, strict=True))


def resumed_outputs(req: SubmitRequest) -> list[list[int] | None] | None:
    """Per choice of a resubmitted request, the output tokens it goes on from (None: that choice
    ended); None for a new request. Raises ValueError for a resubmit that does not add up."""
    if not req.output_token_ids and not req.finished_choices and not req.num_moves:
        return None
    params = req.sampling_params
    if len(req.output_token_ids) != params.n:
        raise ValueError(f"{len(req.output_token_ids)} choices' outputs for a request with n={params.n}")
    if any(not 0 <= i < params.n for i in req.finished_choices):
        raise ValueError(f"finished choices {req.finished_choices} out of range for n={params.n}")
    if req.num_moves < 1:
        raise ValueError("a resubmit counts at least one move")
    outputs: list[list[int] | None] = [unpack_tokens(packed) for packed in req.output_token_ids]
    for index in req.finished_choices:
        outputs[index] = None
    if all(o is None for o in outputs):
        raise ValueError("every choice has ended")
    if any(o is not None and len(o) >= params.max_tokens for o in outputs):
        raise ValueError(f"a choice has its max_tokens ({params.max_tokens}) already")
    return outputs


def _reads_store(handle: WorkerHandle) -> bool:
    """G3 lookups are for workers that plan lower tiers and can read the shared store."""
    return handle.core.kv_tiers.enabled and handle.load.has_kv_store


def malformed(req: SubmitRequest, num_prompt_tokens: int) -> str:
    """Why a submit's packed fields cannot be right ("": they can)."""
    if len(req.prediction_token_ids) % 4:
        return "prediction_token_ids is not packed uint32"
    return bad_image_spans(req.image_spans, num_prompt_tokens)


def bad_image_spans(spans: tuple[ImageSpan, ...], num_prompt_tokens: int) -> str:
    """Why a submit's image spans cannot be right ("": they can): each a 32-byte hash over a
    non-empty run of prompt positions, in order, none overlapping."""
    end = 0
    for i, span in enumerate(spans):
        if len(span.mm_hash) != MM_HASH_NUM_BYTES or span.length <= 0 or span.offset < end:
            return f"image span {i} is malformed or out of order"
        end = span.end
    if end > num_prompt_tokens:
        return f"image spans reach position {end}, past the prompt's {num_prompt_tokens} tokens"
    return ""
