"""Linear-attention layers split by heads over a tensor-parallel group, as vLLM splits them: each rank takes its
heads' query and key, value, gate, beta and decay, their convolution channels and the columns of the output
projection that read them, and the ranks sum their partial outputs. So each rank keeps its heads' share of the state
and runs its share of the recurrence, where transformers' plans gather the projections back (or never split them)
and leave every rank the whole of both. The layers' forwards (theirs, and ``gdn.py``'s kernels) read the head
counts from the layer, which says this rank's.

Gated DeltaNet (Qwen3.5's and Qwen3-Next's: ``gdn.CLASSES``; OLMo hybrid's), Kimi Delta Attention and Mamba 2
(Nemotron-H's, Granite 4's, Bamba's, Falcon-H1's: the ranks split its groups, or each keeps its heads' one); Mamba 1
and short convolutions stay whole on every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .gdn import CLASSES


@torch.no_grad()
def split_state_heads(model: torch.nn.Module) -> int:
    """This rank's share of every such layer of ``model`` (split by transformers' plan over a 1-D mesh); returns the
    layers split (0: none, or their heads do not divide among the ranks, or a projection has a bias: they stay
    whole)."""
    from torch.distributed.tensor import DTensor

    layers: list[Any] = [
        module
        for module in model.modules()
        if type(module).__name__ in SPLITS and not getattr(module, "heads_split", False)  # (split once)
    ]
    split = next((p for p in model.parameters() if isinstance(p, DTensor)), None)  # the group's mesh
    if not layers or split is None or split.device_mesh.ndim != 1:
        return 0
    mesh = split.device_mesh
    rank, size = mesh.get_local_rank(), mesh.size()
    for layer in layers:
        heads = getattr(layer, "num_k_heads", None) or layer.num_heads
        groups = getattr(layer, "n_groups", size)  # Mamba's: the ranks split them, or share one each
        if heads % size or (groups % size and size % groups):
            return 0
        if any(m.bias is not None for m in layer.modules() if isinstance(m, torch.nn.Linear)):
            return 0
    group = mesh.get_group()
    for layer in layers:
        SPLITS[type(layer).__name__](layer, rank, size, group)
        layer.heads_split = True
        layer.register_forward_hook(lambda module, args, output: dist.all_reduce(output, group=group))
    return len(layers)


def _gated_deltanet(layer: Any, rank: int, size: int, group: Any) -> None:
    """A Gated DeltaNet layer cut to rank ``rank``'s heads of ``size`` shares (its value heads follow its key heads:
    each key head serves the same number of consecutive value heads)."""
    dk, dv = layer.head_k_dim, layer.head_v_dim
    keys, values = layer.num_k_heads // size, layer.num_v_heads // size
    q = torch.arange(rank * keys * dk, (rank + 1) * keys * dk)
    v = torch.arange(rank * values * dv, (rank + 1) * values * dv)
    heads = torch.arange(rank * values, (rank + 1) * values)
    channels = torch.cat([q, q + layer.key_dim, v + 2 * layer.key_dim])  # the convolution's: query, key, value
    layout = CLASSES.get(type(layer).__name__)
    if layout == "fused":  # each key head's query, key, values and gates in a run of rows
        _keep(layer.in_proj_qkvz, rows=_share(layer.in_proj_qkvz, rank, size))
        _keep(layer.in_proj_ba, rows=_share(layer.in_proj_ba, rank, size))
    elif layout == "split":
        _keep(layer.in_proj_qkv, rows=channels)
        _keep(layer.in_proj_z, rows=v)
        _keep(layer.in_proj_b, rows=heads)
        _keep(layer.in_proj_a, rows=heads)
    else:  # OLMo hybrid's: each its own projection
        kept = {"q_proj": q, "k_proj": q, "v_proj": v, "g_proj": v, "a_proj": heads, "b_proj": heads}
        for name, rows in kept.items():
            _keep(getattr(layer, name), rows=rows)
    _keep(layer.out_proj if layout else layer.o_proj, columns=v)
    _keep_channels(layer.conv1d, channels)
    layer.A_log = torch.nn.Parameter(layer.A_log[heads], requires_grad=False)
    layer.dt_bias = torch.nn.Parameter(layer.dt_bias[heads], requires_grad=False)
    layer.num_k_heads, layer.num_v_heads = keys, values
    layer.key_dim, layer.value_dim = keys * dk, values * dv
    layer.conv_dim = 2 * layer.key_dim + layer.value_dim


def _kimi_delta_attention(layer: Any, rank: int, size: int, group: Any) -> None:
    """Kimi Delta Attention cut to rank ``rank``'s heads: its query, key and value heads, their convolution
    channels, their channels of the forget gate and the output gate (whose low-rank first halves stay whole), their
    beta and decay."""
    heads = layer.num_heads // size
    c = torch.arange(rank * heads * layer.head_dim, (rank + 1) * heads * layer.head_dim)
    kept = {"q_proj": c, "k_proj": c, "v_proj": c, "b_proj": c[:: layer.head_dim] // layer.head_dim, "g_b_proj": c}
    for name, rows in kept.items():
        _keep(getattr(layer, name), rows=rows)
    gate = layer.forget_gate
    _keep(gate.f_b_proj, rows=c)
    gate.dt_bias = torch.nn.Parameter(gate.dt_bias[c], requires_grad=False)
    gate.A_log = torch.nn.Parameter(gate.A_log[:, :, kept["b_proj"]], requires_grad=False)
    _keep(layer.o_proj, columns=c)
    _keep_channels(layer.conv1d, torch.cat([c, c + layer.qkv_dim, c + 2 * layer.qkv_dim]))
    layer.num_heads = gate.num_heads = heads
    layer.qkv_dim = gate.qkv_dim = len(c)
    layer.conv_dim = 3 * len(c)


def _mamba2(layer: Any, rank: int, size: int, group: Any) -> None:
    """A Mamba 2 mixer cut to rank ``rank``'s heads: its gate, input and step rows of ``in_proj``, its heads' decay,
    skip and step bias, and the B and C of their groups (each group's serve its heads), with their convolution
    channels. Where the ranks outnumber the groups (one group, as most checkpoints have), a rank's heads lie in one
    group, whose B and C it keeps whole, and the gated norm, which normalizes over a whole group, runs on the
    gathered channels (vLLM all-reduces its sums instead)."""
    heads, inner, n = layer.num_heads // size, layer.intermediate_size // size, layer.ssm_state_size
    whole, state, shared = layer.intermediate_size, layer.n_groups * n, layer.n_groups % size != 0
    groups = 1 if shared else layer.n_groups // size
    first = rank * layer.n_groups // size if shared else rank * groups  # its first group
    h = torch.arange(rank * heads, (rank + 1) * heads)
    i = torch.arange(rank * inner, (rank + 1) * inner)
    g = torch.arange(first * n, (first + groups) * n)
    rows = torch.cat([i, whole + i, 2 * whole + g, 2 * whole + state + g, 2 * (whole + state) + h])
    _keep(layer.in_proj, rows=rows)
    if hasattr(layer, "mup_vector"):  # Falcon-H1's multipliers of those rows
        layer.mup_vector = layer.mup_vector[..., rows]
    _keep_channels(layer.conv1d, torch.cat([i, whole + g, whole + state + g]))
    _keep(layer.out_proj, columns=i)
    if shared:
        if not isinstance(layer.norm, torch.nn.Identity):  # (Falcon-H1's may be none)
            layer.norm.forward = _gathered(layer.norm.forward, rank, size, group)
    else:
        if hasattr(layer.norm, "weight"):  # (Falcon-H1's may be none)
            layer.norm.weight = torch.nn.Parameter(layer.norm.weight[i], requires_grad=False)
        if hasattr(layer.norm, "n_groups"):  # Falcon-H1's norm counts its groups (the others: their width)
            layer.norm.n_groups = groups
    for name in ("A_log", "D", "dt_bias"):
        setattr(layer, name, torch.nn.Parameter(getattr(layer, name)[h], requires_grad=False))
    layer.num_heads, layer.intermediate_size, layer.n_groups = heads, inner, groups
    layer.conv_dim = inner + 2 * groups * n


def _gathered(forward: Callable[..., torch.Tensor], rank: int, size: int, group: Any) -> Callable[..., torch.Tensor]:
    """``forward`` (a norm over the last dimension's channels, and a gate's) on the ``size`` ranks' channels, gathered
    in rank order; rank ``rank``'s share of its output."""

    def whole(part: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(part) for _ in range(size)]
        dist.all_gather(parts, part.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    def run(hidden_states: torch.Tensor, gate: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        out = forward(whole(hidden_states), None if gate is None else whole(gate), **kwargs)
        width = out.shape[-1] // size
        return out[..., rank * width : (rank + 1) * width]

    return run


SPLITS: dict[str, Callable[[Any, int, int, Any], None]] = {
    **dict.fromkeys([*CLASSES, "OlmoHybridGatedDeltaNet"], _gated_deltanet),
    "KimiLinearDeltaAttention": _kimi_delta_attention,
    **dict.fromkeys(["NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "BambaMixer", "FalconH1Mixer"], _mamba2),
}
"""The layers split, by class name, and how."""


def _share(linear: Any, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s run of ``size`` equal runs of ``linear``'s output rows."""
    rows = linear.out_features // size
    return torch.arange(rank * rows, (rank + 1) * rows)


def _keep_channels(conv: torch.nn.Conv1d, channels: torch.Tensor) -> None:
    """A depthwise convolution cut to ``channels``."""
    conv.weight = torch.nn.Parameter(conv.weight[channels], requires_grad=False)
    if conv.bias is not None:
        conv.bias = torch.nn.Parameter(conv.bias[channels], requires_grad=False)
    conv.in_channels = conv.out_channels = conv.groups = len(channels)


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
