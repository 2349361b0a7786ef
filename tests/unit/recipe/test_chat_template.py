"""Chat template rendering: SmolLM2's ChatML from its GGUF, and the sandbox."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.recipe.chat_template import ChatTemplate, render_chat
from libs.recipe.tokenizer import Tokenizer

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def smollm2_template(smollm2_path: Path, model_cache_dir: Path) -> str:
    template = Tokenizer.from_gguf(smollm2_path, model_cache_dir).chat_template
    assert template is not None
    return template


def test_chatml_with_default_system_prompt(smollm2_template: str) -> None:
    prompt = render_chat(smollm2_template, [{"role": "user", "content": "What is the capital of France?"}])
    assert prompt == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_own_system_prompt_replaces_default_and_multi_turn(smollm2_template: str) -> None:
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2+2?"},
    ]
    prompt = render_chat(smollm2_template, messages, add_generation_prompt=False)
    assert DEFAULT_SYSTEM not in prompt
    assert prompt == (
        "<|im_start|>system\nBe terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
    )


def test_tokens_and_helpers_are_available() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m.content | tojson }}{% endfor %}{{ eos_token }}",
        bos_token="<s>",
        eos_token="</s>",
    )
    assert template.render([{"role": "user", "content": 'café "q"'}]) == '<s>"café \\"q\\""</s>'


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__ }}",
        "{{ messages[0].__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{{ messages[0].content.__len__() }}",
    ],
)
def test_sandbox_blocks_dunder_access(source: str) -> None:
    with pytest.raises(ValueError, match="unsafe"):
        render_chat(source, [{"role": "user", "content": "x"}])


def test_sandbox_blocks_mutation() -> None:
    with pytest.raises(ValueError, match="unsafe"):
        render_chat("{{ messages.append({'role': 'x'}) }}", [{"role": "user", "content": "x"}])


def test_raise_exception_becomes_value_error() -> None:
    source = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    with pytest.raises(ValueError, match="first must be user"):
        render_chat(source, [{"role": "assistant", "content": "x"}])


def test_syntax_and_render_errors_become_value_error() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ValueError, match="TypeError"):
        render_chat("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "x"}])
