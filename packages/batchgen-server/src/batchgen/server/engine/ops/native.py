"""C++ kernels (``*.cpp`` beside their Python callers) as torch operators, built for this machine on first use.

Each source registers its operators in the ``batchgen`` namespace itself (``TORCH_LIBRARY_FRAGMENT``: schema, checks,
CPU implementation), so a call from Python is one dispatch into C++. torch's extension builder
(``torch.utils.cpp_extension.load``, which runs ninja) compiles it with the C++ compiler inductor already needs on
CPU, for the CPU it runs on (``-march=native``): about 7 s, most of it torch's headers. The library is kept in a cache
keyed by the source, the compiler, the flags, the CPU's features and torch's version, so later processes load it
without building.
"""

from __future__ import annotations

import fcntl
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


def _ninja() -> None:
    """Make ninja findable by torch's builder, which runs ``ninja`` from ``PATH``: the ``ninja`` package installs it
    beside this interpreter, which is not on ``PATH`` when the venv is not activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja  # the package ships the binary and says where it lies
    except ImportError:
        raise Unavailable("no ninja (torch's extension builder runs it): pip install ninja") from None
    os.environ["PATH"] = os.pathsep.join([str(ninja.BIN_DIR), os.environ.get("PATH", "")])


def _register(source: Path) -> None:
    compiler = _compiler()
    parts = [source.read_bytes(), compiler.encode(), " ".join(FLAGS).encode(), _cpu_features().encode()]
    key = hashlib.sha256(b"\0".join([*parts, torch.__version__.encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchgen" / "kernels"
    path = cache / f"{source.stem}-{key}.so"
    if not path.exists():
        _ninja()
        cache.mkdir(parents=True, exist_ok=True)
        # One process builds, the others (pytest-xdist's workers, a server's replicas) wait and load its library. An
        # flock rather than cpp_extension's lock file, which a build killed half way leaves behind for good.
        with open(cache / f"{source.stem}-{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                _build(source, key, cache, path, compiler)  # and loaded
                return
    try:
        torch.ops.load_library(path)  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError) as exc:
        raise Unavailable(f"could not load {path}: {exc}") from None


def _build(source: Path, key: str, cache: Path, path: Path, compiler: str) -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        name = f"batchgen_{source.stem}_{key}"  # torch's builder remembers a name's sources for the process
        try:
            built = cpp_extension.load(
                name, [str(source)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                build_directory=scratch, is_python_module=False,
            )  # fmt: skip
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:  # it runs the compiler to ask its version
            raise Unavailable(f"{compiler} failed to build {source.name}: {str(exc).strip()[-2000:]}") from None
        os.replace(built, path)  # atomic: a process that finds the path finds a whole library
    logger.info("built the native kernel %s in %.1f s: %s", source.name, time.perf_counter() - start, path)
