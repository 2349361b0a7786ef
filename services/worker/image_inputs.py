"""The image embeddings a step's prefill rows need, read from the media store by content hash.

An encoder wrote each image's vision-tower output (``[length, hidden]``, safetensors) under its
hash before the request was submitted; a row whose chunk reaches an image's tokens takes those
rows of it in place of the placeholder tokens' embeddings. A sequence keeps the images it still
needs (loaded on first use, dropped once its prompt is computed past them), so a long image split
over several prefill chunks is read once. A missing or misshapen output fails that sequence alone.
"""

from __future__ import annotations

import torch
from safetensors.torch import load as load_safetensors

from libs.kvstore.media_store import EMBEDS_TENSOR, MediaStore
from services.worker.sequence_state import SequenceState
from services.worker.step_rows import ImageRows, StepRow


class ImageInputError(ValueError):
    """One sequence's image output is unusable: the forward fails, and is rerun row by row, so
    that sequence fails alone (services/worker/row_isolation.py)."""


class ImageInputs:
    def __init__(
        self, store: MediaStore, fingerprint: str, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device

    def missing(self, state: SequenceState) -> str | None:
        """Why a new sequence's images cannot be had (an output the cache no longer holds), or
        None. Only images past its computed prefix count: a cached prefix needs none."""
        for span in state.image_spans:
            if span.end > state.num_computed_tokens and not self.store.has_embeds(
                self.fingerprint, span.mm_hash
            ):
                return f"the encoder output of image {span.mm_hash.hex()[:16]} is not in the media store"
        return None

    def gather(self, rows: list[StepRow]) -> ImageRows | None:
        """The image rows of a step laid out as ``rows`` (in order, each ``num_tokens`` long from
        its ``num_computed_tokens``); None when no row reaches an image."""
        positions: list[int] = []
        pieces: list[torch.Tensor] = []
        base = 0
        for row in rows:
            state = row.state
            start = state.num_computed_tokens
            end = start + row.num_tokens
            for i, span in enumerate(state.image_spans):
                first, last = max(start, span.offset), min(end, span.end)
                if first < last:
                    embeds = self._embeds(state, i)
                    pieces.append(embeds[first - span.offset : last - span.offset])
                    positions += range(base + first - start, base + last - start)
                if span.end <= end:
                    # computed by this step: not needed again (a rerun of the step reads it again)
                    state.image_embeds.pop(i, None)
            base += row.num_tokens
        if not positions:
            return None
        return ImageRows(positions, torch.cat(pieces).to(self.device, self.dtype))

    def _embeds(self, state: SequenceState, index: int) -> torch.Tensor:
        held = state.image_embeds.get(index)
        if held is not None:
            return held
        span = state.image_spans[index]
        try:
            data = self.store.read_embeds(self.fingerprint, span.mm_hash)
            embeds = load_safetensors(data)[EMBEDS_TENSOR]
        except (OSError, KeyError, ValueError, RuntimeError) as exc:
            raise ImageInputError(
                f"image {span.mm_hash.hex()[:16]}: no usable encoder output ({exc})"
            ) from None
        if tuple(embeds.shape) != (span.length, self.hidden_size):
            why = f"encoder output {tuple(embeds.shape)}, expected ({span.length}, {self.hidden_size})"
            raise ImageInputError(f"image {span.mm_hash.hex()[:16]}: {why}")
        state.image_embeds[index] = embeds
        return embeds
