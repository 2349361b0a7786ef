"""The image embeddings a step's prefill rows need, read from the media store by content hash.

An encoder wrote each image's vision-tower output (``[length, hidden]``, safetensors) under its
hash before the request was submitted; a row whose chunk reaches an image's tokens takes those
rows of it in place of the placeholder tokens' embeddings. Outputs are read before the forward
(``load``), so a missing or misshapen one fails that sequence alone, never the step. A sequence
keeps the images it still needs (read on first use, dropped at its first step past them), so an
image split over several prefill chunks is read once.
"""

from __future__ import annotations

import torch
from safetensors.torch import load as load_safetensors

from libs.kvstore.media_store import EMBEDS_TENSOR, MediaStore
from libs.protocol.messages import ImageSpan
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

    def load(self, rows: list[StepRow], failed: dict[str, str]) -> list[StepRow]:
        """``rows`` less those whose chunk reaches an image whose output cannot be read (they go
        to ``failed``); the others hold every image their chunk needs, for ``gather``."""
        kept = []
        for row in rows:
            why = self._load_row(row)
            if why is None:
                kept.append(row)
            else:
                failed[row.seq_id] = why
        return kept

    def _load_row(self, row: StepRow) -> str | None:
        state = row.state
        start = state.num_computed_tokens
        end = start + row.num_tokens
        for i, span in enumerate(state.image_spans):
            if span.end <= start:
                state.image_embeds.pop(i, None)  # computed by an earlier step: not needed again
            elif span.offset < end and i not in state.image_embeds:
                try:
                    state.image_embeds[i] = self._read(span)
                except ImageInputError as exc:
                    return str(exc)
        return None

    def _read(self, span: ImageSpan) -> torch.Tensor:
        name = span.mm_hash.hex()[:16]
        try:
            data = self.store.read_embeds(self.fingerprint, span.mm_hash)
            embeds = load_safetensors(data)[EMBEDS_TENSOR]
        except FileNotFoundError:
            raise ImageInputError(f"the encoder output of image {name} is not in the media store") from None
        except (OSError, KeyError, ValueError, RuntimeError) as exc:
            raise ImageInputError(f"image {name}: no usable encoder output ({exc})") from None
        if tuple(embeds.shape) != (span.length, self.hidden_size):
            why = f"encoder output {tuple(embeds.shape)}, expected ({span.length}, {self.hidden_size})"
            raise ImageInputError(f"image {name}: {why}")
        return embeds

    def gather(self, rows: list[StepRow]) -> ImageRows | None:
        """The image rows of a step laid out as ``rows`` (in order, each ``num_tokens`` long from
        its ``num_computed_tokens``; ``load`` gave each the images it reaches); None when no row
        reaches an image."""
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
                    embeds = state.image_embeds[i]
                    pieces.append(embeds[first - span.offset : last - span.offset])
                    positions += range(base + first - start, base + last - start)
            base += row.num_tokens
        if not positions:
            return None
        return ImageRows(positions, torch.cat(pieces).to(self.device, self.dtype))
