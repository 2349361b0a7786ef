"""RestartPolicy: exponential backoff per window, and the limit past which serve gives up."""

from __future__ import annotations

import pytest

from deepinfer.restart_policy import RestartPolicy


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(max_restarts=10, window_s=60.0, backoff_s=0.5, max_backoff_s=4.0)
    delays = [policy.on_exit(now=float(t)) for t in range(6)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_gives_up_after_max_restarts_within_the_window() -> None:
    policy = RestartPolicy(max_restarts=3, window_s=60.0)
    assert [policy.on_exit(now) for now in (0.0, 1.0, 2.0)] == [0.5, 1.0, 2.0]
    assert policy.on_exit(3.0) is None  # the 4th death within 60 s
    assert policy.num_recent_deaths == 4


def test_deaths_outside_the_window_are_forgotten() -> None:
    policy = RestartPolicy(max_restarts=2, window_s=10.0)
    assert policy.on_exit(0.0) == 0.5
    assert policy.on_exit(5.0) == 1.0
    # 20 s later both are out of the window: a fresh start, not a give-up, and the backoff resets
    assert policy.on_exit(25.0) == 0.5
    assert policy.on_exit(26.0) == 1.0
    assert policy.on_exit(27.0) is None


def test_zero_restarts_gives_up_at_the_first_death() -> None:
    assert RestartPolicy(max_restarts=0, window_s=60.0).on_exit(0.0) is None


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"max_restarts": -1, "window_s": 60.0}, "max_restarts"),
        ({"max_restarts": 5, "window_s": 0.0}, "window_s"),
        ({"max_restarts": 5, "window_s": 60.0, "backoff_s": 0.0}, "backoff_s"),
        ({"max_restarts": 5, "window_s": 60.0, "max_backoff_s": -1.0}, "max_backoff_s"),
    ],
)
def test_bad_values_name_their_key(kwargs: dict[str, float], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]
