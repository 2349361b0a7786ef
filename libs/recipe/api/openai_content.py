"""What Chat and Responses messages spell alike: a message's role, and its content as text and images. Pure.

Each API keeps its own tables (role names, part types, how its image part is spelled); this module
reads a message with them, so both refuse bad roles, misplaced images and media parts in the same
words. An image is a data URL (``data:<media type>;base64,<payload>``, decoded here) or an http(s)
URL (kept for the gateway to fetch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from libs.recipe.api.common import UNSUPPORTED_INPUT, join_text, strict_base64, web_url
from libs.recipe.conversation import IMAGE_MARK, IMAGE_MEDIA_TYPES, ImageInput, Role
from libs.recipe.fields import ApiError, lookup, shown

DETAILS = ("auto", "low", "high")

ImageReader = Callable[[dict[str, Any], str], ImageInput]  # (the image part, its path) -> the image


@dataclass(frozen=True, slots=True)
class PartTypes:
    """An API's content part types: its text parts, its image part (and how to read one), and the
    other media parts, each with the name its refusal calls it (that input is not supported)."""

    text: tuple[str, ...]
    image: str
    read_image: ImageReader
    media: dict[str, str]


def message_role(item: dict[str, Any], roles: dict[str, Role], where: str) -> Role:
    """The Conversation role of ``item["role"]``, through the API's table of the names it accepts."""
    role = lookup(roles, item.get("role"))
    if role is None:
        raise ApiError(
            400, f"'{where}.role' must be one of {', '.join(map(repr, roles))}", param=f"{where}.role"
        )
    return role


def client_text(text: str, where: str) -> str:
    """``text`` as sent, refused when it holds the image mark: a client cannot forge an image slot."""
    if IMAGE_MARK in text:
        raise ApiError(400, f"'{where}' must not contain the reserved text {IMAGE_MARK!r}", param=where)
    return text


def _data_url(url: str, where: str, param: str, detail: str) -> ImageInput:
    header, comma, payload = url[len("data:") :].partition(",")
    media_type, *parameters = header.split(";")  # parameters (name=...) before ";base64" are allowed
    if not comma or not parameters or parameters[-1].lower() != "base64":
        raise ApiError(
            400, f"'{param}' must be a data URL of the form data:<media type>;base64,<data>", param=param
        )
    media_type = media_type.lower()
    media_type = "image/jpeg" if media_type == "image/jpg" else media_type  # a common misspelling
    if media_type not in IMAGE_MEDIA_TYPES:
        types = ", ".join(map(repr, IMAGE_MEDIA_TYPES))
        raise ApiError(400, f"'{param}' must have an image media type, one of {types}", param=param)
    data = strict_base64(payload)
    if not data:
        raise ApiError(400, f"'{param}' must hold the image as non-empty, valid base64 data", param=param)
    return ImageInput(where, data=data, media_type=media_type, detail=detail)


def image_input(url: str, where: str, param: str, detail: str | None) -> ImageInput:
    """The image of part ``where`` from its URL (the field ``param``): a data URL, decoded, or an
    http(s) URL, kept as it is."""
    if url[:5].lower() == "data:":
        return _data_url(url, where, param, detail or "auto")
    if not web_url(url):
        raise ApiError(
            400, f"'{param}' must be a base64 data URL or an http(s) URL, got {shown(url)}", param=param
        )
    return ImageInput(where, url=url, detail=detail or "auto")


def _part(part: Any, where: str, types: PartTypes, user: bool) -> tuple[str, ImageInput | None]:
    """One part: (its text, None), or (IMAGE_MARK, its image)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == types.image and isinstance(part, dict):
        if not user:
            message = f"Invalid '{where}': image content parts are only allowed in messages with role 'user'"
            raise ApiError(400, message, param=where)
        return IMAGE_MARK, types.read_image(part, where)
    medium = lookup(types.media, kind)
    if medium is not None:
        raise ApiError(400, UNSUPPORTED_INPUT.format(kind=medium), param=where)
    # A refusal part (an earlier assistant turn's refusal) is text under its own key.
    key = "refusal" if kind == "refusal" else "text"
    if kind not in (*types.text, "refusal") or not isinstance(part.get(key), str):
        raise ApiError(400, f"'{where}' must be a text content part", param=where)
    return client_text(part[key], f"{where}.{key}"), None


def message_content(
    content: Any, where: str, types: PartTypes, user: bool
) -> tuple[str, tuple[ImageInput, ...]]:
    """A string, or parts joined: text parts as they are, each image part an ``IMAGE_MARK`` (images
    are read only in a ``user`` message's content; anywhere else an image part is a 400)."""
    if isinstance(content, str):
        return client_text(content, where), ()
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}' must be a string or an array of content parts", param=where)
    parts = [_part(part, f"{where}[{j}]", types, user) for j, part in enumerate(content)]
    return join_text([text for text, _ in parts]), tuple(image for _, image in parts if image is not None)
