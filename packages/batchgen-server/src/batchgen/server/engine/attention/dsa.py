"""DSA sparse attention (DeepSeek-V3.2, GLM-5): each layer's lightning indexer run per sequence over its paged keys.

A DSA layer's indexer scores every past token for each query and keeps the ``index_topk`` best; the layer attends
only to those (``attention/selection.py``). The indexer's key, one vector per token, is cached like K and V: its own
tensor per layer in the same blocks (``KVCache.indexer_keys``), so prefix hits, forks and preemption need nothing
more.

The engine installs a forward on each indexer module (an instance attribute, as ``fast_forward.py`` does; the
class's own is one ``pop`` away) that, in the engine's forwards (the layer's mask is the engine's ``SELECTION``),
calls **the indexer's own forward** once per sequence of the packed row, with the chunk's causal mask and a cache
whose ``update_indexer`` writes the chunk's keys at the step's slots and returns the sequence's whole context of
keys, gathered through its block table: exactly what transformers' cache returns for that sequence alone. The
selections come back as positions ``[1, tokens, index_topk]`` (-1 past a short context's), which the layer hands to
attention as ``indices``. In the load-time probe (one sequence from position 0) it records the keys' shape; anywhere
else (the self-check's reference forward) it is the indexer's own forward.
"""

from __future__ import annotations

from typing import Any

import torch

from . import SELECTION, LayerProbe, PagedStep
from .kernels import causal_mask
from .step import current


def indexers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The DSA indexers: an attention module's ``indexer`` child that keeps ``index_topk`` tokens per query."""
    return [
        module.get_submodule("indexer")
        for module in model.modules()
        if isinstance(getattr(module, "indexer", None), torch.nn.Module)
        and hasattr(module.indexer, "index_topk")
        and hasattr(module, "o_proj")
    ]


def install(model: torch.nn.Module) -> bool:
    """Lay the engine's forward over every DSA indexer of ``model`` (once: engines may share a model); whether it
    has any."""
    found = indexers(model)
    for indexer in found:
        if "forward" not in vars(indexer):
            indexer.forward = _IndexerForward(indexer)
    return bool(found)


class _IndexerForward:
    def __init__(self, indexer: torch.nn.Module) -> None:
        self.original = type(indexer).forward.__get__(indexer)
        self.topk = int(getattr(indexer, "index_topk"))  # noqa: B009 (torch types a Module's attributes as modules)

    def __call__(
        self,
        hidden_states: torch.Tensor,
        q_resid: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: Any,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        args = (hidden_states, q_resid, position_embeddings)
        if attention_mask is not SELECTION:  # transformers' own forwards (the self-check's reference)
            return self.original(*args, attention_mask, position_ids, cache=cache, **kwargs)  # type: ignore[no-any-return]
        step = current()
        if isinstance(step, LayerProbe):  # one sequence from position 0
            mask = causal_mask(hidden_states.shape[1], 0, None, hidden_states.device).unsqueeze(0)
            return self.original(*args, mask, position_ids, cache=_Recording(step))  # type: ignore[no-any-return]
        if not isinstance(step, PagedStep):
            raise RuntimeError("a DSA indexer ran with the engine's mask outside the engine's forward")
        return self._per_sequence(step, hidden_states, q_resid, position_embeddings, position_ids)

    def _per_sequence(
        self,
        step: PagedStep,
        hidden_states: torch.Tensor,
        q_resid: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """The indexer once per sequence, over exactly its context; the selections ``[1, tokens, index_topk]``.
        Not the decodes as one batch padded to the longest context: ``topk`` breaks ties (exact zeros after the
        ReLU) differently over a wider row, and transformers' decode step scores exactly the context."""
        keys = step.cache.indexer_keys[step.layers_attended]  # it selects for the attention layer that runs next
        contexts = step.sparse_contexts()
        cos, sin = position_embeddings
        device = hidden_states.device
        selected = torch.full((hidden_states.shape[1], self.topk), -1, dtype=torch.int32, device=device)
        parts = [(chunk.rows, chunk.positions, chunk.slots) for chunk in contexts.chunks]
        if contexts.decodes is not None:
            decodes = contexts.decodes
            for i, seq in enumerate(s for s in step.seqs if s.num_tokens == 1):  # in the group's order
                parts.append(
                    (slice(seq.row, seq.row + 1), decodes.positions[i : i + 1], decodes.slots[i : i + 1, : seq.end])
                )
        for rows, positions, slots in parts:
            visible = torch.arange(slots.shape[1], device=device) <= positions.to(device).unsqueeze(1)
            chosen = self.original(
                hidden_states[:, rows],
                q_resid[:, rows],
                (cos[:, rows], sin[:, rows]),
                visible.unsqueeze(0),  # [1, new tokens, context]
                None if position_ids is None else position_ids[:, rows],
                cache=_PagedKeys(keys, step.slot_mapping[rows], slots),
            )
            selected[rows, : chosen.shape[-1]] = chosen[0]
        return selected.unsqueeze(0)


class _PagedKeys:
    """The cache an indexer sees: the new keys go to their slots, each sequence's whole context comes back
    (``context_slots`` ``[batch, context]``)."""

    def __init__(self, keys: torch.Tensor, new_slots: torch.Tensor, context_slots: torch.Tensor) -> None:
        self.keys, self.new_slots, self.context_slots = keys, new_slots, context_slots

    def update_indexer(self, new: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self.keys.index_copy_(0, self.new_slots.to(self.keys.device), new.flatten(0, 1).to(self.keys.dtype))
        return self.keys[self.context_slots.to(self.keys.device)]


class _Recording:
    """The probe's cache for an indexer: records its keys' shape, keeps nothing."""

    def __init__(self, probe: LayerProbe) -> None:
        self.probe = probe

    def update_indexer(self, new: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self.probe.record_indexer(new)
        return new
