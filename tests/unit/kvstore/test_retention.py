from __future__ import annotations

import pytest

from libs.kvstore.retention import (
    DEFAULT_RETENTION_CLASSES,
    SECONDS_PER_DAY,
    RetentionClass,
    RetentionPolicy,
    UnknownRetentionClass,
    eviction_key,
    expires_at,
    parse_retention_classes,
    parse_ttl,
)

NOW = 1_700_000_000.0


def test_defaults_agent_three_days_chat_seven() -> None:
    policy = RetentionPolicy()
    assert policy.default.name == "agent"
    assert expires_at(policy.get("agent"), NOW) == NOW + 3 * SECONDS_PER_DAY
    assert expires_at(policy.get("chat"), NOW) == NOW + 7 * SECONDS_PER_DAY
    assert policy.get("chat").priority > policy.get("agent").priority
    assert set(policy.classes) == {c.name for c in DEFAULT_RETENTION_CLASSES}


def test_expiry_with_an_injected_clock() -> None:
    agent = RetentionPolicy().get("agent")
    deadline = agent.expires_at(NOW)
    assert eviction_key(deadline, agent.priority, NOW, now=deadline - 1)[0]  # still live
    assert not eviction_key(deadline, agent.priority, NOW, now=deadline)[0]  # expired at the deadline


def test_parse_request_input() -> None:
    policy = RetentionPolicy()
    assert policy.parse(None).name == "agent"
    assert policy.parse("  ").name == "agent"
    assert policy.parse(" Chat ").name == "chat"
    with pytest.raises(UnknownRetentionClass) as info:
        policy.parse("forever")
    assert info.value.known == ("agent", "chat")
    assert isinstance(info.value, ValueError)  # a 400 where the gateway maps ValueError


def test_configurable_classes_and_default() -> None:
    classes = parse_retention_classes("agent=12h, chat=2d:1, batch=30m:-1")
    assert classes == (
        RetentionClass("agent", 12 * 3600.0, 0),
        RetentionClass("chat", 2 * SECONDS_PER_DAY, 1),
        RetentionClass("batch", 1800.0, -1),
    )
    policy = RetentionPolicy(classes, default="batch")
    assert policy.parse(None).name == "batch"
    with pytest.raises(UnknownRetentionClass):
        RetentionPolicy(classes, default="nope")
    with pytest.raises(ValueError, match="twice"):
        RetentionPolicy([*classes, RetentionClass("chat", 1.0, 0)])


@pytest.mark.parametrize("spec", ["", "agent", "agent=", "agent=-1d", "agent=3x", "Agent!=3d", "a=1d:x"])
def test_bad_class_specs_name_the_item(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_retention_classes(spec)


def test_parse_ttl_units() -> None:
    assert [parse_ttl(t) for t in ("90", "90s", "2m", "1.5h", "3d")] == [90, 90, 120, 5400, 3 * 86400]
    for bad in ("", "d", "0", "-5s", "nan"):
        with pytest.raises(ValueError):
            parse_ttl(bad)


def test_eviction_key_orders_expired_then_class_then_recency() -> None:
    keys = {
        "expired_high_recent": eviction_key(NOW - 1, 5, NOW, NOW),
        "live_low_recent": eviction_key(NOW + 9, 0, NOW, NOW),
        "live_low_old": eviction_key(NOW + 9, 0, NOW - 100, NOW),
        "live_high_old": eviction_key(NOW + 9, 5, NOW - 1000, NOW),
    }
    assert sorted(keys, key=keys.__getitem__) == [
        "expired_high_recent",
        "live_low_old",
        "live_low_recent",
        "live_high_old",
    ]


def test_stronger_keeps_the_higher_priority() -> None:
    policy = RetentionPolicy()
    agent, chat = policy.get("agent"), policy.get("chat")
    assert policy.stronger(agent, chat) is chat and policy.stronger(chat, agent) is chat
    tie = RetentionClass("other", 1.0, agent.priority)
    assert policy.stronger(agent, tie) is agent
