"""A prompt's image slots expanded into the model's image tokens, and where each image sits. Pure.

A chat format writes one ``IMAGE_SLOT`` id per image; once the images are known by content hash,
each slot becomes the model's placeholder token ``num_image_tokens`` times (what its encoder
writes for one image), and an ``ImageSpan`` names the image those positions hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from libs.protocol.messages import ImageSpan
from libs.recipe.conversation import IMAGE_SLOT
from libs.recipe.template_format import Prompt


def expand_image_slots(
    prompt: Prompt, mm_hashes: Sequence[bytes], image_token_id: int, num_image_tokens: int
) -> Prompt:
    """``prompt`` with slot i replaced by ``num_image_tokens`` image tokens, spanned by
    ``mm_hashes[i]``; ``images`` emptied (they are spans now)."""
    if prompt.token_ids.count(IMAGE_SLOT) != len(mm_hashes):
        raise ValueError(f"{len(mm_hashes)} images for {prompt.token_ids.count(IMAGE_SLOT)} image slots")
    token_ids: list[int] = []
    spans: list[ImageSpan] = []
    for token_id in prompt.token_ids:
        if token_id != IMAGE_SLOT:
            token_ids.append(token_id)
            continue
        spans.append(ImageSpan(mm_hashes[len(spans)], len(token_ids), num_image_tokens))
        token_ids += [image_token_id] * num_image_tokens
    return replace(prompt, token_ids=token_ids, images=(), image_spans=tuple(spans))
