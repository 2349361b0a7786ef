"""What Chat and Responses messages spell alike: a message's role and its text content. Pure.

Each API keeps its own tables (role names, text part types, media part types); this module reads a
message with them, so both refuse bad roles and media parts in the same words.
"""

from __future__ import annotations

from typing import Any

from libs.recipe.api.common import UNSUPPORTED_INPUT, join_text
from libs.recipe.conversation import Role
from libs.recipe.fields import ApiError, lookup


def message_role(item: dict[str, Any], roles: dict[str, Role], where: str) -> Role:
    """The Conversation role of ``item["role"]``, through the API's table of the names it accepts."""
    role = lookup(roles, item.get("role"))
    if role is None:
        raise ApiError(
            400, f"'{where}.role' must be one of {', '.join(map(repr, roles))}", param=f"{where}.role"
        )
    return role


def _part_text(part: Any, where: str, text_kinds: tuple[str, ...], media: dict[str, str]) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    medium = lookup(media, kind)
    if medium is not None:
        raise ApiError(400, UNSUPPORTED_INPUT.format(kind=medium), param=where)
    # A refusal part (an earlier assistant turn's refusal) is text under its own key.
    key = "refusal" if kind == "refusal" else "text"
    if kind not in (*text_kinds, "refusal") or not isinstance(part.get(key), str):
        raise ApiError(400, f"'{where}' must be a text content part", param=where)
    return str(part[key])


def content_text(content: Any, where: str, text_kinds: tuple[str, ...], media: dict[str, str]) -> str:
    """A string, or text parts joined. ``text_kinds``: the API's text part types; ``media``: its
    media part types, each with the name a refusal calls it (media input is not supported)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}' must be a string or an array of content parts", param=where)
    return join_text([_part_text(part, f"{where}[{j}]", text_kinds, media) for j, part in enumerate(content)])
