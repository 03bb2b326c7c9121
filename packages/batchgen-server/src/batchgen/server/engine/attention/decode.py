"""Decode attention that reads the paged cache in place: one new query per sequence, over its own blocks.

Each decode is given as a row of a block table (its visible blocks, from the first) and the positions that bound
what it sees: vLLM's and flash-attention's layout, built on the host with one index into the persistent block tables
(``block_tables.py``), and what every kernel reads. ``paged_decode`` says the computation in plain tensor
operations: the reference, and the eager fallback. The fast versions read every visible key and value once, where it
lies: on CUDA a Triton kernel (``triton_decode.py``; no host synchronisation, so a CUDA graph can capture it), on
CPU a C++ kernel (``cpu_decode.cpp``).
"""

from __future__ import annotations

import torch

from ..ops.fast_paths import FastPath
from . import cpu_decode
from .layer import LayerAttention
from .step import DecodeBlocks


def first_visible(position: int, window: int | None) -> int:
    """The first position a query at ``position`` sees (transformers' sliding-window rule)."""
    return 0 if window is None else max(0, position - window + 1)


GATHER_ELEMENTS = 1 << 25
"""The most cache elements ``paged_decode`` gathers at once (each decode's row is padded to the longest): decodes
go in groups under it, so one long context among many short ones does not multiply the memory it takes."""


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: DecodeBlocks,
    sinks: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """``query`` ``[B, H, D]``; caches ``[KVH, slots, D]``; ``sinks`` ``[H]`` or ``None``. Returns ``[B, H, Dv]`` in
    the query's dtype. Each decode's blocks are gathered and attended in at least float32, so that a sum over many
    blocks does not lose bf16 precision; a sink is one more softmax column that carries no value."""
    batch, (kv_heads, _, dim) = query.shape[0], k_cache.shape
    per_decode = kv_heads * blocks.tables.shape[1] * blocks.block_size * max(dim, v_cache.shape[-1])
    group = max(1, GATHER_ELEMENTS // per_decode)
    if batch > group:
        parts = [
            _gathered_decode(query[i : i + group], k_cache, v_cache, blocks.rows(i, i + group), sinks, scale, softcap)
            for i in range(0, batch, group)
        ]
        return torch.cat(parts)
    return _gathered_decode(query, k_cache, v_cache, blocks, sinks, scale, softcap)


def _gathered_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: DecodeBlocks,
    sinks: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    batch = query.shape[0]
    kv_heads, _, dim = k_cache.shape
    bs, acc = blocks.block_size, torch.promote_types(query.dtype, torch.float32)
    slots = (blocks.tables[:, :, None] * bs + torch.arange(bs, device=blocks.tables.device)).view(batch, -1)
    q = query.reshape(batch, kv_heads, -1, dim).to(acc)  # [B, KVH, G, D]
    scores = torch.einsum("bkgd,kbsd->bkgs", q, k_cache[:, slots].to(acc)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~blocks.visible()[:, None, None, :], float("-inf"))
    if sinks is not None:
        column = sinks.to(acc).view(1, kv_heads, -1, 1).expand(batch, -1, -1, 1)
        scores = torch.cat([scores, column], dim=-1)
    weights = torch.softmax(scores, dim=-1)[..., : slots.shape[1]]
    out = torch.einsum("bkgs,kbsd->bkgd", weights, v_cache[:, slots].to(acc))
    return out.reshape(batch, -1, v_cache.shape[-1]).to(query.dtype)


def combine(
    best: torch.Tensor, total: torch.Tensor, weighted: torch.Tensor, query: torch.Tensor, sinks: torch.Tensor | None
) -> torch.Tensor:
    """Each decode's softmax from its splits' partials (flash-decoding's combine): the maximum score ``[B, S, KVH,
    G]`` of each of its ``S`` splits (``-inf`` where a split sees nothing), the sum of ``exp(score - maximum)`` and
    those weights times the values ``[B, S, KVH, G, Dv]``, rescaled to the decode's maximum and summed. ``[B, H, Dv]``
    in the query's dtype."""
    batch, _, kv_heads = best.shape[:3]
    seq_max = best.amax(dim=1)  # [B, KVH, G]: every decode sees at least its own position
    if sinks is not None:
        sinks = sinks.to(best.dtype).view(kv_heads, -1)
        seq_max = torch.maximum(seq_max, sinks)
    scale = torch.exp(best - seq_max[:, None])  # 0 for a split that sees nothing
    out = (weighted * scale.unsqueeze(-1)).sum(dim=1)
    norm = (total * scale).sum(dim=1)
    if sinks is not None:
        norm = norm + torch.exp(sinks - seq_max)
    return (out / norm.unsqueeze(-1)).reshape(batch, -1, weighted.shape[-1]).to(query.dtype)


class DecodeKernel:
    """``paged_decode``, fast: on CUDA its splits' partials from a Triton kernel (``triton_decode.py``), on CPU the C++
    kernel (``cpu_decode.py``, for float32 and bfloat16 caches); anything else runs it eagerly. A fast path
    (``fast_paths.py``): off for good, with the reason, if it fails where the plain version succeeds."""

    def __init__(self) -> None:
        self.path = FastPath("decode kernel")

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        blocks: DecodeBlocks,
        layer: LayerAttention,
    ) -> torch.Tensor:
        scale = layer.scale if layer.scale is not None else query.shape[-1] ** -0.5
        args = (query, k_cache, v_cache, blocks, layer.sinks, scale, layer.softcap)
        return self.path.run(lambda: self._fast(*args), lambda: paged_decode(*args))

    def _fast(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        blocks: DecodeBlocks,
        sinks: torch.Tensor | None,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        if query.device.type == "cuda" and query.dtype != torch.float64:  # it accumulates in float32
            from .triton_decode import split_partials  # Triton ships with CUDA builds only

            # The kernel addresses rows by canonical strides, which a size-1 dimension of the model's layout need not
            # have (a copy only when the layout is not contiguous).
            query = query.reshape(-1).view(query.shape)
            return combine(*split_partials(query, k_cache, v_cache, blocks, scale, softcap), query, sinks)
        if cpu_decode.supports(query, k_cache, v_cache):
            return cpu_decode.paged_decode(query, k_cache, v_cache, blocks, sinks, scale, softcap)
        return paged_decode(query, k_cache, v_cache, blocks, sinks, scale, softcap)
