"""Host values to the device without making the host wait."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``. On CUDA the copy goes through pinned memory and does not block the host (a plain
    ``.to("cuda")`` waits for every kernel queued before it): it is ordered on the stream before every kernel that
    reads it, and the pinned block is not reused until the copy is done (PyTorch's caching host allocator)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def indices(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host integers as a ``long`` index tensor on ``device``, through ``to_device``."""
    return to_device(torch.tensor(values, dtype=torch.long), device)
