"""Fixtures shared by the service tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.scheduler.config import Config
from tests.service.scheduler_harness import Stack, running


@pytest.fixture(params=[True, False], ids=["overlap", "no-overlap"])
async def scheduler_stack(request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    """A scheduler service with one scripted worker, with overlap on and off."""
    async with running(Config(scheduler_id="s1", max_num_waiting=4, overlap=request.param)) as parts:
        yield parts
