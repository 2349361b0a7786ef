"""Log lines as text or JSON, each carrying the request id of the task that logged it (and of
the tasks it started), none outside a request."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest

from libs.runtime.logs import request_scope, set_request_id, setup_logging


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """The log output, in a buffer; the root logger restored afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield io.StringIO()
    root.handlers[:] = handlers
    root.setLevel(level)


def install(buffer: io.StringIO, log_format: str) -> None:
    setup_logging("info", "gateway", log_format)
    logging.getLogger().handlers[0].setStream(buffer)  # type: ignore[attr-defined]


def test_json_lines_carry_the_request_id_of_their_task(captured: io.StringIO) -> None:
    buffer = captured
    install(buffer, "json")
    log = logging.getLogger("services.gateway.test")

    async def handle(request_id: str) -> None:
        set_request_id(request_id)
        log.info("admitted")
        await asyncio.gather(asyncio.create_task(child()))  # a task it starts inherits the id

    async def child() -> None:
        await asyncio.sleep(0)
        log.warning("streaming")

    async def main() -> None:
        await asyncio.gather(handle("chatcmpl-a"), handle("chatcmpl-b"))
        log.info("fleet line")

    asyncio.run(main())
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    by_request = sorted((line.get("request_id", ""), line["message"]) for line in lines)
    assert by_request == [
        ("", "fleet line"),
        ("chatcmpl-a", "admitted"),
        ("chatcmpl-a", "streaming"),
        ("chatcmpl-b", "admitted"),
        ("chatcmpl-b", "streaming"),
    ]
    assert all(line["service"] == "gateway" and line["logger"] == "services.gateway.test" for line in lines)
    assert {line["level"] for line in lines} == {"INFO", "WARNING"} and lines[0]["ts"].endswith("+00:00")


def test_a_traceback_is_one_json_line(captured: io.StringIO) -> None:
    buffer = captured
    install(buffer, "json")
    with request_scope("cmpl-x"):
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("t").exception("failed")
    (line,) = buffer.getvalue().splitlines()
    record = json.loads(line)
    assert record["request_id"] == "cmpl-x" and "RuntimeError: boom" in record["exc_info"]


def test_text_lines_end_with_the_request_id(captured: io.StringIO) -> None:
    buffer = captured
    install(buffer, "text")
    log = logging.getLogger("t")
    with request_scope("msg_1"):
        log.info("paused")
    log.info("reconnected")
    first, second = buffer.getvalue().splitlines()
    assert first.endswith("gateway INFO t: paused [msg_1]") and second.endswith("gateway INFO t: reconnected")


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log_format"):
        setup_logging("info", "gateway", "yaml")
