"""What the worker holds for one sequence between steps: its tokens, block table and sampling setup,
and the check that a new one is something the model can take."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from libs.protocol.messages import ImageSpan, SamplingParams

if TYPE_CHECKING:
    import torch

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
    image_spans: tuple[ImageSpan, ...] = ()  # its prompt's images
    # span index -> its embeddings [length, hidden], while a prefill chunk still needs them
    image_embeds: dict[int, torch.Tensor] = field(default_factory=dict)

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


def input_error(state: SequenceState, vocab_size: int, max_num_tokens: int) -> str | None:
    """Why the model cannot take a new sequence, or None: its tokens must be ids the embedding
    table has and positions the model has. The gateway checks the same; this guards the step
    against any other sender (one bad row would fail the whole forward)."""
    if not state.num_prompt_tokens:
        return "the prompt is empty"
    if state.num_tokens > max_num_tokens:
        return f"{state.num_tokens} tokens exceed the model's {max_num_tokens} positions"
    if max(state.token_ids) >= vocab_size:
        bad = next(t for t in state.token_ids if t >= vocab_size)
        return f"token id {bad} is outside the model's vocabulary of {vocab_size}"
    stop = [t for t in state.stop_token_ids if not 0 <= t < vocab_size]
    if stop:
        return f"stop token id {min(stop)} is outside the model's vocabulary of {vocab_size}"
    return None
