from __future__ import annotations

import argparse

import pytest

from deepinfer.settings import build_config
from services.gateway.config import Config


def test_retry_after_from_env_and_validated() -> None:
    assert Config().retry_after_s == 1
    config = build_config(Config, argparse.Namespace(), {"DEEPINFER_RETRY_AFTER_S": "5"})
    assert config.retry_after_s == 5
    with pytest.raises(ValueError, match="retry_after_s"):
        Config(retry_after_s=0)
