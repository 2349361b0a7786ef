"""Request fields that steer a hosted API's own machinery (moderation, regions, speed tiers, access
programs, cache diagnostics, compaction): each is checked against the shape its SDK sends and then
has no effect here. A value that would promise what this server cannot keep is refused instead,
saying why. docs/sdk-compat.md lists what each field means for this server. Pure."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from libs.recipe.api.common import check_fields, one_of, refuse
from libs.recipe.fields import ApiError, optional_bool, optional_dict, optional_str

Unknown = Callable[[str], str]  # an API's wording of the 400 for a field it does not know

PROMPT_CACHE_TTLS = ("30m", "12h")  # Chat's SDK types only "30m"; Responses' both
CHAT_PROMPT_CACHE_KEYS = ("mode", "ttl")
RESPONSES_PROMPT_CACHE_KEYS = ("mode", "ttl", "prewarm", "comparison_response_id")


def strict_object(
    obj: dict[str, Any], key: str, allowed: tuple[str, ...], unknown: Unknown, param: str | None = None
) -> dict[str, Any] | None:
    """``obj[key]``: an object (None when absent) holding only ``allowed`` keys."""
    where = param or key
    value = optional_dict(obj, key, where)
    if value is not None:
        check_fields(value, allowed, unknown, prefix=f"{where}.")
    return value


def moderation(body: dict[str, Any], unknown: Unknown) -> None:
    """OpenAI's ``moderation: {model, policy: {input, output: {mode}}}``. No moderation model runs
    here: "score" is inert (no moderation results come back), and "block" is refused, since a client
    that asks for blocking must not go on believing it is protected."""
    spec = strict_object(body, "moderation", ("model", "policy"), unknown)
    if spec is None:
        return
    if not isinstance(spec.get("model"), str) or not spec["model"]:
        raise ApiError(400, "'moderation.model' is required and must be a string", param="moderation.model")
    policy = strict_object(spec, "policy", ("input", "output"), unknown, "moderation.policy") or {}
    for side in ("input", "output"):
        where = f"moderation.policy.{side}"
        entry = strict_object(policy, side, ("mode",), unknown, where)
        if entry is None:
            continue
        if entry.get("mode") is None:
            raise ApiError(400, f"'{where}.mode' is required", param=f"{where}.mode")
        if one_of(entry, "mode", ("score", "block"), f"{where}.mode") == "block":
            refuse(f"{where}.mode", "this server runs no moderation model, so nothing would be blocked")


def prompt_cache_options(body: dict[str, Any], unknown: Unknown, keys: tuple[str, ...]) -> None:
    """OpenAI's ``prompt_cache_options``. The prefix cache here is always on and content-addressed,
    with no breakpoints to place, so ``mode`` is inert; ``ttl`` is a minimum lifetime, which no
    retention class promises under memory pressure (a class is chosen by ``prompt_cache_retention``
    or the class header); ``comparison_response_id`` asks for diagnostics that are not produced.
    ``prewarm: true`` (fill the cache, generate nothing) is refused: this server would generate."""
    options = strict_object(body, "prompt_cache_options", keys, unknown)
    if options is None:
        return
    one_of(options, "mode", ("implicit", "explicit"), "prompt_cache_options.mode")
    one_of(options, "ttl", PROMPT_CACHE_TTLS, "prompt_cache_options.ttl")
    optional_str(options, "comparison_response_id", "prompt_cache_options.comparison_response_id")
    if optional_bool(options, "prewarm", "prompt_cache_options.prewarm"):
        why = "every request here generates; send the prompt with a small max_output_tokens to warm the cache"
        refuse("prompt_cache_options.prewarm", why)


def access_programs(body: dict[str, Any], unknown: Unknown) -> None:
    """OpenAI's ``access_programs: {cyber}``: its programs gate OpenAI's models; every caller here
    gets the served model as it is."""
    programs = strict_object(body, "access_programs", ("cyber",), unknown)
    if programs is not None:
        one_of(programs, "cyber", ("standard", "daybreak_blue", "daybreak_red"), "access_programs.cyber")


def background_options(body: dict[str, Any], unknown: Unknown) -> None:
    """OpenAI's ``background_options``: a background response here starts as soon as it is admitted,
    which meets any ``completion_window``; ``continuation_id`` is a prioritisation hint, unused."""
    keys = ("completion_window", "continuation_id")
    options = strict_object(body, "background_options", keys, unknown)
    if options is not None:
        windows = ("soonest", "2h", "8h")
        one_of(options, "completion_window", windows, "background_options.completion_window")
        optional_str(options, "continuation_id", "background_options.continuation_id")


def image_options(body: dict[str, Any], unknown: Unknown) -> None:
    """OpenAI's ``image: {context_compression}``: images reach the model as its format renders them."""
    options = strict_object(body, "image", ("context_compression",), unknown)
    if options is not None:
        modes = ("auto", "enabled", "disabled")
        one_of(options, "context_compression", modes, "image.context_compression")


def context_management(body: dict[str, Any], unknown: Unknown) -> None:
    """OpenAI's Responses ``context_management: [{type: "compaction", compact_threshold}]``: nothing
    is compacted here; an input past the context window is the 400 it is without this field."""
    entries = body.get("context_management")
    if entries is None:
        return
    if not isinstance(entries, list):
        raise ApiError(400, "'context_management' must be an array", param="context_management")
    for i, entry in enumerate(entries):
        where = f"context_management[{i}]"
        if not isinstance(entry, dict):
            raise ApiError(400, f"'{where}' must be an object", param=where)
        check_fields(entry, ("type", "compact_threshold"), unknown, prefix=f"{where}.")
        if entry.get("type") != "compaction":
            raise ApiError(400, f"'{where}.type' must be 'compaction'", param=f"{where}.type")
        threshold = entry.get("compact_threshold")
        if threshold is not None and (type(threshold) is not int or threshold < 1):
            message = f"'{where}.compact_threshold' must be a positive integer"
            raise ApiError(400, message, param=f"{where}.compact_threshold")


def responses_stream_options(body: dict[str, Any], unknown: Unknown) -> None:
    """Responses' ``stream_options: {include_obfuscation}``: no obfuscation padding is sent either
    way (it masks payload sizes on networks the server does not control)."""
    options = strict_object(body, "stream_options", ("include_obfuscation",), unknown)
    if options is not None:
        optional_bool(options, "include_obfuscation", "stream_options.include_obfuscation")


def anthropic_options(body: dict[str, Any], unknown: Unknown) -> None:
    """Anthropic's ``speed`` (one speed here), ``inference_geo`` (inference runs where this server
    does), ``service_tier`` (no tiers) and ``diagnostics`` (no cache-miss report is produced)."""
    one_of(body, "speed", ("standard", "fast"))
    optional_str(body, "inference_geo")
    optional_str(body, "service_tier")
    diagnostics = strict_object(body, "diagnostics", ("previous_message_id",), unknown)
    if diagnostics is not None:
        optional_str(diagnostics, "previous_message_id", "diagnostics.previous_message_id")
