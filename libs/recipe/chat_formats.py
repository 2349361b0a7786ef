"""Which chat format a served model speaks: its own Jinja template, or DeepSeek V4 / V4.1. Pure.

Every format turns a ``Conversation`` into a ``Prompt``: the token ids, and how the output parser
must read what the model writes (syntax, the stage the prompt leaves the model in). Only a
template format renders images; the DeepSeek formats refuse a conversation that has any.
"""

from __future__ import annotations

from typing import Literal, Protocol

from libs.recipe.api.common import UNSUPPORTED_INPUT
from libs.recipe.chat_template import ChatTemplate
from libs.recipe.conversation import Conversation, RecipeError
from libs.recipe.deepseek_v4 import DeepSeekV4Format, encode_prompt
from libs.recipe.template_format import Prompt, TemplateFormat
from libs.recipe.tokenizer import Tokenizer

FORMATS = ("template", "deepseek-v4", "deepseek-v4.1")


class ChatFormat(Protocol):
    def prompt(self, conv: Conversation) -> Prompt: ...


class DeepSeekChatFormat:
    """DeepSeek V4 / V4.1, rendered as the deepseek-recipe wheel does; DSML tool calls."""

    def __init__(self, version: Literal["v4", "v4.1"], tokenizer: Tokenizer) -> None:
        self.renderer = DeepSeekV4Format(version)
        self.tokenizer = tokenizer

    def prompt(self, conv: Conversation) -> Prompt:
        image = next((image for message in conv.messages for image in message.images), None)
        if image is not None:  # DeepSeek V4 reads no images
            raise RecipeError(UNSUPPORTED_INPUT.format(kind="image"), param=image.param)
        layout = self.renderer.layout(conv)  # one rendering: the prompt and how to read the output
        token_ids = encode_prompt(layout.prompt, self.tokenizer)
        dialect = self.renderer.dialect
        return Prompt(token_ids, "deepseek", layout.stage, layout.tools_on, layout.thinking, dsml=dialect)


def make_chat_format(name: str, template: ChatTemplate | None, tokenizer: Tokenizer) -> ChatFormat:
    if name == "template":
        if template is None:
            raise ValueError("the model has no chat template: choose a chat format")
        return TemplateFormat(template, tokenizer)
    if name == "deepseek-v4":
        return DeepSeekChatFormat("v4", tokenizer)
    if name == "deepseek-v4.1":
        return DeepSeekChatFormat("v4.1", tokenizer)
    raise ValueError(f"unknown chat format {name!r}: one of {', '.join(FORMATS)}")
