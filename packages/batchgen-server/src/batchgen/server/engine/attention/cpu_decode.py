"""``cpu_decode.cpp`` (built on first use by ``native.py``), called through ``ctypes``."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import native
from ..fast_paths import plain_tensor

if TYPE_CHECKING:
    from .step import DecodeBlocks

SOURCE = Path(__file__).with_suffix(".cpp")
CACHE_TYPES = {torch.float32: 0, torch.bfloat16: 1}
"""The cache dtypes the kernel reads (others take the compiled ``paged_decode``)."""


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Plain CPU tensors of the dtypes the kernel reads (it reads them by their data pointers)."""
    return (
        k_cache.dtype in CACHE_TYPES
        and plain_tensor(query, device="cpu")
        and plain_tensor(k_cache, device="cpu")
        and plain_tensor(v_cache, k_cache.dtype, device="cpu")
        and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: DecodeBlocks,
    sinks: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """``decode.paged_decode``'s contract (where ``supports`` holds), on the native kernel."""
    batch, heads, dim = query.shape
    kv_heads, slots, vdim = v_cache.shape
    q = query.to(torch.float32).contiguous()
    out = torch.empty(batch, heads, vdim, dtype=torch.float32)
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    tensors = (k_cache, v_cache, blocks.tables, blocks.first, blocks.last)
    if not all(t.is_contiguous() for t in tensors) or any(t.dtype != torch.int64 for t in tensors[2:]):
        raise ValueError("the native decode kernel reads contiguous caches and int64 block tables")
    library().batchgen_paged_decode(
        batch, kv_heads, heads // kv_heads, dim, vdim, slots, blocks.block_size,
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), CACHE_TYPES[k_cache.dtype],
        blocks.tables.data_ptr(), blocks.tables.shape[1], blocks.first.data_ptr(), blocks.last.data_ptr(),
        None if sinks is None else sinks.data_ptr(), out.data_ptr(),
        scale, 0.0 if softcap is None else softcap, torch.get_num_threads(),
    )  # fmt: skip
    return out.to(query.dtype)


@functools.cache
def library() -> ctypes.CDLL:
    """The built kernel; raises ``native.Unavailable``."""
    lib = native.load(SOURCE)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.batchgen_paged_decode.argtypes = [
        *[i64] * 7,
        ptr,
        ptr,
        ptr,
        ctypes.c_int,
        ptr,
        i64,
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
