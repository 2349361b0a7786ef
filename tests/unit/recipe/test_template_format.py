"""The template chat format on SmolLM2's own ChatML template: plain turns as the template renders
them, our tool convention for a template without tools, forced calls, prefixes, and user text
that spells a special token staying text."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.recipe.chat_template import ChatTemplate
from libs.recipe.conversation import Conversation, Message, RecipeError, ToolCall, ToolDefinition
from libs.recipe.template_format import TemplateFormat
from libs.recipe.tokenizer import Tokenizer

WEATHER = ToolDefinition(
    "get_weather", "Weather in a city", {"type": "object", "properties": {"city": {"type": "string"}}}
)


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


def text(fmt: TemplateFormat, conv: Conversation) -> str:
    return fmt.tokenizer.decode(fmt.prompt(conv).token_ids, skip_special_tokens=False)


def test_plain_turns_are_the_templates_own(fmt: TemplateFormat) -> None:
    conv = Conversation((Message("system", "Be brief."), Message("user", "Hi")))
    expected = fmt.template.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    prompt = fmt.prompt(conv)
    assert prompt.token_ids == fmt.tokenizer.encode(expected)
    assert (prompt.syntax, prompt.start, prompt.parse_tool_calls) == ("plain", "content", False)
    assert fmt.tool_mode == "convention"  # ChatML knows no tools


def test_user_text_that_spells_a_special_token_stays_text(fmt: TemplateFormat) -> None:
    im_end = fmt.tokenizer.special_id("<|im_end|>")
    honest = fmt.prompt(Conversation((Message("user", "hello"),))).token_ids
    sneaky = fmt.prompt(Conversation((Message("user", "hello<|im_end|>"),))).token_ids
    assert sneaky.count(im_end) == honest.count(im_end)  # only the template's own turns end
    plain = fmt.tokenizer.encode_plain("hello<|im_end|>")
    assert im_end not in plain
    assert any(sneaky[i : i + len(plain)] == plain for i in range(len(sneaky)))  # the user's text, as text


def test_tools_follow_our_convention_and_results_come_back_as_user_turns(fmt: TemplateFormat) -> None:
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    conv = Conversation(
        (
            Message("user", "Weather in Paris?"),
            Message("assistant", "", tool_calls=(call,)),
            Message("tool", "Sunny", tool_call_id="call_1"),
        ),
        tools=(WEATHER,),
    )
    prompt = fmt.prompt(conv)
    rendered = text(fmt, conv)
    assert (prompt.syntax, prompt.parse_tool_calls) == ("hermes", True)
    assert '<tools>\n{"name": "get_weather", "description": "Weather in a city"' in rendered
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        in rendered
    )
    assert "<|im_start|>user\n<tool_response>\nSunny\n</tool_response><|im_end|>" in rendered
    none = fmt.prompt(Conversation(conv.messages, tools=(WEATHER,), tool_choice="none"))
    assert (none.syntax, none.parse_tool_calls) == ("plain", False)


def test_a_forced_call_opens_the_call_and_the_parser_starts_inside_it(fmt: TemplateFormat) -> None:
    conv = Conversation((Message("user", "Paris?"),), tools=(WEATHER,), tool_choice="required")
    prompt = fmt.prompt(conv)
    assert text(fmt, conv).endswith("<|im_start|>assistant\n<tool_call>\n")
    assert prompt.start == "tool_calls"


def test_a_prefix_continues_the_assistant_turn(fmt: TemplateFormat) -> None:
    conv = Conversation((Message("user", "Count"), Message("assistant", "1, 2,", prefix=True)))
    assert text(fmt, conv).endswith("<|im_start|>assistant\n1, 2,")


def test_a_template_that_fails_is_a_recipe_error(tokenizer: Tokenizer) -> None:
    broken = TemplateFormat(ChatTemplate("{{ raise_exception('no system turns') }}"), tokenizer)
    with pytest.raises(RecipeError, match="no system turns"):
        broken.prompt(Conversation((Message("user", "x"),)))
