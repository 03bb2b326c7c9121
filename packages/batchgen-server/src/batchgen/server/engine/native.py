"""C++ kernels (``*.cpp`` beside their Python callers), built for this machine on first use, loaded through ``ctypes``.

The compiled path already needs a C++ compiler on CPU (inductor generates C++), so this asks for nothing new: the same
compiler builds a few hundred lines in under a second, for the CPU it runs on (``-march=native``), and the library is
kept in a cache keyed by the source, the compiler, its flags and the CPU's features, so later processes load it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp"]


class Unavailable(RuntimeError):
    """No library: no compiler, or it failed (the message says which)."""


def load(source: Path) -> ctypes.CDLL:
    """The library built from ``source`` (built now if no process on this machine has built it yet); raises
    ``Unavailable``."""
    return ctypes.CDLL(str(_cached_build(source)))


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and (found := shutil.which(name)):
            return found
    raise Unavailable("no C++ compiler found (set CXX, or install g++)")


def _cpu_features() -> str:
    """What ``-march=native`` depends on: a library built on one CPU may not run on another sharing the cache."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _cached_build(source: Path) -> Path:
    compiler = _compiler()
    text = source.read_bytes()
    key = hashlib.sha256(b"\0".join([text, compiler.encode(), " ".join(FLAGS).encode(), _cpu_features().encode()]))
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchgen" / "kernels"
    path = cache / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / path.name
        result = subprocess.run(
            [compiler, *FLAGS, str(source), "-o", str(built)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise Unavailable(f"{compiler} failed to build {source.name}: {result.stderr.strip()[-2000:]}")
        os.replace(built, path)  # atomic: processes building at once each get a whole library
    logger.info("built the native kernel %s: %s", source.name, path)
    return path
