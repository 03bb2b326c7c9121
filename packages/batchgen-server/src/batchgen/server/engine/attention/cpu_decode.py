"""``batchgen::paged_decode``, the torch operator ``cpu_decode.cpp`` defines (built on first use by ``native.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..ops import native
from ..ops.fast_paths import plain_tensor

if TYPE_CHECKING:
    from .step import DecodeBlocks

SOURCE = Path(__file__).with_suffix(".cpp")
CACHE_TYPES = (torch.float32, torch.bfloat16)
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
    """``decode.paged_decode``'s contract (where ``supports`` holds), on the native kernel; raises
    ``native.Unavailable``."""
    native.load(SOURCE)
    out: torch.Tensor = torch.ops.batchgen.paged_decode(
        query, k_cache, v_cache, blocks.tables, blocks.first, blocks.last, blocks.block_size, sinks, scale, softcap
    )
    return out
