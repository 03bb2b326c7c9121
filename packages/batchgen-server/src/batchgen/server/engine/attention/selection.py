"""Sparse attention over a per-query selection of past tokens (DSA: DeepSeek-V3.2, GLM-5).

A DSA layer's lightning indexer picks, for each query, the ``index_topk`` past tokens it attends to; the layer then
hands the chosen positions to the attention function as ``indices`` (transformers' path for kernels that read a
selection; its eager path folds them into the mask instead). The engine builds no mask: the layer's
``attention_mask`` is ``SELECTION``, a stand-in that only says "the indexer runs in the engine" (``dsa.py`` runs it
per sequence over the paged indexer keys), and a query here sees a key iff it is causal and selected, exactly
transformers' ``causal & ~index_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .kernels import attend
from .layer import SELECTION, LayerAttention, SelectionMask


class Selections(dict[str, Any]):
    """The model's mask mapping (``attention_mask=`` a dict: "already prepared", the models skip building theirs):
    ``SELECTION`` for every kind of layer it asks for."""

    def __missing__(self, key: str) -> SelectionMask:
        return SELECTION


def selected_mask(selected: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """``[queries, width]``: which of the positions ``0..width-1`` each query (at ``positions``) sees: causal and
    among its ``selected`` positions (``[queries, k]``, -1 for none)."""
    chosen = torch.where(selected < 0, width, selected.long()).clamp(max=width)  # none -> a column dropped below
    mask = torch.zeros(selected.shape[0], width + 1, dtype=torch.bool, device=selected.device)
    mask.scatter_(1, chosen, True)
    return mask[:, :width] & (torch.arange(width, device=selected.device) <= positions.unsqueeze(1))


@dataclass(slots=True)
class Chunk:
    """A prefill chunk, attended alone."""

    rows: slice
    """Its packed rows."""
    positions: torch.Tensor
    """``[rows]`` its tokens' positions."""
    slots: torch.Tensor
    """``[1, context]`` the cache slots of its whole context."""


@dataclass(slots=True)
class Decodes:
    """The step's decodes, attended in one call over contexts padded to the longest."""

    rows: torch.Tensor
    """``[B]`` their packed rows."""
    positions: torch.Tensor
    """``[B]`` each one's position (it sees positions up to it)."""
    slots: torch.Tensor
    """``[B, width]`` the cache slots of each context; past a context's end, stale slots (valid, never visible)."""


@dataclass(slots=True)
class SparseContexts:
    """What a step's DSA layers (the indexer, ``dsa.py``, and the attention) read, built once a step."""

    chunks: list[Chunk]
    decodes: Decodes | None


def attend_selected(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query: torch.Tensor,
    layer: LayerAttention,
    selected: torch.Tensor,
    contexts: SparseContexts,
) -> torch.Tensor:
    """The step's queries (``query`` ``[1, H, T, D]``) over their sequences' cached contexts, each seeing its
    causal, selected positions (``selected`` ``[T, k]``); returns ``[T, H, Dv]``. The decodes in one call over their
    chosen keys alone, each prefill chunk in its own over its context (its queries choose differently)."""
    device = k_cache.device
    out = query.new_empty(query.shape[2], query.shape[1], v_cache.shape[-1])
    decodes = contexts.decodes
    if decodes is not None:  # each reads only its k chosen keys: the same set, a k-wide gather
        rows, slots = decodes.rows.to(device), decodes.slots.to(device)
        chosen = selected[rows].to(device).long()  # [B, k] positions, -1 for none
        visible = (chosen >= 0) & (chosen <= decodes.positions.to(device).unsqueeze(1))
        slots = slots.gather(1, chosen.clamp(0, slots.shape[1] - 1))
        q = query[0][:, rows].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        keys, values = k_cache[:, slots].transpose(0, 1), v_cache[:, slots].transpose(0, 1)  # [B, KVH, k, D]
        out[rows] = attend(q, keys, values, layer, visible[:, None, None])[:, :, 0]
    for chunk in contexts.chunks:
        slots = chunk.slots[0].to(device)
        mask = selected_mask(selected[chunk.rows].to(device), chunk.positions.to(device), slots.shape[0])
        keys, values = k_cache[:, slots].unsqueeze(0), v_cache[:, slots].unsqueeze(0)
        out[chunk.rows] = attend(query[:, :, chunk.rows], keys, values, layer, mask[None, None])[0].transpose(0, 1)
    return out
