"""Who sent a request, as the API-key check (services/gateway/auth.py) admitted it: its tenant and
priority, kept in the ASGI scope's state for the routes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from starlette.requests import Request

CALLER_KEY: Final = "deepinfer.caller"  # in the ASGI scope's "state"


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str = ""  # the key's tenant; "": keys are off (anonymous)
    priority: int = 0  # lower runs first
    key_label: str = ""
    weight: float = 1.0  # the tenant's share of admissions when tenants wait together


ANONYMOUS: Final = Caller()


def caller_of(request: Request) -> Caller:
    """The caller the key check admitted (ANONYMOUS when keys are off)."""
    caller = request.scope.get("state", {}).get(CALLER_KEY)
    return caller if isinstance(caller, Caller) else ANONYMOUS
