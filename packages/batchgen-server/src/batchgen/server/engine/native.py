"""C++ kernels (``*.cpp`` beside their Python callers) as torch operators, built for this machine on first use.

Each source registers its operators in the ``batchgen`` namespace itself (``TORCH_LIBRARY_FRAGMENT``: schema, checks,
CPU implementation), so a call from Python is one dispatch into C++. torch's extension builder
(``torch.utils.cpp_extension.load``, which runs ninja) compiles it with the C++ compiler inductor already needs on
CPU, for the CPU it runs on (``-march=native``): about 7 s, most of it torch's headers. The library is kept in a cache
keyed by the source, the compiler, the flags, the CPU's features and torch's version, so later processes load it
without building.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp"]


class Unavailable(RuntimeError):
    """No library: no compiler or ninja, or the build failed (the message says which)."""


def load(source: Path) -> None:
    """Register ``source``'s operators, built now if no process on this machine has built them yet; raises
    ``Unavailable``. A process tries once: a failure is raised again, without building again, on every later call."""
    if (reason := _loaded(source)) is not None:
        raise Unavailable(reason)


@functools.cache
def _loaded(source: Path) -> str | None:
    """Why ``source``'s operators are unavailable, or ``None`` once they are registered."""
    try:
        _register(source)
    except Unavailable as exc:
        return str(exc)
    return None


def _compiler() -> str:
    """The compiler torch's builder runs (``CXX``, else ``c++``)."""
    compiler = str(cpp_extension.get_cxx_compiler())  # type: ignore[no-untyped-call]
    found = shutil.which(compiler)
    if found is None:
        raise Unavailable(f"no C++ compiler: {compiler} not found (set CXX, or install g++)")
    return found


def _cpu_features() -> str:
    """What ``-march=native`` depends on: a library built on one CPU may not run on another sharing the cache."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _register(source: Path) -> None:
    compiler = _compiler()
    parts = [source.read_bytes(), compiler.encode(), " ".join(FLAGS).encode(), _cpu_features().encode()]
    key = hashlib.sha256(b"\0".join([*parts, torch.__version__.encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchgen" / "kernels"
    path = cache / f"{source.stem}-{key}.so"
    if path.exists():
        try:
            torch.ops.load_library(path)  # type: ignore[no-untyped-call]
        except (OSError, RuntimeError) as exc:
            raise Unavailable(f"could not load {path}: {exc}") from None
        return
    if shutil.which("ninja") is None:
        raise Unavailable(f"no ninja to build {source.name} (torch's builder runs it): pip install ninja")
    cache.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        name = f"batchgen_{source.stem}_{key}"  # torch's builder remembers a name's sources for the process
        try:  # builds, then loads
            built = cpp_extension.load(
                name, [str(source)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                build_directory=scratch, is_python_module=False,
            )  # fmt: skip
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:  # it runs the compiler to ask its version
            raise Unavailable(f"{compiler} failed to build {source.name}: {str(exc).strip()[-2000:]}") from None
        os.replace(built, path)  # atomic: processes building at once each get a whole library
    logger.info("built the native kernel %s in %.1f s: %s", source.name, time.perf_counter() - start, path)
