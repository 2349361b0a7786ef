"""Render a model's Jinja chat template (from its GGUF metadata) into the prompt text, sandboxed.

Templates come with model files, so they are untrusted code: they run in jinja2's
ImmutableSandboxedEnvironment (no dunder access, no mutation of the messages), with the same
globals and options transformers' `apply_chat_template` provides.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# What a template may raise while rendering bad input (e.g. `'a' + None` on a missing content):
# all of it is the caller's bad request or the template's bug, reported as ValueError.
_RENDER_ERRORS = (TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError)


class ChatTemplateRejected(TemplateError):
    """Raised by the template itself through `raise_exception(message)`."""


class _SandboxEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, but an unsafe attribute raises at once instead of rendering as ''."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateRejected(message)


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    # Like transformers: no HTML escaping and non-ASCII kept, unlike jinja2's own tojson.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template; render() turns messages into the prompt string."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        env = _SandboxEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            line = getattr(exc, "lineno", None)
            raise ValueError(f"chat template does not compile (line {line}): {exc}") from exc
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for messages ({"role", "content"} dicts); extra names reach the template."""
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
            "messages": [dict(message) for message in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(context)
        except ChatTemplateRejected as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from exc
        except _RENDER_ERRORS as exc:
            raise ValueError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """One-shot compile + render; keep a ChatTemplate instead when rendering many prompts."""
    chat = ChatTemplate(template, bos_token=bos_token, eos_token=eos_token)
    return chat.render(messages, add_generation_prompt=add_generation_prompt)
