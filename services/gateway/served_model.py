"""The model as the gateway sees it: names, tokenizer, chat format, context window."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from libs.grammar.sandbox import CompileLimits
from libs.modelfiles.gguf_metadata import read_gguf_config
from libs.modelfiles.llava_config import read_llava_config
from libs.modelfiles.registry import (
    is_vision_model,
    model_fingerprint,
    read_hf_shape,
    resolve_model_path,
)
from libs.protocol.messages import SamplingParams
from libs.recipe.chat_formats import ChatFormat, make_chat_format
from libs.recipe.chat_template import ChatTemplate
from libs.recipe.constraints import structured_output
from libs.recipe.conversation import Conversation, RecipeError
from libs.recipe.dsml import THINK_END
from libs.recipe.fields import ApiError, check_vocabulary
from libs.recipe.grammar_markup import grammar_vocab_of
from libs.recipe.output_parser import MARKER_SPELLINGS
from libs.recipe.template_format import Prompt
from libs.recipe.tokenizer import Tokenizer
from services.gateway.grammar_check import GrammarCheck


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """What the gateway must know of a vision-language model's images: the placeholder token, how
    many of it an image becomes, and whose encoders to ask (the checkpoint's fingerprint)."""

    image_token_id: int
    num_image_tokens: int
    fingerprint: str

    @classmethod
    def of(cls, path: Path) -> VisionSpec | None:
        """A LLaVA-style checkpoint's, or None for a model that takes no images."""
        if not is_vision_model(path):
            return None
        config = read_llava_config(path)
        return cls(config.image_token_id, config.num_image_tokens, model_fingerprint(path))


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    aliases: frozenset[str]  # other ids clients may send (e.g. the --model spec)
    tokenizer: Tokenizer
    chat_format: ChatFormat
    max_model_len: int
    eos_token_id: int
    keep_token_ids: frozenset[int]  # special tokens the output parser must see
    grammar_backend: str = "xgrammar"  # which backend enforces structured outputs
    reasoning_end: tuple[int, ...] = ()  # the tokens that close the model's reasoning
    # Token ids the model has: its embedding rows (the GGUF's vocab_size, which may pad past the
    # tokenizer), or the tokenizer's size where that is unknown (0). See ``num_token_ids``.
    vocab_size: int = 0
    # Bounded, cached compile checks of constraints; None: unchecked here (a worker bounds its own
    # compiles and fails a bad constraint's sequence alone).
    grammar: GrammarCheck | None = None
    # The parser's markers that are one (added) token each, by spelling: grammars name them by id
    markup_ids: Mapping[str, int] = field(default_factory=dict)
    vision: VisionSpec | None = None  # None: the model takes no images

    @classmethod
    def load(
        cls,
        spec: str,
        cache_dir: str,
        served_name: str,
        max_model_len: int,
        chat_format: str = "template",
        grammar_backend: str = "xgrammar",
        grammar_limits: CompileLimits | None = None,
    ) -> ServedModel:
        path = resolve_model_path(spec)
        if path.is_dir():  # an HF checkpoint: tokenizer and template beside config.json
            tokenizer = Tokenizer.from_hf_dir(path)
            num_positions, vocab_size = read_hf_shape(path)
        else:
            tokenizer = Tokenizer.from_gguf(path, Path(cache_dir))
            config = read_gguf_config(path)  # its vocab_size falls back to the token list's length
            num_positions, vocab_size = config.max_position_embeddings, config.vocab_size
        max_model_len = max_model_len or num_positions
        if tokenizer.eos_token_id is None:
            raise ValueError(f"model {spec!r}: the model names no EOS token")
        template = None
        if tokenizer.chat_template is not None:
            template = ChatTemplate(
                tokenizer.chat_template, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token
            )
        name = served_name or path.name.split(".")[0]
        aliases = frozenset({spec, path.name})
        specials = tokenizer.special_token_ids
        keep = frozenset(i for i in specials if tokenizer.id_to_token(i) in MARKER_SPELLINGS)
        speaks = make_chat_format(chat_format, template, tokenizer)
        eos_id = tokenizer.eos_token_id
        # </think> as its special token where the vocabulary has one, else as plain text
        think_end = [i for i in keep if tokenizer.id_to_token(i) == THINK_END]
        reasoning_end = tuple(think_end or tokenizer.encode_plain(THINK_END))
        return cls(
            name,
            aliases,
            tokenizer,
            speaks,
            max_model_len,
            eos_id,
            keep,
            grammar_backend,
            reasoning_end,
            vocab_size,
            GrammarCheck(grammar_vocab_of(tokenizer, vocab_size or tokenizer.vocab_size), grammar_limits),
            markup_token_ids(tokenizer),
            VisionSpec.of(path),
        )

    @property
    def num_token_ids(self) -> int:
        """How many token ids a request may use: 0 to num_token_ids - 1."""
        return self.vocab_size or self.tokenizer.vocab_size

    def card(self) -> dict[str, Any]:
        return {
            "id": self.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "deepinfer",
            "max_model_len": self.max_model_len,
        }

    def check_model(self, model: str) -> None:
        if model != self.name and model not in self.aliases:
            raise ApiError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")

    def prompt(self, conversation: Conversation, format_param: str = "response_format") -> Prompt:
        """The prompt tokens, with the output constraint the conversation asks for (checked: a bad
        one is a 400). ``format_param`` is what the client's API calls its response format."""
        try:
            prompt = self.chat_format.prompt(conversation)
            constraint = structured_output(
                conversation,
                prompt,
                backend=self.grammar_backend,
                reasoning_end=self.reasoning_end,
                markup_ids=self.markup_ids,
            )
        except RecipeError as exc:
            param = exc.param or "messages"
            param = format_param if param == "response_format" else param
            raise ApiError(400, exc.message, param=param) from exc
        if constraint is None:
            return prompt
        # With tools on, the constraint is theirs: beside forced tools a format has no content to
        # shape, and beside auto tools it is a 400 (libs/recipe/constraints.py).
        from_tools = bool(conversation.tools) and conversation.tool_choice != "none"
        if self.grammar is not None:
            self.grammar.check(constraint, "tools" if from_tools else format_param)
        return replace(prompt, structured_output=constraint)

    def encode_text(self, text: str) -> list[int]:
        """A raw prompt (Completions): the client's text is the prompt, special tokens included."""
        return self.tokenizer.encode(text)

    def check_token_ids(self, token_ids: list[int], params: SamplingParams) -> None:
        """400 for a token id the model has no embedding for (it would fail the worker's step, or
        a bias would go to no token)."""
        check_vocabulary(token_ids, self.num_token_ids, "prompt")
        check_vocabulary(params.stop_token_ids, self.num_token_ids, "stop_token_ids")
        check_vocabulary([b.token_id for b in params.logit_bias], self.num_token_ids, "logit_bias")

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The request's max_tokens, defaulting to what the context window leaves; 400 if it does not fit."""
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is None:
            max_tokens = room
        if max_tokens < 1 or num_prompt_tokens + max_tokens > self.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens


def markup_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The output parser's markers that the vocabulary has as one added token, special or not."""
    return tokenizer.added_token_ids(MARKER_SPELLINGS)
