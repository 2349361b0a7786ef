"""Text <-> token ids for a GGUF model (byte-level BPE via HF `tokenizers`), and streaming detokenization.

The GGUF stores vocabulary, merges, token types, special ids and the chat template as metadata;
building the tokenizer from them means reading the whole metadata block (seconds), so the built
tokenizer is cached as JSON in a caller-given dir, keyed by the model fingerprint.
"""

from __future__ import annotations

import codecs
import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from libs.modelfiles.gguf_metadata import read_gguf_header
from libs.modelfiles.registry import model_fingerprint
from libs.recipe.conversation import RecipeError

# Bump when the cached layout or the build rules change: old cache files are then rebuilt.
_CACHE_FORMAT: Final = "deepinfer-tokenizer-v1"
_CONTROL: Final = 3  # llama.cpp token type: control (special) token
_USER_DEFINED: Final = 4  # llama.cpp token type: added token matched whole, not special


def _gpt2_byte_table() -> dict[int, str]:
    """GPT-2's reversible byte -> printable char table used to spell byte-level BPE tokens."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE: Final[Mapping[int, str]] = MappingProxyType(_gpt2_byte_table())
_UNICODE_TO_BYTE: Final[Mapping[str, int]] = MappingProxyType({c: b for b, c in BYTE_TO_UNICODE.items()})


def _token_bytes(token: str) -> bytes:
    """The bytes a vocabulary entry stands for (as the ByteLevel decoder does: raw UTF-8 if not spelled)."""
    if all(char in _UNICODE_TO_BYTE for char in token):
        return bytes(_UNICODE_TO_BYTE[char] for char in token)
    return token.encode("utf-8")


class Tokenizer:
    """A model's tokenizer (from a GGUF or an HF directory): encode/decode plus the ids and chat
    template the recipe needs."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self._plain: HFTokenizer | None = None  # the backend without its added vocabulary, built on use
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.special_token_ids: frozenset[int] = frozenset(
            token_id for token_id, added in backend.get_added_tokens_decoder().items() if added.special
        )
        # Per-id bytes for streaming detokenization: byte-level tokens may split a UTF-8 character.
        self._bytes: list[bytes] = [b""] * self.vocab_size
        for token, token_id in backend.get_vocab(with_added_tokens=True).items():
            if 0 <= token_id < self.vocab_size:
                self._bytes[token_id] = _token_bytes(token)

    @classmethod
    def from_gguf(cls, path: Path, cache_dir: Path | None) -> Tokenizer:
        """Build from a GGUF's metadata, or load the copy cached in cache_dir (None: no cache)."""
        path = Path(path)
        cache_file = None
        if cache_dir is not None:
            cache_file = Path(cache_dir) / f"{path.stem}-{model_fingerprint(path)}.tokenizer.json"
            cached = _read_cache(cache_file)
            if cached is not None:
                return cls._from_record(cached)
        record = _build_record(path)
        if cache_file is not None:
            _write_cache(cache_file, record)
        return cls._from_record(record)

    @classmethod
    def from_hf_dir(cls, directory: Path) -> Tokenizer:
        """Build from an HF checkpoint directory: tokenizer.json, and tokenizer_config.json's BOS /
        EOS spellings, add_bos_token and chat template (or chat_template.jinja)."""
        directory = Path(directory)
        try:
            backend = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises its own untyped exceptions
            raise ValueError(f"{directory / 'tokenizer.json'}: no usable tokenizer ({e})") from None
        config_path = directory / "tokenizer_config.json"
        try:
            config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except (OSError, ValueError) as e:
            raise ValueError(f"{config_path}: unreadable ({e})") from None
        template = config.get("chat_template")
        template_file = directory / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()

        def token_id(field: str) -> int | None:
            value = config.get(field)
            spelling = value.get("content") if isinstance(value, dict) else value
            if spelling is None:
                return None
            found = backend.token_to_id(spelling)
            if found is None:
                raise ValueError(f"{config_path}: {field} {spelling!r} is not in tokenizer.json")
            return int(found)

        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            add_bos=bool(config.get("add_bos_token", False)),
            chat_template=template if isinstance(template, str) else None,
        )

    @classmethod
    def _from_record(cls, record: dict[str, Any]) -> Tokenizer:
        return cls(
            HFTokenizer.from_str(record["tokenizer"]),
            bos_token_id=record["bos_token_id"],
            eos_token_id=record["eos_token_id"],
            add_bos=record["add_bos"],
            chat_template=record["chat_template"],
        )

    @property
    def bos_token(self) -> str:
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self.id_to_token(self.eos_token_id) if self.eos_token_id is not None else ""

    def id_to_token(self, token_id: int) -> str:
        return self._backend.id_to_token(token_id) or ""

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of text; special-token text (`<|im_start|>`) maps to its id. BOS per the GGUF flag."""
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of untrusted text: a special token's spelling stays plain text (no injection)."""
        if self._plain is None:
            record = json.loads(self._backend.to_str())
            record["added_tokens"] = []
            self._plain = HFTokenizer.from_str(json.dumps(record))
        ids: list[int] = self._plain.encode(text, add_special_tokens=False).ids
        return ids

    def special_id(self, spelling: str) -> int:
        """The id of an added (special) token by its spelling; RecipeError when there is none."""
        token_id = self._backend.token_to_id(spelling)
        if token_id is None:
            raise RecipeError(f"special token {spelling!r} is not in this model's vocabulary")
        return int(token_id)

    def added_token_ids(self, spellings: Sequence[str]) -> dict[str, int]:
        """The ids of those ``spellings`` the vocabulary has as one token each, by spelling."""
        ids = {spelling: self._backend.token_to_id(spelling) for spelling in spellings}
        return {spelling: int(token_id) for spelling, token_id in ids.items() if token_id is not None}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (special tokens: their text as UTF-8; unknown ids: b"").

        Unknown ids are tolerated like `decode` does: a model's embedding table may be padded past
        the tokenizer's vocabulary.
        """
        return self._bytes[token_id] if 0 <= token_id < self.vocab_size else b""


class IncrementalDetokenizer:
    """Turns one request's generated ids into text deltas, holding back incomplete UTF-8.

    Invariant: the concatenation of every `add` result and `flush` equals
    `tokenizer.decode(all_ids, skip_special_tokens)`, and no delta contains a character split
    across tokens (so streaming never shows U+FFFD for valid text). Text is never re-emitted.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        keep_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._tokenizer = tokenizer
        # Special tokens to keep although skipping: those that spell an output parser's markers.
        self._skipped = tokenizer.special_token_ids - keep_token_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return only the text they complete (possibly empty)."""
        tok = self._tokenizer
        chunk = b"".join(tok.token_bytes(token_id) for token_id in token_ids if token_id not in self._skipped)
        return self._decoder.decode(chunk, final=False) if chunk else ""

    def flush(self) -> str:
        """End of stream: whatever bytes were held back (an incomplete character becomes U+FFFD)."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


def _read_fields(path: Path) -> dict[str, Any]:
    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
    metadata = read_gguf_header(path, full_arrays=arrays).metadata
    return {key: value for key, value in metadata.items() if key.startswith("tokenizer.")}


def _build_record(path: Path) -> dict[str, Any]:
    """Everything Tokenizer needs, as JSON-able values (the HF tokenizer as its JSON string)."""
    fields = _read_fields(path)
    model = fields.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{path.name}: tokenizer model {model!r} is not supported (only byte-level 'gpt2')")
    backend = _build_byte_level_bpe(fields, path.name)
    return {
        "format": _CACHE_FORMAT,
        "tokenizer": backend.to_str(),
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "add_bos": bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": fields.get("tokenizer.chat_template"),
    }


def _pre_tokenizer(pre: str | None, name: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # As SmolLM2's own tokenizer.json: every digit on its own, then GPT-2's split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in (None, "default", "gpt2"):
        return byte_level
    raise ValueError(f"{name}: tokenizer pre-tokenizer {pre!r} is not supported (smollm, gpt2, default)")


def _build_byte_level_bpe(fields: dict[str, Any], name: str) -> HFTokenizer:
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    token_types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelled = set(BYTE_TO_UNICODE.values())
    # Entries not written in the byte alphabet are respelled, as transformers' GGUF converter does.
    vocab = {
        token if set(token) <= spelled else "".join(BYTE_TO_UNICODE[b] for b in token.encode("utf-8")): i
        for i, token in enumerate(tokens)
    }
    merges = [tuple(merge.split(" ", 1)) for merge in fields["tokenizer.ggml.merges"]]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre"), name)
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel; skip it.
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, token_types, strict=True)
        if kind == _CONTROL and set(t) <= spelled
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, token_types, strict=True)
        if kind == _USER_DEFINED and t in vocab
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user)
    return backend


def _read_cache(cache_file: Path) -> dict[str, Any] | None:
    try:
        record: dict[str, Any] = json.loads(cache_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if record.get("format") == _CACHE_FORMAT else None


def _write_cache(cache_file: Path, record: dict[str, Any]) -> None:
    """Private temp file in the same dir, then rename: concurrent readers never see a partial file."""
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=cache_file.parent, prefix=f".{cache_file.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, ensure_ascii=False)
        os.chmod(tmp_name, 0o644)  # mkstemp makes it 0600; other workers may read the cache
        os.replace(tmp_name, cache_file)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
