"""The decode kernel's per-pair stage as a Triton kernel: the CUDA path of ``decode.py``.

Compiled by inductor, the plain-tensor version of this stage ran 4 ms a layer on an H200 for 256 decodes of 512
tokens (a 50th of the memory roofline). Here one program takes one (sequence, block) pair and one KV head (and up to
``GROUP_BLOCK`` of the query heads that share it): it reads the block's keys and values once, where they lie, and
writes the pair's maximum, sum and weighted values, which ``decode.combine`` turns into each sequence's softmax.
No tensor cores: at one query per sequence the stage is bound by reading the cache, not by arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP_BLOCK = 16
"""Query heads per program at most (an MQA layer's many heads per KV head take several programs)."""


@triton.jit
def _pair_kernel(
    query,
    k_cache,
    v_cache,
    pair_seq,
    pair_block,
    visible,
    out_max,
    out_sum,
    out_acc,
    scale,
    softcap,
    q_stride_b,
    k_stride_h,
    v_stride_h,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr,
    DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
    VDIM: tl.constexpr,
    VDIM_P2: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    pair = tl.program_id(0)
    head = tl.program_id(1)
    g = tl.program_id(2) * GROUP_P2 + tl.arange(0, GROUP_P2)
    d = tl.arange(0, DIM_P2)
    dv = tl.arange(0, VDIM_P2)
    t = tl.arange(0, BLOCK_P2)
    g_ok, d_ok, dv_ok, t_ok = g < GROUP, d < DIM, dv < VDIM, t < BLOCK
    seq = tl.load(pair_seq + pair).to(tl.int64)
    slots = tl.load(pair_block + pair).to(tl.int64) * BLOCK + t  # [BLOCK]

    q_rows = query + seq * q_stride_b + (head * GROUP + g)[:, None] * DIM + d[None, :]
    q = tl.load(q_rows, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [G, D]
    k_rows = k_cache + head * k_stride_h + slots[:, None] * DIM + d[None, :]
    k = tl.load(k_rows, mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK, D]
    scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, BLOCK]
    if HAS_SOFTCAP:
        scores = (2.0 / (1.0 + tl.exp(-2.0 * scores / softcap)) - 1.0) * softcap  # tanh, which tl lacks
    seen = tl.load(visible + pair * BLOCK + t, mask=t_ok, other=0) != 0
    scores = tl.where(seen[None, :], scores, float("-inf"))
    best = tl.max(scores, axis=1)  # [G]; -inf for a pair that sees nothing (a graph's padding)
    weights = tl.exp(scores - tl.where(best == float("-inf"), 0.0, best)[:, None])
    v_rows = v_cache + head * v_stride_h + slots[:, None] * VDIM + dv[None, :]
    v = tl.load(v_rows, mask=t_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK, Dv]
    acc = tl.sum(weights[:, :, None] * v[None, :, :], axis=1)  # [G, Dv]

    row = (pair * KV_HEADS + head) * GROUP + g
    tl.store(out_max + row, best, mask=g_ok)
    tl.store(out_sum + row, tl.sum(weights, axis=1), mask=g_ok)
    tl.store(out_acc + row[:, None] * VDIM + dv[None, :], acc, mask=g_ok[:, None] & dv_ok[None, :])


def pair_partials(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq: torch.Tensor,
    block: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``query`` ``[B, H, D]`` (contiguous), caches ``[KVH, slots, D]``; per pair and query head, float32: the
    maximum score ``[P, KVH, G]``, the sum of ``exp(score - maximum)`` ``[P, KVH, G]`` and those weights times the
    values ``[P, KVH, G, Dv]``, as ``decode.pair_partials`` computes them."""
    kv_heads, _, dim = k_cache.shape
    vdim = v_cache.shape[-1]
    group = query.shape[1] // kv_heads
    pairs, block_size = visible.shape
    out_max = query.new_empty(pairs, kv_heads, group, dtype=torch.float32)
    out_sum = torch.empty_like(out_max)
    out_acc = query.new_empty(pairs, kv_heads, group, vdim, dtype=torch.float32)
    group_p2 = min(triton.next_power_of_2(group), GROUP_BLOCK)
    grid = (pairs, kv_heads, triton.cdiv(group, group_p2))
    if pairs:
        _pair_kernel[grid](
            query,
            k_cache,
            v_cache,
            seq,
            block,
            visible.view(torch.uint8),
            out_max,
            out_sum,
            out_acc,
            scale,
            softcap or 1.0,
            query.stride(0),
            k_cache.stride(0),
            v_cache.stride(0),
            KV_HEADS=kv_heads,
            GROUP=group,
            GROUP_P2=group_p2,
            BLOCK=block_size,
            BLOCK_P2=triton.next_power_of_2(block_size),
            DIM=dim,
            DIM_P2=triton.next_power_of_2(dim),
            VDIM=vdim,
            VDIM_P2=triton.next_power_of_2(vdim),
            HAS_SOFTCAP=softcap is not None,
        )
    return out_max, out_sum, out_acc
