"""Image slots expanded into the model's image tokens, each run spanned by its image's hash."""

from __future__ import annotations

import pytest

from libs.protocol.messages import ImageSpan
from libs.recipe.conversation import IMAGE_SLOT, ImageInput
from libs.recipe.image_slots import expand_image_slots
from libs.recipe.template_format import Prompt

A, B = b"a" * 32, b"b" * 32


def prompt(*token_ids: int) -> Prompt:
    images = tuple(ImageInput(f"p{i}") for i in range(token_ids.count(IMAGE_SLOT)))
    return Prompt(list(token_ids), "plain", "content", False, False, images=images)


def test_each_slot_becomes_a_run_of_image_tokens_named_by_its_image() -> None:
    out = expand_image_slots(prompt(1, IMAGE_SLOT, 2, IMAGE_SLOT), [A, B], 9, 3)
    assert out.token_ids == [1, 9, 9, 9, 2, 9, 9, 9]
    assert out.image_spans == (ImageSpan(A, 1, 3), ImageSpan(B, 5, 3)) and out.images == ()


def test_images_and_slots_must_agree() -> None:
    with pytest.raises(ValueError, match="1 images for 2 image slots"):
        expand_image_slots(prompt(IMAGE_SLOT, IMAGE_SLOT), [A], 9, 3)
