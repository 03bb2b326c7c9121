"""The paged KV cache tensors: one K and one V tensor per attention layer, shaped from what each layer produced
when the engine probed the model (so layers may differ in heads, head size, dtype or device)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LayerShape:
    kv_heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device

    def bytes_per_token(self) -> int:
        return self.kv_heads * (self.key_dim + self.value_dim) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class IndexerShape:
    """A DSA layer's indexer key: one vector per token (``dsa.py``)."""

    dim: int
    dtype: torch.dtype
    device: torch.device

    def bytes_per_token(self) -> int:
        return self.dim * self.dtype.itemsize


class KVCache:
    """Per layer ``[kv_heads, num_blocks * block_size, dim]`` K and V tensors; token slot ``block * block_size +
    offset``. Head-major, so a gathered context has each head's rows contiguous (what SDPA reads fastest on CPU)."""

    def __init__(
        self,
        shapes: list[LayerShape],
        num_blocks: int,
        block_size: int,
        indexers: dict[int, IndexerShape] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        slots = num_blocks * block_size
        # Zeroed: attention may read whole blocks, and a masked-out position must hold a finite value (0 * NaN = NaN).
        self.k = [torch.zeros(s.kv_heads, slots, s.key_dim, dtype=s.dtype, device=s.device) for s in shapes]
        self.v = [torch.zeros(s.kv_heads, slots, s.value_dim, dtype=s.dtype, device=s.device) for s in shapes]
        self.indexer_keys = {
            layer: torch.zeros(slots, s.dim, dtype=s.dtype, device=s.device) for layer, s in (indexers or {}).items()
        }
        """The DSA layers' indexer keys ``[slots, dim]``, by attention layer: per token like K and V, in the same
        blocks (so prefix hits, forks and preemption need nothing more)."""

    @staticmethod
    def block_bytes(shapes: list[LayerShape], block_size: int, indexers: dict[int, IndexerShape] | None = None) -> int:
        per_token = sum(shape.bytes_per_token() for shape in shapes)
        return block_size * (per_token + sum(shape.bytes_per_token() for shape in (indexers or {}).values()))

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """``key``/``value`` ``[kv_heads, tokens, dim]`` go to ``slots``."""
        k_cache, v_cache = self.k[layer], self.v[layer]
        slots = slots.to(k_cache.device)
        k_cache.index_copy_(1, slots, key.to(k_cache.dtype))
        v_cache.index_copy_(1, slots, value.to(v_cache.dtype))

    @torch.no_grad()
    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        for cache in (*self.k, *self.v):
            cache[:, dst * bs : (dst + 1) * bs] = cache[:, src * bs : (src + 1) * bs]
        for keys in self.indexer_keys.values():
            keys[dst * bs : (dst + 1) * bs] = keys[src * bs : (src + 1) * bs]
