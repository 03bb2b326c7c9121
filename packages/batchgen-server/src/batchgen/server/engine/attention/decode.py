"""Decode attention that reads the paged cache in place: one new query per sequence, over its own blocks.

The work is laid out by (sequence, visible block) pairs, with no padding: each pair scores its query against the
block's keys, keeps its maximum, and weighs the block's values, as flash-decoding does per split; the per-sequence
softmax then combines the pairs (a scatter of maxima, then of sums). ``paged_decode`` says it in plain tensor
operations: the reference, and the eager fallback. The fast versions read every visible key and value once, where it
lies: on CUDA a Triton kernel computes the pairs' partials (``triton_decode.py``; no host synchronisation, so a CUDA
graph can capture it), on CPU a C++ kernel does the whole of it (``cpu_decode.cpp``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..transfer import to_device
from . import cpu_decode
from .layer import LayerAttention
from .step import SeqSlice

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DecodePairs:
    """The (sequence, block) pairs of a step's decodes, for one window size."""

    seq: torch.Tensor
    """``[P]`` which decode each pair belongs to (a graph's padding pairs come last, on decode 0)."""
    block: torch.Tensor
    """``[P]`` the cache block it reads."""
    visible: torch.Tensor
    """``[P, block_size]`` which of the block's slots the decode's query sees (causality, the window, a partly
    filled last block). Every sequence sees at least one slot; a pair that sees none adds nothing (padding)."""
    offsets: torch.Tensor
    """``[B + 1]``: decode ``i``'s pairs are ``offsets[i]:offsets[i + 1]`` (pairs come grouped by decode, in order;
    a graph's padding pairs after ``offsets[-1]``)."""

    def to(self, device: torch.device) -> DecodePairs:
        if self.seq.device == device:
            return self
        tensors = (self.seq, self.block, self.visible, self.offsets)
        return DecodePairs(*(to_device(tensor, device) for tensor in tensors))

    @classmethod
    def build(cls, decodes: list[SeqSlice], window: int | None, block_size: int, tables: np.ndarray) -> DecodePairs:
        """The pairs of ``decodes`` (their blocks in ``tables``, ``block_tables.py``) on the host, in whole-array
        numpy (this runs every step, for every decode: at batch 256 it was 2.7 ms in torch's small ops and masks, and
        0.5 ms in a Python pass over the block tables). Every visible block is wholly visible but a decode's last (up
        to its own slot) and, with a window, its first (from the window's start)."""
        bs, count = block_size, len(decodes)
        starts = np.fromiter((s.start for s in decodes), np.int64, count)
        table_rows = np.fromiter((s.table_row for s in decodes), np.int64, count)
        firsts = np.zeros_like(starts) if window is None else np.maximum(starts - window + 1, 0)  # first_visible
        first_blocks = firsts // bs
        lengths = starts // bs - first_blocks + 1
        offsets = np.zeros(count + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        seq = np.repeat(np.arange(count, dtype=np.int64), lengths)
        block = tables[table_rows[seq], np.arange(offsets[-1]) - offsets[seq] + first_blocks[seq]]
        slot = np.arange(bs)
        visible = np.ones((block.shape[0], bs), dtype=bool)
        visible[offsets[1:] - 1] = slot <= (starts % bs)[:, None]
        if window is not None:
            visible[offsets[:-1]] &= slot >= (firsts % bs)[:, None]
        return cls(*(torch.from_numpy(array) for array in (seq, block, visible, offsets)))

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The same on the host, as the eager gather reads it: each decode's visible blocks ``[B, W]`` (padded with
        block 0) and which of their slots it sees ``[B, W * block_size]``."""
        lengths = self.offsets.diff()
        batch, width, count = lengths.shape[0], int(lengths.max()), self.seq.shape[0]
        column = torch.arange(count) - self.offsets[self.seq]
        blocks = torch.zeros(batch, width, dtype=torch.long)
        blocks[self.seq, column] = self.block
        visible = torch.zeros(batch, width, self.visible.shape[1], dtype=torch.bool)
        visible[self.seq, column] = self.visible
        return blocks, visible.view(batch, -1)


def first_visible(position: int, window: int | None) -> int:
    """The first position a query at ``position`` sees (transformers' sliding-window rule)."""
    return 0 if window is None else max(0, position - window + 1)


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pairs: DecodePairs,
    sinks: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """``query`` ``[B, H, D]``; caches ``[KVH, slots, D]``; ``sinks`` ``[H]`` or ``None``. Returns ``[B, H, Dv]`` in
    the query's dtype. Scores, softmax and sums are in at least float32 (compiled, the casts happen as the 16-bit
    cache is read, with no copy), so a sum over many blocks does not lose bf16 precision."""
    partials = pair_partials(query, k_cache, v_cache, pairs, scale, softcap)
    return combine(*partials, pairs.seq, query, sinks)


def pair_partials(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pairs: DecodePairs,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair and query head: the maximum visible score ``[P, KVH, G]`` (``-inf`` for a pair that sees nothing),
    the sum of ``exp(score - maximum)`` ``[P, KVH, G]`` and those weights times the block's values
    ``[P, KVH, G, Dv]`` (G query heads per KV head), in at least float32."""
    batch = query.shape[0]
    kv_heads, _, dim = k_cache.shape
    block_size = pairs.visible.shape[1]
    acc = torch.promote_types(query.dtype, torch.float32)
    q = query.reshape(batch, kv_heads, -1, dim)[pairs.seq].to(acc)  # [P, KVH, G, D]
    keys = k_cache.view(kv_heads, -1, block_size, dim)[:, pairs.block].to(acc)  # [KVH, P, bs, D]
    scores = torch.einsum("pkgd,kptd->pkgt", q, keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~pairs.visible[:, None, None, :], float("-inf"))
    best = scores.amax(dim=-1)  # [P, KVH, G]
    weights = torch.exp(scores - best.masked_fill(best == float("-inf"), 0).unsqueeze(-1))  # [P, KVH, G, bs]
    values = v_cache.view(kv_heads, -1, block_size, v_cache.shape[-1])[:, pairs.block].to(acc)  # [KVH, P, bs, Dv]
    return best, weights.sum(dim=-1), torch.einsum("pkgt,kptd->pkgd", weights, values)


def combine(
    best: torch.Tensor,
    total: torch.Tensor,
    weighted: torch.Tensor,
    seq: torch.Tensor,
    query: torch.Tensor,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Each sequence's softmax from its pairs' partials (``pair_partials``): rescaled to the sequence's maximum and
    summed (flash-decoding's combine); a sink is one more softmax column that carries no value. ``[B, H, Dv]`` in
    the query's dtype."""
    batch = query.shape[0]
    kv_heads = best.shape[1]
    seq_max = best.new_full((batch, *best.shape[1:]), float("-inf"))
    seq_max = seq_max.scatter_reduce(0, seq.view(-1, 1, 1).expand_as(best), best, "amax")
    if sinks is not None:
        sinks = sinks.to(best.dtype).view(kv_heads, -1)
        seq_max = torch.maximum(seq_max, sinks)
    scale = torch.exp(best - seq_max[seq])  # [P, KVH, G]; 0 for a pair that sees nothing
    out = weighted.new_zeros(batch, *weighted.shape[1:]).index_add_(0, seq, weighted * scale.unsqueeze(-1))
    norm = total.new_zeros(batch, *total.shape[1:]).index_add_(0, seq, total * scale)
    if sinks is not None:
        norm = norm + torch.exp(sinks - seq_max)
    return (out / norm.unsqueeze(-1)).reshape(batch, -1, weighted.shape[-1]).to(query.dtype)


class DecodeKernel:
    """``paged_decode``, fast: on CUDA its partials from a Triton kernel (``triton_decode.py``), on CPU the C++ kernel
    (``cpu_decode.py``, for float32 and bfloat16 caches); anything else runs it eagerly. If the fast version fails
    where the plain one succeeds, the kernel says why once in the log and runs eagerly from then on."""

    def __init__(self) -> None:
        self.failure: str | None = None

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pairs: DecodePairs,
        layer: LayerAttention,
    ) -> torch.Tensor:
        scale = layer.scale if layer.scale is not None else query.shape[-1] ** -0.5
        args = (query, k_cache, v_cache, pairs, layer.sinks, scale, layer.softcap)
        if self.failure is not None:
            return paged_decode(*args)
        try:
            return self._fast(*args)
        except Exception as exc:
            out = paged_decode(*args)  # a fault of the inputs raises here too, and is the caller's
            self.failure = f"{type(exc).__name__}: {exc}"
            logger.warning("the fast decode attention failed, running it eagerly from now on (%s)", self.failure)
            return out

    def _fast(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pairs: DecodePairs,
        sinks: torch.Tensor | None,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        if query.device.type == "cuda" and query.dtype != torch.float64:  # it accumulates in float32
            from .triton_decode import split_partials, splits_for  # Triton ships with CUDA builds only

            # The kernel addresses rows by canonical strides, which a size-1 dimension of the model's layout need not
            # have (a copy only when the layout is not contiguous).
            query = query.reshape(-1).view(query.shape)
            splits = splits_for(query.shape[0], k_cache.shape[0], query.device)
            *partials, owner = split_partials(
                query, k_cache, v_cache, pairs.block, pairs.visible, pairs.offsets, scale, softcap, splits
            )
            return combine(*partials, owner, query, sinks)
        if cpu_decode.supports(query, k_cache, v_cache):
            return cpu_decode.paged_decode(query, k_cache, v_cache, pairs, sinks, scale, softcap)
        return paged_decode(query, k_cache, v_cache, pairs, sinks, scale, softcap)
