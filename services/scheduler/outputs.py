"""Publishes the scheduler's sequence outputs: one StepOutputs per destination gateway per call,
into the durable OUT stream, numbered per gateway so that a gateway notices a lost one."""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict

from libs.bus.base import Bus
from libs.protocol.codec import encode, pack_tokens
from libs.protocol.member_messages import OutSeq
from libs.protocol.messages import FinishReason, Logprobs, RequestOutput, StepOutputs
from libs.protocol.subjects import Subjects
from services.scheduler.sequence import Sequence

log = logging.getLogger(__name__)


class OutputPublisher:
    def __init__(self, bus: Bus, subjects: Subjects, scheduler_id: str) -> None:
        self.bus = bus
        self.subjects = subjects
        self.scheduler_id = scheduler_id
        # This process's numbering: a restart under the same id numbers afresh, as another one.
        self.incarnation = uuid.uuid4().hex[:8]
        self._out_seq: dict[str, int] = defaultdict(int)  # gateway id -> last StepOutputs.seq

    def sent_to(self, gateway_id: str) -> int:
        """The last StepOutputs.seq sent to ``gateway_id`` (0: none yet)."""
        return self._out_seq.get(gateway_id, 0)

    def out_seqs(self) -> tuple[OutSeq, ...]:
        """What has been sent each gateway so far (for the heartbeat)."""
        return tuple(OutSeq(gateway_id, seq) for gateway_id, seq in self._out_seq.items())

    async def publish(self, seqs: list[Sequence], error: str = "") -> None:
        """One StepOutputs per destination gateway, carrying each sequence's new tokens."""
        by_gateway: dict[str, list[RequestOutput]] = defaultdict(list)
        for seq in seqs:
            by_gateway[seq.gateway_id].append(_take_output(seq, error))
        for gateway_id, outputs in by_gateway.items():
            self._out_seq[gateway_id] += 1
            step = StepOutputs(self.scheduler_id, self._out_seq[gateway_id], tuple(outputs), self.incarnation)
            try:
                await self.bus.publish_durable(self.subjects.out(gateway_id), encode(step))
            except Exception as exc:  # the gateway sees the seq gap and fails these requests loudly
                log.error("publishing to gateway %s failed: %s", gateway_id, exc)


def _take_output(seq: Sequence, error: str) -> RequestOutput:
    """The sequence's output since the last one sent (which it now counts as sent)."""
    new_tokens = seq.output_token_ids[seq.num_sent_tokens :]
    seq.num_sent_tokens = seq.num_output_tokens
    num_accepted, num_rejected = (
        seq.num_unsent_accepted_prediction_tokens,
        seq.num_unsent_rejected_prediction_tokens,
    )
    seq.num_unsent_accepted_prediction_tokens = seq.num_unsent_rejected_prediction_tokens = 0
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=pack_tokens(new_tokens),
        num_output_tokens=seq.num_output_tokens,
        num_prompt_tokens=seq.num_prompt_tokens,
        finish_reason=seq.finish_reason if seq.is_finished else None,
        num_cached_tokens=seq.num_cached_tokens,
        error=(seq.error or error) if seq.finish_reason is FinishReason.ERROR else "",
        index=seq.index,
        logprobs=_take_logprobs(seq),
        handback=seq.handback if seq.finish_reason is FinishReason.ERROR else None,
        num_accepted_prediction_tokens=num_accepted,
        num_rejected_prediction_tokens=num_rejected,
    )


def _take_logprobs(seq: Sequence) -> Logprobs | None:
    """The logprobs of the tokens not yet sent, merged into one message."""
    parts, seq.unsent_logprobs = seq.unsent_logprobs, []
    return Logprobs.concat(parts)
