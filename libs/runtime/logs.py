"""Log lines of every service: text or JSON (``--log-format``), each tagged with the request it
concerns.

``request_scope(request_id)`` marks the current asyncio task (and the tasks it starts) as working
on that request: every line logged there carries ``request_id``, as a JSON field or a
``[request_id]`` suffix. The gateway sets it where a request is admitted or resumed, the
scheduler where it places, cancels or pauses one; lines about the fleet (a worker lost, a
reconnect) carry none. JSON lines: ``ts`` (ISO 8601, UTC), ``level``, ``service``, ``logger``,
``message``, ``request_id`` when set, ``exc_info`` with a traceback.
"""

from __future__ import annotations

import contextvars
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Final

LOG_FORMATS: Final = ("text", "json")
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("deepinfer_request_id", default="")


@contextmanager
def request_scope(request_id: str) -> Iterator[None]:
    """Lines logged inside (and in tasks started inside) carry ``request_id``."""
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        REQUEST_ID.reset(token)


def set_request_id(request_id: str) -> None:
    """Tag the rest of the current task (an HTTP request's, a submit's) with ``request_id``."""
    REQUEST_ID.set(request_id)


class RequestIdFilter(logging.Filter):
    """Puts the current request id on every record (``request_id``; ``request_tag`` for text)."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = REQUEST_ID.get()
        record.request_id = request_id
        record.request_tag = f" [{request_id}]" if request_id else ""
        return True


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", "")
        if request_id:
            line["request_id"] = request_id
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def setup_logging(level: str, name: str, log_format: str = "text") -> None:
    """The root logger of a service process: ``log_format`` text (one readable line) or json."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter(name))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s%(request_tag)s")
        )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
