"""The probe: one plain forward of a few tokens through our attention, before the cache exists.

It finds every attention layer (the module that calls attention, and the shape of the keys and values it produces),
so the cache can be shaped for any architecture, and it makes every layer state what it asks of attention, so a
model that needs something the engine does not compute is refused at load.
"""

from __future__ import annotations

import torch

from .kernels import attend, causal_mask
from .kv_cache import IndexerShape, LayerShape
from .layer import AttentionRefused, LayerAttention
from .selection import selected_mask


class LayerProbe:
    """The attention context of the probe forward (one sequence, positions from 0, no cache)."""

    def __init__(self) -> None:
        self.modules: list[torch.nn.Module] = []
        self.shapes: list[LayerShape] = []
        self.windows: set[int | None] = set()
        """The sliding windows of the layers (``None``: full attention)."""
        self.indexers: dict[int, IndexerShape] = {}
        """The DSA layers' indexer keys (``dsa.py``), by the index of the attention layer they select for."""

    def record_indexer(self, keys: torch.Tensor) -> None:
        """The indexer of the next attention layer made these keys ``[1, tokens, dim]``."""
        self.indexers[len(self.modules)] = IndexerShape(keys.shape[-1], keys.dtype, keys.device)

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer: LayerAttention,
        selected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if any(module is seen for seen in self.modules):
            raise AttentionRefused("it runs the same attention layer more than once per forward (shared weights)")
        if key.shape[2] != query.shape[2]:  # the paged cache holds one key per token, written at its slot
            raise AttentionRefused(
                f"its attention sees {key.shape[2]} keys for {query.shape[2]} tokens, which a paged KV cache of one "
                "key per token does not hold"
            )
        self.modules.append(module)
        self.shapes.append(LayerShape(key.shape[1], key.shape[3], value.shape[3], key.dtype, key.device))
        self.windows.add(layer.window)
        mask = None if layer.window is None else causal_mask(query.shape[2], 0, layer.window, query.device)
        if selected is not None:  # a DSA layer (``selection.py``)
            chosen = selected_mask(selected, torch.arange(key.shape[2], device=key.device), key.shape[2])
            mask = chosen if mask is None else mask & chosen
        return attend(query, key, value, layer, mask)[0].transpose(0, 1)
