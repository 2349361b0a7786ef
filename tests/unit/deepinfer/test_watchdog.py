"""The watchdog in libs.runtime.process: HangDetector's decisions, and real processes that hang.

The process tests run ``run_service`` in a child interpreter, so that ``os._exit`` is observed: a
loop blocked by ``time.sleep`` and a ``busy()`` block that outlives its bound both end the process
with WATCHDOG_EXIT_CODE; a loop that answers is left alone.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from libs.runtime.process import MAX_TICK_S, WATCHDOG_EXIT_CODE, HangDetector, StopEvent


def test_unanswered_heartbeats_add_up_to_a_hang() -> None:
    detector = HangDetector(watchdog_s=3.0, max_busy_s=0.0, now=0.0)
    assert detector.tick(1.0, answered=True, busy_generation=None) is None
    assert detector.tick(2.0, answered=False, busy_generation=None) is None
    assert detector.tick(3.0, answered=False, busy_generation=None) is None
    reason = detector.tick(4.0, answered=False, busy_generation=None)
    assert reason is not None and "event loop" in reason


def test_an_answer_resets_the_count() -> None:
    detector = HangDetector(watchdog_s=3.0, max_busy_s=0.0, now=0.0)
    for now in range(1, 30):  # a loop answering every other tick is slow, not hung
        assert detector.tick(float(now), answered=now % 2 == 0, busy_generation=None) is None


def test_a_stopped_process_is_not_a_hung_one() -> None:
    """SIGSTOP for a minute: the tick after SIGCONT counts MAX_TICK_S, not 60 s."""
    detector = HangDetector(watchdog_s=2 * MAX_TICK_S, max_busy_s=2 * MAX_TICK_S, now=0.0)
    assert detector.tick(1.0, answered=False, busy_generation=7) is None
    assert detector.tick(61.0, answered=False, busy_generation=7) is None
    assert detector.tick(61.0 + MAX_TICK_S, answered=False, busy_generation=7) is not None


def test_a_busy_block_longer_than_its_bound_is_a_hang() -> None:
    detector = HangDetector(watchdog_s=0.0, max_busy_s=2.0, now=0.0)
    assert detector.tick(1.0, answered=True, busy_generation=1) is None
    assert detector.tick(2.0, answered=True, busy_generation=1) is None
    reason = detector.tick(3.0, answered=True, busy_generation=1)
    assert reason is not None and "step" in reason


def test_busy_blocks_back_to_back_are_not_one_long_one() -> None:
    detector = HangDetector(watchdog_s=0.0, max_busy_s=2.0, now=0.0)
    for now in range(1, 20):  # a new step (generation) each second, or idle in between
        generation = now if now % 3 else None
        assert detector.tick(float(now), answered=True, busy_generation=generation) is None


def test_zero_turns_each_check_off() -> None:
    detector = HangDetector(watchdog_s=0.0, max_busy_s=0.0, now=0.0)
    for now in range(1, 200):
        assert detector.tick(float(now), answered=False, busy_generation=1) is None


def test_sigint_or_a_second_signal_hurries_the_stop() -> None:
    term = StopEvent()
    term.on_signal(signal.SIGTERM)
    assert term.is_set() and not term.hurried.is_set()  # SIGTERM: drain
    term.on_signal(signal.SIGTERM)
    assert term.hurried.is_set()
    interrupt = StopEvent()
    interrupt.on_signal(signal.SIGINT)
    assert interrupt.is_set() and interrupt.hurried.is_set()


SERVICE = """
import asyncio, sys, time
from libs.runtime.logs import setup_logging
from libs.runtime.process import busy, run_service

async def serve(stop):
    mode = sys.argv[1]
    await asyncio.sleep(0.5)
    if mode == "blocked":
        time.sleep(30)  # the event loop itself is stuck
    elif mode == "busy":
        with busy():
            await asyncio.sleep(30)  # the loop answers; the step never ends
    else:
        await asyncio.sleep(4)  # healthy: the loop answers, no step is long
    print("returned", flush=True)

setup_logging("info", "test")
run_service(serve, watchdog_s=float(sys.argv[2]), max_busy_s=float(sys.argv[3]))
"""


def _run(mode: str, watchdog_s: float, max_busy_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SERVICE), mode, str(watchdog_s), str(max_busy_s)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("mode", "watchdog_s", "max_busy_s", "expected"),
    [
        ("blocked", 2.0, 0.0, "event loop has not answered"),
        ("busy", 2.0, 2.0, "a step) has run for"),
    ],
)
def test_a_hung_process_exits_by_itself(
    mode: str, watchdog_s: float, max_busy_s: float, expected: str
) -> None:
    result = _run(mode, watchdog_s, max_busy_s)
    assert result.returncode == WATCHDOG_EXIT_CODE, result.stderr
    assert "returned" not in result.stdout
    assert expected in result.stderr and "watchdog" in result.stderr


def test_a_healthy_process_is_left_alone() -> None:
    result = _run("healthy", 1.0, 1.0)
    assert result.returncode == 0, result.stderr
    assert "returned" in result.stdout and "watchdog" not in result.stderr
