from __future__ import annotations

import argparse
import logging

import pytest

from libs.kvstore.retention import DEFAULT_RETENTION_CLASS, DEFAULT_RETENTION_CLASSES
from libs.runtime.settings import build_config
from services.gateway.config import Config
from services.gateway.main import warn_if_open


def test_retry_after_from_env_and_validated() -> None:
    assert Config().retry_after_s == 1
    config = build_config(Config, argparse.Namespace(), {"DEEPINFER_RETRY_AFTER_S": "5"})
    assert config.retry_after_s == 5
    with pytest.raises(ValueError, match="retry_after_s"):
        Config(retry_after_s=0)


def test_retention_flags_match_the_shared_defaults_and_bad_ones_name_their_key() -> None:
    config = Config()
    assert tuple(config.retention_policy.classes.values()) == DEFAULT_RETENTION_CLASSES
    assert config.retention_policy.default.name == DEFAULT_RETENTION_CLASS
    assert config.tenant_header == ""  # the tenant is the API key's hash unless an operator says so
    env = {"DEEPINFER_RETENTION_CLASSES": "a=1h,b=2d:3", "DEEPINFER_DEFAULT_RETENTION_CLASS": "b"}
    assert build_config(Config, argparse.Namespace(), env).retention_policy.default.ttl_s == 2 * 86400
    with pytest.raises(ValueError, match="retention_classes="):
        Config(retention_classes="agent=forever")
    with pytest.raises(ValueError, match="default_retention_class='gold'"):
        Config(default_retention_class="gold")
    with pytest.raises(ValueError, match="tenant_header"):
        Config(tenant_header="x tenant")


@pytest.mark.parametrize(
    ("host", "keys", "warned"),
    [
        ("127.0.0.1", "", False),
        ("localhost", "", False),
        ("::1", "", False),
        ("0.0.0.0", "", True),
        ("::", "", True),
        ("10.1.2.3", "", True),
        ("gateway.internal", "", True),
        ("0.0.0.0", "keys.json", False),
    ],
)
def test_a_public_address_without_keys_is_warned_about(
    host: str, keys: str, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        warn_if_open(Config(host=host, api_keys_file=keys))
    assert ("without API keys" in caplog.text) == warned
