from __future__ import annotations

import argparse
import dataclasses

import pytest

from libs.runtime.settings import add_config_args, build_config, resolve_cache_dir, to_argv
from services.worker.config import Config


def parse(argv: list[str], env: dict[str, str]) -> Config:
    parser = argparse.ArgumentParser()
    add_config_args(parser, Config)
    return build_config(Config, parser.parse_args(argv), env)


def test_flag_beats_env_beats_default() -> None:
    assert parse([], {}).max_num_seqs == 32
    assert parse([], {"DEEPINFER_MAX_NUM_SEQS": "8"}).max_num_seqs == 8
    assert parse(["--max-num-seqs", "4"], {"DEEPINFER_MAX_NUM_SEQS": "8"}).max_num_seqs == 4


def test_bad_values_name_the_key() -> None:
    with pytest.raises(ValueError, match="DEEPINFER_MAX_NUM_SEQS"):
        parse([], {"DEEPINFER_MAX_NUM_SEQS": "many"})
    with pytest.raises(ValueError, match="dtype"):
        parse(["--dtype", "int3"], {})
    with pytest.raises(ValueError, match="max_num_seqs"):
        parse(["--max-num-seqs", "0"], {})


def test_to_argv_round_trips() -> None:
    config = parse(["--dtype", "float32", "--kv-cache-gb", "0.5"], {})
    assert parse(to_argv(config), {}) == config


def test_cache_dir() -> None:
    assert resolve_cache_dir("/x", {}) == "/x"
    assert resolve_cache_dir("", {"XDG_CACHE_HOME": "/c"}) == "/c/deepinfer"
    assert resolve_cache_dir("", {"HOME": "/h"}) == "/h/.cache/deepinfer"


@dataclasses.dataclass(frozen=True)
class _Percent:
    share: float = dataclasses.field(default=0.1, metadata={"help": "a share, ~10% by default"})


def test_every_services_help_formats() -> None:
    """argparse formats help text with %: a literal % in a field's help (the scheduler's overlap
    flag once said "~10% slower") must not break --help, and prints as written."""
    from services.gateway.config import Config as GatewayConfig
    from services.kvcache.config import Config as KVCacheConfig
    from services.scheduler.config import Config as SchedulerConfig

    for cls in (Config, SchedulerConfig, GatewayConfig, KVCacheConfig, _Percent):
        parser = argparse.ArgumentParser()
        add_config_args(parser, cls)
        text = parser.format_help()
        assert "option_strings" not in text and "%(" not in text, cls
    assert "~10% by default" in " ".join(text.split())
