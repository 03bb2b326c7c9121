"""The few collectives the engine itself calls on a tensor-parallel group (the model's own run inside its layers)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def smallest_across_ranks(value: int, device: torch.device) -> int:
    """The smallest of every rank's ``value`` (all ranks call it at once)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())
