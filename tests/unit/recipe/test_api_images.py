"""Image inputs in each API's request: parsed into the user message's ImageInputs (an IMAGE_MARK in
its text for each, in order), and every bad or misplaced image -> a 400 naming the field."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from libs.recipe.api import parse_chat_request, parse_messages_request, parse_responses_request
from libs.recipe.conversation import IMAGE_MARK, ImageInput, Message
from tests.unit.recipe.api_helpers import MODEL, USER, assert_names_field

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"
B64 = base64.b64encode(PNG).decode()
DATA_URL = f"data:image/png;base64,{B64}"
WEB_URL = "https://images.example.com/cat.jpg"


def chat(*content: Any, role: str = "user") -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": role, "content": list(content)}]}


def chat_image(url: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def responses(*content: Any, role: str = "user") -> dict[str, Any]:
    return {"model": MODEL, "input": [{"role": role, "content": list(content)}]}


def responses_image(url: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "input_image", "image_url": url, **extra}


def anthropic(*content: Any, role: str = "user", **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 2048,
        "messages": [{"role": role, "content": list(content)}],
        **fields,
    }


def anthropic_image(data: str = B64, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def text(value: str, kind: str = "text") -> dict[str, Any]:
    return {"type": kind, "text": value}


def chat_messages(request: dict[str, Any]) -> tuple[Message, ...]:
    return parse_chat_request(request).conversation.messages


def responses_messages(request: dict[str, Any]) -> tuple[Message, ...]:
    return parse_responses_request(request).conversation().messages


def anthropic_messages(request: dict[str, Any]) -> tuple[Message, ...]:
    return parse_messages_request(request).conversation.messages


# --- Chat Completions ------------------------------------------------------------------------


def test_chat_data_url_is_decoded_with_its_media_type_and_detail() -> None:
    (message,) = chat_messages(chat(text("What is it?"), chat_image(DATA_URL, detail="low")))
    assert message.content == f"What is it?\n\n{IMAGE_MARK}"
    assert message.images == (
        ImageInput("messages[0].content[1]", data=PNG, media_type="image/png", detail="low"),
    )


def test_chat_data_url_parameters_and_the_jpg_spelling_are_accepted() -> None:
    url = f"data:image/JPG;name=cat.jpg;base64,{B64}"
    (message,) = chat_messages(chat(chat_image(url)))
    assert message.images[0].media_type == "image/jpeg" and message.images[0].data == PNG


def test_chat_web_url_is_kept_and_a_plain_string_image_url_is_accepted() -> None:
    part = {"type": "image_url", "image_url": WEB_URL}
    (message,) = chat_messages(chat(part, chat_image("HTTP://x.org/a.png")))
    assert message.images == (
        ImageInput("messages[0].content[0]", url=WEB_URL),
        ImageInput("messages[0].content[1]", url="HTTP://x.org/a.png"),
    )


def test_chat_images_keep_their_places_among_the_text() -> None:
    request = chat(text("a"), chat_image(WEB_URL), text("b"), chat_image(DATA_URL, detail="high"))
    (message,) = chat_messages(request)
    assert message.content == f"a\n\n{IMAGE_MARK}\n\nb\n\n{IMAGE_MARK}"
    assert [(i.param, i.url, i.data, i.detail) for i in message.images] == [
        ("messages[0].content[1]", WEB_URL, b"", "auto"),
        ("messages[0].content[3]", "", PNG, "high"),
    ]


CHAT_BAD: dict[str, tuple[dict[str, Any], str, str]] = {
    "bad_base64": (
        chat(chat_image("data:image/png;base64,abc*")),
        "messages[0].content[0].image_url.url",
        "valid base64",
    ),
    "unpadded_base64": (
        chat(chat_image("data:image/png;base64,iVBORw0")),
        "messages[0].content[0].image_url.url",
        "valid base64",
    ),
    "media_type": (
        chat(chat_image(f"data:image/tiff;base64,{B64}")),
        "messages[0].content[0].image_url.url",
        "image media type",
    ),
    "not_base64": (
        chat(chat_image("data:image/png,rawbytes")),
        "messages[0].content[0].image_url.url",
        "data:<media type>;base64,<data>",
    ),
    "empty_data": (
        chat(chat_image("data:image/png;base64,")),
        "messages[0].content[0].image_url.url",
        "non-empty",
    ),
    "file_url": (
        chat(chat_image("file:///etc/passwd")),
        "messages[0].content[0].image_url.url",
        "http(s) URL",
    ),
    "no_host": (chat(chat_image("https://")), "messages[0].content[0].image_url.url", "http(s) URL"),
    "string_file_url": (
        chat({"type": "image_url", "image_url": "ftp://x/a.png"}),
        "messages[0].content[0].image_url",
        "http(s) URL",
    ),
    "no_url": (
        chat({"type": "image_url", "image_url": {}}),
        "messages[0].content[0].image_url.url",
        "string",
    ),
    "image_url_type": (
        chat({"type": "image_url", "image_url": 3}),
        "messages[0].content[0].image_url",
        "object",
    ),
    "detail": (
        chat(chat_image(WEB_URL, detail="max")),
        "messages[0].content[0].image_url.detail",
        "'auto', 'low', 'high'",
    ),
    "in_assistant": (
        {"model": MODEL, "messages": [*USER, {"role": "assistant", "content": [chat_image(WEB_URL)]}]},
        "messages[1].content[0]",
        "only allowed in messages with role 'user'",
    ),
    "in_developer": (
        chat(chat_image(WEB_URL), role="developer"),
        "messages[0].content[0]",
        "only allowed in messages with role 'user'",
    ),
    "mark_in_string": (
        {"model": MODEL, "messages": [{"role": "user", "content": f"x{IMAGE_MARK}"}]},
        "messages[0].content",
        "reserved",
    ),
    "mark_in_part": (chat(text("a"), text(IMAGE_MARK)), "messages[0].content[1].text", "reserved"),
    "mark_in_system": (chat(text(IMAGE_MARK), role="system"), "messages[0].content[0].text", "reserved"),
    "audio": (chat({"type": "input_audio", "input_audio": {}}), "messages[0].content[0]", "audio input"),
    "file": (chat({"type": "file", "file": {}}), "messages[0].content[0]", "file input is not supported"),
}


@pytest.mark.parametrize("name", list(CHAT_BAD))
def test_chat_bad_image_is_a_400_naming_the_field(name: str) -> None:
    assert_names_field(parse_chat_request, *CHAT_BAD[name])


def test_chat_image_in_a_tool_message_is_a_400() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        *USER,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": [chat_image(WEB_URL)]},
    ]
    assert_names_field(
        parse_chat_request, {"model": MODEL, "messages": messages}, "messages[2].content[0]", "role 'user'"
    )


# --- Responses -------------------------------------------------------------------------------


def test_responses_input_image_is_parsed_in_order() -> None:
    request = responses(
        text("Compare", "input_text"), responses_image(DATA_URL, detail="high"), responses_image(WEB_URL)
    )
    (message,) = responses_messages(request)
    assert message.content == f"Compare\n\n{IMAGE_MARK}\n\n{IMAGE_MARK}"
    assert message.images == (
        ImageInput("input[0].content[1]", data=PNG, media_type="image/png", detail="high"),
        ImageInput("input[0].content[2]", url=WEB_URL),
    )


RESPONSES_BAD: dict[str, tuple[dict[str, Any], str, str]] = {
    "file_id": (
        responses({"type": "input_image", "file_id": "file-1"}),
        "input[0].content[0].file_id",
        "no file store",
    ),
    "no_url": (responses({"type": "input_image"}), "input[0].content[0].image_url", "required"),
    "bad_base64": (
        responses(responses_image("data:image/png;base64,!!!!")),
        "input[0].content[0].image_url",
        "valid base64",
    ),
    "media_type": (
        responses(responses_image(f"data:text/plain;base64,{B64}")),
        "input[0].content[0].image_url",
        "image media type",
    ),
    "file_url": (responses(responses_image("file:///x.png")), "input[0].content[0].image_url", "http(s)"),
    "detail": (responses(responses_image(WEB_URL, detail="ultra")), "input[0].content[0].detail", "'low'"),
    "in_system": (responses(responses_image(WEB_URL), role="system"), "input[0].content[0]", "role 'user'"),
    "in_assistant": (
        responses(responses_image(WEB_URL), role="assistant"),
        "input[0].content[0]",
        "role 'user'",
    ),
    "mark_in_string": ({"model": MODEL, "input": f"a{IMAGE_MARK}b"}, "input", "reserved"),
    "mark_in_part": (responses(text(IMAGE_MARK, "input_text")), "input[0].content[0].text", "reserved"),
    "input_file": (responses({"type": "input_file", "file_id": "f"}), "input[0].content[0]", "file input"),
    "input_audio": (responses({"type": "input_audio"}), "input[0].content[0]", "audio input"),
}


@pytest.mark.parametrize("name", list(RESPONSES_BAD))
def test_responses_bad_image_is_a_400_naming_the_field(name: str) -> None:
    assert_names_field(parse_responses_request, *RESPONSES_BAD[name])


def test_responses_image_in_a_function_call_output_is_a_400() -> None:
    items = [
        {"role": "user", "content": "q"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [responses_image(WEB_URL)]},
    ]
    assert_names_field(
        parse_responses_request, {"model": MODEL, "input": items}, "input[2].output[0]", "role 'user'"
    )


# --- Anthropic Messages ----------------------------------------------------------------------


def test_anthropic_base64_and_url_images_are_parsed_among_text() -> None:
    url = {"type": "image", "source": {"type": "url", "url": WEB_URL}}
    (message,) = anthropic_messages(anthropic(anthropic_image(media_type="image/gif"), text("and"), url))
    assert message.content == f"{IMAGE_MARK}\n\nand\n\n{IMAGE_MARK}"
    assert message.images == (
        ImageInput("messages[0].content[0]", data=PNG, media_type="image/gif"),
        ImageInput("messages[0].content[2]", url=WEB_URL),
    )


def test_anthropic_images_follow_tool_results_in_their_own_user_message() -> None:
    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "done"}
    request = anthropic(text("go"))
    request["messages"] += [
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result, anthropic_image(), text("see")]},
    ]
    request["tools"] = [{"name": "f", "input_schema": {"type": "object"}}]
    *_, tool, user = anthropic_messages(request)
    assert (tool.role, tool.content, tool.images) == ("tool", "done", ())
    assert (user.content, [i.param for i in user.images]) == (
        f"{IMAGE_MARK}\n\nsee",
        ["messages[2].content[1]"],
    )


def _with_history(*content: Any, role: str) -> dict[str, Any]:
    request = anthropic(text("q"))
    request["messages"].append({"role": role, "content": list(content)})
    return request


ANTHROPIC_BAD: dict[str, tuple[dict[str, Any], str, str]] = {
    "source_type": (
        anthropic({"type": "image", "source": {"type": "file", "file_id": "f"}}),
        "messages[0].content[0].source.type",
        "'base64' or 'url'",
    ),
    "no_source": (anthropic({"type": "image"}), "messages[0].content[0].source", "valid dictionary"),
    "media_type": (
        anthropic(anthropic_image(media_type="image/bmp")),
        "messages[0].content[0].source.media_type",
        "'image/jpeg', 'image/png', 'image/gif' or 'image/webp'",
    ),
    "bad_base64": (
        anthropic(anthropic_image(data="not base64!")),
        "messages[0].content[0].source.data",
        "base64",
    ),
    "empty_data": (anthropic(anthropic_image(data="")), "messages[0].content[0].source.data", "non-empty"),
    "data_url": (anthropic(anthropic_image(data=DATA_URL)), "messages[0].content[0].source.data", "base64"),
    "file_url": (
        anthropic({"type": "image", "source": {"type": "url", "url": "file:///x"}}),
        "messages[0].content[0].source.url",
        "http or https",
    ),
    "in_assistant": (
        _with_history(anthropic_image(), role="assistant"),
        "messages[1].content[0]",
        "only allowed in the content of user messages",
    ),
    "in_system": (anthropic(text("q"), system=[anthropic_image()]), "system[0]", "only allowed"),
    "in_tool_result": (
        anthropic({"type": "tool_result", "tool_use_id": "t", "content": [anthropic_image()]}),
        "messages[0].content[0].content[0]",
        "only allowed",
    ),
    "mark_in_text": (anthropic(text(f"a{IMAGE_MARK}")), "messages[0].content[0].text", "reserved"),
    "mark_in_string": (
        {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": IMAGE_MARK}]},
        "messages[0].content[0].text",
        "reserved",
    ),
    "mark_in_system": (anthropic(text("q"), system=IMAGE_MARK), "system", "reserved"),
    "mark_in_tool_result": (
        anthropic({"type": "tool_result", "tool_use_id": "t", "content": IMAGE_MARK}),
        "messages[0].content[0].content",
        "reserved",
    ),
    "mark_in_assistant": (
        _with_history(text(IMAGE_MARK), role="assistant"),
        "messages[1].content[0].text",
        "reserved",
    ),
    "document": (anthropic({"type": "document", "source": {}}), "messages[0].content[0]", "document input"),
}


@pytest.mark.parametrize("name", list(ANTHROPIC_BAD))
def test_anthropic_bad_image_is_a_400_naming_the_field(name: str) -> None:
    assert_names_field(parse_messages_request, *ANTHROPIC_BAD[name])
