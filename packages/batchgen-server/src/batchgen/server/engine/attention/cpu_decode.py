"""``cpu_decode.cpp``, built for this machine on first use and called through ``ctypes``.

The compiled path already needs a C++ compiler on CPU (inductor generates C++), so this asks for nothing new: the
same compiler builds a 300-line file in under a second, for the CPU it runs on (``-march=native``), and the library
is kept in a cache keyed by the source, the compiler, its flags and the CPU's features, so later processes load it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .decode import DecodePairs

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp"]
CACHE_TYPES = {torch.float32: 0, torch.bfloat16: 1}
"""The cache dtypes the kernel reads (others take the compiled ``paged_decode``)."""


class Unavailable(RuntimeError):
    """No library: no compiler, or it failed (the message says which)."""


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and k_cache.dtype in CACHE_TYPES
        and v_cache.dtype == k_cache.dtype
        and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pairs: DecodePairs,
    sinks: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """``decode.paged_decode``'s contract (where ``supports`` holds), on the native kernel."""
    batch, heads, dim = query.shape
    kv_heads, slots, vdim = v_cache.shape
    block_size = pairs.visible.shape[1]
    q = query.to(torch.float32).contiguous()
    out = torch.empty(batch, heads, vdim, dtype=torch.float32)
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    tensors = (k_cache, v_cache, pairs.block, pairs.visible, pairs.offsets)
    if not all(t.is_contiguous() for t in tensors) or pairs.block.dtype != torch.int64:
        raise ValueError("the native decode kernel reads contiguous caches and int64 block tables")
    library().batchgen_paged_decode(
        batch, kv_heads, heads // kv_heads, dim, vdim, slots, block_size,
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), CACHE_TYPES[k_cache.dtype],
        pairs.block.data_ptr(), pairs.visible.data_ptr(), pairs.offsets.data_ptr(),
        None if sinks is None else sinks.data_ptr(), out.data_ptr(),
        scale, 0.0 if softcap is None else softcap, torch.get_num_threads(),
    )  # fmt: skip
    return out.to(query.dtype)


@functools.cache
def library() -> ctypes.CDLL:
    """The built kernel (built now if no process on this machine has built it yet); raises ``Unavailable``."""
    path = _cached_build()
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.batchgen_paged_decode.argtypes = [
        *[i64] * 7,
        ptr,
        ptr,
        ptr,
        ctypes.c_int,
        ptr,
        ptr,
        ptr,
        ptr,
        ptr,
        ctypes.c_float,
        ctypes.c_float,
        ctypes.c_int,
    ]
    lib.batchgen_paged_decode.restype = None
    return lib


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


def _cached_build() -> Path:
    compiler = _compiler()
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(FLAGS).encode(), _cpu_features().encode()]))
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchgen" / "kernels"
    path = cache / f"cpu_decode-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / path.name
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise Unavailable(f"{compiler} failed to build {SOURCE.name}: {result.stderr.strip()[-2000:]}")
        os.replace(built, path)  # atomic: processes building at once each get a whole library
    logger.info("built the native decode kernel: %s", path)
    return path
