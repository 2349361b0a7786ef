"""GET /dashboard: a live page of the gateway's numbers (one self-contained HTML file, whose script
polls this gateway's /metrics and draws them)."""

from __future__ import annotations

from importlib.resources import files
from typing import Final

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

# Read once, at import: a package missing its page fails at startup, not on the first visit.
PAGE: Final = files("services.gateway").joinpath("dashboard.html").read_bytes()

HEADERS: Final = {
    # The page loads nothing from elsewhere: inline script and style, and fetches to this origin only.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


async def dashboard(request: Request) -> Response:
    return HTMLResponse(PAGE, headers=HEADERS)
