"""The few collectives the engine itself calls on a tensor-parallel group (the model's own run inside its layers)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def smallest_across_ranks(values: list[int], device: torch.device) -> list[int]:
    """Each of ``values``, the smallest any rank has (all ranks call it at once): one collective for them all."""
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return [int(value) for value in tensor.tolist()]
