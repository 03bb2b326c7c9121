"""batchgen's attention, registered with transformers' ``AttentionInterface`` as ``batchgen_paged``.

The engine runs the model on one packed row of tokens (every scheduled sequence's new tokens back to back, no
padding). For each layer, the registered function writes the new keys and values into the paged KV cache, then lets
the step's backend attend each sequence's new queries over its own cached context: ``gather`` (contexts copied into
a buffer, then SDPA: the CPU path) or ``flex`` (FlexAttention reading the cache in place: the GPU path). Both honour
everything the layer asks for (``layer.py``); anything else refuses the model at load (``probe.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface

from .decode import DecodeKernel
from .flex import FlexBackend
from .gather import GatherBackend
from .layer import AttentionRefused, LayerAttention
from .probe import LayerProbe
from .step import AttentionBackend, PagedStep, SeqSlice, active, current

ATTENTION_NAME = "batchgen_paged"


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` is ``[1, heads, tokens, head_dim]``, ``key``/``value`` ``[1, kv_heads, tokens, head_dim]``; returns
    ``[1, tokens, heads, head_dim]`` as transformers' attention functions do."""
    step = current()
    if step is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention runs only inside the batchgen engine's forward")
    layer = LayerAttention.of(module, attention_mask, kwargs)
    return step.attend(module, query, key, value, layer).unsqueeze(0), None


def make_backend(name: str, device: torch.device, compiled: bool) -> AttentionBackend:
    """``auto``: ``flex`` on CUDA, ``gather`` elsewhere. ``compiled``: gather's decodes read the cache in place
    through a compiled kernel; flex is compiled on CUDA (on CPU it is a dense reference, for the tests)."""
    if name == "auto":
        name = "flex" if device.type == "cuda" else "gather"
    if name == "gather":
        return GatherBackend(DecodeKernel() if compiled else None)
    if name == "flex":
        return FlexBackend(compiled=compiled and device.type == "cuda")
    raise ValueError(f"unknown attention backend {name!r}; choose auto, gather or flex")


AttentionInterface.register(ATTENTION_NAME, paged_attention)

__all__ = [
    "ATTENTION_NAME",
    "AttentionBackend",
    "AttentionRefused",
    "LayerProbe",
    "PagedStep",
    "SeqSlice",
    "active",
    "make_backend",
]
