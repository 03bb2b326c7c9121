"""batchgen's attention, registered with transformers' ``AttentionInterface`` as ``batchgen_paged``.

The engine runs the model on one packed row of tokens (every scheduled sequence's new tokens back to back, no padding).
For each layer, the registered function writes the new keys and values into the paged KV cache, then lets the step's
backend attend each sequence's new queries over its own cached context: ``gather`` (decodes read the cache in place
through the fast decode kernel, prefill chunks gathered for SDPA: the default) or ``flex`` (FlexAttention reading
the cache in place, compiled on CUDA: an option). Both honour everything the layer asks for (``layer.py``); anything
else refuses the model at load (``probe.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface

from .decode import DecodeKernel
from .flex import FlexBackend
from .gather import GatherBackend
from .layer import SELECTION, AttentionRefused, LayerAttention
from .probe import LayerProbe
from .selection import Selections
from .step import AttentionBackend, DecodeBlocks, PagedStep, SeqSlice, active, current
from .varlen import VarlenAttention, flash_varlen

ATTENTION_NAME = "batchgen_paged"
PROBE_NAME = "batchgen_probe"
"""The load-time probe's attention (``probe.py``): a plain forward that records every layer."""


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
    layer = LayerAttention.of(module, attention_mask, kwargs)
    selected = _selected(attention_mask, kwargs)
    out = torch.ops.batchgen.paged_attention(
        query, key, value, layer.scale, layer.window, layer.softcap, layer.sinks, selected
    )
    return out.unsqueeze(0), None


def _selected(attention_mask: object, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A DSA layer's selection ``[tokens, k]`` (``selection.py``), or ``None``."""
    indices = kwargs.get("indices") if attention_mask is SELECTION else None
    return None if indices is None else indices[0]


@torch.library.custom_op("batchgen::paged_attention", mutates_args=())
def _paged_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    selected: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's attention in the current step (its cache write included). An operator, so that a compiled decoder
    layer keeps it as one opaque call: what it does depends on the step, which is Python the compiler must not see.
    ``selected``: a DSA layer's positions per query (``selection.py``)."""
    step = current()
    if not isinstance(step, PagedStep):
        raise RuntimeError(f"{ATTENTION_NAME} attention runs only inside the batchgen engine's forward")
    # Contiguous, as the fake below declares it (compiled layers check the strides of what it returns).
    return step.attend(query, key, value, LayerAttention(scale, window, softcap, sinks), selected).contiguous()


@_paged_attention_op.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *layer: Any) -> torch.Tensor:
    return query.new_empty(query.shape[2], query.shape[1], value.shape[3])


def probe_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    probe = current()
    if not isinstance(probe, LayerProbe):
        raise RuntimeError(f"{PROBE_NAME} attention runs only inside the batchgen engine's probe")
    layer = LayerAttention.of(module, attention_mask, kwargs)
    return probe.attend(module, query, key, value, layer, _selected(attention_mask, kwargs)).unsqueeze(0), None


def make_backend(name: str, device: torch.device, compiled: bool) -> AttentionBackend:
    """``auto`` is ``gather``. ``compiled``: gather's decodes read the cache in place through the fast kernel, and on
    CUDA its prefill chunks attend in one varlen call; flex is compiled on CUDA (eager, it is a dense reference over
    the whole cache: for the tests' small caches)."""
    if name in ("auto", "gather"):
        call = flash_varlen() if compiled and device.type == "cuda" else None
        return GatherBackend(DecodeKernel() if compiled else None, VarlenAttention(call) if call else None)
    if name == "flex":
        return FlexBackend(compiled=compiled and device.type == "cuda")
    raise ValueError(f"unknown attention backend {name!r}; choose auto, gather or flex")


AttentionInterface.register(ATTENTION_NAME, paged_attention)
AttentionInterface.register(PROBE_NAME, probe_attention)

__all__ = [
    "ATTENTION_NAME",
    "PROBE_NAME",
    "AttentionBackend",
    "AttentionRefused",
    "DecodeBlocks",
    "LayerProbe",
    "PagedStep",
    "SELECTION",
    "SeqSlice",
    "Selections",
    "active",
    "make_backend",
]
