"""Attention over contiguous keys and values, honouring a layer's scale, soft-cap and sinks.

SDPA when the layer asks for nothing more; otherwise the scores are computed explicitly, in the same order as
transformers' eager attention (scale, soft-cap, mask, sinks, softmax in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layer import LayerAttention


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: LayerAttention, mask: torch.Tensor | None
) -> torch.Tensor:
    """``query`` ``[B, H, Tq, D]``, ``key``/``value`` ``[B, KVH, Tk, D]``; ``mask`` ``True`` where visible, or
    ``None`` for plain causal attention (``Tq == Tk``). Returns ``[B, H, Tq, Dv]``. Keys and values from a cache of
    another dtype (``--kv-cache-dtype``) are read in the query's."""
    key, value = key.to(query.dtype), value.to(query.dtype)
    gqa = query.shape[1] != key.shape[1]
    if not layer.needs_explicit_scores:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=mask is None, scale=layer.scale, enable_gqa=gqa
        )
    if mask is None:
        mask = causal_mask(query.shape[2], 0, None, query.device)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = layer.scale if layer.scale is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)  # at least float32, as transformers does
    scores = scores.to(softmax_dtype).masked_fill(~mask, float("-inf"))
    if layer.sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sinks = layer.sinks.to(softmax_dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(value.dtype), value)


def both_ways(
    mask: torch.Tensor, first_query: int, spans: tuple[tuple[int, int], ...], window: int | None
) -> torch.Tensor:
    """``mask`` (``causal_mask``'s) with each span's queries also seeing the span's later keys, as transformers'
    Gemma 3 masks do: OR(causal, same span), and under a window AND(window, OR(causal, same span))."""
    mask = mask.clone()
    for first, end in spans:
        rows = slice(max(first, first_query) - first_query, end - first_query)
        if window is None:
            mask[rows, first:end] = True
        else:
            queries = torch.arange(max(first, first_query), end, device=mask.device).unsqueeze(1)
            keys = torch.arange(first, end, device=mask.device).unsqueeze(0)
            mask[rows, first:end] |= keys > queries - window
    return mask


def causal_mask(num_queries: int, first_query: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``[num_queries, first_query + num_queries]``: query ``i`` (at position ``first_query + i``) sees keys at
    positions ``<= first_query + i`` and, with a window, ``> first_query + i - window``."""
    positions = torch.arange(first_query, first_query + num_queries, device=device).unsqueeze(1)
    keys = torch.arange(first_query + num_queries, device=device).unsqueeze(0)
    visible = keys <= positions
    if window is not None:
        visible &= keys > positions - window
    return visible
