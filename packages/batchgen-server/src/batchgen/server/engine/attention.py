"""Our attention function, registered with transformers' ``AttentionInterface``.

The model runs on one packed row of tokens (every scheduled sequence's new tokens back to back, no padding). For
each layer this function writes the new keys/values into the paged cache, then attends each sequence's new queries
over all of its cached tokens: decode tokens (one query each) in one batched call, prefill chunks one call each.
The per-step index tensors are built once by the model runner and passed in as the ``paged`` keyword argument,
which transformers forwards from the model's ``forward`` to every attention call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "batchgen_paged"


@dataclass(slots=True)
class PrefillChunk:
    start: int
    """First row of the chunk in the packed tokens."""
    end: int
    context_slots: torch.Tensor | None
    """Cache slots of every token the chunk attends to (cached ones then its own); ``None`` when it starts at 0."""
    mask: torch.Tensor | None
    """Causal mask ``[chunk, context]`` used with ``context_slots``."""


@dataclass(slots=True)
class PagedStep:
    """What one forward needs to read and write the paged KV cache."""

    k_caches: list[torch.Tensor]
    """Per layer ``[num_slots, kv_heads, head_dim]``; slot = block * block_size + offset."""
    v_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor
    """Cache slot of each packed token."""
    decode_rows: torch.Tensor | None = None
    """Packed rows that are single-token decodes."""
    decode_slots: torch.Tensor | None = None
    """``[decodes, max_context]`` slots of each decode's context (padding repeats a valid slot)."""
    decode_mask: torch.Tensor | None = None
    """``[decodes, 1, 1, max_context]``: ``True`` where a context slot is real."""
    prefills: list[PrefillChunk] = field(default_factory=list)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged: PagedStep | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` is ``[1, heads, tokens, head_dim]``, ``key``/``value`` ``[1, kv_heads, tokens, head_dim]``."""
    if paged is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs the engine's `paged` step argument")
    layer = module.layer_idx
    q = query[0].transpose(0, 1)  # [tokens, heads, dim]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    k_cache, v_cache = paged.k_caches[layer], paged.v_caches[layer]
    device = k_cache.device  # differs from the step's device only for models spread over devices (device_map)
    slot_mapping = paged.slot_mapping.to(device)
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
    if paged.decode_rows is not None:
        assert paged.decode_slots is not None and paged.decode_mask is not None
        rows, slots = paged.decode_rows.to(device), paged.decode_slots.to(device)
        qd = q[rows].unsqueeze(2)  # [decodes, heads, 1, dim]
        shape = (*slots.shape, *k_cache.shape[1:])
        kd = k_cache.index_select(0, slots.flatten()).view(shape).transpose(1, 2)  # [decodes, kv_heads, context, dim]
        vd = v_cache.index_select(0, slots.flatten()).view(shape).transpose(1, 2)
        mask = paged.decode_mask.to(device)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[rows] = od.squeeze(2)
    for chunk in paged.prefills:
        qp = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, heads, chunk, dim]
        if chunk.context_slots is None:
            kp = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            vp = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            context_slots = chunk.context_slots.to(device)
            kp = k_cache.index_select(0, context_slots).transpose(0, 1).unsqueeze(0)
            vp = v_cache.index_select(0, context_slots).transpose(0, 1).unsqueeze(0)
            mask = chunk.mask.to(device) if chunk.mask is not None else None
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[chunk.start : chunk.end] = op[0].transpose(0, 1)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention)
