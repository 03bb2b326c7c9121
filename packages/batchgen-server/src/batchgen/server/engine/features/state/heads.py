"""Gated DeltaNet layers split by heads over a tensor-parallel group, as vLLM splits them: each rank takes its key
heads' query and key, its value heads' value, gate, beta and decay, their convolution channels and the columns of the
output projection that read them, and the ranks sum their partial outputs. So each rank keeps its heads' share of the
state and runs its share of the recurrence, where transformers' plans gather the projections back (or never split
them) and leave every rank the whole of both. The layers' forwards (theirs, and ``gdn.py``'s kernels) read the head
counts from the layer, which says this rank's. Qwen3.5's and Qwen3-Next's layers (``gdn.CLASSES``), and OLMo
hybrid's."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .gdn import CLASSES

LAYOUTS = {**CLASSES, "OlmoHybridGatedDeltaNet": "separate"}
"""The layers split, by how they project: ``gdn.CLASSES``' two layouts, and OLMo hybrid's query, key, value, gate,
beta and decay each a projection of its own."""
LINEARS = {
    "split": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
    "fused": ("in_proj_qkvz", "in_proj_ba", "out_proj"),
    "separate": ("q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj", "o_proj"),
}
"""Each layout's linears, the output projection last."""


@torch.no_grad()
def split_state_heads(model: torch.nn.Module) -> int:
    """This rank's share of every Gated DeltaNet layer of ``model`` (split by transformers' plan over a 1-D mesh);
    returns the layers split (0: none, or their heads do not divide among the ranks: they stay whole)."""
    from torch.distributed.tensor import DTensor

    layers: list[Any] = [module for module in model.modules() if type(module).__name__ in LAYOUTS]
    split = next((p for p in model.parameters() if isinstance(p, DTensor)), None)  # the group's mesh
    if not layers or split is None or split.device_mesh.ndim != 1:
        return 0
    mesh = split.device_mesh
    rank, size = mesh.get_local_rank(), mesh.size()
    for layer in layers:
        linears = LINEARS[LAYOUTS[type(layer).__name__]]
        if layer.num_k_heads % size or any(getattr(layer, name).bias is not None for name in linears):
            return 0
    group = mesh.get_group()
    for layer in layers:
        _split(layer, rank, size)
        layer.register_forward_hook(lambda module, args, output: dist.all_reduce(output, group=group))
    return len(layers)


def _split(layer: Any, rank: int, size: int) -> None:
    """``layer`` cut to rank ``rank``'s heads of ``size`` shares (its value heads follow its key heads: each key head
    serves the same number of consecutive value heads)."""
    dk, dv = layer.head_k_dim, layer.head_v_dim
    keys, values = layer.num_k_heads // size, layer.num_v_heads // size
    q = torch.arange(rank * keys * dk, (rank + 1) * keys * dk)
    v = torch.arange(rank * values * dv, (rank + 1) * values * dv)
    heads = torch.arange(rank * values, (rank + 1) * values)
    channels = torch.cat([q, q + layer.key_dim, v + 2 * layer.key_dim])  # the convolution's: query, key, value
    layout = LAYOUTS[type(layer).__name__]
    if layout == "fused":  # each key head's query, key, values and gates in a run of rows
        _keep(layer.in_proj_qkvz, rows=_share(layer.in_proj_qkvz, rank, size))
        _keep(layer.in_proj_ba, rows=_share(layer.in_proj_ba, rank, size))
    elif layout == "split":
        _keep(layer.in_proj_qkv, rows=channels)
        _keep(layer.in_proj_z, rows=v)
        _keep(layer.in_proj_b, rows=heads)
        _keep(layer.in_proj_a, rows=heads)
    else:
        kept = {"q_proj": q, "k_proj": q, "v_proj": v, "g_proj": v, "a_proj": heads, "b_proj": heads}
        for name, rows in kept.items():
            _keep(getattr(layer, name), rows=rows)
    _keep(getattr(layer, LINEARS[layout][-1]), columns=v)
    layer.conv1d.weight = torch.nn.Parameter(layer.conv1d.weight[channels], requires_grad=False)
    layer.conv1d.in_channels = layer.conv1d.out_channels = layer.conv1d.groups = len(channels)
    layer.A_log = torch.nn.Parameter(layer.A_log[heads], requires_grad=False)
    layer.dt_bias = torch.nn.Parameter(layer.dt_bias[heads], requires_grad=False)
    layer.num_k_heads, layer.num_v_heads = keys, values
    layer.key_dim, layer.value_dim = keys * dk, values * dv
    layer.conv_dim = 2 * layer.key_dim + layer.value_dim


def _share(linear: Any, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s run of ``size`` equal runs of ``linear``'s output rows."""
    rows = linear.out_features // size
    return torch.arange(rank * rows, (rank + 1) * rows)


def _keep(linear: torch.nn.Linear, rows: torch.Tensor | None = None, columns: torch.Tensor | None = None) -> None:
    """``linear`` made a plain layer of its ``rows`` or ``columns`` of the whole weight, without transformers'
    tensor-parallel forward; the weight remembers them (``heads_kept``), for its LoRA adapters' share
    (``lora_split.shard_adapter``)."""
    from torch.distributed.tensor import DTensor

    whole = linear.weight.full_tensor() if isinstance(linear.weight, DTensor) else linear.weight
    kept = torch.nn.Parameter((whole[rows] if rows is not None else whole[:, columns]).contiguous(), False)
    kept.heads_kept = (rows, columns)  # type: ignore[attr-defined]
    linear.weight = kept  # its in_features and out_features still the whole layer's, as transformers' split keeps them
    vars(linear).pop("forward", None)  # the class's own: the input is whole, the output this rank's
