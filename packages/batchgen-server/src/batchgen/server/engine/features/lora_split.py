"""LoRA adapters on a model split over tensor-parallel ranks, by vLLM's rule: each rank holds its share of every
adapter as it holds its share of the weight beside it. A column-parallel linear (its weight's output rows split)
keeps A whole and takes its rows of B: its delta is its share of the output, as its own output is. A row-parallel
linear (its weight's input columns split) takes its columns of A and keeps B whole: its delta is a partial sum, added
to the layer's partial output before the layer's own all-reduce, which sums both. Every split linear's delta is added
inside transformers' tensor-parallel forward, to the local output (``add_inside``). A packed projection (gate and up
in one weight: transformers' ``_StridedShard``) splits B per its parts, as the weight. The split is the weight's own
placement applied to the matrix (``distribute_tensor`` without communication), so no rule is copied here; a state
layer's linear split by heads (``state/heads.py``) takes the rows or columns its weight kept.

In pipeline stages each stage holds its own layers' adapters; every stage checks an adapter's matrices for every
stage's layers (``other_stages_linears``), so that all reach the same verdict."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a weight the plan split (a ``DTensor``), or the weight itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def split_dims(weight: torch.Tensor) -> set[int]:
    """The dimensions of ``weight`` (0: output rows, 1: input columns) split across the ranks."""
    from torch.distributed.tensor import DTensor

    if not isinstance(weight, DTensor):
        return set()
    return {placement.dim % 2 for placement in weight.placements if hasattr(placement, "dim")}


def shard_adapter(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of an adapter's A ``[r, in]`` and B ``[out, r]`` for the linear whose weight is ``weight``:
    B split as the weight's rows, A as its columns, each on the host."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    kept = getattr(weight, "heads_kept", None)
    if kept is not None:  # a state layer's linear split by heads (``state/heads.py``): its rows or columns
        rows, columns = kept
        return (a if columns is None else a[:, columns].contiguous()), (b if rows is None else b[rows].contiguous())
    dims = split_dims(weight)
    if not dims:
        return a, b
    assert isinstance(weight, DTensor)

    device = local(weight).device  # this rank's own (a reader thread's current CUDA device may be another's)

    def like_weight(matrix: torch.Tensor) -> torch.Tensor:
        whole = matrix.to(device)
        part = distribute_tensor(whole, weight.device_mesh, weight.placements, src_data_rank=None).to_local()
        return part.to("cpu").contiguous()

    return (like_weight(a) if 1 in dims else a), (like_weight(b) if 0 in dims else b)


def add_inside(
    linear: torch.nn.Linear, delta: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> Callable[[], None] | None:
    """For a linear the plan splits: ``delta(x, output)`` runs on the layer's local output, inside transformers'
    tensor-parallel forward (``TensorParallelLayer.install_forward``), where the input and the weight are this rank's
    and before the output is reduced or gathered: a row-parallel layer's all-reduce then sums the adapters' partial
    products with the weight's, and a column-parallel one that gathers its output (``colwise_gather_output``) gathers
    the deltas with it. Returns what undoes it, or ``None`` for a linear the plan does not split (its output, whole,
    takes the delta in the forward hook). ``RuntimeError`` if its forward is not transformers'."""
    if not split_dims(linear.weight):
        return None
    forward: Any = vars(linear).get("forward")
    code = getattr(forward, "__code__", None)
    if code is None or "original_forward" not in code.co_freevars:
        raise RuntimeError(f"its split {type(linear).__name__} runs a forward the engine cannot reach into")
    cell = forward.__closure__[code.co_freevars.index("original_forward")]
    original = cell.cell_contents

    def local_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        return delta(args[0], original(*args, **kwargs))

    cell.cell_contents = local_forward

    def undo() -> None:
        cell.cell_contents = original

    return undo


def other_stages_linears(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """The linears other pipeline stages hold (where this stage has transformers' ``PipelineIdentityLayer``), by
    name, with their input and output widths: read from the model's layout built on the meta device (no memory)."""
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    gone = [name for name, module in model.named_modules() if isinstance(module, PipelineIdentityLayer)]
    if not gone:
        return {}
    with torch.device("meta"):
        whole = type(model)(model.config)
    return {
        name: (module.in_features, module.out_features)
        for name, module in whole.named_modules()
        if isinstance(module, torch.nn.Linear) and any(name.startswith(prefix + ".") for prefix in gone)
    }
