"""The decode kernel's CUDA path: a Triton kernel that walks each sequence's blocks with an online softmax.

One program takes one sequence, one KV head (with the query heads that share it, at most ``GROUP_BLOCK`` of them)
and one split of the sequence's visible blocks (its row of ``decode.DecodeBlocks``): it reads each block's keys and
values once, where they lie, and keeps a running maximum, sum and weighted values. Splits (flash-decoding's) keep the
chip busy when few sequences decode; ``decode.combine`` combines their partials. No tensor cores: with one query per
sequence the work is bound by reading the cache, not by arithmetic.

Measured on an H200 (``benchmarks/RESULTS.md``): the first version, one program per pair, took 241 us of device time
a layer for 64 decodes of 512 tokens, plus a combine over every pair's partials; walking the blocks in one program
writes partials per split only. Visibility is computed from positions, not read from a mask.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from .step import DecodeBlocks

GROUP_BLOCK = 16
"""Query heads per program at most (an MQA layer's many heads per KV head take several programs)."""
MAX_SPLITS = 16


@triton.jit
def _split_kernel(
    query,
    k_cache,
    v_cache,
    tables,
    firsts,
    lasts,
    out_max,
    out_sum,
    out_acc,
    scale,
    softcap,
    q_stride_b,
    table_stride,
    k_stride_h,
    v_stride_h,
    SPLITS,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    GROUP_TILES: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr,
    DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
    VDIM: tl.constexpr,
    VDIM_P2: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1) // GROUP_TILES
    head_k = head.to(tl.int64)  # times a head's stride in the cache: past 2**31 elements on a large cache
    g = (tl.program_id(1) % GROUP_TILES) * GROUP_P2 + tl.arange(0, GROUP_P2)
    split = tl.program_id(2)
    d = tl.arange(0, DIM_P2)
    dv = tl.arange(0, VDIM_P2)
    t = tl.arange(0, BLOCK_P2)
    g_ok, d_ok, dv_ok, t_ok = g < GROUP, d < DIM, dv < VDIM, t < BLOCK

    first = tl.load(firsts + seq)
    last = tl.load(lasts + seq)
    first_block = first // BLOCK
    count = last // BLOCK - first_block + 1
    per_split = tl.cdiv(count, SPLITS)
    start = split * per_split
    stop = tl.minimum(count, start + per_split)
    row = tables + seq.to(tl.int64) * table_stride

    q_rows = query + seq.to(tl.int64) * q_stride_b + (head * GROUP + g)[:, None] * DIM + d[None, :]
    q = tl.load(q_rows, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [G, D]
    best = tl.full([GROUP_P2], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, VDIM_P2], tl.float32)
    for column in range(start, stop):
        slots = tl.load(row + column).to(tl.int64) * BLOCK + t  # [BLOCK]
        k_rows = k_cache + head_k * k_stride_h + slots[:, None] * DIM + d[None, :]
        k = tl.load(k_rows, mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK, D]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, BLOCK]
        if HAS_SOFTCAP:
            scores = (2.0 / (1.0 + tl.exp(-2.0 * scores / softcap)) - 1.0) * softcap  # tanh, which tl lacks
        position = (first_block + column) * BLOCK + t
        seen = t_ok & (position >= first) & (position <= last)
        scores = tl.where(seen[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        base = tl.where(new_best == float("-inf"), 0.0, new_best)  # nothing seen yet: no rescaling to do
        rescale = tl.exp(best - base)
        weights = tl.exp(scores - base[:, None])
        v_rows = v_cache + head_k * v_stride_h + slots[:, None] * VDIM + dv[None, :]
        v = tl.load(v_rows, mask=t_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK, Dv]
        total = total * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
        best = new_best

    out = ((seq * SPLITS + split) * KV_HEADS + head) * GROUP + g
    tl.store(out_max + out, best, mask=g_ok)
    tl.store(out_sum + out, total, mask=g_ok)
    tl.store(out_acc + out[:, None] * VDIM + dv[None, :], acc, mask=g_ok[:, None] & dv_ok[None, :])


def split_partials(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: DecodeBlocks,
    scale: float,
    softcap: float | None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``query`` ``[B, H, D]`` (contiguous), caches ``[KVH, slots, D]``. Per split of each decode's blocks (``splits``
    of them, by default enough to fill the GPU), in float32: the maximum score ``[B, S, KVH, G]`` (``-inf`` for a
    split that sees nothing), the sum of ``exp(score - maximum)`` and those weights times the values ``[B, S, KVH, G,
    Dv]``, for ``decode.combine``."""
    batch = query.shape[0]
    kv_heads, _, dim = k_cache.shape
    vdim = v_cache.shape[-1]
    group = query.shape[1] // kv_heads
    block_size, tables = blocks.block_size, blocks.tables
    splits = splits or splits_for(batch, kv_heads, query.device)
    out_max = query.new_empty(batch, splits, kv_heads, group, dtype=torch.float32)
    out_sum = torch.empty_like(out_max)
    out_acc = query.new_empty(batch, splits, kv_heads, group, vdim, dtype=torch.float32)
    # The kernel's addressing assumes contiguous rows (the cache's, the queries' and the tables' own layout).
    assert k_cache.stride(1) == dim and v_cache.stride(1) == vdim and query.stride(1) == dim
    assert tables.stride(1) == 1 and blocks.first.is_contiguous() and blocks.last.is_contiguous()
    group_p2 = min(triton.next_power_of_2(group), GROUP_BLOCK)
    tiles = triton.cdiv(group, group_p2)
    dim_p2, block_p2 = triton.next_power_of_2(max(dim, vdim)), triton.next_power_of_2(block_size)
    # The [group, block, dim] products spill at four warps from 16k elements (ptxas, sm_90): eight hold them.
    warps = 8 if group_p2 * block_p2 * dim_p2 >= 16384 else 4
    if batch:
        # Triton launches on the current device, not the tensors' (CPU tensors: Triton's interpreter)
        with torch.cuda.device(query.device) if query.is_cuda else nullcontext():
            _split_kernel[(batch, kv_heads * tiles, splits)](
                query,
                k_cache,
                v_cache,
                tables,
                blocks.first,
                blocks.last,
                out_max,
                out_sum,
                out_acc,
                scale,
                softcap or 1.0,
                query.stride(0),
                tables.stride(0),
                k_cache.stride(0),
                v_cache.stride(0),
                splits,
                KV_HEADS=kv_heads,
                GROUP=group,
                GROUP_P2=group_p2,
                GROUP_TILES=tiles,
                BLOCK=block_size,
                BLOCK_P2=block_p2,
                DIM=dim,
                DIM_P2=triton.next_power_of_2(dim),
                VDIM=vdim,
                VDIM_P2=triton.next_power_of_2(vdim),
                HAS_SOFTCAP=softcap is not None,
                num_warps=warps,
            )
    return out_max, out_sum, out_acc


def splits_for(batch: int, kv_heads: int, device: torch.device) -> int:
    """Enough programs for about four per multiprocessor, whatever the batch (a graph's bucket fixes it)."""
    programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, -(-programs // max(1, batch * kv_heads))))
