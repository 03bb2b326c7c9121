"""Gated DeltaNet layers (Qwen3.5 and Qwen3.5-MoE, Qwen3-Next) on CPU: a step's every sequence in one call.

The generic path (``mixers.py``) runs a layer's own forward once for the step's decodes and once per prompt chunk,
because transformers' torch fallbacks for the convolution and the delta rule take one batch of equal-length rows
(they ignore ``cu_seqlens``): on CPU that is most of a hybrid model's forward (a Python loop over 64-token chunks and a
triangular solve per chunk, a dozen full passes over the state per decode, and a copy of every state in and out).
Here the layer's projections, gates, norm and output run once on the packed row, as its forward writes them, and
the short convolution and the delta rule run in ``gdn.cpp`` over every sequence piece of the step, reading and
writing the state cache in place (``StateStep.segments``). That is the layer's step written out, which the issue
allows only where it is the only way to batch it: ``tests/engine/test_gdn.py`` checks it against the layer's own
forward and the kernels against transformers' functions.

It applies only where it is known to be that layer's math: the classes below, on CPU, float32 recurrent state, SiLU,
and only where the kernels build. LoRA adapters apply as on any linear: the projections run on the whole packed row,
as the step packs it (``lora.py``). Elsewhere (GPU with ``flash-linear-attention`` and ``causal-conv1d`` in
charge, another layer, no compiler) the generic path runs, unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...ops import native
from ...ops.fast_paths import plain_tensor
from .discovery import StateLayer
from .facade import StateKey

SOURCE = Path(__file__).with_suffix(".cpp")
CLASSES = {
    "Qwen3_5GatedDeltaNet": "split",
    "Qwen3_5MoeGatedDeltaNet": "split",
    "Qwen3NextGatedDeltaNet": "fused",
}
"""The layers whose forward ``GatedDeltaNet`` follows, by how they project: ``in_proj_qkv`` / ``_z`` / ``_b`` / ``_a``
(split) or ``in_proj_qkvz`` / ``in_proj_ba`` through ``fix_query_key_value_ordering`` (fused)."""


class GatedDeltaNet:
    """One Gated DeltaNet layer's step over its two state tensors (conv ``[slots, C, K]``, recurrent
    ``[slots, Hv, dk, dv]``)."""

    def __init__(self, module: torch.nn.Module, projection: str, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.module: Any = module  # transformers' layer: its attributes as its forward reads them
        self.projection = projection
        self.conv = conv
        self.recurrent = recurrent

    def run(self, hidden: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """The layer's output on the packed row ``hidden`` ``[1, T, hidden]``, its sequences' states advanced."""
        m = self.module
        rows, dv = hidden.shape[1], m.head_v_dim
        qkv, z, b, a = self._project(hidden)
        weight = m.conv1d.weight.squeeze(1).float().contiguous()
        bias = None if m.conv1d.bias is None else m.conv1d.bias.float().contiguous()
        qkv = F.silu(torch.ops.batchgen.gdn_conv(qkv.contiguous(), self.conv, weight, bias, segments))
        query, key, value = torch.split(qkv.float(), [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        beta = b.sigmoid().float()
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        core = torch.ops.batchgen.gdn_rule(
            query.reshape(rows, -1, m.head_k_dim).contiguous(),
            key.reshape(rows, -1, m.head_k_dim).contiguous(),
            value.reshape(rows, -1, dv).contiguous(),
            g.contiguous(),
            beta.contiguous(),
            self.recurrent,
            segments,
        ).to(hidden.dtype)
        core = m.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(1, rows, -1)
        out: torch.Tensor = m.out_proj(core)
        return out

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's input projections on ``hidden``: the convolution's input ``[T, C]`` (query, key, value), the
        gate ``z``, and the ``b`` and ``a`` of beta and the decay, as its forward derives them."""
        m = self.module
        if self.projection == "fused":
            q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(hidden), m.in_proj_ba(hidden))
            qkv = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (q, k, v)], dim=-1)
        else:
            qkv, z, b, a = m.in_proj_qkv(hidden), m.in_proj_z(hidden), m.in_proj_b(hidden), m.in_proj_a(hidden)
        return qkv[0], z[0], b[0], a[0]


def fast_path(layer: StateLayer, tensors: dict[StateKey, torch.Tensor]) -> GatedDeltaNet | str | None:
    """The fast step of ``layer`` over its state tensors in the cache; why not (a Gated DeltaNet layer it steps aside
    for); or ``None`` for another layer."""
    module: Any = layer.module
    projection = CLASSES.get(type(module).__name__)
    if projection is None:
        return None
    idx = getattr(module, "layer_idx", None)
    conv, recurrent = tensors.get((idx, "conv", 0)), tensors.get((idx, "recurrent", 0))  # type: ignore[arg-type]
    weight = getattr(getattr(module, "conv1d", None), "weight", None)
    if not plain_tensor(weight, device="cpu"):
        return "not on CPU (flash-linear-attention and causal-conv1d serve there when installed)"
    if (
        len(layer.states) != 2
        or conv is None
        or recurrent is None
        or not plain_tensor(conv, device="cpu")
        or not plain_tensor(recurrent, torch.float32, device="cpu")
        or getattr(module, "activation", None) not in ("silu", "swish")
        or recurrent.shape[1:] != (module.num_v_heads, module.head_k_dim, module.head_v_dim)
        or conv.shape[1] != module.conv_dim
    ):
        return f"{type(module).__name__} keeps other states than the kernels were written for"
    try:
        native.load(SOURCE)
    except native.Unavailable as exc:
        return str(exc)
    return GatedDeltaNet(module, projection, conv, recurrent)
