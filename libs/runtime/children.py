"""What a child process runs before exec: it dies with its parent and leaves Ctrl-C to it."""

from __future__ import annotations

import ctypes
import signal


def child_setup() -> None:
    """In a child before exec: SIGKILL from the kernel when its parent goes away (Linux), and
    Ctrl-C ignored until the service's event loop takes SIGINT over: a Ctrl-C that lands while it
    is still importing must not become a KeyboardInterrupt traceback (the parent stops it with SIGTERM)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: a clean stop still ends every child
