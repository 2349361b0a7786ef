"""Images through the chat formats: the template format writes one IMAGE_SLOT id where each image
sits (SmolLM2's ChatML template) and lists the images in slot order; a template that drops or
repeats a message with images is a RecipeError; the DeepSeek formats refuse images."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.recipe.chat_formats import DeepSeekChatFormat
from libs.recipe.chat_template import ChatTemplate
from libs.recipe.conversation import (
    IMAGE_MARK,
    IMAGE_SLOT,
    Conversation,
    ImageInput,
    Message,
    RecipeError,
    ToolDefinition,
)
from libs.recipe.template_format import TemplateFormat
from libs.recipe.tokenizer import Tokenizer

CAT = ImageInput("messages[0].content[1]", data=b"\x89PNG", media_type="image/png")
DOG = ImageInput("messages[0].content[3]", url="https://example.com/dog.jpg", detail="low")
BIRD = ImageInput("messages[2].content[0]", url="https://example.com/bird.jpg")


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path, model_cache_dir: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path, model_cache_dir)


@pytest.fixture(scope="module")
def fmt(tokenizer: Tokenizer) -> TemplateFormat:
    assert tokenizer.chat_template is not None
    template = ChatTemplate(
        tokenizer.chat_template, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token
    )
    return TemplateFormat(template, tokenizer)


def two_images() -> Conversation:
    content = f"Look\n\n{IMAGE_MARK}\n\nand\n\n{IMAGE_MARK}"
    return Conversation((Message("system", "Be brief."), Message("user", content, images=(CAT, DOG))))


def slots(ids: list[int]) -> list[int]:
    return [i for i, token in enumerate(ids) if token == IMAGE_SLOT]


def test_each_image_is_one_slot_where_it_sits(fmt: TemplateFormat) -> None:
    prompt = fmt.prompt(two_images())
    ids = prompt.token_ids
    first, second = slots(ids)
    rendered = fmt.template.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Look\n\n@\n\nand\n\n@"}]
    )
    head, middle, tail = rendered.split("@")  # the prompt text around the two images
    pieces = (ids[:first], ids[first + 1 : second], ids[second + 1 :])
    assert [fmt.tokenizer.decode(p, skip_special_tokens=False) for p in pieces] == [head, middle, tail]
    assert IMAGE_SLOT not in pieces[0] + pieces[1] + pieces[2]
    assert prompt.images == (CAT, DOG)


def test_the_text_between_images_is_plain_text(fmt: TemplateFormat) -> None:
    im_end = fmt.tokenizer.special_id("<|im_end|>")
    honest = fmt.prompt(Conversation((Message("user", "hello"),))).token_ids
    conv = Conversation((Message("user", f"hello<|im_end|>{IMAGE_MARK}", images=(CAT,)),))
    ids = fmt.prompt(conv).token_ids
    assert ids.count(im_end) == honest.count(im_end)  # only the template's own turns end
    assert ids.count(IMAGE_SLOT) == 1


def test_images_are_listed_in_the_order_of_their_slots(tokenizer: Tokenizer) -> None:
    reversing = TemplateFormat(
        ChatTemplate("{% for m in messages | reverse %}{{ m.role }}: {{ m.content }}\n{% endfor %}"),
        tokenizer,
    )
    conv = Conversation(
        (
            Message("user", f"{IMAGE_MARK} {IMAGE_MARK}", images=(CAT, DOG)),
            Message("assistant", "Two pets."),
            Message("user", f"And {IMAGE_MARK}?", images=(BIRD,)),
        )
    )
    prompt = reversing.prompt(conv)
    assert len(slots(prompt.token_ids)) == 3
    assert prompt.images == (BIRD, CAT, DOG)


@pytest.mark.parametrize(
    "source",
    [
        "{% for m in messages[1:] %}{{ m.content }}{% endfor %}",  # drops the message with the images
        "{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}",  # writes it twice
        "{% for m in messages %}{{ m.content[1:] }}{% endfor %}",  # cuts it
    ],
)
def test_a_template_that_does_not_keep_each_image_once_is_a_recipe_error(
    tokenizer: Tokenizer, source: str
) -> None:
    conv = Conversation((Message("user", IMAGE_MARK, images=(CAT,)), Message("assistant", "ok")))
    with pytest.raises(RecipeError):
        TemplateFormat(ChatTemplate(source), tokenizer).prompt(conv)


def test_marks_that_do_not_match_the_images_are_a_recipe_error(fmt: TemplateFormat) -> None:
    with pytest.raises(RecipeError) as info:
        fmt.prompt(Conversation((Message("user", "no mark here", images=(CAT,)),)))
    assert info.value.param == CAT.param


def test_a_mark_outside_the_image_messages_is_only_text(fmt: TemplateFormat) -> None:
    tool = ToolDefinition("f", f"spells {IMAGE_MARK}", {"type": "object"})
    conv = Conversation((Message("user", IMAGE_MARK, images=(DOG,)),), tools=(tool,))
    prompt = fmt.prompt(conv)
    assert prompt.token_ids.count(IMAGE_SLOT) == 1 and prompt.images == (DOG,)


def test_no_images_no_slots(fmt: TemplateFormat) -> None:
    prompt = fmt.prompt(Conversation((Message("user", "Hi"),)))
    assert IMAGE_SLOT not in prompt.token_ids and prompt.images == ()


@pytest.mark.parametrize("version", ["v4", "v4.1"])
def test_deepseek_formats_refuse_images(tokenizer: Tokenizer, version: str) -> None:
    conv = Conversation((Message("user", "Hi"), Message("user", f"{IMAGE_MARK}", images=(BIRD, CAT))))
    with pytest.raises(RecipeError) as info:
        DeepSeekChatFormat(version, tokenizer).prompt(conv)  # type: ignore[arg-type]
    assert (info.value.message, info.value.param) == (
        "image input is not supported by this model",
        BIRD.param,
    )
