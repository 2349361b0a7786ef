"""One running stack (real nats-server, real model in fp32) shared by the system tests of a session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.system.stack import Stack


@pytest.fixture(scope="session")
def stack(model_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log = tmp_path_factory.mktemp("stack") / "stack.log"
    running = Stack.start(model_cache_dir, log, dtype="float32")
    yield running
    running.stop()
