"""Liveness and load messages: members' heartbeats in the members bucket and the load a worker
publishes after each step, with the steps it timed at start. Frozen dataclasses on the wire like
every message (see codec)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class MemberKind(enum.IntEnum):
    GATEWAY = 1
    SCHEDULER = 2
    WORKER = 3
    KVCACHE = 4
    ENCODER = 5


@dataclass(frozen=True, slots=True)
class OutSeq:
    """A scheduler's last ``StepOutputs.seq`` to one gateway, in its heartbeat."""

    gateway_id: str
    seq: int


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """Value of ``<kind>.<id>`` in the members bucket; refreshed well within the bucket's TTL."""

    kind: MemberKind
    member_id: str
    model: str = ""
    ready: bool = True
    # +1 per refresh: a watcher that sees it unchanged for a while knows the process stopped,
    # before the bucket's TTL removes the entry
    heartbeat: int = 0
    step_s: float = 0.0  # a worker: how long its running step has run (0: none running)
    max_step_s: float = 0.0  # a worker: a step running longer is stuck (0: no bound)
    owner: str = ""  # a worker: the scheduler it serves ("": none)
    # a scheduler: what it has sent each gateway; a gateway that stays behind lost the rest
    out_seqs: tuple[OutSeq, ...] = ()
    # a scheduler: the workers it drives now (-1: not said); with none, it cannot serve yet (after a
    # NATS outage it claims its workers again from their next load reports)
    num_workers: int = -1
    draining: bool = False  # a worker: told to stop (SIGTERM), it takes no new sequences
    incarnation: str = ""  # a scheduler: which start of its id (see SchedulerRef)
    role: str = "both"  # a worker: prefill | decode | both (a prefill worker alone cannot serve)
    device: str = ""  # a worker: its device kind (cpu, cuda, npu): serving economics count its time

    @property
    def stuck(self) -> bool:
        """A worker whose step does not return: alive, but it cannot serve."""
        return self.max_step_s > 0 and self.step_s > self.max_step_s


@dataclass(frozen=True, slots=True)
class StepSample:
    """One step a worker timed at start (services/worker/step_profile.py): what it computed and
    how long its forward and sampling took. The scheduler's speculative policy fits its step-time
    model to these before any request has run."""

    num_tokens: int  # tokens computed, drafted ones included
    num_draft_tokens: int
    num_draft_rows: int  # rows that verified a draft
    seconds: float


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """Published by a worker after each step and periodically while idle."""

    worker_id: str
    num_running_seqs: int
    max_num_seqs: int
    max_model_len: int
    num_kv_blocks: int  # KV pages the scheduler may hand out on this worker
    block_size: int  # tokens per page
    step_time_ms: float = 0.0
    model: str = ""
    owner: str = ""  # the scheduler whose sequences it holds; others must not schedule here
    # identity of the KV it computes (weights, dtype, KV layout), folded into every block hash;
    # empty: the scheduler falls back to ``model``
    model_fingerprint: str = ""
    has_kv_store: bool = False  # it reads the shared store (G3): only then are G3 loads planned for it
    has_handoff_area: bool = False  # it writes and reads P/D handoffs' partial blocks (PartialSave)
    # told to stop (SIGTERM): its owner sends it no new sequences and moves those it holds; it
    # leaves once it holds none (or its drain timeout passes)
    draining: bool = False
    # prefill: only prompts handed off to another worker after their first token; decode: no
    # long uncached prompt while a prefill worker is free; both: anything
    role: str = "both"
    # what one token's KV costs on it, every layer (its model's KV spec and KV dtype): 23,040 for
    # SmolLM2 in bf16, 70,272 for DeepSeek-V3's MLA latent; 0 from a worker older than the field
    kv_bytes_per_token: int = 0
    # steps it timed at start (decodes with and without drafts); empty: not profiled
    step_profile: tuple[StepSample, ...] = ()
