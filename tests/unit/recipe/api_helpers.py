"""What the recipe's API request tests share: the model their bodies name, and how a 400 is checked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from libs.recipe.fields import ApiError

# V4.1: the wheel converts a developer message to system for it (V4 would make it a user turn).
MODEL = "DeepSeek-V4.1-Flash"
USER = [{"role": "user", "content": "Hi"}]


def rejected(parse: Callable[[Any], object], request: dict[str, Any]) -> ApiError:
    """The 400 that ``parse`` raises for ``request``; anything else fails the test."""
    with pytest.raises(ApiError) as info:
        parse(request)
    assert info.value.status == 400
    return info.value


def assert_names_field(
    parse: Callable[[Any], object], request: dict[str, Any], param: str, fragment: str
) -> None:
    """``request`` is a 400 whose param is ``param`` and whose message contains ``fragment``."""
    err = rejected(parse, request)
    assert err.param == param
    assert fragment in err.message
