"""The flex backend: FlexAttention reads every sequence's context in place from the paged cache, with no copy, in
one call per layer for the whole packed step (prefill chunks and decodes together). An option (``gather`` is the
default): on an H200 with torch 2.11 it does not compile, FlexAttention having no kernel configuration for 16-token
query and KV blocks (``NoValidChoicesError``), so the engine falls back to eager ``gather`` for good.

The keys are the whole cache, one long row of slots; the block mask lists, for each group of ``Q_BLOCK`` packed
queries, only the cache blocks their sequences can see, so the kernel visits nothing else. Inside those blocks the
mask function maps a slot back to its position in the query's own sequence (through a physical-to-logical table,
since blocks are shared between sequences by the prefix cache and by forks) and applies causality and the window.
Soft-capping is a score modification; sinks rescale the output by ``sigmoid(lse - sink)``, which is exactly an
extra softmax column that carries no value.

Compiled with ``torch.compile`` (Triton kernels on CUDA) when asked; eager FlexAttention computes the same result
through a dense reference, fine for the small shapes of the CPU tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from ..ops.fast_paths import FastPath
from ..ops.transfer import to_device
from .layer import LayerAttention
from .step import PagedStep

Q_BLOCK = 16
"""Packed queries per block-mask row: small, since one group's sequences all share its list of KV blocks."""


@dataclass(slots=True)
class _Layout:
    """Where each packed query belongs, built once per step for every window."""

    query_seq: torch.Tensor
    """``[T]`` index of the query's sequence in the step."""
    query_pos: torch.Tensor
    """``[T]`` position of the query in its sequence."""
    tables: torch.Tensor
    """``[S, max_blocks]`` block tables, padded with ``-1``."""
    physical_to_logical: torch.Tensor
    """``[S, num_blocks]``: a block's index in the sequence's table, ``-1`` where the sequence does not use it."""


class FlexBackend:
    def __init__(self, compiled: bool) -> None:
        self._flex: Callable[..., Any] = flex_attention
        if compiled:
            self._flex = torch.compile(flex_attention, dynamic=True)

    @property
    def paths(self) -> list[FastPath]:
        return []  # compiled on CUDA or not, it has no plainer path to fall back to

    def attend(
        self,
        step: PagedStep,
        layer_index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer: LayerAttention,
    ) -> torch.Tensor:
        mask: BlockMask = step.memo(("flex", layer.window), lambda: _block_mask(step, layer.window))
        k_cache, v_cache = step.cache.k[layer_index], step.cache.v[layer_index]
        score_mod = None if layer.softcap is None else _softcap(layer.softcap)
        result = self._flex(
            query,
            k_cache.unsqueeze(0),
            v_cache.unsqueeze(0),
            score_mod=score_mod,
            block_mask=mask,
            scale=layer.scale,
            enable_gqa=query.shape[1] != k_cache.shape[0],
            return_aux=AuxRequest(lse=True) if layer.sinks is not None else None,
        )
        if layer.sinks is None:
            out: torch.Tensor = result
        else:
            out, aux = result
            sinks = layer.sinks.to(aux.lse.dtype).view(1, -1, 1)
            out = out * torch.sigmoid(aux.lse - sinks).unsqueeze(-1).to(out.dtype)
        return out[0].transpose(0, 1)


def _softcap(cap: float) -> Callable[..., torch.Tensor]:
    def score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return torch.tanh(score / cap) * cap

    return score_mod


def _layout(step: PagedStep) -> _Layout:
    """Built on the host and moved without a wait (only the physical-to-logical map, which is as wide as the cache,
    is made on the device)."""
    device, num_blocks = step.device, step.cache.num_blocks
    own = [step.blocks(seq) for seq in step.seqs]
    tables = torch.full((len(own), max(len(blocks) for blocks in own)), -1, dtype=torch.long)
    for i, blocks in enumerate(own):
        tables[i, : len(blocks)] = torch.from_numpy(blocks)
    query_seq = torch.tensor([i for i, s in enumerate(step.seqs) for _ in range(s.num_tokens)])
    query_pos = torch.tensor([p for s in step.seqs for p in range(s.start, s.end)])
    tables, query_seq, query_pos = (to_device(t, device) for t in (tables, query_seq, query_pos))
    logical = torch.arange(tables.shape[1], device=device).expand_as(tables)
    physical_to_logical = torch.full((len(step.seqs), num_blocks + 1), -1, dtype=torch.long, device=device)
    physical_to_logical.scatter_(1, torch.where(tables >= 0, tables, num_blocks), logical)
    return _Layout(query_seq, query_pos, tables, physical_to_logical[:, :num_blocks])


def _block_mask(step: PagedStep, window: int | None) -> BlockMask:
    layout: _Layout = step.memo("flex-layout", lambda: _layout(step))
    bs, num_blocks = step.cache.block_size, step.cache.num_blocks
    query_seq, query_pos, p2l = layout.query_seq, layout.query_pos, layout.physical_to_logical

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        block = p2l[query_seq[q], kv // bs]
        position = block * bs + kv % bs
        visible = (block >= 0) & (position <= query_pos[q])
        if window is not None:
            visible &= position > query_pos[q] - window
        return visible

    # Each query's visible blocks (its sequence's table, cut to the window and to its own position), as a dense
    # [query groups, num_blocks] map, then in the ordered form the kernel reads.
    tables = layout.tables[query_seq]
    logical = torch.arange(tables.shape[1], device=tables.device).unsqueeze(0)
    seen = (tables >= 0) & (logical <= (query_pos // bs).unsqueeze(1))
    if window is not None:
        seen &= logical >= ((query_pos - window + 1).clamp(min=0) // bs).unsqueeze(1)
    num_queries = query_pos.shape[0]
    groups = -(-num_queries // Q_BLOCK)
    pad = groups * Q_BLOCK - num_queries
    targets = torch.where(seen, tables, num_blocks)
    targets = torch.nn.functional.pad(targets, (0, 0, 0, pad), value=num_blocks).view(groups, -1)
    dense = torch.zeros(groups, num_blocks + 1, dtype=torch.bool, device=tables.device)
    dense.scatter_(1, targets, True)
    dense = dense[:, :num_blocks]
    kv_num_blocks = dense.sum(dim=1, dtype=torch.int32)
    kv_indices = torch.argsort(dense.to(torch.int8), dim=1, descending=True, stable=True).to(torch.int32)
    return BlockMask.from_kv_blocks(
        kv_num_blocks[None, None],
        kv_indices[None, None],
        BLOCK_SIZE=(Q_BLOCK, bs),
        mask_mod=mask_mod,
        seq_lengths=(num_queries, num_blocks * bs),
    )
