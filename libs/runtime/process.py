"""The process skeleton every service's main() shares: logging, uvloop, signals -> stop, a watchdog.

Signals: SIGINT or SIGTERM sets the stop event and the service drains and returns. SIGINT (Ctrl-C)
or a second signal also sets ``stop.hurried``: whatever drain is left is cut short, and the
process exits ``HURRIED_EXIT_S`` later at the latest. Once ``serve`` returns, the process exits at
once (no interpreter teardown: a worker's takes seconds).

Watchdog: a supervisor (``deepinfer serve``, compose's ``restart:``) acts on exit, not on health, so
a process that hangs must exit on its own. A daemon thread posts a heartbeat callback to the event
loop every second; when the loop has not run one for ``watchdog_s``, or a unit of work marked with
``busy()`` (a worker step) has run for longer than ``max_busy_s``, the process logs why and leaves
with ``os._exit(WATCHDOG_EXIT_CODE)`` (no cleanup can be trusted to finish in a hung process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import NoReturn

from libs.runtime.tracing import shutdown_tracing

log = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = 70  # EX_SOFTWARE: "hung", distinct from a crash's signal or a config error (2)
WATCHDOG_INTERVAL_S = 1.0
# A tick later than this (the whole process was stopped, e.g. SIGSTOP, or the host was suspended)
# counts as this much: time the process did not run is not time its loop failed to answer.
MAX_TICK_S = 5 * WATCHDOG_INTERVAL_S
HURRIED_EXIT_S = 2.0  # Ctrl-C to exit, at most: the rest of a stack's stop must fit in 5 s
HURRIED_EXIT_CODE = 128 + signal.SIGINT


class StopEvent(asyncio.Event):
    """Set by SIGINT/SIGTERM: the service drains and returns. ``hurried``: stop draining now; a
    process still there ``HURRIED_EXIT_S`` later exits anyway (Ctrl-C means now)."""

    def __init__(self, hurried_exit_s: float = 0.0) -> None:
        super().__init__()
        self.hurried = asyncio.Event()
        self._hurried_exit_s = hurried_exit_s

    def on_signal(self, signum: int) -> None:
        if (signum == signal.SIGINT or self.is_set()) and not self.hurried.is_set():
            self.hurried.set()
            if self._hurried_exit_s > 0:
                threading.Thread(target=_exit_after, args=(self._hurried_exit_s,), daemon=True).start()
        self.set()


def _exit_after(delay_s: float) -> None:
    time.sleep(delay_s)
    log.warning("still stopping %.1f s after Ctrl-C (or a second signal): exiting now", delay_s)
    logging.shutdown()
    os._exit(HURRIED_EXIT_CODE)


ServeFn = Callable[[StopEvent], Awaitable[None]]


class _Busy:
    """Whether the process is inside a ``busy()`` block: a generation number per block, so that
    two blocks back to back are not one long one. Written on the loop, read by the watchdog."""

    def __init__(self) -> None:
        self.generation = 0
        self.active = False


_busy = _Busy()


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """Mark a unit of work (one worker step) that the watchdog bounds by ``max_busy_s``."""
    _busy.generation += 1
    _busy.active = True
    try:
        yield
    finally:
        _busy.active = False


class HangDetector:
    """The watchdog's decision, without threads or clocks: ``tick(now, ...)`` once per interval
    returns why the process is hung, or None. Durations count at most ``MAX_TICK_S`` per tick."""

    def __init__(self, watchdog_s: float, max_busy_s: float, now: float) -> None:
        self.watchdog_s = watchdog_s
        self.max_busy_s = max_busy_s
        self._last_tick = now
        self._unanswered_s = 0.0  # since the loop last ran a heartbeat
        self._busy_generation = -1
        self._busy_s = 0.0  # in the current busy() block

    def tick(self, now: float, answered: bool, busy_generation: int | None) -> str | None:
        """``answered``: the loop ran the heartbeat posted at the previous tick; ``busy_generation``:
        the current busy() block's, or None when not busy."""
        elapsed = min(max(now - self._last_tick, 0.0), MAX_TICK_S)
        self._last_tick = now
        self._unanswered_s = 0.0 if answered else self._unanswered_s + elapsed
        if busy_generation is None or busy_generation != self._busy_generation:
            self._busy_s = 0.0
        else:
            self._busy_s += elapsed
        self._busy_generation = -1 if busy_generation is None else busy_generation
        if self.watchdog_s > 0 and self._unanswered_s >= self.watchdog_s:
            return f"the event loop has not answered for {self._unanswered_s:.0f} s"
        if self.max_busy_s > 0 and self._busy_s >= self.max_busy_s:
            return f"one unit of work (a step) has run for {self._busy_s:.0f} s"
        return None


class Watchdog:
    """The daemon thread around HangDetector: heartbeats to ``loop``, ``os._exit`` when hung."""

    def __init__(self, loop: asyncio.AbstractEventLoop, watchdog_s: float, max_busy_s: float) -> None:
        self._loop = loop
        self._detector = HangDetector(watchdog_s, max_busy_s, time.monotonic())
        self._posted = 0  # heartbeats posted, and the last one the loop ran
        self._answered = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def _beat(self, n: int) -> None:
        self._answered = n

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()

    def _run(self) -> None:
        while not self._done.wait(WATCHDOG_INTERVAL_S):
            answered = self._answered == self._posted
            generation = _busy.generation if _busy.active else None
            reason = self._detector.tick(time.monotonic(), answered, generation)
            if reason is not None:
                log.critical("watchdog: %s: exiting so that the supervisor restarts this process", reason)
                logging.shutdown()
                os._exit(WATCHDOG_EXIT_CODE)
            if answered:
                self._posted += 1
                try:
                    self._loop.call_soon_threadsafe(self._beat, self._posted)
                except RuntimeError:  # the loop is closed: the process is on its way out
                    return


def run_service(serve: ServeFn, watchdog_s: float = 0.0, max_busy_s: float = 0.0) -> NoReturn:
    """Run ``serve(stop)`` on uvloop, then exit the process (0); SIGINT/SIGTERM set ``stop``. A
    watchdog runs when ``watchdog_s`` or ``max_busy_s`` is > 0."""

    async def main() -> None:
        stop = StopEvent(HURRIED_EXIT_S)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.on_signal, sig)
        watchdog = Watchdog(loop, watchdog_s, max_busy_s) if watchdog_s > 0 or max_busy_s > 0 else None
        if watchdog is not None:
            watchdog.start()
        try:
            await serve(stop)
        finally:
            if watchdog is not None:
                watchdog.stop()

    try:
        import uvloop
    except ImportError:  # not on every platform; plain asyncio is only slower
        asyncio.run(main())
    else:
        uvloop.run(main())
    # serve() returned: everything the service owns is closed. Skip the interpreter's teardown,
    # which for a worker (a model's tensors) takes seconds of garbage collection, and in which a
    # late Ctrl-C would be a KeyboardInterrupt traceback.
    shutdown_tracing()  # the spans still batched
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
