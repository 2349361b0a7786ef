"""The CPU kernel extension (csrc/*.cpp): built on first use with this machine's compiler,
cached, and loaded as ``torch.ops.deepinfer_cpu``; or absent, and callers take their torch paths.

The build targets the machine it runs on (``-march=native``), so the cache key holds the CPU's
feature flags beside the source and torch version: a cache directory shared by machines of
different kinds keeps one build per kind. A cold build takes ~20-40 s on two cores; a warm start
only loads the library. Without a C++ compiler, or when the build fails, ``ops()`` is None and a
warning says why, once.

``configure(enabled=False)`` (the worker's ``--cpu-kernels false``) turns the kernels off, so a
run can be compared against the torch paths.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# vec.h, ops.h and pool.h beside them
SOURCE_FILES = (
    "cpu_ops.cpp",
    "cpu_int8.cpp",
    "cpu_pointwise.cpp",
    "cpu_block.cpp",
    "cpu_invariant.cpp",
    "cpu_pool.cpp",
)
SOURCES = tuple(CSRC / f for f in SOURCE_FILES)
LIBRARY = "deepinfer_cpu"
CFLAGS = ("-O3", "-march=native", "-fopenmp")

_lock = threading.Lock()
_state: dict[str, Any] = {"enabled": True, "cache_dir": None, "ops": None, "tried": False}


def configure(enabled: bool = True, cache_dir: str | os.PathLike[str] | None = None) -> None:
    """Turn the kernels on or off, and say where builds are cached (default:
    ``$XDG_CACHE_HOME/deepinfer/kernels``). Call before the first ``ops()``."""
    with _lock:
        _state["enabled"] = enabled
        if cache_dir is not None:
            _state["cache_dir"] = Path(cache_dir)


def ops() -> Any | None:
    """``torch.ops.deepinfer_cpu`` once built and loaded; None when off or unavailable."""
    if not _state["enabled"]:
        return None
    if _state["tried"]:
        return _state["ops"]
    with _lock:
        if not _state["tried"]:
            _state["ops"] = _build_and_load()
            _state["tried"] = True
    return _state["ops"]


def set_num_threads(num_threads: int) -> None:
    """The kernels' threads (csrc/pool.h), apart from torch's; 0: as many as torch has on the
    calling thread (the default). No-op without the extension."""
    extension = ops()
    if extension is not None:
        extension.set_num_threads(num_threads)


def fp32_ops(*tensors: torch.Tensor) -> Any | None:
    """``ops()`` when every tensor is a float32 CPU tensor (the kernels' one dtype), else None."""
    for t in tensors:  # a loop, not all(...): called ~200 times a step, each microsecond shows
        if t.dtype != torch.float32 or not t.is_cpu:
            return None
    return ops()


def _cpu_kind() -> str:
    """The machine and its CPU's feature lines (x86 ``flags``, ARM ``Features`` and ``CPU part``)."""
    lines = [platform.machine()]
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "CPU part")) and line not in lines:
                lines.append(line)
    except OSError:
        pass
    return "\n".join(lines)


def build_dir() -> Path:
    """Where this source, torch version and CPU kind's build lives."""
    key = hashlib.sha256()
    for part in (
        *(f.read_bytes() for f in sorted(CSRC.iterdir()) if f.suffix in (".cpp", ".h")),
        torch.__version__.encode(),
        " ".join(CFLAGS).encode(),
        _cpu_kind().encode(),
    ):
        key.update(part)
    root = _state["cache_dir"]
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(base) / "deepinfer" / "kernels"
    return Path(root) / key.hexdigest()[:16]


def _build_and_load() -> Any | None:
    if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        log.warning("no C++ compiler found: CPU kernels off, the torch paths run instead")
        return None
    try:
        from torch.utils import cpp_extension

        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        # One build at a time per directory, under an flock the kernel releases when its holder
        # dies. torch's own lock is a plain file that a killed build leaves behind, on which every
        # later build would wait forever; holding the flock, any such file is stale.
        with (directory / "build.flock").open("w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (directory / "lock").unlink(missing_ok=True)
            cpp_extension.load(
                name=LIBRARY,
                sources=[str(f) for f in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # a missing toolchain piece or a compiler error: run without them
        log.warning("CPU kernels could not be built (%s): the torch paths run instead", exc)
        return None
    return getattr(torch.ops, LIBRARY)
