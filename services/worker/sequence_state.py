"""What the worker holds for one sequence between steps: its tokens, block table and sampling setup."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from libs.protocol.messages import SamplingParams

if TYPE_CHECKING:
    from services.worker.grammar import SequenceGrammar


@dataclass(eq=False)
class SequenceState:
    seq_id: str
    token_ids: list[int]  # prompt + outputs; a just-sampled token's KV is not in the cache yet
    num_prompt_tokens: int
    sampling_params: SamplingParams
    stop_token_ids: frozenset[int]  # masked while fewer than min_tokens outputs exist
    block_table: list[int]  # KV page ids, assigned by the scheduler
    num_computed_tokens: int  # tokens whose KV is in the cache
    grammar: SequenceGrammar | None = None  # its structured-output constraint, if any

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
