"""The process skeleton every service's main() shares: logging, uvloop, signals -> stop event."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

ServeFn = Callable[[asyncio.Event], Awaitable[None]]


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )


def run_service(serve: ServeFn) -> None:
    """Run ``serve(stop)`` on uvloop; SIGINT/SIGTERM set ``stop`` and ``serve`` drains and returns."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(stop)

    try:
        import uvloop
    except ImportError:  # not on every platform; plain asyncio is only slower
        asyncio.run(main())
    else:
        uvloop.run(main())
