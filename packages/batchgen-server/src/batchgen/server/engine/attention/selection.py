"""Sparse attention over a per-query selection of past tokens (DSA: DeepSeek-V3.2, GLM-5).

A DSA layer's lightning indexer picks, for each query, the ``index_topk`` past tokens it attends to; the layer then
hands the chosen positions to the attention function as ``indices`` (transformers' path for kernels that read a
selection; its eager path folds them into the mask instead). The engine builds no mask: the layer's
``attention_mask`` is ``SELECTION``, a stand-in that only says "the indexer runs in the engine" (``dsa.py`` runs it
per sequence over the paged indexer keys), and a query here sees a key iff it is causal and selected, exactly
transformers' ``causal & ~index_mask``.
"""

from __future__ import annotations

from typing import Any

import torch

from .kernels import attend
from .layer import SELECTION, LayerAttention, SelectionMask


class Selections(dict[str, Any]):
    """The model's mask mapping (``attention_mask=`` a dict: "already prepared", the models skip building theirs):
    ``SELECTION`` for every kind of layer it asks for."""

    def __missing__(self, key: str) -> SelectionMask:
        return SELECTION


def selected_mask(selected: torch.Tensor, first: int, width: int) -> torch.Tensor:
    """``[queries, width]``: which of the positions ``0..width-1`` each query (at positions ``first`` on) sees:
    causal and among its ``selected`` positions (``[queries, k]``, -1 for none)."""
    queries = selected.shape[0]
    chosen = torch.where(selected < 0, width, selected.long()).clamp(max=width)  # none -> a column dropped below
    mask = torch.zeros(queries, width + 1, dtype=torch.bool, device=selected.device)
    mask.scatter_(1, chosen, True)
    positions = torch.arange(first, first + queries, device=selected.device).unsqueeze(1)
    return mask[:, :width] & (torch.arange(width, device=selected.device).unsqueeze(0) <= positions)


def attend_selected(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query: torch.Tensor,
    layer: LayerAttention,
    selected: torch.Tensor,
    contexts: list[tuple[int, int, int, torch.Tensor]],
) -> torch.Tensor:
    """Each sequence's queries (``query`` ``[1, H, T, D]``) over its cached context, each seeing its causal,
    selected positions (``selected`` ``[T, k]``); returns ``[T, H, Dv]``. ``contexts``: per sequence its first
    packed row, its first new position, its context length and the cache slots of that context. One call per
    sequence: the selection is per query, so no layout is shared across them."""
    device = k_cache.device
    out = query.new_empty(query.shape[2], query.shape[1], v_cache.shape[-1])
    for row, start, end, slots in contexts:
        rows = slice(row, row + end - start)
        mask = selected_mask(selected[rows].to(device), start, end)
        slots = slots.to(device)
        keys, values = k_cache[:, slots].unsqueeze(0), v_cache[:, slots].unsqueeze(0)
        out[rows] = attend(query[:, :, rows], keys, values, layer, mask[None, None])[0].transpose(0, 1)
    return out
