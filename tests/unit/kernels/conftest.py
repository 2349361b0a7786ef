"""Fixtures shared by the kernel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from libs.kernels import cpu_ext


@pytest.fixture
def extension_off() -> Iterator[None]:
    """The CPU extension turned off (`--cpu-kernels false`): the torch paths run."""
    cpu_ext.configure(enabled=False)
    try:
        yield
    finally:
        cpu_ext.configure(enabled=True)
